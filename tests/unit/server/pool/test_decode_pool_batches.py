"""The decode pool's results in batches (`DecodePool.get_results`, server/pool/decode_pool.py): every
message a worker's socket holds is read at once, in order, and taken in one call."""

from __future__ import annotations

import pickle
import socket

import pytest

from joader.server.pool.decode_pool import DecodePool
from joader.server.pool.faults import FaultHandling
from joader.server.pool.probes import Probing
from joader.server.pool.records import DecodeResult, DecodeTask, PoolConfig, Worker
from joader.server.pool.roster import Roster
from joader.server.pool.spawning import WorkerSpawning

pytestmark = pytest.mark.timeout(30)


def _no_dispatch() -> None:
    pass


def _bare_pool(worker: Worker, tasks: list[DecodeTask]) -> DecodePool:
    """A pool with one worker on a socket pair and no process (no forker: none is started):
    what reading results uses, the roster and the parts it calls, with no dispatch."""
    pool = object.__new__(DecodePool)
    pool._roster = roster = Roster(PoolConfig(1, decode_timeout_s=None), (), 0)
    roster.selector.close()  # the worker's socket is read directly, never selected
    roster.workers = {worker.index: worker}
    roster.tasks = {task.task_id: task for task in tasks}
    pool._probing = Probing(roster, _no_dispatch)
    pool._faults = FaultHandling(roster, WorkerSpawning(roster, _no_dispatch), pool._probing, _no_dispatch)
    pool._dispatch = _no_dispatch  # type: ignore[method-assign]
    return pool


def test_every_result_a_worker_sent_is_read_at_once_and_taken_in_one_batch() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        worker = Worker(0, 0, ours, 0)
        tasks = [DecodeTask(task_id, 0, task_id, task_id * 10, 10) for task_id in (4, 5, 6)]
        worker.tasks.extend(tasks)
        pool = _bare_pool(worker, tasks)
        for task in tasks:  # what the worker sent while the consumer was busy filing
            theirs.send(pickle.dumps(DecodeResult(task.task_id, True, None, f"{task.task_id}.jpg", 0.001, (1, 2, 5),
                                                  "uint8", 10, task.task_id)))
        pool._read_worker(worker)
        assert not worker.tasks and len(pool._roster.ready) == 3
        batch = pool._take_ready(limit=2)  # at most `limit`, in order
        assert [r.task_id for r in batch] == [4, 5] and [r.checksum for r in batch] == [4, 5]
        assert [r.task_id for r in pool._take_ready(limit=8)] == [6]
        assert not pool._roster.tasks and not pool._roster.ready
        pool._read_worker(worker)  # nothing more: returns at once
        assert not pool._roster.ready
    finally:
        ours.close()
        theirs.close()
