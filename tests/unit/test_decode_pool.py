"""The decode pool: workers write prepared samples into the arena; failures are reported."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from joader.cache.arena import Arena
from joader.errors import InvalidArgumentError
from joader.server.decode_pool import DecodePool, DecodeResult, PoolConfig, SourceSpec
from joader.sources.demo import corrupt_jpeg, make_demo_data
from joader.sources.imagefolder import SourceListing, list_image_folder
from joader.stages import build_stage

pytestmark = pytest.mark.timeout(120)

SIZE = 64
STAGE = build_stage("center-crop", size=SIZE, upscale=True)
NBYTES = 3 * SIZE * SIZE


def item_nbytes(size: int) -> int:
    return 3 * size * size


def prepare(listing: SourceListing, item_id: int) -> np.ndarray:
    return STAGE.prepare(listing.read(item_id), listing.paths[item_id])


def spec_of(listing: SourceListing) -> SourceSpec:
    return SourceSpec(listing, STAGE)


def _submit(pool: DecodePool, task_id: int, item_id: int, unit: int) -> None:
    """Item `item_id` into the `unit`-th item-sized range of the arena."""
    pool.submit(task_id, 0, item_id, unit * NBYTES, NBYTES)


def view(arena: Arena, unit: int) -> np.ndarray:
    return arena.array(unit * NBYTES, (3, SIZE, SIZE))


@pytest.fixture(scope="module")
def listing(tmp_path_factory: pytest.TempPathFactory) -> SourceListing:
    root = tmp_path_factory.mktemp("demo")
    listing = make_demo_data(root, 6, num_classes=2, progress=False)
    corrupt_jpeg(listing.root / listing.paths[5])
    return listing


def _children() -> set[int]:
    """Pids of this process's live children, from /proc (no psutil)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            pids.add(int(entry))
    return pids


def _collect(pool: DecodePool, count: int, timeout_s: float = 60) -> dict[int, DecodeResult]:
    results: dict[int, DecodeResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < count and time.monotonic() < deadline:
        result = pool.get_result(timeout_s=0.5)
        if result is not None:
            results[result.task_id] = result
    assert len(results) == count, f"only {len(results)} of {count} results before the deadline"
    return results


@pytest.mark.parametrize("num_workers", [1, 2])
def test_decodes_into_the_arena(listing: SourceListing, num_workers: int) -> None:
    before = _children()
    spec = spec_of(listing)
    with Arena.create(8 * NBYTES, NBYTES) as arena:
        pool = DecodePool(PoolConfig(num_workers), str(arena.path), [spec])
        try:
            # One child, the forker; the workers are its children.
            assert pool.num_workers == num_workers and len(_children() - before) == 1
            assert pool.stats().workers_alive == num_workers
            slots = {task_id: 7 - task_id for task_id in range(6)}  # item i -> range 7-i
            for task_id, slot in slots.items():
                _submit(pool, task_id, task_id, slot)
            results = _collect(pool, 6)
            assert pool.in_flight == 0
            for item_id in range(5):
                result = results[item_id]
                assert result.ok and result.error is None and result.decode_s > 0
                assert result.path == listing.paths[item_id]
                assert result.shape == (3, SIZE, SIZE) and result.dtype == "uint8" and result.nbytes == NBYTES
                got = view(arena, slots[item_id])
                assert np.array_equal(got, prepare(listing, item_id))
                del got
            bad = results[5]
            assert (
                not bad.ok and listing.paths[5] in bad.error and bad.path.endswith(listing.paths[5])
            )
            assert pool.stats().workers_alive == num_workers  # a bad file does not kill a worker
        finally:
            pool.close()
            pool.close()  # idempotent
    assert _children() - before == set()


def test_submit_validates_and_close_stops_everything(listing: SourceListing) -> None:
    before = _children()
    spec = spec_of(listing)
    with Arena.create(2 * NBYTES, NBYTES) as arena:
        with DecodePool(PoolConfig(2), str(arena.path), [spec]) as pool:
            with pytest.raises(InvalidArgumentError, match="source"):
                pool.submit(0, 1, 0, 0, NBYTES)
            with pytest.raises(InvalidArgumentError, match="item id"):
                pool.submit(0, 0, 6, 0, NBYTES)
            with pytest.raises(InvalidArgumentError, match="outside the arena"):
                pool.submit(0, 0, 0, 2 * NBYTES, NBYTES)
            for task_id in range(20):  # close with work still queued
                _submit(pool, task_id, task_id % 5, task_id % 2)
        assert pool.get_result(timeout_s=0) is None
    assert _children() - before == set()


def test_workers_exit_when_the_parent_dies(listing: SourceListing, tmp_path: Path) -> None:
    # A middle process starts a pool and is SIGKILLed; its workers must go away by themselves.
    import multiprocess

    spec = spec_of(listing)
    pid_file = tmp_path / "pids"

    def middle(arena_path: str) -> None:
        pool = DecodePool(PoolConfig(2), arena_path, [spec])
        pid_file.write_text(" ".join(map(str, [*pool.worker_pids, pool._forker_pid])))
        os.kill(os.getpid(), 9)

    with Arena.create(2 * NBYTES, NBYTES) as arena:
        proc = multiprocess.get_context("fork").Process(
            target=middle, args=(str(arena.path),)
        )
        proc.start()
        proc.join(30)
        worker_pids = [int(p) for p in pid_file.read_text().split()]
        assert len(worker_pids) == 3  # two workers and the forker
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(pid) for pid in worker_pids):
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in worker_pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pool(arena: Arena, spec: SourceSpec, num_workers: int = 2, **kwargs: float) -> DecodePool:
    return DecodePool(PoolConfig(num_workers, **kwargs), str(arena.path), [spec])


