"""The decode pool: workers write prepared samples into the arena; failures are reported."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from joader.cache.arena import Arena
from joader.errors import InvalidArgumentError
from joader.server.decode_pool import DecodePool, DecodeResult, SourceSpec
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
        pool = DecodePool(num_workers, str(arena.path), arena.slot_bytes, [spec])
        try:
            assert pool.num_workers == num_workers and len(_children() - before) == num_workers
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
            assert pool.workers_alive() == num_workers  # a bad file does not kill a worker
        finally:
            pool.close()
            pool.close()  # idempotent
    assert _children() - before == set()


def test_submit_validates_and_close_stops_everything(listing: SourceListing) -> None:
    before = _children()
    spec = SourceSpec(str(listing.root), listing.paths, SIZE)
    with Arena.create(2 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena:
        with pytest.raises(InvalidArgumentError, match="cache slot"):
            DecodePool(1, str(arena.path), arena.slot_bytes, [SourceSpec("/", ("x",), SIZE * 2)])
        with DecodePool(2, str(arena.path), arena.slot_bytes, [spec]) as pool:
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
        pool = DecodePool(2, arena_path, slot_bytes, [spec])
        pid_file.write_text(" ".join(map(str, pool.worker_pids)))
        os.kill(os.getpid(), 9)

    with Arena.create(2 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena:
        proc = multiprocess.get_context("fork").Process(
            target=middle, args=(str(arena.path), arena.slot_bytes)
        )
        proc.start()
        proc.join(30)
        worker_pids = [int(p) for p in pid_file.read_text().split()]
        assert len(worker_pids) == 2
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


def _fifo_source(listing: SourceListing, tmp_path: Path) -> SourceSpec:
    """The demo listing plus a FIFO posing as an image: opening it blocks a worker for good."""
    os.mkfifo(tmp_path / "stuck.jpg")
    os.symlink(listing.root, tmp_path / "demo")
    return SourceSpec(str(tmp_path), ("stuck.jpg", *(f"demo/{p}" for p in listing.paths)), SIZE)


def _wait_busy(pool: DecodePool, task_id: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for index in range(pool.num_workers):
            if pool._current[index] == task_id:
                return index
        time.sleep(0.01)
    raise AssertionError(f"no worker took task {task_id}")


def test_a_dead_workers_task_fails_and_the_others_go_on(
    listing: SourceListing, tmp_path: Path
) -> None:
    before = _children()
    spec = _fifo_source(listing, tmp_path)
    with (
        Arena.create(4 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena,
        DecodePool(2, str(arena.path), arena.slot_bytes, [spec]) as pool,
    ):
        pool.submit(100, 0, 0, 0)  # the FIFO
        index = _wait_busy(pool, 100)
        os.kill(pool.worker_pids[index], 9)
        pool.submit(101, 0, 1, 1)
        results = _collect(pool, 2)
        assert not results[100].ok and "worker died" in results[100].error
        assert "stuck.jpg" in results[100].error
        assert results[101].ok
        assert pool.workers_alive() == 1 and pool.in_flight == 0
    assert _children() - before == set()


def test_with_no_worker_left_pending_tasks_fail(listing: SourceListing, tmp_path: Path) -> None:
    spec = _fifo_source(listing, tmp_path)
    with (
        Arena.create(4 * item_nbytes(SIZE), item_nbytes(SIZE)) as arena,
        DecodePool(1, str(arena.path), arena.slot_bytes, [spec]) as pool,
    ):
        pool.submit(7, 0, 0, 0)
        _wait_busy(pool, 7)
        pool.submit(8, 0, 1, 1)  # queued behind it
        os.kill(pool.worker_pids[0], 9)
        results = _collect(pool, 2)
        assert "worker died" in results[7].error
        assert "no decode worker is left" in results[8].error
        start = time.monotonic()
        assert pool.get_result(timeout_s=0.2) is None
        assert time.monotonic() - start >= 0.1  # does not spin
