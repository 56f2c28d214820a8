"""The decode pool's results in batches (`DecodePool.get_results`, server/pool/decode_pool.py): every
message a worker's socket holds is read at once, in order, and taken in one call."""

from __future__ import annotations

import pickle
import socket
from collections import OrderedDict, deque

import pytest

from joader.server.pool.decode_pool import DecodePool
from joader.server.pool.records import DecodeTask, Worker
from joader.server.pool.timeout import DecodeTimes

pytestmark = pytest.mark.timeout(30)


def _bare_pool(worker: Worker, tasks: list[DecodeTask]) -> DecodePool:
    """A pool with one worker on a socket pair and no process: what reading results uses."""
    pool = object.__new__(DecodePool)
    pool._workers = {worker.index: worker}
    pool._ready = deque()
    pool._tasks = {task.task_id: task for task in tasks}
    pool._suspect_ids = set()
    pool._staged = OrderedDict()
    pool._timeouts = DecodeTimes(None)
    pool._dispatch = lambda: None  # type: ignore[method-assign]
    return pool


def test_every_result_a_worker_sent_is_read_at_once_and_taken_in_one_batch() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        worker = Worker(0, 0, ours, 0)
        tasks = [DecodeTask(task_id, 0, task_id, task_id * 10, 10) for task_id in (4, 5, 6)]
        worker.tasks.extend(tasks)
        pool = _bare_pool(worker, tasks)
        for task in tasks:  # what the worker sent while the consumer was busy filing
            theirs.send(pickle.dumps((task.task_id, True, None, f"{task.task_id}.jpg", 0.001, (1, 2, 5), "uint8", 10,
                                      task.task_id)))
        pool._read_worker(worker)
        assert not worker.tasks and len(pool._ready) == 3
        batch = pool._take_ready(limit=2)  # at most `limit`, in order
        assert [r.task_id for r in batch] == [4, 5] and [r.checksum for r in batch] == [4, 5]
        assert [r.task_id for r in pool._take_ready(limit=8)] == [6]
        assert not pool._tasks and not pool._ready
        pool._read_worker(worker)  # nothing more: returns at once
        assert not pool._ready
    finally:
        ours.close()
        theirs.close()