def _wait(predicate: object, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_killed_idle_worker_is_replaced(listing: SourceListing) -> None:
    spec = spec_of(listing)
    with Arena.create(4 * NBYTES, NBYTES) as arena, _pool(arena, spec) as pool:
        victim = pool.worker_pids[0]
        os.kill(victim, 9)
        pool.get_result(timeout_s=0.5)  # the consumer notices the death and replaces it
        _wait(lambda: pool.stats().workers_alive == 2, "a replacement")
        stats = pool.stats()
        assert stats.workers_replaced == 1 and victim not in stats.worker_pids
        for task_id in range(4):
            _submit(pool, task_id, task_id, task_id)
        assert all(r.ok for r in _collect(pool, 4).values())


def test_a_worker_killed_mid_task_is_not_a_file_failure(listing: SourceListing) -> None:
    spec = spec_of(listing)
    with Arena.create(4 * NBYTES, NBYTES) as arena, _pool(arena, spec) as pool:
        victim = pool.worker_pids[0]
        os.kill(victim, signal.SIGSTOP)  # it takes the first task and holds it
        _submit(pool, 1, 1, 1)
        os.kill(victim, 9)
        result = _collect(pool, 1)[1]
        assert result.ok, result.error
        assert np.array_equal(view(arena, 1), prepare(listing, 1))
        stats = pool.stats()
        assert stats.tasks_retried == 1 and stats.workers_replaced == 1 and stats.workers_alive == 2


def test_a_stuck_decode_times_out_and_runs_elsewhere(listing: SourceListing) -> None:
    spec = spec_of(listing)
    with (
        Arena.create(4 * NBYTES, NBYTES) as arena,
        _pool(arena, spec, decode_timeout_s=0.5) as pool,
    ):
        stuck = pool.worker_pids[0]
        os.kill(stuck, signal.SIGSTOP)  # as a hung NFS read would
        _submit(pool, 2, 2, 2)
        result = _collect(pool, 1)[2]
        assert result.ok, result.error
        stats = pool.stats()
        assert stats.tasks_timed_out == 1 and stats.workers_replaced == 1 and stuck not in stats.worker_pids


def test_an_item_that_hangs_every_time_fails_with_the_reason(listing: SourceListing, tmp_path: Path) -> None:
    from PIL import Image

    (tmp_path / "c").mkdir()
    Image.new("RGB", (8000, 8000), (9, 9, 9)).save(tmp_path / "c" / "huge.png")  # seconds to decode
    spec = spec_of(list_image_folder(tmp_path))
    with (
        Arena.create(4 * NBYTES, NBYTES) as arena,
        _pool(arena, spec, num_workers=1, decode_timeout_s=0.2) as pool,
    ):
        _submit(pool, 3, 0, 0)
        result = _collect(pool, 1)[3]
        assert not result.ok and "--decode-timeout-s" in result.error and "huge.png" in result.error
        assert pool.stats().tasks_timed_out == 2


def test_forker_and_workers_do_not_hold_the_arena_lock(listing: SourceListing) -> None:
    """The arena's lock must die with joaderd: children must not keep its locked descriptor."""
    import fcntl

    spec = spec_of(listing)
    with Arena.create(4 * NBYTES, NBYTES) as arena, _pool(arena, spec) as pool:
        probe = os.open(arena.path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # joaderd (this process) holds it
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            arena.close()  # as if joaderd died (its mapping dups the locked descriptor too)
            assert pool.stats().workers_alive == 2
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else holds it
        finally:
            os.close(probe)


def test_with_no_worker_to_be_had_pending_tasks_fail(listing: SourceListing) -> None:
    spec = spec_of(listing)
    with (
        Arena.create(4 * NBYTES, NBYTES) as arena,
        _pool(arena, spec, num_workers=1) as pool,
    ):
        worker = pool.worker_pids[0]
        os.kill(worker, signal.SIGSTOP)
        _submit(pool, 7, 0, 0)
        _submit(pool, 8, 1, 1)
        os.kill(pool._forker_pid, 9)  # no replacement can be forked now
        os.kill(worker, 9)
        results = _collect(pool, 2)
        assert not results[7].ok and not results[8].ok
        assert "no decode worker is left" in results[8].error
        start = time.monotonic()
        assert pool.get_result(timeout_s=0.2) is None
        assert time.monotonic() - start >= 0.1  # does not spin


class _FloatStage:
    """A user-style stage: float32 (2, 4) per item, or a wrong size for item 1."""

    name = "floats"

    def __init__(self) -> None:
        from joader.stages import ItemSpec

        self.spec = ItemSpec.fixed((2, 4), "float32")

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        if path.endswith(self.bad):
            return np.zeros((100, 100), np.float32)
        return np.full((2, 4), len(data), np.float32)


def test_any_dtype_is_written_and_a_stage_breaking_its_spec_fails_the_item(listing: SourceListing) -> None:
    stage = _FloatStage()
    stage.bad = listing.paths[1]
    with Arena.create(4 * NBYTES, NBYTES) as arena, DecodePool(PoolConfig(1), str(arena.path), [SourceSpec(listing, stage)]) as pool:
        pool.submit(0, 0, 0, 0, 32)
        pool.submit(1, 0, 1, NBYTES, 32)
        results = _collect(pool, 2)
        assert results[0].ok and results[0].shape == (2, 4) and results[0].dtype == "float32"
        assert np.array_equal(arena.array(0, (2, 4), np.float32), np.full((2, 4), len(listing.read(0)), np.float32))
        assert not results[1].ok and "not its declared (2, 4)" in results[1].error
