"""The decode pool: joaderd's side of the decode workers. This module is its facade and its
dispatch: tasks in (`submit`, `submit_many`), results out (`get_results`, in batches), tasks sent to the least
loaded worker a slot per message (NOTE [ Decode tasks in batches ] in batching.py).

Three process kinds, each in a module of its own:

- **joaderd** (the pool, the owner) talks to every worker directly over a socket of its own,
  sends it tasks (`tasks_per_worker` slots ahead, framed on a stream: `joader.server.wire`)
  and reads its results;
- **the forker** (`joader.server.pool.forker`) forks every worker, because joaderd must never fork
  once gRPC runs;
- **the workers** (`joader.server.pool.worker`) run the shared stage and write into the arena.

`DecodePool` has one lock (the roster's) and one consumer thread (the caller of
`get_result`). It is composed of parts, each a class of its own module that owns its own state
and holds typed references to the roster and to the other parts it calls:

- `records.py`: the records they share (config, result, stats, tasks, probes, workers);
- `roster.py` (`Roster`): the workers, their sockets and the selector, the probation worker, the
  target size, and the dispatch state (tasks in flight, the queue, results ready, kept arrays);
- `spawning.py` (`WorkerSpawning`): workers asked of the forker and adopted; a slow forker;
- `faults.py` (`FaultHandling`): dead and hung workers, suspects, the probation worker,
  quarantine, the crash-loop policy (`joader.server.pool.replacement`);
- `resizing.py` (`Resizing`): the target size, growing, retiring the surplus;
- `probes.py` (`Probing`): exact sizes read from files' headers for the cache;
- this module: composing them, submitting, dispatching, reading results, stats, closing.

Exact sizes (`joader.server.books.item_sizes`). A task of capacity 0 (*size first*) has no range yet:
its worker prepares the item, keeps the array and answers with its size (a result that did not
fit: a `NeedsBytes`, `joader.server.pool.worker`); the cache then allocates exactly that
and submits the item again. The pool sends that second task straight to the worker that keeps
the array (`Roster.staged`), past its queue limit (it is a copy of a few microseconds once it comes
up), so the item is prepared once. If that worker has died or retired meanwhile, the task goes
to any worker, which prepares it from scratch.
"""

from __future__ import annotations

import logging
import os
import select
import selectors
import time
from collections.abc import Sequence
from typing import Self

from joader.errors import InvalidArgumentError, JoaderError
from joader.server.pool.batching import TaskBatching
from joader.server.pool.faults import FaultHandling
from joader.server.pool.probes import Probing
from joader.server.pool.records import (
    DecodeResult,
    DecodeTask,
    Finished,
    NeedsBytes,
    PoolConfig,
    PoolStats,
    Probe,
    ProbeSizes,
    SourceSpec,
    Worker,
)
from joader.server.pool.resizing import Resizing
from joader.server.pool.roster import Roster
from joader.server.pool.spawning import WorkerSpawning
from joader.server.wire import READ_BYTES, recv_nowait, send_message

__all__ = ["DecodePool", "DecodeResult", "Finished", "NeedsBytes", "PoolConfig", "PoolStats", "SourceSpec"]

logger = logging.getLogger(__name__)

_SLICE_S = 0.1  # how often get_result looks at timeouts while it waits
_CLOSE_TIMEOUT_S = 5.0
_STAGED_KEYS = 4096  # items remembered as kept by a worker (far more than workers keep)
RESULTS_BATCH = 1024  # results `get_results` returns at most (one hold of the registry's lock)


def _load(worker: Worker) -> int:
    return len(worker.tasks)


