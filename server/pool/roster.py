"""The roster: the decode pool's workers, their sockets and the selector that watches them, and
the dispatch state every part of the pool works on (the tasks in flight, the queue, the results
ready, the arrays workers keep).

`DecodePool` (`joader.server.pool.decode_pool`) is this roster and the parts that act on it,
each owning its own state and holding explicit references to the roster and to the other parts
it calls:

- `WorkerSpawning` (`joader.server.pool.spawning`): workers asked of the forker and adopted;
- `FaultHandling` (`joader.server.pool.faults`): dead and hung workers, suspects, quarantine;
- `Resizing` (`joader.server.pool.resizing`): the target size, growing, retiring the surplus;
- `Probing` (`joader.server.pool.probes`): exact sizes read from files' headers.

A worker on the roster is a *member* (gets healthy tasks), *retiring*, or the *probation
worker* (`joader.server.pool.records`, `Worker`). Everything here runs with `lock` held.
"""

from __future__ import annotations

import logging
import selectors
import threading
import time
from collections import OrderedDict, deque

from joader.server.pool.records import (
    DecodeResult,
    DecodeTask,
    Finished,
    PoolConfig,
    Probe,
    SourceSpec,
    Worker,
)
from joader.server.wire import send_message
from joader.sources.safe_open import display_path

__all__ = ["Roster"]

logger = logging.getLogger("joader.server.pool.decode_pool")  # the pool's log, whichever part writes


class Roster:
    """The pool's workers and the dispatch state its parts share (see the module docstring)."""

    def __init__(self, config: PoolConfig, sources: tuple[SourceSpec, ...], arena_bytes: int) -> None:
        self.config = config
        self.sources = sources
        self.arena_bytes = arena_bytes
        self.lock = threading.RLock()  # the pool's one lock
        self.closed = False
        # the target: members wanted (`joader.server.pool.resizing` sets it)
        self.num_workers = config.num_workers
        self.workers: dict[int, Worker] = {}  # by worker index; retiring ones too, until stopped
        self.probation: Worker | None = None  # the probation worker (`joader.server.pool.faults`)
        self.selector = selectors.DefaultSelector()
        self.tasks: dict[int, DecodeTask] = {}  # submitted, no final result taken yet
        self.pending: deque[DecodeTask] = deque()  # not sent to a worker yet
        # (source index, item id) -> index of the worker keeping its prepared array (did not fit)
        self.staged: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.ready: deque[Finished] = deque()

    def members(self) -> list[Worker]:
        """The live workers that are neither retiring nor the probation worker: the ones that
        get healthy tasks."""
        return [w for w in self.workers.values() if not (w.retiring or w.probation)]

    def add(self, worker: Worker) -> None:
        """A worker the forker started, on the roster under its index (and the probation worker
        if it is one), its socket watched."""
        self.workers[worker.index] = worker
        self.selector.register(worker.sock, selectors.EVENT_READ, worker)
        if worker.probation:
            self.probation = worker

    def send(self, worker: Worker, task: DecodeTask | Probe) -> bool:
        """Sends `task` to `worker`; False if its socket is closed (the caller handles the death)."""
        try:
            worker.sock.sendall(task.message())
        except OSError:
            return False
        self._sent(worker, [task])
        return True

    def send_batch(self, worker: Worker, tasks: list[DecodeTask]) -> bool:
        """Sends `tasks` to `worker` in one message (NOTE [ Decode tasks in batches ] in
        batching.py); False if its socket is closed (the caller handles the death)."""
        if len(tasks) == 1:
            return self.send(worker, tasks[0])
        try:
            send_message(worker.sock, [task.fields() for task in tasks])
        except OSError:
            return False
        self._sent(worker, tasks)
        return True

    @staticmethod
    def _sent(worker: Worker, tasks: list[DecodeTask | Probe] | list[DecodeTask]) -> None:
        """`tasks` are the worker's now; an idle worker's clock starts with the first."""
        if not worker.tasks:
            worker.started_s = time.monotonic()
        worker.tasks.extend(tasks)

    def forget_staged(self, worker: Worker) -> None:
        """What a worker that is gone kept is gone too (and a new worker may get its index)."""
        for key in [key for key, index in self.staged.items() if index == worker.index]:
            del self.staged[key]

    def stop(self, worker: Worker) -> None:
        """Stops a retiring worker (or the probation worker) that has no task left; the forker
        reaps it."""
        del self.workers[worker.index]
        if worker is self.probation:
            self.probation = None
        self.forget_staged(worker)
        try:
            self.selector.unregister(worker.sock)
        except (KeyError, ValueError):
            pass
        try:
            send_message(worker.sock, None)  # it exits on this, or on the EOF just after
        except OSError:
            pass  # already gone
        worker.sock.close()
        logger.info("decode pool: %s %d (pid %d) %s", "probation worker" if worker.probation else "worker",
                    worker.index, worker.pid, "stopped, no suspect left" if worker.probation else "retired")

    def path(self, task: DecodeTask | Probe) -> str:
        if isinstance(task, Probe):
            return str(self.sources[task.source_index].source.paths[task.item_ids[0]])
        return str(self.sources[task.source_index].source.paths[task.item_id])

    def describe(self, task: DecodeTask | Probe) -> str:
        path = display_path(self.path(task))
        if isinstance(task, Probe):
            return f"the headers of {len(task.item_ids)} files from {path} on"
        return path

    def fail(self, task: DecodeTask, reason: str) -> None:
        """`task`'s final result: failed with `reason`."""
        self.ready.append(DecodeResult(task.task_id, False, reason, self.path(task), 0.0))
