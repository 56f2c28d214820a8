"""The decode pool: workers write prepared samples into the arena; failures are reported."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from joader.cache.arena import Arena
from joader.client.tools.demo_data import make_demo_data
from joader.errors import InvalidArgumentError, JoaderError
from joader.process_ref import ProcessRef
from joader.server.pool import spawning as pool_spawning
from joader.server.pool.decode_pool import DecodePool, DecodeResult, PoolConfig, SourceSpec
from joader.sources.imagefolder import SourceListing, list_image_folder
from joader.stages import build_stage
from tests.support.data import corrupt_jpeg

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
                assert result.checksum == zlib.crc32(got.tobytes()) != 0  # what a client verifies
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


@pytest.mark.parametrize("num_workers", [1, 2])
def test_tasks_sent_in_batches_decode_the_right_pixels_each_answered_as_it_finishes(
        listing: SourceListing, num_workers: int) -> None:
    """NOTE [ Decode tasks in batches ] (server/pool/batching.py) with real workers: tasks go
    three per message, and each result says its own item, with its pixels at its own range
    (the corrupt file fails alone)."""
    spec = spec_of(listing)
    with Arena.create(14 * NBYTES, NBYTES) as arena:
        with DecodePool(PoolConfig(num_workers), str(arena.path), [spec]) as pool:
            pool._batching.tasks_per_slot = 3
            pool._batching.add = lambda decode_s: None  # type: ignore[method-assign]  # kept at 3
            units = {task_id: 13 - task_id for task_id in range(12)}  # task t: item t % 6 into unit 13 - t
            pool.submit_many([(t, 0, t % 6, unit * NBYTES, NBYTES) for t, unit in units.items()])
            results = _collect(pool, 12)
            assert pool.in_flight == 0
            for task_id, unit in units.items():
                result, item_id = results[task_id], task_id % 6
                if item_id == 5:
                    assert not result.ok and listing.paths[5] in result.error
                    continue
                assert result.ok and result.path == listing.paths[item_id]
                got = view(arena, unit)
                assert np.array_equal(got, prepare(listing, item_id))
                assert result.checksum == zlib.crc32(got.tobytes())
                del got
            with pytest.raises(InvalidArgumentError, match="already in flight"):
                pool.submit_many([(20, 0, 0, 0, NBYTES), (20, 0, 1, NBYTES, NBYTES)])
            assert pool.in_flight == 0  # refused whole: nothing queued


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
        pid_file.write_text(" ".join(map(str, [*pool.worker_pids, pool._spawning.forker_pid])))
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


def test_a_crash_loop_slows_replacements_down_and_the_pool_recovers(listing: SourceListing) -> None:
    """Twelve deaths within seconds (a crash loop): replacements go on, more slowly; tasks
    submitted while no worker is left wait and then succeed (before the fix: the pool stayed
    at zero workers and every decode failed with "no decode worker is left")."""
    spec = spec_of(listing)
    with Arena.create(4 * NBYTES, NBYTES) as arena, _pool(arena, spec) as pool:
        deaths = 0
        while not pool.stats().crash_loop:
            for pid in pool.worker_pids:
                # a worker killed in the last round may still be listed until the pool notices its death
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
                    deaths += 1
            pool.get_result(timeout_s=0.3)
            assert deaths < 30, "no crash loop after 30 deaths"
        for pid in pool.worker_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        pool.get_result(timeout_s=0.3)
        assert pool.stats().workers_alive < 2 and pool.stats().restart_in_s > 0
        for task_id in range(4):
            _submit(pool, task_id, task_id, task_id)
        started = time.monotonic()
        results = _collect(pool, 4, timeout_s=60)
        assert all(r.ok for r in results.values()), [r.error for r in results.values()]
        _wait(lambda: (pool.get_result(timeout_s=0.1), pool.stats().workers_alive)[1] == 2,
              "the pool back at its target", timeout_s=60)
        recovered_s = time.monotonic() - started
        print(f"crash loop after {deaths} deaths: tasks done and the pool back at its target in {recovered_s:.1f} s")
        assert recovered_s < 60
        assert pool.stats().crash_loop  # until a quiet minute


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
        os.kill(pool._spawning.forker_pid, 9)  # no replacement can be forked now
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


# ----------------------------------------------------------------------------- resizing


def _state(pid: int) -> str:
    """The process state letter from /proc ("T" stopped, "Z" zombie), "" once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


