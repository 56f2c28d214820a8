"""A worker's answers are named records (NOTE [ Named worker results ], server/pool/records.py):
`run_probe` answers a `ProbeSizes`, `run_task` a `DecodeResult`, and joaderd's reader tells them
apart by type."""

from __future__ import annotations

import mmap
import socket
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

from joader.server.pool.records import (
    DecodeResult,
    DecodeTask,
    NeedsBytes,
    Probe,
    ProbeSizes,
    Worker,
)
from joader.server.pool.worker import Staging, run_probe, run_task
from joader.server.wire import send_message
from tests.unit.server.pool.test_decode_pool_batches import _bare_pool

pytestmark = pytest.mark.timeout(30)


class _Stage:
    name = "test:stage"
    spec = SimpleNamespace(shape=None, max_nbytes=64)

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        return np.frombuffer(data, np.uint8)

    def item_nbytes(self, data: bytes) -> int:
        return len(data)


def _sources() -> tuple[SimpleNamespace, ...]:
    files = {0: b"abcd", 1: b"abcdefgh"}
    source = SimpleNamespace(paths=["a.bin", "b.bin"], read=files.__getitem__)
    return (SimpleNamespace(source=source, stage=_Stage()),)


def test_a_probe_answers_with_named_sizes() -> None:
    answer = run_probe(("probe", 7, 0, (0, 1)), _sources())
    assert isinstance(answer, ProbeSizes)
    assert answer.probe_id == 7 and answer.sizes == ((0, 4), (1, 8))


def test_a_decode_answers_with_a_named_result_and_its_bytes_are_written() -> None:
    arena = mmap.mmap(-1, 64)
    try:
        result = run_task((3, 0, 1, 16, 8), arena, _sources())
        assert isinstance(result, DecodeResult)
        assert result.task_id == 3 and result.ok and result.nbytes == 8 and result.path == "b.bin"
        assert arena[16:24] == b"abcdefgh"
    finally:
        arena.close()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A worker's socket: the pool's end and the worker's."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_the_reader_tells_a_probe_answer_from_a_decode_by_type(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    worker = Worker(0, 0, ours, 0)
    probe, task = Probe(9, 0, (0, 1)), DecodeTask(4, 0, 0, 0, 8)
    worker.tasks.extend([probe, task])
    pool = _bare_pool(worker, [task])
    send_message(theirs, ProbeSizes(9, ((0, 4), (1, 8))))
    send_message(theirs, DecodeResult(4, True, None, "a.bin", 0.001, (4,), "uint8", 4, 1))
    pool._read_worker(worker)
    assert not worker.tasks
    assert pool.take_sizes() == [(0, 0, 4), (0, 1, 8)]
    assert [r.task_id for r in pool._take_ready(limit=8)] == [4]


def test_a_decode_that_does_not_fit_answers_with_the_bytes_it_needs_not_a_failure() -> None:
    arena = mmap.mmap(-1, 64)
    staging = Staging()
    try:
        result = run_task((3, 0, 1, 16, 0), arena, _sources(), staging)  # size first: no range
        assert isinstance(result, NeedsBytes) and not result.ok and result.size_only
        assert result.nbytes == 8 and result.shape == (8,) and arena[16:24] == bytes(8)
        assert len(staging) == 1  # kept for the placement that follows
        placed = run_task((4, 0, 1, 16, 8), arena, _sources(), staging)
        assert isinstance(placed, DecodeResult) and placed.ok and not placed.size_only
        assert arena[16:24] == b"abcdefgh" and len(staging) == 0
    finally:
        arena.close()


def test_the_reader_remembers_which_worker_keeps_an_item_that_needs_bytes(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    worker = Worker(0, 0, ours, 0)
    task = DecodeTask(4, 0, 2, 0, 0)
    worker.tasks.append(task)
    pool = _bare_pool(worker, [task])
    send_message(theirs, NeedsBytes(4, "a.bin: 8 bytes, 0 allocated", "a.bin", 0.001, (8,), "uint8", 8))
    pool._read_worker(worker)
    assert dict(pool._roster.staged) == {(0, 2): 0}
    [result] = pool._take_ready(limit=8)
    assert isinstance(result, NeedsBytes) and result.nbytes == 8
