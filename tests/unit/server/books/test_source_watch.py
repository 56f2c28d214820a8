"""A source that changes under joaderd: each source's health (server/books/source_watch.py, clock
given), and the registry holding failed reads until the verdict (fake pool, fake clock; no
thread, no gRPC). The stamps and verdicts themselves: tests/unit/sources/test_watch.py."""

from __future__ import annotations

import pytest

from joader.errors import SourceChangedError
from joader.server.books.source_watch import SourceWatch
from joader.sources.watch import (
    Stamp,
    Verdict,
    VerdictKind,
    WatchTargets,
)
from tests.support.registry_driver import ITEM_BYTES, attach, make_registry, nxt

pytestmark = pytest.mark.timeout(60)

# the stamp taken when the source was listed
LISTED = Stamp(root=(1, 10), folders=((1, 20, 5), (1, 21, 5)), files=((30, 100, 7), (31, 200, 7), (32, 300, 7)))

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