# NOTE [ Signals to a pid another test may now hold ]
# The pid space here is 32,768 and `make test` churns through it in minutes (every thread takes
# one): a worker retired or killed meanwhile may have left its pid to a process of another test.
# A signal by bare pid after that stops or kills the wrong process; `ProcessRef` (pid and start
# time, sent through a pidfd) reaches only the process it was taken of.
_HALTED: dict[int, ProcessRef] = {}


def _halt(*pids: int) -> None:
    """SIGSTOPs workers and waits until they are stopped, so that tasks sent next stay queued."""
    for pid in pids:
        ref = ProcessRef.of(pid)
        assert ref is not None and ref.send_signal(signal.SIGSTOP), f"worker {pid} is gone"
        _HALTED[pid] = ref
    _wait(lambda: all(_state(pid) in ("T", "t") for pid in pids), "the workers to stop")


def _resume(*pids: int) -> None:
    """SIGCONT to the workers `_halt` stopped, those that still run (never to a pid's next owner)."""
    for pid in pids:
        ref = _HALTED.pop(pid, None)
        if ref is not None:
            ref.send_signal(signal.SIGCONT)


def _forker_children(pool: DecodePool) -> set[int]:
    """The live workers, retiring or not, as the kernel sees them (the forker's children)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pool._spawning.forker_pid and fields[0] != "Z":
                pids.add(int(entry))
    return pids


def _collect_once(pool: DecodePool, count: int, timeout_s: float = 60) -> dict[int, DecodeResult]:
    """`count` results, failing on a second result for any task."""
    results: dict[int, DecodeResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < count and time.monotonic() < deadline:
        result = pool.get_result(timeout_s=0.5)
        if result is not None:
            assert result.task_id not in results, f"a second result for task {result.task_id}"
            results[result.task_id] = result
    assert len(results) == count, f"only {len(results)} of {count} results before the deadline"
    return results


def _check_all_ok(arena: Arena, listing: SourceListing, results: dict[int, DecodeResult]) -> None:
    """Task i prepared item i % 5 (all good files) into the i-th range of the arena."""
    for task_id, result in results.items():
        assert result.ok, result.error
        assert np.array_equal(view(arena, task_id), prepare(listing, task_id % 5))


def _in_thread(action: object) -> tuple[threading.Thread, list[BaseException]]:
    """Runs `action` on a thread of its own (as joaderd's autoscaler calls `resize`), keeping
    what it raises for the test to re-raise."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()  # type: ignore[operator]
        except BaseException as error:  # handed to the test
            errors.append(error)

    thread = threading.Thread(target=run, name="test-resize")
    thread.start()
    return thread, errors


def test_grow_while_the_consumer_waits_takes_effect_at_once(listing: SourceListing) -> None:
    before = _children()
    spec = spec_of(listing)
    with Arena.create(12 * NBYTES, NBYTES) as arena, _pool(arena, spec, num_workers=1) as pool:
        (first,) = pool.worker_pids
        _halt(first)  # it holds the two tasks sent to it; the other ten wait in the pool
        try:
            for task_id in range(12):
                _submit(pool, task_id, task_id % 5, task_id)
            assert pool.stats().workers_busy == 1

            def grow() -> None:
                time.sleep(0.3)  # the consumer (this test's main thread) is inside get_result by now
                pool.resize(3, "grow test")

            thread, errors = _in_thread(grow)
            # Results can only come from the new workers while the first one is stopped.
            results = _collect_once(pool, 10)
            thread.join(30)
            assert not errors and not thread.is_alive()
            stats = pool.stats()
            assert stats.workers_configured == 3 and stats.workers_alive == 3 and pool.num_workers == 3
            assert first in stats.worker_pids and len(set(stats.worker_pids)) == 3
        finally:
            _resume(first)
        results |= _collect_once(pool, 2)
        assert sorted(results) == list(range(12)) and pool.in_flight == 0
        _check_all_ok(arena, listing, results)
        stats = pool.stats()
        assert stats.workers_alive == 3 and stats.workers_replaced == 0 and stats.tasks_retried == 0
        assert _forker_children(pool) == set(stats.worker_pids)
        assert len(_children() - before) == 1  # still only the forker: joaderd itself never forks
        assert stats.resizes[-1].endswith("workers 1 -> 3 (grow test)")


def test_shrink_drains_retiring_workers_and_loses_nothing(listing: SourceListing) -> None:
    spec = spec_of(listing)
    with Arena.create(15 * NBYTES, NBYTES) as arena, _pool(arena, spec, num_workers=3) as pool:
        pids = pool.worker_pids
        _halt(*pids)  # two tasks sent to each and held there; nine more queued in the pool
        try:
            for task_id in range(15):
                _submit(pool, task_id, task_id % 5, task_id)
            assert pool.stats().workers_busy == 3
            after_resize = []

            def shrink() -> None:
                time.sleep(0.3)  # while the main thread waits in get_result
                pool.resize(1, "shrink test")
                after_resize.append(pool.stats())
                _resume(*pids)

            thread, errors = _in_thread(shrink)
            results = _collect_once(pool, 15)
            thread.join(30)
            assert not errors and not thread.is_alive()
        finally:
            _resume(*pids)
        (stats,) = after_resize
        # At once: the target is 1, two (busy) workers retire, the oldest keeps serving.
        assert stats.workers_configured == 1 and stats.workers_alive == 1 and stats.workers_retiring == 2
        assert stats.worker_pids == (pids[0],) and pool.num_workers == 1
        retired = set(pids) - {pids[0]}
        # Every task exactly once, none failed or retried: the retiring workers finished theirs.
        assert sorted(results) == list(range(15)) and pool.in_flight == 0
        _check_all_ok(arena, listing, results)
        assert pool.get_result(timeout_s=0.5) is None
        _wait(lambda: not any(_state(pid) for pid in retired), "the retired workers to be reaped")
        stats = pool.stats()
        assert stats.workers_configured == 1 and stats.workers_alive == 1 and stats.workers_retiring == 0
        assert stats.tasks_retried == 0 and stats.tasks_timed_out == 0 and stats.workers_replaced == 0
        assert _forker_children(pool) == {pids[0]}
        assert stats.resizes[-1].endswith("workers 3 -> 1 (shrink test)")


def test_shrink_stops_idle_workers_at_once_newest_first(listing: SourceListing) -> None:
    spec = spec_of(listing)
    with Arena.create(4 * NBYTES, NBYTES) as arena, _pool(arena, spec, num_workers=3) as pool:
        pids = pool.worker_pids
        pool.resize(2)
        assert pool.worker_pids == pids[:2]
        assert pool.stats().workers_retiring == 0  # idle: stopped, not draining
        _wait(lambda: not _state(pids[2]), "the retired worker to be reaped")
        for task_id in range(4):
            _submit(pool, task_id, task_id, task_id)
        _check_all_ok(arena, listing, _collect_once(pool, 4))


def test_a_grow_takes_back_retiring_workers_before_forking(listing: SourceListing) -> None:
    spec = spec_of(listing)
    with Arena.create(6 * NBYTES, NBYTES) as arena, _pool(arena, spec, num_workers=3) as pool:
        pids = pool.worker_pids
        _halt(*pids)
        try:
            for task_id in range(6):
                _submit(pool, task_id, task_id % 5, task_id)
            pool.resize(1, "down")
            assert pool.stats().workers_retiring == 2
            pool.resize(3, "up again")
            stats = pool.stats()
            assert stats.worker_pids == tuple(pids) and stats.workers_retiring == 0
        finally:
            _resume(*pids)
        results = _collect_once(pool, 6)
        _check_all_ok(arena, listing, results)
        assert pool.worker_pids == pids and _forker_children(pool) == set(pids)


def test_after_a_shrink_a_dead_worker_is_replaced_up_to_the_target(listing: SourceListing) -> None:
    spec = spec_of(listing)
    with Arena.create(4 * NBYTES, NBYTES) as arena, _pool(arena, spec, num_workers=3) as pool:
        pids = pool.worker_pids
        pool.resize(2, "fewer")
        victim = pool.worker_pids[0]
        os.kill(victim, 9)

        def replaced() -> bool:
            pool.get_result(timeout_s=0.1)  # the consumer notices the death and replaces it
            return pool.stats().workers_replaced == 1

        _wait(replaced, "a replacement")
        for _ in range(5):  # and no more than one, however long the consumer runs
            pool.get_result(timeout_s=0.1)
        stats = pool.stats()
        assert stats.workers_alive == 2 and stats.workers_configured == 2 and stats.workers_replaced == 1
        assert victim not in stats.worker_pids and pids[2] not in stats.worker_pids
        _wait(lambda: _forker_children(pool) == set(pool.worker_pids), "the dead and the retired to be reaped")
        for task_id in range(4):
            _submit(pool, task_id, task_id, task_id)
        _check_all_ok(arena, listing, _collect_once(pool, 4))


def test_a_worker_dying_while_retiring_is_not_replaced_and_its_tasks_run_elsewhere(
    listing: SourceListing,
) -> None:
    spec = spec_of(listing)
    with Arena.create(4 * NBYTES, NBYTES) as arena, _pool(arena, spec, num_workers=2) as pool:
        pids = pool.worker_pids
        _halt(*pids)
        try:
            for task_id in range(4):  # two held by each worker
                _submit(pool, task_id, task_id, task_id)
            pool.resize(1, "one less")
            assert pool.worker_pids == pids[:1] and pool.stats().workers_retiring == 1
            os.kill(pids[1], 9)  # the retiring one, with its two tasks unfinished
            _resume(pids[0])
            results = _collect_once(pool, 4)
        finally:
            _resume(*pids)
        _check_all_ok(arena, listing, results)
        stats = pool.stats()
        assert stats.workers_alive == 1 and stats.workers_retiring == 0 and stats.workers_replaced == 0
        assert stats.tasks_retried == 1  # the one it was running; the queued one just moved
        _wait(lambda: _forker_children(pool) == {pids[0]}, "the dead worker to be reaped")


def test_resize_validates_and_logs_every_change(listing: SourceListing, caplog: pytest.LogCaptureFixture) -> None:
    spec = spec_of(listing)
    with Arena.create(2 * NBYTES, NBYTES) as arena:
        with _pool(arena, spec, num_workers=1) as pool:
            for bad in (0, -1):
                with pytest.raises(ValueError, match="at least 1"):
                    pool.resize(bad)
            with caplog.at_level(logging.INFO, logger="joader.server.pool.decode_pool"):
                pool.resize(2, "more")
                pool.resize(2, "the same")  # not a change: not logged
                pool.resize(1)
            assert len(pool.stats().resizes) == 2
            first, second = pool.stats().resizes
            assert re.fullmatch(r"\d\d:\d\d:\d\d workers 1 -> 2 \(more\)", first), first
            assert re.fullmatch(r"\d\d:\d\d:\d\d workers 2 -> 1", second), second
            assert "workers 1 -> 2 (more)" in caplog.text and "the same" not in caplog.text
            for i in range(24):  # the log keeps the most recent 20
                pool.resize(2 if i % 2 == 0 else 1, f"step {i}")
            resizes = pool.stats().resizes
            assert len(resizes) == 20 and resizes[-1].endswith("workers 2 -> 1 (step 23)")
            assert resizes[0].endswith("(step 4)")
            assert pool.stats().workers_alive == 1 and pool.stats().workers_replaced == 0
        with pytest.raises(JoaderError, match="closed"):
            pool.resize(2)


# ----------------------------------------------------------------------------- a slow forker


def _open_fds() -> dict[int, str]:
    """This process's open descriptors and what each names (so that a leak says which)."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return fds


def _assert_no_new_fds(before: dict[int, str]) -> None:
    """As many descriptors open as `before`; else which were opened and which closed."""
    after = _open_fds()
    assert len(after) == len(before), (
        f"descriptors opened: {sorted(set(after.items()) - set(before.items()))}, "
        f"closed: {sorted(set(before.items()) - set(after.items()))}")


def _timed_out(caplog: pytest.LogCaptureFixture) -> bool:
    return "did not answer within 1 s" in caplog.text


def test_a_slow_forker_is_waited_for_and_the_pool_recovers(
    listing: SourceListing, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forker stopped (as on a swapping host) while both workers die: the spawn times out,
    tasks submitted meanwhile wait, and once the forker answers its late worker joins the pool
    and replacement goes on until the pool is back at its target. Before the fix the timeout
    counted as the forker gone: no worker ever started again, the late answer (and its worker's
    socket) was dropped, and every task failed with "no decode worker is left"."""
    monkeypatch.setattr(pool_spawning, "SPAWN_TIMEOUT_S", 1.0)
    before = _children()
    spec = spec_of(listing)
    with (
        Arena.create(4 * NBYTES, NBYTES) as arena,
        caplog.at_level(logging.INFO, logger="joader.server.pool.decode_pool"),
    ):
        fds = _open_fds()
        pool = _pool(arena, spec)
        forker = pool._spawning.forker_pid
        try:
            dead = pool.worker_pids
            _halt(forker)
            for pid in dead:
                os.kill(pid, 9)
            _wait(lambda: (pool.get_result(timeout_s=0.1), pool.stats().workers_alive)[1] == 0
                  and _timed_out(caplog), "both deaths seen and the replacement's request timed out")
            for task_id in range(4):
                _submit(pool, task_id, task_id, task_id)
            assert pool.get_result(timeout_s=0.3) is None  # they wait: a slow forker is not a gone one
            _resume(forker)
            _check_all_ok(arena, listing, _collect_once(pool, 4))
            _wait(lambda: (pool.get_result(timeout_s=0.1), pool.stats().workers_alive)[1] == 2,
                  "the pool back at its target")
            _wait(lambda: _forker_children(pool) == set(pool.worker_pids), "no worker beyond the pool's")
            stats = pool.stats()
            assert stats.workers_replaced == 2 and not set(dead) & set(stats.worker_pids)
            assert "joins the pool" in caplog.text
            assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.CRITICAL]
        finally:
            _resume(forker)
            pool.close()
        _assert_no_new_fds(fds)
    assert _children() - before == set()


