"""The decode pool's suspect lane (joader.server.pool.decode_pool, "Suspects"): a file that kills its
worker is retried alone and quarantined after its second death; deaths it explains are replaced
at once; healthy decodes never wait behind it; a suspect that decodes was innocent."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from joader.cache.arena import Arena
from joader.client.tools.demo_data import make_demo_data
from joader.server.pool.decode_pool import DecodePool, DecodeResult, PoolConfig, SourceSpec
from joader.sources.imagefolder import SourceListing
from joader.stages import build_stage

pytestmark = pytest.mark.timeout(120)

SIZE = 32
NBYTES = 3 * SIZE * SIZE
NUM_ITEMS = 40


class _Stage:
    """center-crop, except on `crash_on` (the worker exits, as a native decoder's crash would)
    and on `hang_on` (it waits until the file `gate` exists, writing its pid to `entered`)."""

    def __init__(self, crash_on: tuple[str, ...] = (), hang_on: str = "", gate: Path | None = None) -> None:
        self.inner = build_stage("center-crop", size=SIZE, upscale=True)
        self.spec = self.inner.spec
        self.name = "suspect-test"
        self.crash_on = crash_on
        self.hang_on = hang_on
        self.gate = gate

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        if self.crash_on and path.endswith(self.crash_on):
            os._exit(3)
        if self.hang_on and path.endswith(self.hang_on) and self.gate is not None:
            (self.gate.parent / "entered").write_text(str(os.getpid()))
            while not self.gate.exists():
                time.sleep(0.01)
        return self.inner.prepare(data, path)


@pytest.fixture(scope="module")
def listing(tmp_path_factory: pytest.TempPathFactory) -> SourceListing:
    return make_demo_data(tmp_path_factory.mktemp("suspects"), NUM_ITEMS, num_classes=4, progress=False)


def _collect(pool: DecodePool, count: int, timeout_s: float = 60) -> list[DecodeResult]:
    """`count` results in the order they came, failing on a second result for any task."""
    results: list[DecodeResult] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < count and time.monotonic() < deadline:
        result = pool.get_result(timeout_s=0.2)
        if result is not None:
            assert result.task_id not in {r.task_id for r in results}, f"a second result for {result.task_id}"
            results.append(result)
    assert len(results) == count, f"only {len(results)} of {count} results before the deadline"
    return results


def _poll(pool: DecodePool, predicate: Any, what: str, timeout_s: float = 30) -> None:
    """Runs the consumer (`get_result`, nothing expected) until `predicate()` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert pool.get_result(timeout_s=0.05) is None


def test_files_killing_their_worker_are_quarantined_and_replacements_are_not_slowed(listing: SourceListing) -> None:
    """Twelve of 40 files kill their worker every time (24 deaths, past the ten a minute that
    start the backoff): they fail with the reason, every other item decodes right, no crash
    loop, one member replaced per file; asked again, a quarantined file kills no member."""
    bad = set(range(1, NUM_ITEMS, 3)[:12])
    stage = _Stage(crash_on=tuple(listing.paths[i] for i in bad))
    with (Arena.create(NUM_ITEMS * NBYTES, NBYTES) as arena,
          DecodePool(PoolConfig(2), str(arena.path), [SourceSpec(listing, stage)]) as pool):
        for item_id in range(NUM_ITEMS):
            pool.submit(item_id, 0, item_id, item_id * NBYTES, NBYTES)
        results = {r.task_id: r for r in _collect(pool, NUM_ITEMS)}
        for item_id, result in results.items():
            if item_id in bad:
                assert not result.ok and listing.paths[item_id] in result.error
                assert "crashes the decoder" in result.error and "2 times" in result.error
            else:
                assert result.ok, result.error
                got = arena.array(item_id * NBYTES, (3, SIZE, SIZE))
                assert np.array_equal(got, stage.inner.prepare(listing.read(item_id), listing.paths[item_id]))
                del got
        stats = pool.stats()
        assert not stats.crash_loop and stats.quarantined == 12 and stats.suspects == 0
        assert stats.workers_replaced == 12 and stats.workers_alive == 2 and pool.in_flight == 0
        _poll(pool, lambda: pool.stats().probation_pid == 0, "the probation worker to stop")
        again = min(bad)
        pool.submit(100, 0, again, 0, NBYTES)  # as the cache does after --retry-failed-s
        (result,) = _collect(pool, 1)
        assert not result.ok and listing.paths[again] in result.error
        assert pool.stats().workers_replaced == 12  # tried alone: no member died for it


def test_healthy_decodes_never_wait_behind_a_suspect_and_an_innocent_one_is_not_failed(
        listing: SourceListing, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A member killed from outside while running item 0 (an OOM kill, say): item 0 is a suspect,
    retried alone, and hangs there until the test opens the gate. Meanwhile the healthy items
    all decode on the members, and the suspect is not counted in `in_flight`. Once it decodes it
    is not failed, and its death is charged as one nothing explains."""
    gate = tmp_path / "gate"
    stage = _Stage(hang_on=listing.paths[0], gate=gate)
    caplog.set_level(logging.INFO, logger="joader.server.pool.decode_pool")
    with (Arena.create(NUM_ITEMS * NBYTES, NBYTES) as arena,
          DecodePool(PoolConfig(2), str(arena.path), [SourceSpec(listing, stage)]) as pool):
        pool.submit(0, 0, 0, 0, NBYTES)
        entered = tmp_path / "entered"
        _poll(pool, entered.exists, "item 0's decode to start")
        member = int(entered.read_text())
        entered.unlink()
        os.kill(member, 9)
        _poll(pool, lambda: entered.exists() and pool.stats().probation_pid == int(entered.read_text()),
              "item 0 to hang in the probation worker")
        stats = pool.stats()
        assert stats.suspects == 1 and stats.workers_alive == 2 and member not in stats.worker_pids
        assert pool.in_flight == 0  # the registry keeps the members busy meanwhile
        for item_id in range(1, NUM_ITEMS):
            pool.submit(item_id, 0, item_id, item_id * NBYTES, NBYTES)
        healthy = _collect(pool, NUM_ITEMS - 1)  # the suspect still hangs: it cannot come first
        assert all(r.ok for r in healthy) and {r.task_id for r in healthy} == set(range(1, NUM_ITEMS))
        assert pool.stats().suspects == 1
        gate.touch()
        (result,) = _collect(pool, 1)
        assert result.task_id == 0 and result.ok, result.error
        assert np.array_equal(arena.array(0, (3, SIZE, SIZE)), stage.inner.prepare(listing.read(0), listing.paths[0]))
        stats = pool.stats()
        assert stats.quarantined == 0 and stats.suspects == 0 and stats.tasks_retried == 1
        assert "did not kill the probation worker" in caplog.text
        assert pool._faults.replacement._recent  # charged: a death nothing explains
