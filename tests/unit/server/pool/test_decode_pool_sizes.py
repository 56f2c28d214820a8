"""The decode pool's side of exact sizes: probes (sizes from files' headers), size-first tasks
whose worker keeps the prepared item for the placement that follows, and faults on the way."""

from __future__ import annotations

import os
import signal
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from joader.cache.arena import Arena
from joader.client.tools.demo_data import make_demo_data
from joader.server.pool.decode_pool import DecodePool, DecodeResult, PoolConfig, SourceSpec
from joader.server.pool.worker import Staging
from joader.sources.imagefolder import SourceListing
from joader.stages import ItemSpec, build_stage

pytestmark = pytest.mark.timeout(120)

STAGE = build_stage("resize", size=32)
ARENA = 1 << 20


@pytest.fixture(scope="module")
def listing(tmp_path_factory: pytest.TempPathFactory) -> SourceListing:
    root = tmp_path_factory.mktemp("demo")
    listing = make_demo_data(root, 6, num_classes=2, progress=False)
    (listing.root / listing.paths[5]).write_bytes(b"not an image")
    return listing


def _collect(pool: DecodePool, count: int, timeout_s: float = 60) -> dict[int, DecodeResult]:
    results: dict[int, DecodeResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < count and time.monotonic() < deadline:
        result = pool.get_result(timeout_s=0.2)
        if result is not None:
            results[result.task_id] = result
    assert len(results) == count, f"only {len(results)} of {count} results before the deadline"
    return results


def _sizes(pool: DecodePool, count: int, timeout_s: float = 30) -> dict[int, int]:
    """The probes' answers (item id -> bytes), once `count` have come; the results thread's
    `get_result` is what reads the workers' messages."""
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(sizes) < count and time.monotonic() < deadline:
        assert pool.get_result(timeout_s=0.05) is None  # probes are no decode results
        for source_index, item_id, nbytes in pool.take_sizes():
            assert source_index == 0
            sizes[item_id] = nbytes
    assert len(sizes) == count, sizes
    return sizes


def test_probes_read_exact_sizes_and_are_not_decodes(listing: SourceListing) -> None:
    with Arena.create(ARENA, 64) as arena, DecodePool(PoolConfig(2), str(arena.path), [SourceSpec(listing, STAGE)]) as pool:
        pool.probe(0, list(range(6)))
        assert pool.in_flight == 0  # the registry's limit counts decodes only
        sizes = _sizes(pool, 6)
        for item_id in range(5):
            assert sizes[item_id] == STAGE.prepare(listing.read(item_id), "x").nbytes == 3 * 32 * 42
        assert sizes[5] == 0  # not an image: not known (its decode says why)
        with pytest.raises(Exception, match="out of range"):
            pool.probe(0, [6])


class Counting:
    """A user-like stage that notes every call (pid and path) in a file: an item placed by
    preparing it again, instead of copying the kept array, shows up twice."""

    name = "counting"
    spec = ItemSpec.variable(4096, "uint8", 1)

    def __init__(self, log: Path) -> None:
        self.log = log

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        with open(self.log, "a") as out:
            out.write(f"{os.getpid()} {path}\n")
        return np.full(100 + len(path), len(data) % 251, np.uint8)

    def calls(self, path: str) -> int:
        return sum(1 for line in self.log.read_text().splitlines() if line.split(" ", 1)[1] == path)


def test_size_first_is_prepared_once_and_placed_by_the_worker_that_kept_it(listing: SourceListing,
                                                                             tmp_path: Path) -> None:
    stage = Counting(tmp_path / "calls.log")
    with Arena.create(ARENA, 64) as arena, DecodePool(PoolConfig(2), str(arena.path), [SourceSpec(listing, stage)]) as pool:
        nbytes = 100 + len(listing.paths[4])
        pool.submit(1, 0, 4, 0, 0)  # size first: no range (both idle: the first worker takes it)
        first = _collect(pool, 1)[1]
        assert not first.ok and first.nbytes == nbytes and first.shape == (nbytes,) and first.dtype == "uint8"
        assert np.all(arena.array(0, (nbytes,)) == 0)  # nothing written
        pool.submit(10, 0, 0, 16384, 4096)  # the first worker busy again: the other is the less loaded
        pool.submit(2, 0, 4, 4096, nbytes)  # the placement: exactly its bytes, to the keeper all the same
        placed = _collect(pool, 2)[2]
        assert placed.ok and placed.nbytes == nbytes
        got = arena.array(4096, (nbytes,))
        assert np.all(got == len(listing.read(4)) % 251) and placed.checksum == zlib.crc32(got.tobytes())
        del got
        assert stage.calls(listing.paths[4]) == 1  # copied by the worker that kept it, not prepared again
        # too small a range (a size read before; the file changed since): kept, and placed again
        pool.submit(3, 0, 0, 8192, 10)
        short = _collect(pool, 1)[3]
        assert not short.ok and short.nbytes == 100 + len(listing.paths[0])
        pool.submit(4, 0, 0, 8192, short.nbytes)
        assert _collect(pool, 1)[4].ok and stage.calls(listing.paths[0]) == 2  # once before, once here


def test_a_kept_item_whose_worker_died_is_prepared_again_elsewhere(listing: SourceListing) -> None:
    stage = build_stage("resize", size=32)
    with Arena.create(ARENA, 64) as arena, DecodePool(PoolConfig(1), str(arena.path), [SourceSpec(listing, stage)]) as pool:
        pool.submit(1, 0, 2, 0, 0)
        sized = _collect(pool, 1)[1]
        assert not sized.ok and sized.nbytes == 3 * 32 * 42
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pool.stats().workers_replaced < 1 and time.monotonic() < deadline:
            pool.get_result(timeout_s=0.1)
        pool.submit(2, 0, 2, 0, sized.nbytes)  # its keeper is gone: any worker prepares it
        placed = _collect(pool, 1)[2]
        assert placed.ok
        assert np.array_equal(arena.array(0, (3, 32, 42)), stage.prepare(listing.read(2), "x"))


class DiesOnProbe:
    """A resize stage whose header reader kills its worker on one file (as a native crash)."""

    def __init__(self, path: str) -> None:
        self.inner = build_stage("resize", size=32)
        self.name, self.spec, self.path = self.inner.name, self.inner.spec, path

    def item_nbytes(self, data: bytes) -> int | None:
        if data == self.bad:
            os._exit(3)
        return self.inner.item_nbytes(data)

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        return self.inner.prepare(data, path)


def test_a_probe_whose_worker_dies_answers_unknown_and_decodes_go_on(listing: SourceListing) -> None:
    stage = DiesOnProbe(listing.paths[3])
    stage.bad = listing.read(3)
    with Arena.create(ARENA, 64) as arena, DecodePool(PoolConfig(1), str(arena.path), [SourceSpec(listing, stage)]) as pool:
        pool.probe(0, [0, 3, 4])  # one message: the whole batch is lost with the worker
        pool.probe(0, [1])
        sizes = _sizes(pool, 4)
        assert sizes[0] == sizes[3] == sizes[4] == 0 and sizes[1] == 3 * 32 * 42
        assert pool.stats().workers_replaced == 1
        pool.submit(1, 0, 3, 0, 0)
        assert _collect(pool, 1)[1].nbytes == 3 * 32 * 42  # the decode itself is fine


def test_staging_keeps_the_newest_few_for_a_while() -> None:
    now = [0.0]
    staging = Staging(max_items=3, max_bytes=1000, max_age_s=10.0, clock=lambda: now[0])
    for item_id in range(5):
        staging.put((0, item_id), np.zeros(100, np.uint8))
    assert len(staging) == 3 and staging.take((0, 1)) is None and staging.take((0, 4)) is not None
    staging.put((0, 9), np.zeros(5000, np.uint8))  # over the bytes: only the newest stays
    assert len(staging) == 1 and staging.take((0, 9)) is not None and staging.take((0, 9)) is None
    staging.put((1, 2), np.zeros(10, np.uint8))
    now[0] = 10.5  # too old: its file is read again (it may have changed since)
    assert staging.take((1, 2)) is None and len(staging) == 0