class DecodePool:
    """Worker processes preparing items into the arena; see the module docstring.

    The roster and the parts are made here and wired to each other; each part's class says what
    it owns and holds the methods that change it. The internal methods (`_name`, and the parts'
    methods) run with the roster's lock held, taken by the public ones (or in `__init__`, before
    any other thread)."""

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
        self.arena_bytes = arena_bytes
        self._roster = roster = Roster(config, tuple(sources), arena_bytes)
        self._batching = TaskBatching()  # tasks per message (NOTE [ Decode tasks in batches ], batching.py)
        self._probing = Probing(roster, self._dispatch)
        self._spawning = WorkerSpawning(roster, self._dispatch)
        self._faults = FaultHandling(roster, self._spawning, self._probing, self._dispatch)
        self._resizing = Resizing(roster, self._spawning, self._faults, self._dispatch)
        self._spawning.faults = self._faults
        self._faults.resizing = self._resizing
        self._spawning.start(arena_path)
        try:
            for index in range(config.num_workers):
                self._spawning.spawn(index)
        except BaseException:
            self.close()
            raise
        logger.info("decode pool: %d workers (forker pid %d) on arena %s; decode timeout %s", config.num_workers,
                    self._spawning.forker_pid, arena_path, self._faults.timeouts.describe())
        self._faults.timeouts.to_log()

    # ----------------------------------------------------------------------------- use

    @property
    def num_workers(self) -> int:
        """The target number of members (`resize` changes it)."""
        return self._roster.num_workers

    @num_workers.setter
    def num_workers(self, n: int) -> None:  # the target alone, as the attribute it was (use `resize`)
        self._roster.num_workers = n

    @property
    def in_flight(self) -> int:
        """Tasks submitted whose result has not been taken yet, less the suspects
        (`joader.server.pool.faults`, "Suspects": the healthy queue must not wait for the lane)."""
        return len(self._roster.tasks) - len(self._faults.suspect_ids)

    @property
    def tasks_per_slot(self) -> int:
        """The decode tasks one slot of the registry's limit (and of `tasks_per_worker`) holds,
        sent to a worker in one message: about `batching.SLOT_S` of decoding at the measured
        decode time (NOTE [ Decode tasks in batches ], batching.py)."""
        return self._batching.tasks_per_slot

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        """Queue one item for preparation into `capacity` bytes at `offset`; never blocks.

        Capacity 0: size first (the module docstring, "Exact sizes"): the result says how many bytes
        it needs.
        """
        self.submit_many([(task_id, source_index, item_id, offset, capacity)])

    def submit_many(self, tasks: Sequence[tuple[int, int, int, int, int]]) -> None:
        """`submit` for each (task id, source index, item id, offset, capacity), in order, and
        one dispatch after them all: tasks go to the workers in batches (NOTE [ Decode tasks in
        batches ], batching.py). Raises before queueing any if one is invalid."""
        roster, faults = self._roster, self._faults
        arena_bytes = self.arena_bytes
        num_items_of = [len(spec.source.paths) for spec in roster.sources]
        for _task_id, source_index, item_id, offset, capacity in tasks:
            if not 0 <= source_index < len(num_items_of):
                raise InvalidArgumentError(f"decode pool: no source with index {source_index}")
            num_items = num_items_of[source_index]
            if not 0 <= item_id < num_items:
                raise InvalidArgumentError(f"decode pool: item id {item_id} out of range 0..{num_items - 1}")
            if offset < 0 or capacity < 0 or offset + capacity > arena_bytes:
                raise InvalidArgumentError(
                    f"decode pool: {capacity} bytes at {offset} are outside the arena ({arena_bytes} bytes)")
        with roster.lock:
            if roster.closed:
                raise JoaderError("decode pool is closed")
            in_flight = roster.tasks
            if len({fields[0] for fields in tasks}) != len(tasks) or any(fields[0] in in_flight for fields in tasks):
                raise InvalidArgumentError(f"decode pool: a task id of {[fields[0] for fields in tasks]} is "
                                           "already in flight")
            staged, quarantine, lifted, pending = roster.staged, faults.quarantine, faults.lifted, roster.pending
            any_quarantined = bool(quarantine)
            for fields in tasks:
                task = DecodeTask(*fields)
                in_flight[task.task_id] = task
                key = fields[1], fields[2]  # task.key
                if any_quarantined and key in quarantine:  # unchanged since it hung or crashed twice: not run
                    roster.fail(task, quarantine.reason(key))
                    continue
                if lifted and key in lifted:  # it changed on disk since: tried again, alone
                    lifted.discard(key)
                    task.attempts = self.config.max_attempts - 1
                    faults.to_lane(task)
                    continue
                if staged and key in staged:  # the size-first copy goes to the worker that keeps it
                    keeper = roster.workers.get(staged.pop(key))
                    if keeper is not None and not (keeper.retiring or keeper.probation) and roster.send(keeper, task):
                        continue
                pending.append(task)
            self._dispatch()

    def get_result(self, timeout_s: float | None) -> Finished | None:
        """The next final result, or None after `timeout_s` (None: wait indefinitely)."""
        results = self.get_results(timeout_s, limit=1)
        return results[0] if results else None

    def get_results(self, timeout_s: float | None, limit: int = RESULTS_BATCH, gather_s: float = 0.0) -> list[Finished]:
        """The final results ready now, at least one and at most `limit`, in the order they
        came; [] after `timeout_s` (None: wait indefinitely) or once closed. `gather_s`: once a
        result is in, wait that long for more while decodes are cheap (below).

        NOTE [ Results in batches ]
        The results thread took one result per call, and filed each under the registry's lock
        (issue 37). It now takes every result ready, and files them in one acquisition
        (`Registry.file_results`). A worker still sends each result as it finishes (a
        result is never held back to fill a batch); a batch is what queued while the last one
        was filed, and every message a worker's socket holds is read at once (`_read_worker`).
        With cheap decodes (0.1 ms) that batch was one result: the thread woke, took the
        registry's lock, filed, dispatched one task and woke the waiting `Next`s once per
        decode (joaderd spent about 210 us of main-process CPU per decode in all at 128k items,
        `bench.system.scale`). So while a batch of tasks holds more than
        one (`tasks_per_slot`: decodes well under `batching.SLOT_S`) and more results are on
        their way, the caller's `gather_s` (joaderd: 5 ms) passes before the batch is taken:
        a result waits at most that long, and the workers, a slot or more of tasks ahead, do
        not wait for it (NOTE [ Decode tasks in batches ], batching.py).
        """
        roster, faults = self._roster, self._faults
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with roster.lock:
                faults.check_timeouts()
                faults.replace_deferred()
                due = faults.quarantine.due(time.monotonic())
            if due:  # before a quarantined file's failure is out: its stamp is the reference
                faults.restamp(due)  # stats off the lock
            with roster.lock:
                if roster.ready:
                    return self._take_ready(limit)
                if roster.closed:
                    return []
            wait = _SLICE_S if deadline is None else max(0.0, min(_SLICE_S, deadline - time.monotonic()))
            events = roster.selector.select(wait)
            with roster.lock:
                if roster.closed:
                    return []
                self._read_events(events)
                if roster.ready and not faults.quarantine.unstamped:
                    if not (gather_s and self._more_coming(limit)):
                        return self._take_ready(limit)
                    gather = True
                else:
                    gather = False
            if gather:  # then the top of the loop takes the batch (and stamps a new quarantine first)
                self._gather(gather_s)
                gather_s = 0.0
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return []

    def stats(self) -> PoolStats:
        roster, faults = self._roster, self._faults
        with roster.lock:
            workers = roster.members()
            probation = roster.probation
            return PoolStats(
                workers_configured=roster.num_workers,
                workers_alive=len(workers),
                workers_busy=sum(1 for w in workers if w.tasks),
                workers_replaced=faults.replaced,
                tasks_retried=faults.retried,
                tasks_timed_out=faults.timed_out,
                worker_pids=tuple(w.pid for w in workers),
                workers_retiring=sum(1 for w in roster.workers.values() if w.retiring),
                resizes=self._resizing.log,
                crash_loop=faults.replacement.crash_loop,
                restart_in_s=(max(0.0, round(faults.replacement.retry_at() - time.monotonic(), 1))
                              if len(workers) < roster.num_workers and faults.replacement.crash_loop else 0.0),
                suspects=len(faults.suspect_ids),
                quarantined=len(faults.quarantine),
                probation_pid=probation.pid if probation is not None else 0,
                decode_timeout_s=faults.timeouts.limit_s,
                quarantine_lifted=faults.quarantine.lifted,
            )

    def is_quarantined(self, source_index: int, item_id: int) -> bool:
        """Whether the item's file hung or crashed a worker twice and has not changed on disk
        since (joader.server.pool.quarantine): asking for it again would only fail."""
        with self._roster.lock:
            return (source_index, item_id) in self._faults.quarantine

    @property
    def worker_pids(self) -> list[int]:
        return list(self.stats().worker_pids)

    def resize(self, n: int, reason: str = "") -> None:
        """Sets the number of workers to `n` (at least 1), while the pool serves: `Resizing.resize`
        (`joader.server.pool.resizing`)."""
        self._resizing.resize(n, reason)

    def probe(self, source_index: int, item_ids: Sequence[int]) -> None:
        """Asks for the exact sizes of `item_ids`; they come back through `take_sizes`:
        `Probing.probe` (`joader.server.pool.probes`)."""
        self._probing.probe(source_index, item_ids)

    def take_sizes(self) -> list[tuple[int, int, int]]:
        """The probes' answers since the last call: (source index, item id, exact bytes or 0)."""
        return self._probing.take_sizes()

    def close(self) -> None:
        """Stops every worker and the forker, and reaps them; idempotent."""
        roster = self._roster
        with roster.lock:
            if roster.closed:
                return
            roster.closed = True
            workers = list(roster.workers.values())
            roster.workers.clear()
        for worker in workers:
            try:
                send_message(worker.sock, None)
            except OSError:
                pass
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        for worker in workers:  # wait for each to go (EOF), results discarded
            while time.monotonic() < deadline:
                ready, _, _ = select.select([worker.sock], [], [], 0.1)
                if ready:
                    try:
                        if not worker.sock.recv(READ_BYTES):
                            break
                    except OSError:
                        break
            worker.sock.close()
        roster.selector.close()
        self._spawning.stop(_CLOSE_TIMEOUT_S)  # the forker sees EOF, kills what is left and exits
        logger.info("decode pool: stopped")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- internals

    def _more_coming(self, limit: int) -> bool:
        """Whether gathering is worth a wait: decodes are cheap (a batch holds more than one),
        fewer than `limit` results are ready, and some task has yet to answer."""
        roster = self._roster
        return self._batching.tasks_per_slot > 1 and len(roster.tasks) > len(roster.ready) < limit

    def _gather(self, gather_s: float) -> None:
        """Reads the results that came within `gather_s` more (NOTE [ Results in batches ])."""
        roster = self._roster
        time.sleep(gather_s)  # one wait, not a poll: each wake and read costs the GIL's hand-over
        if roster.closed:  # closed meanwhile: its selector too
            return
        events = roster.selector.select(0)
        with roster.lock:
            if not roster.closed:
                self._read_events(events)

    def _take(self, result: Finished) -> Finished:
        self._roster.tasks.pop(result.task_id, None)
        self._faults.suspect_ids.discard(result.task_id)
        return result

    def _take_ready(self, limit: int) -> list[Finished]:
        ready = self._roster.ready
        return [self._take(ready.popleft()) for _ in range(min(limit, len(ready)))]

    def _dispatch(self) -> None:
        """Send the next suspect to the probation worker; then pending probes, then pending tasks,
        to the least loaded members (never to a retiring one)."""
        roster, faults, probes, pending = self._roster, self._faults, self._probing.queue, self._roster.pending
        faults.run_suspect()
        per_slot = self._batching.tasks_per_slot
        limit = self.config.tasks_per_worker * per_slot
        members = self._takers() if probes or pending else []  # once per call, unless one dies
        while probes or pending:
            if not members:
                break
            worker = members[0] if len(members) == 1 else min(members, key=_load)
            room = limit - len(worker.tasks)
            if room <= 0:
                return
            if probes:
                probe = probes.popleft()
                if roster.send(worker, probe):
                    continue
                probes.appendleft(probe)
            else:  # a batch: at most one slot, so that the next slot goes to the least loaded worker
                batch = [pending.popleft() for _ in range(min(room, per_slot, len(pending)))]
                if roster.send_batch(worker, batch):
                    continue
                pending.extendleft(reversed(batch))
            faults.worker_died(worker, "its socket closed")
            members = self._takers()
        if self._spawning.forker_gone:
            reason = ("no decode worker is left and none can be started: the decode pool's forker "
                      "process is gone (see joaderd's log); restart joaderd")
            if (probes or roster.pending) and not roster.members():
                faults.fail_all(reason)
            if faults.suspects and roster.probation is None:
                faults.fail_suspects(reason)

    # NOTE [ A stalled worker gets no more tasks ]
    # With a slot of tens of cheap decodes per message, a member whose running decode hangs (a
    # hung read, a pathological file) would be handed up to `tasks_per_worker` slots of healthy
    # tasks by the least-loaded rule, all held until its decode timeout (2-60 s) ends it; one
    # task was held that way before batches. So a member whose running task has gone on longer
    # than `TaskBatching.stall_s` (50 ms, or 10 times the mean decode) gets no new task while
    # another member is not stalled; with every member stalled the rule is the plain one.

    def _takers(self) -> list[Worker]:
        """The members that may take the next tasks: those not stalled (NOTE [ A stalled
        worker gets no more tasks ]), or every member if each is."""
        members = self._roster.members()
        if len(members) < 2:
            return members
        now, stall_s = time.monotonic(), self._batching.stall_s
        fresh = [w for w in members if not w.tasks or now - w.started_s < stall_s]
        return fresh or members

    def _read_events(self, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        """Reads what the selector saw: the forker's control socket, and workers' results."""
        for key, _ in events:
            worker = key.data
            if worker is None:
                self._spawning.read_control()
            else:
                self._read_worker(worker)

    def _read_worker(self, worker: Worker) -> None:
        """Reads every message `worker`'s socket holds (in order; its EOF after them)."""
        workers, messages = self._roster.workers, worker.inbox.messages
        read = False
        while workers.get(worker.index) is worker:  # not yet handled, or not since
            if messages:  # in order, each whole one before the EOF (NOTE [ One read per batch of results ])
                self._read_message(worker, messages.popleft())
                read = True
                continue
            data = recv_nowait(worker.sock)
            if data is None:
                break
            if not data:
                self._faults.worker_died(worker, "its connection closed")  # (it dispatches)
                return
            worker.inbox.feed(data)
        if read:
            self._dispatch()  # once for what was read: the worker's next batch goes out whole

    def _read_message(self, worker: Worker, message: DecodeResult | NeedsBytes | ProbeSizes) -> None:
        """Files one message of `worker` (NOTE [ Named worker results ] in records.py); the
        caller dispatches once its messages are read."""
        roster = self._roster
        head = worker.tasks[0] if worker.tasks else None
        if isinstance(message, ProbeSizes):
            if isinstance(head, Probe) and head.probe_id == message.probe_id:
                worker.tasks.popleft()
                self._probing.answered(head, message.sizes)
        else:
            result = message
            needs_bytes = isinstance(result, NeedsBytes)
            if result.ok or needs_bytes:  # decoded (a misfit too: it decoded, then did not fit)
                self._faults.measured(result.decode_s)
                self._batching.add(result.decode_s)
            if isinstance(head, DecodeTask) and head.task_id == result.task_id:
                worker.tasks.popleft()
                if worker.probation:
                    self._faults.settle_suspect(head, result)
                elif needs_bytes:  # did not fit (it needs more than head.capacity): the worker keeps it
                    roster.staged[(head.source_index, head.item_id)] = worker.index
                    roster.staged.move_to_end((head.source_index, head.item_id))
                    while len(roster.staged) > _STAGED_KEYS:
                        roster.staged.popitem(last=False)
            roster.ready.append(result)
        worker.started_s = time.monotonic()  # the next queued task starts now
        if worker.retiring and not worker.tasks:
            roster.stop(worker)
