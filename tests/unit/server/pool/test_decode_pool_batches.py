"""The decode pool's results in batches (`DecodePool.get_results`, server/pool/decode_pool.py): every
message a worker's socket holds is read at once, in order, and taken in one call; and its tasks
in batches, a slot per message (server/pool/batching.py)."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

from joader.server.pool.batching import TaskBatching
from joader.server.pool.decode_pool import DecodePool
from joader.server.pool.faults import FaultHandling
from joader.server.pool.probes import Probing
from joader.server.pool.records import DecodeResult, DecodeTask, PoolConfig, SourceSpec, Worker
from joader.server.pool.roster import Roster
from joader.server.pool.spawning import WorkerSpawning
from joader.server.wire import Inbox, send_message

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
    pool._spawning = WorkerSpawning(roster, _no_dispatch)  # no forker: none is started
    pool._faults = FaultHandling(roster, pool._spawning, pool._probing, _no_dispatch)
    pool._batching = TaskBatching()
    pool._dispatch = _no_dispatch  # type: ignore[method-assign]
    return pool


def test_every_result_a_worker_sent_is_read_at_once_and_taken_in_one_batch() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        worker = Worker(0, 0, ours, 0)
        tasks = [DecodeTask(task_id, 0, task_id, task_id * 10, 10) for task_id in (4, 5, 6)]
        worker.tasks.extend(tasks)
        pool = _bare_pool(worker, tasks)
        for task in tasks:  # what the worker sent while the consumer was busy filing
            send_message(theirs, DecodeResult(task.task_id, True, None, f"{task.task_id}.jpg", 0.001, (1, 2, 5),
                                              "uint8", 10, task.task_id))
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


def test_tasks_go_to_a_worker_a_slot_per_message() -> None:
    """NOTE [ Decode tasks in batches ] (server/pool/batching.py): `submit_many` queues the
    tasks, and the dispatch sends each worker up to a slot of them per message, up to
    `tasks_per_worker` slots."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        worker = Worker(0, 0, ours, 0)
        pool = _bare_pool(worker, [])
        del pool._dispatch  # the pool's own dispatch, not the stub
        pool.config = pool._roster.config  # tasks_per_worker 2
        pool.arena_bytes = 1 << 20
        pool._roster.sources = (SourceSpec(SimpleNamespace(paths=("a.jpg",) * 20), None),)
        pool._batching.tasks_per_slot = 4
        pool.submit_many([(task_id, 0, task_id, task_id * 10, 10) for task_id in range(10)])
        assert [task.task_id for task in worker.tasks] == list(range(8))  # two slots sent
        assert [task.task_id for task in pool._roster.pending] == [8, 9]  # the rest waits its turn
        inbox = Inbox()
        while len(inbox.messages) < 2:
            inbox.feed(theirs.recv(1 << 16))
        assert list(inbox.messages) == [[(t, 0, t, t * 10, 10) for t in range(4)],
                                        [(t, 0, t, t * 10, 10) for t in range(4, 8)]]
        for task_id in range(3):  # three answers read together: one message of three tasks follows
            send_message(theirs, DecodeResult(task_id, True, None, "a.jpg", 0.0001, (10,), "uint8", 10, task_id))
        pool._read_worker(worker)
        assert [task.task_id for task in worker.tasks] == [3, 4, 5, 6, 7, 8, 9] and not pool._roster.pending
        inbox.messages.clear()
        while not inbox.messages:
            inbox.feed(theirs.recv(1 << 16))
        assert list(inbox.messages) == [[(t, 0, t, t * 10, 10) for t in (8, 9)]]
        assert [result.task_id for result in pool._take_ready(limit=8)] == [0, 1, 2]
    finally:
        ours.close()
        theirs.close()


def test_a_worker_whose_task_stalls_gets_no_more_tasks_while_another_does_not() -> None:
    """NOTE [ A stalled worker gets no more tasks ] (server/pool/decode_pool.py): a slot of
    healthy tasks is not handed to a member whose running decode hangs, to wait for its timeout."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    try:
        stalled, healthy = Worker(0, 0, pairs[0][0], 0), Worker(1, 0, pairs[1][0], 1)
        hung = DecodeTask(99, 0, 9, 990, 10)
        pool = _bare_pool(stalled, [hung])
        pool._roster.workers[healthy.index] = healthy
        del pool._dispatch  # the pool's own dispatch, not the stub
        pool.config = pool._roster.config  # tasks_per_worker 2
        pool.arena_bytes = 1 << 20
        pool._roster.sources = (SourceSpec(SimpleNamespace(paths=("a.jpg",) * 20), None),)
        pool._batching.tasks_per_slot = 4
        stalled.tasks.append(hung)
        stalled.started_s = time.monotonic() - 10 * pool._batching.stall_s  # its decode hangs
        pool.submit_many([(task_id, 0, task_id, task_id * 10, 10) for task_id in range(12)])
        assert list(stalled.tasks) == [hung]  # nothing more for it
        assert [task.task_id for task in healthy.tasks] == list(range(8))  # two slots, its limit
        assert [task.task_id for task in pool._roster.pending] == [8, 9, 10, 11]  # wait for a free slot
        stalled.started_s = time.monotonic()  # it answered; its next task started just now
        pool._dispatch()
        assert [task.task_id for task in stalled.tasks] == [99, 8, 9, 10, 11]
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
