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
from joader.sources.imagefolder import SourceListing
from joader.sources.stage import item_nbytes, prepare

pytestmark = pytest.mark.timeout(120)

SIZE = 64


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
def test_decodes_into_arena_slots(listing: SourceListing, num_workers: int) -> None:
    before = _children()
    spec = SourceSpec(str(listing.root), listing.paths, SIZE)
    with Arena.create(8 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena:
        pool = DecodePool(PoolConfig(num_workers), str(arena.path), arena.slot_bytes, [spec])
        try:
            # One child, the forker; the workers are its children.
            assert pool.num_workers == num_workers and len(_children() - before) == 1
            assert pool.stats().workers_alive == num_workers
            slots = {task_id: 7 - task_id for task_id in range(6)}  # item i -> slot 7-i
            for task_id, slot in slots.items():
                pool.submit(task_id, 0, task_id, slot)
            results = _collect(pool, 6)
            assert pool.in_flight == 0
            for item_id in range(5):
                result = results[item_id]
                assert result.ok and result.error is None and result.decode_s > 0
                assert result.path == str(listing.root / listing.paths[item_id])
                got = arena.slot_array(slots[item_id], (3, SIZE, SIZE))
                assert np.array_equal(got, prepare(result.path, SIZE))
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
    spec = SourceSpec(str(listing.root), listing.paths, SIZE)
    with Arena.create(2 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena:
        with pytest.raises(InvalidArgumentError, match="cache slot"):
            DecodePool(PoolConfig(1), str(arena.path), arena.slot_bytes, [SourceSpec("/", ("x",), SIZE * 2)])
        with DecodePool(PoolConfig(2), str(arena.path), arena.slot_bytes, [spec]) as pool:
            with pytest.raises(InvalidArgumentError, match="source"):
                pool.submit(0, 1, 0, 0)
            with pytest.raises(InvalidArgumentError, match="item id"):
                pool.submit(0, 0, 6, 0)
            with pytest.raises(InvalidArgumentError, match="slot"):
                pool.submit(0, 0, 0, 2)
            for task_id in range(20):  # close with work still queued
                pool.submit(task_id, 0, task_id % 5, task_id % 2)
        assert pool.get_result(timeout_s=0) is None
    assert _children() - before == set()


def test_workers_exit_when_the_parent_dies(listing: SourceListing, tmp_path: Path) -> None:
    # A middle process starts a pool and is SIGKILLed; its workers must go away by themselves.
    import multiprocess

    spec = SourceSpec(str(listing.root), listing.paths, SIZE)
    pid_file = tmp_path / "pids"

    def middle(arena_path: str, slot_bytes: int) -> None:
        pool = DecodePool(PoolConfig(2), arena_path, slot_bytes, [spec])
        pid_file.write_text(" ".join(map(str, [*pool.worker_pids, pool._forker_pid])))
        os.kill(os.getpid(), 9)

    with Arena.create(2 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena:
        proc = multiprocess.get_context("fork").Process(
            target=middle, args=(str(arena.path), arena.slot_bytes)
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
    return DecodePool(PoolConfig(num_workers, **kwargs), str(arena.path), arena.slot_bytes, [spec])


def _wait(predicate: object, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_killed_idle_worker_is_replaced(listing: SourceListing) -> None:
    spec = SourceSpec(str(listing.root), listing.paths, SIZE)
    with Arena.create(4 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena, _pool(arena, spec) as pool:
        victim = pool.worker_pids[0]
        os.kill(victim, 9)
        pool.get_result(timeout_s=0.5)  # the consumer notices the death and replaces it
        _wait(lambda: pool.stats().workers_alive == 2, "a replacement")
        stats = pool.stats()
        assert stats.workers_replaced == 1 and victim not in stats.worker_pids
        for task_id in range(4):
            pool.submit(task_id, 0, task_id, task_id)
        assert all(r.ok for r in _collect(pool, 4).values())


def test_a_worker_killed_mid_task_is_not_a_file_failure(listing: SourceListing) -> None:
    spec = SourceSpec(str(listing.root), listing.paths, SIZE)
    with Arena.create(4 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena, _pool(arena, spec) as pool:
        victim = pool.worker_pids[0]
        os.kill(victim, signal.SIGSTOP)  # it takes the first task and holds it
        pool.submit(1, 0, 1, 1)
        os.kill(victim, 9)
        result = _collect(pool, 1)[1]
        assert result.ok, result.error
        assert np.array_equal(arena.slot_array(1, (3, SIZE, SIZE)), prepare(result.path, SIZE))
        stats = pool.stats()
        assert stats.tasks_retried == 1 and stats.workers_replaced == 1 and stats.workers_alive == 2


def test_a_stuck_decode_times_out_and_runs_elsewhere(listing: SourceListing) -> None:
    spec = SourceSpec(str(listing.root), listing.paths, SIZE)
    with (
        Arena.create(4 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena,
        _pool(arena, spec, decode_timeout_s=0.5) as pool,
    ):
        stuck = pool.worker_pids[0]
        os.kill(stuck, signal.SIGSTOP)  # as a hung NFS read would
        pool.submit(2, 0, 2, 2)
        result = _collect(pool, 1)[2]
        assert result.ok, result.error
        stats = pool.stats()
        assert stats.tasks_timed_out == 1 and stats.workers_replaced == 1 and stuck not in stats.worker_pids


def test_an_item_that_hangs_every_time_fails_with_the_reason(listing: SourceListing, tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (8000, 8000), (9, 9, 9)).save(tmp_path / "huge.png")  # seconds to decode
    spec = SourceSpec(str(tmp_path), ("huge.png",), SIZE)
    with (
        Arena.create(4 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena,
        _pool(arena, spec, num_workers=1, decode_timeout_s=0.2) as pool,
    ):
        pool.submit(3, 0, 0, 0)
        result = _collect(pool, 1)[3]
        assert not result.ok and "--decode-timeout-s" in result.error and "huge.png" in result.error
        assert pool.stats().tasks_timed_out == 2


def test_forker_and_workers_do_not_hold_the_arena_lock(listing: SourceListing) -> None:
    """The arena's lock must die with joaderd: children must not keep its locked descriptor."""
    import fcntl

    spec = SourceSpec(str(listing.root), listing.paths, SIZE)
    with Arena.create(4 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena, _pool(arena, spec) as pool:
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
    spec = SourceSpec(str(listing.root), listing.paths, SIZE)
    with (
        Arena.create(4 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena,
        _pool(arena, spec, num_workers=1) as pool,
    ):
        worker = pool.worker_pids[0]
        os.kill(worker, signal.SIGSTOP)
        pool.submit(7, 0, 0, 0)
        pool.submit(8, 0, 1, 1)
        os.kill(pool._forker_pid, 9)  # no replacement can be forked now
        os.kill(worker, 9)
        results = _collect(pool, 2)
        assert not results[7].ok and not results[8].ok
        assert "no decode worker is left" in results[8].error
        start = time.monotonic()
        assert pool.get_result(timeout_s=0.2) is None
        assert time.monotonic() - start >= 0.1  # does not spin
