"""The decode pool: joaderd's side of the decode workers. This module is its facade and its
dispatch: tasks in (`submit`), results out (`get_results`, in batches), tasks sent to the least loaded worker.

Three process kinds, each in a module of its own:

- **joaderd** (the pool, the owner) talks to every worker directly over a socket of its own,
  sends it tasks (`tasks_per_worker` ahead) and reads its results;
- **the forker** (`joader.server.pool.forker`) forks every worker, because joaderd must never fork
  once gRPC runs;
- **the workers** (`joader.server.pool.worker`) run the shared stage and write into the arena.

`DecodePool` is one object with one lock (`_lock`) and one consumer thread (the caller of
`get_result`). Its parts, each a class of its own module that `DecodePool` is made of:

- `pool_records.py`: the records they share (config, result, stats, tasks, probes, workers);
- `pool_spawning.py` (`WorkerSpawning`): workers asked of the forker and adopted; a slow forker;
- `pool_faults.py` (`FaultHandling`): dead and hung workers, suspects, the probation worker,
  quarantine, the crash-loop policy (`joader.server.pool.replacement`);
- `pool_resizing.py` (`Resizing`): the target size, growing, retiring the surplus;
- `pool_probes.py` (`Probing`): exact sizes read from files' headers for the cache;
- this module: the state they share, submitting, dispatching, reading results, stats, closing.

Exact sizes (`joader.server.books.item_sizes`). A task of capacity 0 (*size first*) has no range yet:
its worker prepares the item, keeps the array and answers with its size (a result that did not
fit: ok False, nbytes > 0, `joader.server.pool.worker`); the cache then allocates exactly that
and submits the item again. The pool sends that second task straight to the worker that keeps
the array (`_staged`), past its queue limit (it is a copy of a few microseconds once it comes
up), so the item is prepared once. If that worker has died or retired meanwhile, the task goes
to any worker, which prepares it from scratch.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import selectors
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import count
from typing import Any, Self

from joader.errors import InvalidArgumentError, JoaderError
from joader.server.pool.faults import FaultHandling
from joader.server.pool.probes import Probing
from joader.server.pool.quarantine import Quarantine
from joader.server.pool.records import (
    DecodeResult,
    DecodeTask,
    PoolConfig,
    PoolStats,
    Probe,
    SourceSpec,
    Worker,
    recv_nowait,
)
from joader.server.pool.replacement import ReplacementPolicy
from joader.server.pool.resizing import RESIZE_LOG, Resizing
from joader.server.pool.spawning import OwedSpawn, WorkerSpawning, reap, start_forker
from joader.server.pool.timeout import AutoTimeout, DecodeTimes
from joader.server.pool.worker import MAX_MESSAGE, SIZES
from joader.sources.safe_open import display_path

__all__ = ["DecodePool", "DecodeResult", "PoolConfig", "PoolStats", "SourceSpec"]

logger = logging.getLogger(__name__)

_SLICE_S = 0.1  # how often get_result looks at timeouts while it waits
_CLOSE_TIMEOUT_S = 5.0
_STAGED_KEYS = 4096  # items remembered as kept by a worker (far more than workers keep)
RESULTS_BATCH = 1024  # results `get_results` returns at most (one hold of the registry's lock)


def _load(worker: Worker) -> int:
    return len(worker.tasks)


class DecodePool(Probing, Resizing, FaultHandling, WorkerSpawning):
    """Worker processes preparing items into the arena; see the module docstring.

    Its state is set up here, grouped by the part that owns it; each part's class (the bases)
    says what it owns and holds the methods that change it. The internal methods (`_name`) run
    with `_lock` held, taken by the public ones (or in `__init__`, before any other thread)."""

    sizes_first = True  # `submit` takes capacity 0: prepare, keep, answer with the size

    def __init__(self, config: PoolConfig, arena_path: str, sources: Sequence[SourceSpec]) -> None:
        if config.num_workers <= 0:
            raise InvalidArgumentError(f"num_workers must be positive, got {config.num_workers}")
        if config.decode_timeout_s is not None and config.decode_timeout_s <= 0:
            raise InvalidArgumentError(f"decode_timeout_s must be positive, got {config.decode_timeout_s}")
        if config.decode_timeout_ceiling_s <= 0:
            raise InvalidArgumentError(
                f"decode_timeout_ceiling_s must be positive, got {config.decode_timeout_ceiling_s}")
        try:
            arena_bytes = os.path.getsize(arena_path)
        except FileNotFoundError:
            raise JoaderError(f"decode pool: arena {arena_path} does not exist") from None
        self.config = config
        self.num_workers = config.num_workers
        self.arena_bytes = arena_bytes
        self._sources = tuple(sources)
        self._lock = threading.RLock()
        self._closed = False
        # dispatch and results (this module)
        self._tasks: dict[int, DecodeTask] = {}  # submitted, no final result taken yet
        self._pending: deque[DecodeTask] = deque()  # not sent to a worker yet
        # (source index, item id) -> index of the worker keeping its prepared array (did not fit)
        self._staged: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._ready: deque[DecodeResult] = deque()
        self._workers: dict[int, Worker] = {}  # by worker index; retiring ones too, until stopped
        self._selector = selectors.DefaultSelector()
        # probes (pool_probes.py)
        self._probes: deque[Probe] = deque()  # not sent to a worker yet (sent before `_pending`)
        self._probe_ids = count()
        self._sizes: list[tuple[int, int, int]] = []  # (source index, item id, bytes or 0), not taken yet
        # resizing (pool_resizing.py; `num_workers` above)
        self._resizes: deque[str] = deque(maxlen=RESIZE_LOG)
        # faults (pool_faults.py)
        self._replacement = ReplacementPolicy()
        self._suspects: deque[DecodeTask] = deque()  # the suspect lane's tasks not sent yet
        self._suspect_ids: set[int] = set()  # task ids in the lane, waiting or running
        self._quarantine = Quarantine()  # (source index, item id) that hung or crashed twice
        self._lifted: set[tuple[int, int]] = set()  # quarantined, then changed on disk: not tried yet
        self._timeouts = DecodeTimes(config.decode_timeout_s, AutoTimeout(ceiling_s=config.decode_timeout_ceiling_s))
        self._probation: Worker | None = None
        self._replaced = 0
        self._retried = 0
        self._timed_out = 0
        # spawning (pool_spawning.py)
        self._born = 0  # workers started so far
        self._forker_gone = False
        self._owed: OwedSpawn | None = None  # a spawn request the forker has not answered yet
        self._control, self._forker_pid = start_forker(arena_path, self._sources)
        self._selector.register(self._control, selectors.EVENT_READ, None)
        try:
            for index in range(config.num_workers):
                self._spawn(index)
        except BaseException:
            self.close()
            raise
        logger.info("decode pool: %d workers (forker pid %d) on arena %s; decode timeout %s", config.num_workers,
                    self._forker_pid, arena_path, self._timeouts.describe())
        self._timeouts.to_log()

    # ----------------------------------------------------------------------------- use

    @property
    def in_flight(self) -> int:
        """Tasks submitted whose result has not been taken yet, less the suspects
        (`joader.server.pool.faults`, "Suspects": the healthy queue must not wait for the lane)."""
        return len(self._tasks) - len(self._suspect_ids)

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        """Queue one item for preparation into `capacity` bytes at `offset`; never blocks.

        Capacity 0: size first (the module docstring, "Exact sizes"): the result says how many bytes
        it needs.
        """
        if not 0 <= source_index < len(self._sources):
            raise InvalidArgumentError(f"decode pool: no source with index {source_index}")
        num_items = len(self._sources[source_index].source.paths)
        if not 0 <= item_id < num_items:
            raise InvalidArgumentError(f"decode pool: item id {item_id} out of range 0..{num_items - 1}")
        if offset < 0 or capacity < 0 or offset + capacity > self.arena_bytes:
            raise InvalidArgumentError(
                f"decode pool: {capacity} bytes at {offset} are outside the arena ({self.arena_bytes} bytes)")
        with self._lock:
            if self._closed:
                raise JoaderError("decode pool is closed")
            if task_id in self._tasks:
                raise InvalidArgumentError(f"decode pool: task id {task_id} is already in flight")
            task = DecodeTask(task_id, source_index, item_id, offset, capacity)
            self._tasks[task_id] = task
            if task.key in self._quarantine:  # unchanged since it hung or crashed twice: not run
                self._fail(task, self._quarantine.reason(task.key))
                return
            if task.key in self._lifted:  # it changed on disk since: tried again, alone
                self._lifted.discard(task.key)
                task.attempts = self.config.max_attempts - 1
                self._to_lane(task)
                self._dispatch()
                return
            keeper = self._workers.get(self._staged.pop((source_index, item_id), -1))
            if keeper is None or keeper.retiring or keeper.probation or not self._send(keeper, task):
                self._pending.append(task)
            self._dispatch()

    def get_result(self, timeout_s: float | None) -> DecodeResult | None:
        """The next final result, or None after `timeout_s` (None: wait indefinitely)."""
        results = self.get_results(timeout_s, limit=1)
        return results[0] if results else None

    def get_results(self, timeout_s: float | None, limit: int = RESULTS_BATCH) -> list[DecodeResult]:
        """The final results ready now, at least one and at most `limit`, in the order they
        came; [] after `timeout_s` (None: wait indefinitely) or once closed.

        NOTE [ Results in batches ]
        The results thread took one result per call, and filed each under the registry's lock
        (issue 37). It now takes every result ready, and files them in one acquisition
        (`Registry.file_results`). A worker still sends each result as it finishes (a
        result is never held back to fill a batch); a batch is what queued while the last one
        was filed, and every message a worker's socket holds is read at once (`_read_worker`).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._check_timeouts()
                self._replace_deferred()
                due = self._quarantine.due(time.monotonic())
            if due:  # before a quarantined file's failure is out: its stamp is the reference
                self._restamp(due)  # stats off the lock
            with self._lock:
                if self._ready:
                    return self._take_ready(limit)
                if self._closed:
                    return []
            wait = _SLICE_S if deadline is None else max(0.0, min(_SLICE_S, deadline - time.monotonic()))
            events = self._selector.select(wait)
            with self._lock:
                if self._closed:
                    return []
                for key, _ in events:
                    worker = key.data
                    if worker is None:
                        self._read_control()
                    else:
                        self._read_worker(worker)
                if self._ready and not self._quarantine.unstamped:
                    return self._take_ready(limit)
            if deadline is not None and time.monotonic() >= deadline:
                return []

    def stats(self) -> PoolStats:
        with self._lock:
            workers = self._members()
            probation = self._probation
            return PoolStats(
                workers_configured=self.num_workers,
                workers_alive=len(workers),
                workers_busy=sum(1 for w in workers if w.tasks),
                workers_replaced=self._replaced,
                tasks_retried=self._retried,
                tasks_timed_out=self._timed_out,
                worker_pids=tuple(w.pid for w in workers),
                workers_retiring=sum(1 for w in self._workers.values() if w.retiring),
                resizes=tuple(self._resizes),
                crash_loop=self._replacement.crash_loop,
                restart_in_s=(max(0.0, round(self._replacement.retry_at() - time.monotonic(), 1))
                              if len(workers) < self.num_workers and self._replacement.crash_loop else 0.0),
                suspects=len(self._suspect_ids),
                quarantined=len(self._quarantine),
                probation_pid=probation.pid if probation is not None else 0,
                decode_timeout_s=self._timeouts.limit_s,
                quarantine_lifted=self._quarantine.lifted,
            )

    def is_quarantined(self, source_index: int, item_id: int) -> bool:
        """Whether the item's file hung or crashed a worker twice and has not changed on disk
        since (joader.server.pool.quarantine): asking for it again would only fail."""
        with self._lock:
            return (source_index, item_id) in self._quarantine

    @property
    def worker_pids(self) -> list[int]:
        return list(self.stats().worker_pids)

    def close(self) -> None:
        """Stops every worker and the forker, and reaps them; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            try:
                worker.sock.send(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        for worker in workers:  # wait for each to go (EOF), results discarded
            while time.monotonic() < deadline:
                ready, _, _ = select.select([worker.sock], [], [], 0.1)
                if ready:
                    try:
                        if not worker.sock.recv(MAX_MESSAGE):
                            break
                    except OSError:
                        break
            worker.sock.close()
        self._selector.close()
        self._control.close()  # the forker sees EOF, kills what is left and exits
        reap(self._forker_pid, _CLOSE_TIMEOUT_S)
        logger.info("decode pool: stopped")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- internals

    def _take(self, result: DecodeResult) -> DecodeResult:
        self._tasks.pop(result.task_id, None)
        self._suspect_ids.discard(result.task_id)
        return result

    def _take_ready(self, limit: int) -> list[DecodeResult]:
        ready = self._ready
        return [self._take(ready.popleft()) for _ in range(min(limit, len(ready)))]

    def _path(self, task: DecodeTask | Probe) -> str:
        if isinstance(task, Probe):
            return str(self._sources[task.source_index].source.paths[task.item_ids[0]])
        return str(self._sources[task.source_index].source.paths[task.item_id])

    def _describe(self, task: DecodeTask | Probe) -> str:
        path = display_path(self._path(task))
        if isinstance(task, Probe):
            return f"the headers of {len(task.item_ids)} files from {path} on"
        return path

    def _members(self) -> list[Worker]:
        """The live workers that are neither retiring nor the probation worker: the ones that
        get healthy tasks."""
        return [w for w in self._workers.values() if not (w.retiring or w.probation)]

    def _dispatch(self) -> None:
        """Send the next suspect to the probation worker; then pending probes, then pending tasks,
        to the least loaded members (never to a retiring one)."""
        self._run_suspect()
        limit = self.config.tasks_per_worker
        members = self._members() if self._probes or self._pending else []  # once per call, unless one dies
        while self._probes or self._pending:
            if not members:
                break
            worker = members[0] if len(members) == 1 else min(members, key=_load)
            if len(worker.tasks) >= limit:
                return
            queue: deque[Any] = self._probes if self._probes else self._pending
            task = queue.popleft()
            if not self._send(worker, task):
                queue.appendleft(task)
                self._worker_died(worker, "its socket closed")
                members = self._members()
        if self._forker_gone:
            reason = ("no decode worker is left and none can be started: the decode pool's forker "
                      "process is gone (see joaderd's log); restart joaderd")
            if (self._probes or self._pending) and not self._members():
                self._fail_all(reason)
            if self._suspects and self._probation is None:
                self._fail_suspects(reason)

    def _forget_staged(self, worker: Worker) -> None:
        """What a worker that is gone kept is gone too (and a new worker may get its index)."""
        for key in [key for key, index in self._staged.items() if index == worker.index]:
            del self._staged[key]

    def _send(self, worker: Worker, task: DecodeTask | Probe) -> bool:
        """Sends `task` to `worker`; False if its socket is closed (the caller handles the death)."""
        try:
            worker.sock.send(task.message())
        except OSError:
            return False
        if not worker.tasks:
            worker.started_s = time.monotonic()
        worker.tasks.append(task)
        return True

    def _read_worker(self, worker: Worker) -> None:
        """Reads every message `worker`'s socket holds (in order; its EOF after them)."""
        while self._workers.get(worker.index) is worker:  # not yet handled, or not since
            data = recv_nowait(worker.sock)
            if data is None:
                return
            if not data:
                self._worker_died(worker, "its connection closed")
                return
            self._read_message(worker, pickle.loads(data))

    def _read_message(self, worker: Worker, message: tuple[Any, ...]) -> None:
        head = worker.tasks[0] if worker.tasks else None
        if message[0] == SIZES:
            _, probe_id, sizes = message
            if isinstance(head, Probe) and head.probe_id == probe_id:
                worker.tasks.popleft()
                self._sizes.extend((head.source_index, item_id, nbytes) for item_id, nbytes in sizes)
        else:
            result = DecodeResult(*message)
            if result.ok or result.nbytes:  # decoded (a misfit too: it decoded, then did not fit)
                self._measured(result.decode_s)
            if isinstance(head, DecodeTask) and head.task_id == result.task_id:
                worker.tasks.popleft()
                if worker.probation:
                    self._settle_suspect(head, result)
                elif not result.ok and result.nbytes > head.capacity:  # did not fit: the worker keeps it
                    self._staged[(head.source_index, head.item_id)] = worker.index
                    self._staged.move_to_end((head.source_index, head.item_id))
                    while len(self._staged) > _STAGED_KEYS:
                        self._staged.popitem(last=False)
            self._ready.append(result)
        worker.started_s = time.monotonic()  # the next queued task starts now
        if worker.retiring and not worker.tasks:
            self._stop(worker)
        self._dispatch()
