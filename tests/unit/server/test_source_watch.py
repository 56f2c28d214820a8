"""A source that changes under joaderd: stamps and verdicts (joader/sources/watch.py, pure but
for `take_stamp`), each source's health (server/source_watch.py, clock given), and the registry
holding failed reads until the verdict (fake pool, fake clock; no thread, no gRPC)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from joader.errors import DecodeError, SourceChangedError
from joader.server.source_watch import SourceWatch
from joader.sources.imagefolder import list_image_folder
from joader.sources.safe_open import open_in_root, root_identity
from joader.sources.watch import (
    Stamp,
    Verdict,
    VerdictKind,
    WatchTargets,
    compare,
    is_read_error,
    take_stamp,
    watch_targets,
)
from tests.support.registry_driver import ITEM_BYTES, attach, make_registry, nxt

pytestmark = pytest.mark.timeout(60)

LISTED = Stamp(root=(1, 10), folders=((1, 20, 5), (1, 21, 5)), files=((30, 100, 7), (31, 200, 7), (32, 300, 7)))


# ----------------------------------------------------------------------------- compare (pure)

def test_the_same_stamp_is_ok() -> None:
    assert compare(LISTED, LISTED).kind is VerdictKind.OK


def test_folder_mtimes_and_a_missing_file_are_not_a_change() -> None:
    """Files added or removed change a class folder's mtime; a removed file is a per-item
    failure, not another dataset."""
    now = Stamp(root=(1, 10), folders=((1, 20, 99), (1, 21, 5)), files=((30, 100, 7), None, (32, 300, 7)))
    assert compare(LISTED, now).kind is VerdictKind.OK


def test_a_root_gone_or_every_sampled_file_gone_is_away() -> None:
    assert compare(LISTED, Stamp(None, (None, None), (None, None, None))).kind is VerdictKind.AWAY
    empty_mount = Stamp((2, 99), (None, None), (None, None, None))
    assert compare(LISTED, empty_mount).kind is VerdictKind.AWAY


def test_another_folder_or_other_files_are_a_change() -> None:
    replaced = compare(LISTED, Stamp((1, 11), LISTED.folders, LISTED.files))
    assert replaced.kind is VerdictKind.CHANGED and replaced.root_replaced
    assert "another folder is at its path" in replaced.describe()
    resized = compare(LISTED, Stamp((1, 10), LISTED.folders, ((30, 100, 7), (31, 201, 7), (33, 300, 8))))
    assert resized.kind is VerdictKind.CHANGED and resized.files_differ == 2
    assert resized.describe() == "2 of 3 sampled files differ"
    folder = compare(LISTED, Stamp((1, 10), ((1, 20, 5), (1, 22, 5)), LISTED.files))
    assert folder.kind is VerdictKind.CHANGED and folder.folders_replaced == 1


def test_one_file_edited_or_a_broken_file_fixed_is_not_a_change() -> None:
    """One differing file is that file's business (as before); files whose item failed since
    the listing are left out (`ignore`): a broken file fixed on disk is served again."""
    one = compare(LISTED, Stamp((1, 10), LISTED.folders, ((30, 100, 7), (31, 201, 7), (32, 300, 7))))
    assert one.kind is VerdictKind.OK and one.differing == (1,)
    two = Stamp((1, 10), LISTED.folders, ((30, 100, 7), (31, 201, 7), (32, 301, 7)))
    assert compare(LISTED, two).kind is VerdictKind.CHANGED
    assert compare(LISTED, two, frozenset({2})).kind is VerdictKind.OK


def test_read_errors_are_told_from_stage_and_pool_failures() -> None:
    assert is_read_error("cannot read /d/a/1.jpg: it no longer exists; ...")
    assert not is_read_error("cannot prepare /d/a/1.jpg: truncated")
    assert not is_read_error("stage resize:8 failed on x: ValueError")
    assert not is_read_error(None)


# ----------------------------------------------------------------------------- stamps on disk

def _folder(root: Path, seed: int) -> Path:
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for i in range(5):
            (root / name / f"{i}.jpg").write_bytes(bytes([seed]) * (10 + i))
    return root


def test_targets_are_drawn_with_the_given_rng(tmp_path: Path) -> None:
    listing = list_image_folder(_folder(tmp_path / "d", 1))
    first = watch_targets(listing, random.Random(5), max_files=4)
    assert first == watch_targets(listing, random.Random(5), max_files=4)
    assert len(first.files) == 4 and len(first.folders) == 2
    assert all(path.startswith(str(listing.root)) for path in first.files)


def test_a_folder_renamed_away_then_back_and_one_replaced(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", 1)
    targets = watch_targets(list_image_folder(root), random.Random(0))
    listed = take_stamp(targets)
    root.rename(tmp_path / "away")
    assert compare(listed, take_stamp(targets)).kind is VerdictKind.AWAY
    (tmp_path / "away").rename(root)
    assert compare(listed, take_stamp(targets)).kind is VerdictKind.OK
    root.rename(tmp_path / "old")
    _folder(root, 2)  # the same layout, other bytes
    verdict = compare(listed, take_stamp(targets))
    assert verdict.kind is VerdictKind.CHANGED and verdict.root_replaced


def test_reads_refuse_a_root_replaced_since_listing(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", 1)
    listing = list_image_folder(root)
    assert listing.root_id == root_identity(root)
    assert listing.read(0) == bytes([1]) * 10
    root.rename(tmp_path / "away")
    with pytest.raises(DecodeError, match="is gone") as gone:
        listing.read(0)
    assert is_read_error(str(gone.value))
    _folder(root, 2)
    with pytest.raises(DecodeError, match="was replaced since joaderd listed it") as replaced:
        listing.read(0)
    assert is_read_error(str(replaced.value)) and "another name" in str(replaced.value)
    fd = open_in_root(root, "a/0.jpg")  # without the listed identity: reads what is there
    os.close(fd)


# ----------------------------------------------------------------------------- health (clock given)

class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def _watch(clock: Clock) -> tuple[SourceWatch, list[int]]:
    pokes: list[int] = []
    targets = WatchTargets("/d/photos", (), ("/d/photos/a/0.jpg", "/d/photos/a/1.jpg", "/d/photos/b/2.jpg"),
                           (0, 1, 2))
    watch = SourceWatch("photos", targets, LISTED, poke=lambda: pokes.append(1), clock=clock)
    return watch, pokes


def test_a_sampled_file_whose_item_failed_is_left_out_of_the_comparison() -> None:
    watch, _ = _watch(Clock())
    watch.settled(50, 1, True)
    watch.settled(51, 7, False)  # not sampled
    assert watch.ignore == frozenset()
    watch.settled(52, 2, False)
    assert watch.ignore == frozenset({2})


def test_a_failed_read_is_held_once_then_reported() -> None:
    clock = Clock()
    watch, pokes = _watch(clock)
    assert watch.park(7, "cannot read /d/photos/a/1.jpg: it no longer exists")
    assert pokes and watch.held == {7: 1}
    assert not watch.park(8, "cannot prepare /d/photos/a/2.jpg: truncated")
    settled = watch.settle(Verdict(VerdictKind.OK), clock(), [])
    assert settled.release == [7] and not watch.held
    assert not watch.park(7, "cannot read /d/photos/a/1.jpg: it no longer exists")  # the file's own
    watch.settled(7, 107, True)
    assert watch.park(7, "cannot read /d/photos/a/1.jpg: it no longer exists")  # a new failure


def test_away_holds_every_read_until_back_and_releases_only_what_the_stamp_saw() -> None:
    clock = Clock()
    watch, _ = _watch(clock)
    assert watch.park(1, "cannot read x: the source folder /d/photos is gone")
    watch.settle(Verdict(VerdictKind.AWAY), clock(), [])
    assert watch.state is VerdictKind.AWAY and "is gone" in watch.waiting_reason(clock())
    assert watch.park(2, "cannot read y: the source folder /d/photos is gone")
    seen = watch.hold_seq
    assert watch.park(3, "cannot read z: the source folder /d/photos is gone")  # after the stamp
    clock.now += 6
    settled = watch.settle(Verdict(VerdictKind.OK), clock(), [], seen)
    assert settled.release == [1, 2] and watch.held == {3: 3} and watch.state is VerdictKind.OK
    assert watch.settle(Verdict(VerdictKind.OK), clock(), []).release == [3]


def test_a_change_stops_the_jobs_and_refuses_new_ones() -> None:
    clock = Clock()
    watch, _ = _watch(clock)
    watch.park(4, "cannot read x: the source folder /d/photos was replaced since joaderd listed it")
    settled = watch.settle(Verdict(VerdictKind.CHANGED, 3, 64, root_replaced=True), clock(), ["j1", "j2"])
    assert settled.drop and settled.release == [4] and [j for j, _ in settled.stop_jobs] == ["j1", "j2"]
    text = watch.stopped("j1")
    assert text and text.startswith("job j1: source 'photos' changed under joaderd (3 of 64 sampled")
    assert "Restart joaderd" in text and "another name" in text
    with pytest.raises(SourceChangedError, match="changed under joaderd"):
        watch.check_attach()
    assert not watch.park(5, "cannot read x: ...")  # nobody reads it any more
    assert watch.settle(Verdict(VerdictKind.OK), clock(), []).release == []  # final until a restart
    assert watch.status(clock())["state"] == "changed"


# ----------------------------------------------------------------------------- the registry

class _Pool:
    """A fake pool whose decodes fail with a given error, or succeed."""

    num_workers = 2

    def __init__(self) -> None:
        self.submitted: list[tuple[int, int]] = []

    @property
    def in_flight(self) -> int:
        return len(self.submitted)

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        self.submitted.append((task_id, item_id))

    def finish(self, registry: object, error: str | None = None) -> int:
        done = 0
        while self.submitted:
            task_id, _ = self.submitted.pop(0)
            registry.file_result(task_id, error is None, error, 0.001, shape=(3, 8, 8),  # type: ignore[attr-defined]
                                 dtype="uint8", nbytes=ITEM_BYTES)
            done += 1
        return done


def _registry() -> tuple[object, _Pool, Clock, SourceWatch, list[int]]:
    registry, _, clock = make_registry(num_slots=80)
    pool = _Pool()
    registry._pool = pool  # type: ignore[attr-defined]
    source = registry.source("demo")
    watch, pokes = _watch(clock)  # type: ignore[arg-type]
    source.watch = watch
    return registry, pool, clock, watch, pokes  # type: ignore[return-value]


def _drain(registry: object, pool: _Pool, error: str | None = None) -> None:
    for _ in range(20):
        registry.schedule_once()  # type: ignore[attr-defined]
        if not pool.finish(registry, error):
            return


def test_reads_failing_while_the_folder_is_away_are_served_when_it_is_back() -> None:
    registry, pool, clock, watch, pokes = _registry()
    source = registry.source("demo")  # type: ignore[attr-defined]
    job = attach(registry, "demo", range(16), "j", 16)
    assert not nxt(registry, job.job_id, 1, 16, []).item_ids  # type: ignore[arg-type]  # the pass starts
    started = len(pokes)
    _drain(registry, pool, "cannot read /d/photos/a/1.jpg: the source folder /d/photos is gone")
    assert len(pokes) > started and len(watch.held) == 16 and not source.failed
    registry.source_checked(source, Verdict(VerdictKind.AWAY))  # type: ignore[attr-defined]
    empty = nxt(registry, job.job_id, 1, 16, [])  # type: ignore[arg-type]
    assert not empty.item_ids and not empty.failed and "is gone" in empty.waiting
    clock.now += 3  # within the job's lease (5 s)
    registry.source_checked(source, Verdict(VerdictKind.OK))  # type: ignore[attr-defined]
    _drain(registry, pool)
    batch = nxt(registry, job.job_id, 1, 16, [])  # type: ignore[arg-type]
    assert sorted(batch.item_ids) == list(range(16)) and not batch.failed and batch.end_of_epoch


def test_a_file_missing_with_its_folder_in_place_is_reported_after_one_check() -> None:
    registry, pool, _clock, watch, _ = _registry()
    source = registry.source("demo")  # type: ignore[attr-defined]
    job = attach(registry, "demo", [3], "j", 1)
    assert not nxt(registry, job.job_id, 1, 1, []).item_ids  # type: ignore[arg-type]
    missing = "cannot read /d/photos/b/003.jpg: it no longer exists"
    _drain(registry, pool, missing)
    assert list(watch.held) == [3]
    registry.source_checked(source, Verdict(VerdictKind.OK))  # type: ignore[attr-defined]
    _drain(registry, pool, missing)
    batch = nxt(registry, job.job_id, 1, 1, [])  # type: ignore[arg-type]
    assert [f[0] for f in batch.failed] == [3] and "no longer exists" in batch.failed[0][2]


def test_a_changed_source_stops_its_jobs_and_drops_its_items() -> None:
    registry, pool, _clock, _watch_, _ = _registry()
    source = registry.source("demo")  # type: ignore[attr-defined]
    job = attach(registry, "demo", range(8), "j", 4)
    assert not nxt(registry, job.job_id, 1, 4, []).item_ids  # type: ignore[arg-type]
    _drain(registry, pool)
    got = nxt(registry, job.job_id, 1, 4, [])  # type: ignore[arg-type]
    assert len(got.item_ids) == 4 and source.cached_ids
    registry.source_checked(source, Verdict(VerdictKind.CHANGED, 2, 64))  # type: ignore[attr-defined]
    with pytest.raises(SourceChangedError, match=f"job {job.job_id}: source 'photos' changed under joaderd"):
        nxt(registry, job.job_id, 1, 4, got.item_ids)  # type: ignore[arg-type]
    with pytest.raises(SourceChangedError, match="Restart joaderd"):
        registry.attach("demo", None, "late", 4)  # type: ignore[attr-defined]
    assert not source.cached_ids
    registry.check_invariants()  # type: ignore[attr-defined]
