"""The decode pool's quarantine (joader.server.pool.quarantine): a file that hung its worker twice
fails at once when it is asked for again, without a decode, until it changes on disk; once it
changed it is tried again, alone, and a fixed file decodes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from joader.cache.arena import Arena
from joader.client.tools.demo_data import make_demo_data
from joader.server.pool.decode_pool import DecodePool, DecodeResult, PoolConfig, SourceSpec
from joader.sources.imagefolder import SourceListing
from joader.testing.hang_stage import HANG_MARK, HangOn

pytestmark = pytest.mark.timeout(120)

SIZE = 32
NBYTES = 3 * SIZE * SIZE
NUM_ITEMS = 8
HANGING = 3


def _collect(pool: DecodePool, count: int, timeout_s: float = 60) -> list[DecodeResult]:
    results: list[DecodeResult] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < count:
        assert time.monotonic() < deadline, f"only {len(results)} of {count} results before the deadline"
        result = pool.get_result(timeout_s=0.1)
        if result is not None:
            results.append(result)
    return results


def _poll(pool: DecodePool, predicate: object, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert pool.get_result(timeout_s=0.05) is None


@pytest.fixture
def listing(tmp_path: Path) -> SourceListing:
    return make_demo_data(tmp_path / "images", NUM_ITEMS, num_classes=2, progress=False)


def test_a_file_that_hung_twice_is_not_decoded_again_until_it_changes(listing: SourceListing) -> None:
    target = Path(listing.root) / listing.paths[HANGING]
    good = target.read_bytes()
    target.write_bytes(HANG_MARK + good)
    stage = HangOn({"size": SIZE})
    with (Arena.create(NUM_ITEMS * NBYTES, NBYTES) as arena,
          DecodePool(PoolConfig(2, decode_timeout_s=0.3), str(arena.path), [SourceSpec(listing, stage)]) as pool):
        pool.submit(1, 0, HANGING, 0, NBYTES)
        (first,) = _collect(pool, 1)
        assert not first.ok and "--decode-timeout-s" in first.error and pool.stats().tasks_timed_out == 2
        _poll(pool, lambda: pool.stats().probation_pid == 0, "the probation worker to stop")

        pool.submit(2, 0, HANGING, 0, NBYTES)  # the next epoch asks for it again
        (again,) = _collect(pool, 1, timeout_s=0.25)  # less than one timeout: it was not run
        assert not again.ok and again.error == first.error
        stats = pool.stats()
        assert stats.tasks_timed_out == 2 and stats.probation_pid == 0 and stats.quarantined == 1
        assert "quarantined, not decoded again until the file changes" in first.error
        assert pool.is_quarantined(0, HANGING)

        target.write_bytes(good)  # fixed on disk: a new size and modification time
        os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))
        _poll(pool, lambda: not pool.is_quarantined(0, HANGING), "the change to lift the quarantine")
        pool.submit(3, 0, HANGING, 0, NBYTES)
        (fixed,) = _collect(pool, 1)
        assert fixed.ok, fixed.error
        got = arena.array(0, (3, SIZE, SIZE))
        assert np.array_equal(got, stage.inner.prepare(good, listing.paths[HANGING]))
        del got
        stats = pool.stats()
        assert stats.quarantined == 0 and stats.quarantine_lifted == 1 and stats.tasks_timed_out == 2


def test_auto_timeout_kills_a_hanging_decode_long_before_the_ceiling(listing: SourceListing) -> None:
    """--decode-timeout-s auto (None): with fast decodes measured, a hanging file is killed
    after a few seconds, not the 60 s ceiling."""
    target = Path(listing.root) / listing.paths[HANGING]
    target.write_bytes(HANG_MARK + target.read_bytes())
    stage = HangOn({"size": SIZE})
    with (Arena.create(NUM_ITEMS * NBYTES, NBYTES) as arena,
          DecodePool(PoolConfig(2, decode_timeout_s=None), str(arena.path), [SourceSpec(listing, stage)]) as pool):
        task_id = 0
        for _ in range(4):  # 28 fast decodes: past the 20 the rule waits for
            for item_id in (i for i in range(NUM_ITEMS) if i != HANGING):
                pool.submit(task_id, 0, item_id, item_id * NBYTES, NBYTES)
                task_id += 1
            assert all(r.ok for r in _collect(pool, NUM_ITEMS - 1))
        assert pool.stats().decode_timeout_s == 2.0  # the floor: these decodes take milliseconds
        pool.submit(task_id, 0, HANGING, HANGING * NBYTES, NBYTES)
        (result,) = _collect(pool, 1)
        assert not result.ok and pool.is_quarantined(0, HANGING)
        assert "took longer than 2 s (--decode-timeout-s auto)" in result.error