def test_a_late_worker_the_pool_no_longer_needs_is_stopped(
    listing: SourceListing, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forker answers a replacement's request after the pool was shrunk to the workers it
    has: the late worker is stopped (and reaped by the forker), not leaked, not adopted."""
    monkeypatch.setattr(pool_spawning, "SPAWN_TIMEOUT_S", 1.0)
    before = _children()
    spec = spec_of(listing)
    with (
        Arena.create(4 * NBYTES, NBYTES) as arena,
        caplog.at_level(logging.INFO, logger="joader.server.pool.decode_pool"),
    ):
        fds = _open_fds()
        pool = _pool(arena, spec)
        forker = pool._spawning.forker_pid
        try:
            victim, survivor = pool.worker_pids
            _halt(forker)
            os.kill(victim, 9)
            _wait(lambda: (pool.get_result(timeout_s=0.1), pool.stats().workers_alive)[1] == 1
                  and _timed_out(caplog), "the death seen and the replacement's request timed out")
            pool.resize(1, "shrunk while the forker is slow")
            _resume(forker)
            _wait(lambda: (pool.get_result(timeout_s=0.1), "not needed any more" in caplog.text)[1],
                  "the late answer")
            _wait(lambda: _forker_children(pool) == {survivor}, "the late worker gone")
            assert pool.worker_pids == [survivor]
            for task_id in range(4):
                _submit(pool, task_id, task_id, task_id)
            _check_all_ok(arena, listing, _collect_once(pool, 4))
            assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.CRITICAL]
        finally:
            _resume(forker)
            pool.close()
        _assert_no_new_fds(fds)
    assert _children() - before == set()


# Run in a fresh interpreter, as joaderd runs its pool: a lean parent whose forked workers start
# with a small heap (a worker forked from pytest inherits a large, fragmented one, where the
# decode buffers fit in old free space and nothing is ever returned to the kernel).
_FAULTS_SCRIPT = """
import sys
from joader.cache.arena import Arena
from joader.server.pool import worker as decode_worker
from joader.server.pool.decode_pool import DecodePool, PoolConfig, SourceSpec
from joader.sources.imagefolder import list_image_folder
from joader.stages import build_stage

if sys.argv[2] == "without":
    decode_worker.keep_heap = lambda: None
listing = list_image_folder(sys.argv[1])
nbytes = 3 * 256 * 256
with Arena.create(2 * nbytes, nbytes) as arena:
    pool = DecodePool(PoolConfig(1), str(arena.path), [SourceSpec(listing, build_stage("center-crop", size=256))])
    (worker,) = pool.stats().worker_pids

    def faults():
        with open(f"/proc/{worker}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt

    def decode(first, count):
        for task_id in range(first, first + count):
            pool.submit(task_id, 0, task_id % 5, 0, nbytes)
            while (result := pool.get_result(timeout_s=10)) is None:
                pass
            assert result.ok, result.error

    decode(0, 10)
    before = faults()
    decode(10, 40)
    print((faults() - before) / 40)
    pool.close()
"""


def _faults_per_decode(root: Path, how: str) -> float:
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, str(root), how],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


def test_a_worker_keeps_its_freed_decode_buffers(listing: SourceListing) -> None:
    """Each decode of a 500x375 JPEG to 256 x 256 allocates and frees ~1.5 MB of arrays. With
    glibc's adaptive thresholds a worker gave that back to the kernel after every task and
    faulted it in again (about 260 page faults, a quarter of the task's CPU); `keep_heap` keeps
    it. Measured after the first tasks (which fault the heap and the arena in)."""
    without = _faults_per_decode(listing.root, "without")
    if without < 100:
        pytest.skip(f"this C library does not return a worker's heap after each decode here "
                    f"({without:.0f} page faults per decode without keep_heap): nothing to show")
    kept = _faults_per_decode(listing.root, "with")
    assert kept < 50, f"{kept:.0f} page faults per decode (without keep_heap: {without:.0f})"
