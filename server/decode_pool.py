"""The decode pool: joaderd's side of the decode workers (tasks, results, faults, resizing).

Three process kinds, each in a module of its own:

- **joaderd** (this module, the pool's owner) talks to every worker directly over a socket of
  its own, sends it tasks (`tasks_per_worker` ahead) and reads its results;
- **the forker** (`joader.server.forker`) forks every worker, because joaderd must never fork
  once gRPC runs;
- **the workers** (`joader.server.decode_worker`) run the shared stage and write into the arena.

Exact sizes (`joader.server.item_cache`, "Exact sizes"). A task of capacity 0 (*size first*) has
no range yet: its worker prepares the item, keeps the array and answers with its size (a result
that did not fit: ok False, nbytes > 0, `joader.server.decode_worker`); the cache then allocates
exactly that and submits the item again. The pool sends that second task straight to the worker
that keeps the array (`_staged`), past its queue limit (it is a copy of a few microseconds once
it comes up), so the item is prepared once. If that worker has died or retired meanwhile, the
task goes to any worker, which prepares it from scratch.

Probes (`probe`, `take_sizes`): besides decodes, the cache asks for the exact sizes of items
it will decode soon; a worker reads their files' headers (`run_probe`, no pixel decoded) and
the sizes wait in the pool until the cache takes them (under the registry's lock, when it next
dispatches), so that each decode can be given exactly its bytes. Probes go to the workers before
queued decodes (a probe of 16 files costs well under a millisecond, and the decodes behind it
wait for its answer), are never counted in `in_flight` (the registry's limit on decodes), and
never fail: a probe whose worker dies or times out, or that the pool cannot send any more,
reports its items' sizes as 0 (unknown), and their decodes go size first.

Faults, handled in `get_result` (the one consumer thread):

- a worker that dies (EOF on its socket: an OOM kill, a crash in a native decoder) is replaced,
  and the task it was running becomes a *suspect* (below). Tasks it had queued but not started
  go back to the head of the queue without counting an attempt.
- a task running longer than `decode_timeout_s` (a hung NFS read, a pathological file): its
  worker is killed and replaced, and the task becomes a suspect too.
- replacements are never given up: in a crash loop (more than ten deaths that nothing explains
  within a minute) each next one waits longer, 1 s doubling to 30 s, until a minute passes
  without one (`joader.server.replacement`). Meanwhile tasks wait: a pool fault is not a file
  fault. Only when the forker itself is gone (no worker can ever be started again) do pending
  tasks fail.
- a slow forker is not a gone one (below, "A slow forker").

Suspects. A decode fault is either a file's or the pool's, and each is treated as such:

- a task whose worker died (or timed out) while running it leaves the healthy queue for the
  *suspect lane*: it is retried alone, in a worker of its own (the *probation worker*, forked
  when a suspect waits and stopped when none does; not a member of the pool, never given a
  healthy task or a probe, one task at a time so that its death names exactly one file).
- a suspect that dies (or times out) there is quarantined: it fails with the reason, as a
  corrupt file does (`on_error="skip"` skips it, `"raise"` raises), after its second death. The
  pool remembers it: when the cache asks for it again (after `--retry-failed-s`) it goes
  straight to the lane, so a quarantined file never kills a member again; once it decodes, it is
  forgotten.
- a suspect that decodes there was innocent: its first death was the pool's (an OOM kill, a
  signal from outside) and is charged to the replacement policy then.
- replacements for deaths a suspect explains (a member running a task, the probation worker
  running a suspect) start at once, without asking the policy: only deaths nothing explains (an
  idle worker, an innocent suspect) slow replacements down. While the pool is in such a crash
  loop, a new death is not presumed to be a file's: its replacement waits like the others, and
  its task still goes to the lane.
- suspects are not counted in `in_flight` (the registry's limit on decodes), so the healthy
  queue keeps every member busy whatever the lane holds: healthy items never wait behind
  suspects.

# NOTE: issue 27 finding 1. A crashed task used to go back first in line, so each fresh worker
# took the file that had killed the last one, and every death counted toward the crash-loop
# backoff: with 1% of 1,200 files crashing the stage the first epoch took 153 s instead of 2.6 s
# (the pool at 0 of 2 workers most of the time), and with 5% and 10% the job died of
# TimeoutError. The test of the time used 7 bad files, just past the limiter.
- a dead worker is replaced only while the pool is below its target (`num_workers`), and a
  worker that was retiring (below) is not replaced at all: replacing keeps the size that was
  asked for, it never undoes a shrink.

Resizing (`resize`; joaderd's autoscaler calls it every few seconds from a thread of its own,
while the consumer thread waits in `get_result`):

- the target, `num_workers`, changes at once, so the registry's in-flight limit (`num_workers`
  times its decodes per worker) follows at once too; every change goes into a short log shown by
  `stats()` (`joader status`), with the caller's reason.
- growing first takes back workers still retiring (they are running already: no fork, nothing
  to warm up), then asks the forker for new ones through the same path as a replacement, under
  the smallest free indices. Growth does not count against the replacement rate limit: it is a
  decision, not a crash loop.
- shrinking retires the surplus: idle workers first (they are stopped at once, nothing can be
  lost), then the least loaded (they drain soonest), newest first among equals (the one a recent
  grow added is the one to give back). A retiring worker gets no new task but keeps its socket:
  the tasks already sent to it (at most `tasks_per_worker`) finish there and their results are
  delivered as usual. Taking them back would throw away work done, and taking back a task a
  worker may already be running would run it twice. When its last result has been read, it is
  sent the stop message, its socket is closed, and the forker reaps it (the exit notice is
  logged). The stop message is sent only then, not at once behind its queued tasks (which the
  worker would also finish first), so that a grow while it drains can still take it back.
- a retiring worker is not a member of the pool: it is not counted as alive, and when it dies or
  times out its unfinished tasks go back to the queue as for any dead worker (the running one
  counting an attempt), but it is not replaced.
- no wake-up of the consumer is needed, so none is sent: `resize` does all its work on the
  calling thread, under `_lock` (as `submit` already may, forking a replacement when a send
  finds a worker dead). A new worker's socket is registered in the selector, which epoll watches
  at once even while the consumer is blocked in it (other selectors see it at the next slice of
  at most `_SLICE_S`), and `_dispatch` hands it queued tasks before `resize` returns. The one
  step left to the consumer, stopping a retiring worker after its last result, is triggered by
  that result, an event the consumer wakes up for anyway.

A slow forker. `_spawn` asks the forker for a worker and waits up to `SPAWN_TIMEOUT_S` for its
answer (a message with the worker's socket passed by SCM_RIGHTS). Two things can keep it waiting,
and only one is permanent:

- the forker is *gone*: EOF on the control socket, a send that fails, or its process has exited
  (`os.waitpid(pid, WNOHANG)` after a timeout). No worker can ever start again: the pool says so
  (critical) and fails what waits once no member is left.
- the forker is *slow*: the timeout passed and its process is alive (a very loaded or swapping
  host, a SIGSTOP). The request stays *owed* (`_owed`): its answer comes later on the control
  socket, where the consumer reads it (`_read_control`, with its descriptor) and adopts the
  worker where the pool needs one now (a member while below the target, else the probation
  worker while a suspect waits, the need the request was for first), or stops it (the forker
  reaps it) if none. Meanwhile no other request is sent, so each answer is the owed request's:
  one request, one reply, never a reply taken for another's. Replacement then goes on as usual
  (`_replace_deferred`, every slice) until the pool is back at its target; tasks wait meanwhile,
  as for any pool fault. A reminder is logged every `SPAWN_TIMEOUT_S` while the answer is owed.

# NOTE: a timeout used to count as the forker gone: the pool never started a worker again, and
# once the last one died every decode failed until joaderd was restarted, though the forker had
# only been slow (its late answer, and the worker in it, was dropped unread). Growth asked for
# while an answer is owed (`resize`) is made up by the replacement path once it comes, so it
# counts against the replacement rate limit there (harmless: growth is rare, the limit generous).
"""

from __future__ import annotations

import array
import logging
import os
import pickle
import select
import selectors
import signal
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any, Self

from joader.errors import InvalidArgumentError, JoaderError
from joader.server.decode_worker import MAX_MESSAGE, PROBE, SIZES, WorkerContext
from joader.server.forker import forker_main, log_exit
from joader.server.replacement import ReplacementPolicy
from joader.sources.safe_open import display_path

__all__ = ["DecodePool", "DecodeResult", "PoolConfig", "PoolStats", "SourceSpec"]

logger = logging.getLogger(__name__)

_SLICE_S = 0.1  # how often get_result looks at timeouts while it waits
_CLOSE_TIMEOUT_S = 5.0
_RESIZE_LOG = 20  # entries of the resize log kept for `stats()`
_STAGED_KEYS = 4096  # items remembered as kept by a worker (far more than workers keep)
PROBE_BATCH = 16  # items per probe message: small, so that the first sizes come back soon
# How long `_spawn` waits for the forker's answer before going on without it (the answer is still
# adopted when it comes: the module docstring, "A slow forker"). A module constant so that a test
# can shorten it.
SPAWN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SourceSpec:
    """What a worker needs to prepare items of one source (inherited through fork, never
    pickled): the items (`joader.sources.base.ItemSource`) and the stage (`joader.stages.Stage`)."""

    source: Any
    stage: Any


@dataclass(frozen=True)
class DecodeResult:
    task_id: int
    ok: bool
    error: str | None  # set when ok is False: names the file and the reason
    path: str
    decode_s: float
    shape: tuple[int, ...] = ()  # of the prepared item, when ok
    dtype: str = ""
    # its bytes, when ok; when not ok and > 0: the item did not fit the range it was given (size
    # first: none; or its file changed since its size was read), nothing was written, the worker
    # keeps the prepared array, and the item needs this many
    nbytes: int = 0
    checksum: int = 0  # zlib.crc32 of the bytes written into the arena (clients may verify)


@dataclass(frozen=True)
class PoolConfig:
    num_workers: int
    decode_timeout_s: float = 60.0
    tasks_per_worker: int = 2  # sent ahead, so that a worker never idles between tasks
    max_attempts: int = 2


@dataclass(frozen=True)
class PoolStats:
    """A snapshot for `joader status`. Retiring workers (see the module docstring) are counted
    only in `workers_retiring`: `workers_alive`, `workers_busy` and `worker_pids` are the pool's
    members, `workers_configured` its target."""

    workers_configured: int
    workers_alive: int
    workers_busy: int
    workers_replaced: int
    tasks_retried: int
    tasks_timed_out: int
    worker_pids: tuple[int, ...]
    workers_retiring: int = 0  # finishing the tasks they have, then stopped
    resizes: tuple[str, ...] = ()  # "21:04:05 workers 2 -> 3 (reason)", the most recent last
    crash_loop: bool = False  # over ten deaths nothing explains within a minute: replacements slowed
    restart_in_s: float = 0.0  # when the next delayed replacement starts (0: none waiting)
    suspects: int = 0  # tasks in the suspect lane (waiting or running in the probation worker)
    quarantined: int = 0  # files that killed a worker twice, the last time alone (they fail)
    probation_pid: int = 0  # the probation worker (0: none running)


class _Task:
    __slots__ = ("attempts", "capacity", "item_id", "offset", "presumed", "reason", "source_index", "task_id")

    def __init__(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        self.task_id = task_id
        self.source_index = source_index
        self.item_id = item_id
        self.offset = offset
        self.capacity = capacity
        self.attempts = 0  # deaths or timeouts of workers while running it
        self.reason = ""
        # its first death was presumed its own (the worker replaced without asking the policy):
        # charged to the policy if it then decodes
        self.presumed = False

    @property
    def key(self) -> tuple[int, int]:
        return self.source_index, self.item_id

    def message(self) -> bytes:
        return pickle.dumps((self.task_id, self.source_index, self.item_id, self.offset, self.capacity))


class _Probe:
    """Up to `PROBE_BATCH` items of one source whose exact sizes the cache asked for."""

    __slots__ = ("item_ids", "probe_id", "source_index")

    def __init__(self, probe_id: int, source_index: int, item_ids: tuple[int, ...]) -> None:
        self.probe_id = probe_id
        self.source_index = source_index
        self.item_ids = item_ids

    def message(self) -> bytes:
        return pickle.dumps((PROBE, self.probe_id, self.source_index, self.item_ids))


class _Worker:
    __slots__ = ("born", "index", "pid", "probation", "retiring", "sock", "started_s", "tasks")

    def __init__(self, index: int, pid: int, sock: socket.socket, born: int, probation: bool = False) -> None:
        self.index = index
        self.pid = pid
        self.sock = sock
        self.born = born  # the pool's count of workers started before this one: larger is newer
        self.tasks: deque[_Task | _Probe] = deque()  # sent, unfinished; the head is the one running
        self.started_s = 0.0  # when the head task started
        self.retiring = False  # gets no new task; stopped once `tasks` is empty
        self.probation = probation  # runs suspects only, one at a time; not a member of the pool


class _ForkerGone(OSError):
    """The forker can never answer again (EOF on its socket, or its process has exited)."""


class _NoWorker(OSError):
    """No worker this time, though the forker is there: the pool tries again later."""


class _ForkerSlow(_NoWorker):
    """The forker is alive but did not answer within `SPAWN_TIMEOUT_S`; its answer is owed."""


@dataclass
class _Owed:
    """The one spawn request the forker has not answered yet (module docstring, "A slow forker")."""

    probation: bool  # what it was asked for: the probation worker, or a member
    replacing: bool  # a member replacing a dead one (counted in `workers_replaced` when adopted)
    since: float  # monotonic time of the request
    reminded: float  # monotonic time of the last log line about it


class DecodePool:
    """Worker processes preparing items into the arena; see the module docstring."""

    sizes_first = True  # `submit` takes capacity 0: prepare, keep, answer with the size

    def __init__(self, config: PoolConfig, arena_path: str, sources: Sequence[SourceSpec]) -> None:
        if config.num_workers <= 0:
            raise InvalidArgumentError(f"num_workers must be positive, got {config.num_workers}")
        if config.decode_timeout_s <= 0:
            raise InvalidArgumentError(f"decode_timeout_s must be positive, got {config.decode_timeout_s}")
        try:
            arena_bytes = os.path.getsize(arena_path)
        except FileNotFoundError:
            raise JoaderError(f"decode pool: arena {arena_path} does not exist") from None
        self.config = config
        self.num_workers = config.num_workers
        self.arena_bytes = arena_bytes
        self._sources = tuple(sources)
        self._lock = threading.RLock()
        self._tasks: dict[int, _Task] = {}  # submitted, no final result taken yet
        self._pending: deque[_Task] = deque()  # not sent to a worker yet
        self._probes: deque[_Probe] = deque()  # not sent to a worker yet (sent before `_pending`)
        self._probe_ids = count()
        self._sizes: list[tuple[int, int, int]] = []  # (source index, item id, bytes or 0), not taken yet
        # (source index, item id) -> index of the worker keeping its prepared array (did not fit)
        self._staged: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._ready: deque[DecodeResult] = deque()
        self._workers: dict[int, _Worker] = {}  # by worker index; retiring ones too, until stopped
        self._born = 0  # workers started so far
        self._resizes: deque[str] = deque(maxlen=_RESIZE_LOG)
        self._selector = selectors.DefaultSelector()
        self._replacement = ReplacementPolicy()
        self._suspects: deque[_Task] = deque()  # the suspect lane's tasks not sent yet
        self._suspect_ids: set[int] = set()  # task ids in the lane, waiting or running
        self._quarantined: set[tuple[int, int]] = set()  # (source index, item id) that failed so
        self._probation: _Worker | None = None
        self._forker_gone = False
        self._owed: _Owed | None = None  # a spawn request the forker has not answered yet
        self._replaced = 0
        self._retried = 0
        self._timed_out = 0
        self._closed = False
        self._control, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the forker
            try:
                child_end_fd = child_end.fileno()
                forker_main(child_end, WorkerContext(arena_path, self._sources), parent, keep={child_end_fd})
            finally:
                os._exit(0)
        child_end.close()
        self._forker_pid = pid
        self._selector.register(self._control, selectors.EVENT_READ, None)
        try:
            for index in range(config.num_workers):
                self._spawn(index)
        except BaseException:
            self.close()
            raise
        logger.info("decode pool: %d workers (forker pid %d) on arena %s", config.num_workers, pid, arena_path)

    # ----------------------------------------------------------------------------- use

    @property
    def in_flight(self) -> int:
        """Tasks submitted whose result has not been taken yet, less the suspects (the module
        docstring: the healthy queue must not wait for the lane)."""
        return len(self._tasks) - len(self._suspect_ids)

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        """Queue one item for preparation into `capacity` bytes at `offset`; never blocks.

        Capacity 0: size first (the module docstring): the result says how many bytes it needs.
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
            task = _Task(task_id, source_index, item_id, offset, capacity)
            self._tasks[task_id] = task
            if task.key in self._quarantined:  # it killed workers before: tried alone again
                task.attempts = self.config.max_attempts - 1
                self._to_lane(task)
                self._dispatch()
                return
            keeper = self._workers.get(self._staged.pop((source_index, item_id), -1))
            if keeper is None or keeper.retiring or keeper.probation or not self._send(keeper, task):
                self._pending.append(task)
            self._dispatch()

    def probe(self, source_index: int, item_ids: Sequence[int]) -> None:
        """Asks for the exact sizes of `item_ids` (read from their files' headers by a worker);
        they come back through `take_sizes`, 0 where not known. Never blocks; ignored once closed."""
        if not 0 <= source_index < len(self._sources):
            raise InvalidArgumentError(f"decode pool: no source with index {source_index}")
        num_items = len(self._sources[source_index].source.paths)
        ids = tuple(int(i) for i in item_ids)
        if any(not 0 <= i < num_items for i in ids):
            raise InvalidArgumentError(f"decode pool: a probed item id is out of range 0..{num_items - 1}")
        with self._lock:
            if self._closed:
                return
            for start in range(0, len(ids), PROBE_BATCH):
                self._probes.append(_Probe(next(self._probe_ids), source_index, ids[start:start + PROBE_BATCH]))
            self._dispatch()

    def take_sizes(self) -> list[tuple[int, int, int]]:
        """The probes' answers since the last call: (source index, item id, exact bytes or 0)."""
        with self._lock:
            sizes, self._sizes = self._sizes, []
            return sizes

    def resize(self, n: int, reason: str = "") -> None:
        """Sets the number of workers to `n` (at least 1), while the pool serves.

        Safe from any thread, also while another one waits in `get_result`. `num_workers` is `n`
        when this returns; new workers have started (unless the forker fails, which is logged),
        surplus idle ones have stopped, and surplus busy ones are retiring: they finish the tasks
        they have, then stop. `reason` goes into the log line and `stats().resizes`. See the
        module docstring for why it works this way.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(f"decode pool: the number of workers must be a whole number of at least 1, got {n!r}")
        with self._lock:
            if self._closed:
                raise JoaderError("decode pool is closed")
            old = self.num_workers
            if n == old:
                return
            self.num_workers = n
            change = f"workers {old} -> {n}" + (f" ({reason})" if reason else "")
            self._resizes.append(f"{time.strftime('%H:%M:%S')} {change}")
            logger.info("decode pool: %s", change)
            if n > old:
                self._fill(replacing=False)
            else:
                self._retire_surplus()
            self._dispatch()

    def get_result(self, timeout_s: float | None) -> DecodeResult | None:
        """The next final result, or None after `timeout_s` (None: wait indefinitely)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._check_timeouts()
                self._replace_deferred()
                if self._ready:
                    return self._take(self._ready.popleft())
                if self._closed:
                    return None
            wait = _SLICE_S if deadline is None else max(0.0, min(_SLICE_S, deadline - time.monotonic()))
            events = self._selector.select(wait)
            with self._lock:
                if self._closed:
                    return None
                for key, _ in events:
                    worker = key.data
                    if worker is None:
                        self._read_control()
                    else:
                        self._read_worker(worker)
                if self._ready:
                    return self._take(self._ready.popleft())
            if deadline is not None and time.monotonic() >= deadline:
                return None

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
                quarantined=len(self._quarantined),
                probation_pid=probation.pid if probation is not None else 0,
            )

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
        _reap(self._forker_pid, _CLOSE_TIMEOUT_S)
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

    def _to_lane(self, task: _Task) -> None:
        """`task` is a suspect now: retried alone, in the probation worker (module docstring)."""
        self._suspects.append(task)
        self._suspect_ids.add(task.task_id)

    def _path(self, task: _Task | _Probe) -> str:
        if isinstance(task, _Probe):
            return str(self._sources[task.source_index].source.paths[task.item_ids[0]])
        return str(self._sources[task.source_index].source.paths[task.item_id])

    def _describe(self, task: _Task | _Probe) -> str:
        path = display_path(self._path(task))
        if isinstance(task, _Probe):
            return f"the headers of {len(task.item_ids)} files from {path} on"
        return path

    def _drop_probe(self, probe: _Probe) -> None:
        """Its items' sizes are not known (0): their decodes get the stage's bound."""
        self._sizes.extend((probe.source_index, item_id, 0) for item_id in probe.item_ids)

    def _members(self) -> list[_Worker]:
        """The live workers that are neither retiring nor the probation worker: the ones that
        get healthy tasks."""
        return [w for w in self._workers.values() if not (w.retiring or w.probation)]

    def _dispatch(self) -> None:
        """Send the next suspect to the probation worker; then pending probes, then pending tasks,
        to the least loaded members (never to a retiring one)."""
        self._run_suspect()
        limit = self.config.tasks_per_worker
        while self._probes or self._pending:
            members = self._members()
            if not members:
                break
            worker = min(members, key=lambda w: len(w.tasks))
            if len(worker.tasks) >= limit:
                return
            queue: deque[Any] = self._probes if self._probes else self._pending
            task = queue.popleft()
            if not self._send(worker, task):
                queue.appendleft(task)
                self._worker_died(worker, "its socket closed")
        if self._forker_gone:
            reason = ("no decode worker is left and none can be started: the decode pool's forker "
                      "process is gone (see joaderd's log); restart joaderd")
            if (self._probes or self._pending) and not self._members():
                self._fail_all(reason)
            if self._suspects and self._probation is None:
                self._fail_suspects(reason)

    def _run_suspect(self) -> None:
        """Sends the lane's next suspect to the probation worker (forked if there is none, at
        once unless the pool is in a crash loop), or stops that worker when the lane is empty."""
        worker = self._probation
        if not self._suspects:
            if worker is not None and not worker.tasks:
                self._stop(worker)
            return
        if self._closed or (worker is not None and worker.tasks):
            return
        if worker is None:
            if self._forker_gone or self._owed is not None:
                return  # gone; or the owed answer comes first (`_late_worker`)
            if self._replacement.crash_loop and not self._may_replace():
                return  # `_replace_deferred` comes back when the policy allows
            try:
                worker = self._spawn(next(i for i in count() if i not in self._workers), probation=True)
            except _NoWorker:
                return  # logged; tried again later (`_late_worker`, `_dispatch`)
            except OSError as error:
                self._forker_lost(f"cannot start a probation worker: {error}")
                return
        task = self._suspects.popleft()
        if not self._send(worker, task):
            self._suspects.appendleft(task)
            self._worker_died(worker, "its socket closed")

    def _forget_staged(self, worker: _Worker) -> None:
        """What a worker that is gone kept is gone too (and a new worker may get its index)."""
        for key in [key for key, index in self._staged.items() if index == worker.index]:
            del self._staged[key]

    def _send(self, worker: _Worker, task: _Task | _Probe) -> bool:
        """Sends `task` to `worker`; False if its socket is closed (the caller handles the death)."""
        try:
            worker.sock.send(task.message())
        except OSError:
            return False
        if not worker.tasks:
            worker.started_s = time.monotonic()
        worker.tasks.append(task)
        return True

    def _read_worker(self, worker: _Worker) -> None:
        if self._workers.get(worker.index) is not worker:
            return  # already handled
        data = _recv_nowait(worker.sock)
        if data is None:
            return
        if not data:
            self._worker_died(worker, "its connection closed")
            return
        message = pickle.loads(data)
        head = worker.tasks[0] if worker.tasks else None
        if message[0] == SIZES:
            _, probe_id, sizes = message
            if isinstance(head, _Probe) and head.probe_id == probe_id:
                worker.tasks.popleft()
                self._sizes.extend((head.source_index, item_id, nbytes) for item_id, nbytes in sizes)
        else:
            result = DecodeResult(*message)
            if isinstance(head, _Task) and head.task_id == result.task_id:
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

    def _settle_suspect(self, task: _Task, result: DecodeResult) -> None:
        """A suspect's result from the probation worker: it did not kill the worker this time
        (decoded, failed as a file, or did not fit its range), so its death was not its fault."""
        if task.presumed:
            task.presumed = False
            self._replacement.charge(time.monotonic())
            logger.warning("decode pool: %s did not kill the probation worker; the death while a "
                           "member ran it counts as one nothing explains", self._describe(task))
        if result.ok and task.key in self._quarantined:
            self._quarantined.discard(task.key)
            logger.info("decode pool: %s decodes again; no longer quarantined", self._describe(task))

    def _read_control(self) -> None:
        """The forker's messages outside `_spawn`: exit notices, an owed answer (with the new
        worker's socket, hence `_recv_with_fd`: a plain `recv` drops it), or EOF."""
        message = _recv_with_fd(self._control)
        if message is None:
            return
        data, fd = message
        if not data:
            self._forker_lost("its control socket closed")
            self._dispatch()
            return
        kind, pid, _ = pickle.loads(data)
        if kind == "spawned":
            self._late_worker(pid, fd)
            self._dispatch()
            return
        if fd is not None:  # cannot happen: only answers carry a socket
            os.close(fd)
        log_exit(data)

    def _late_worker(self, pid: int, fd: int | None) -> None:
        """The owed answer (module docstring, "A slow forker"): its worker is adopted where the
        pool needs one now, the need it was asked for first, or stopped if there is none."""
        owed, self._owed = self._owed, None
        if fd is None:
            logger.error("decode pool: the forker's answer (worker pid %d) came without the worker's "
                         "socket (out of descriptors?); that worker exits by itself", pid)
            return
        sock = socket.socket(fileno=fd)
        late_s = time.monotonic() - owed.since if owed is not None else 0.0
        member = len(self._members()) < self.num_workers
        probation = self._probation is None and bool(self._suspects)
        as_probation = probation and (not member or (owed is not None and owed.probation))
        if owed is None or self._closed or self._forker_gone or not (member or as_probation):
            try:
                sock.send(pickle.dumps(None))  # it exits; the forker reaps it
            except OSError:
                pass
            sock.close()
            if owed is None:  # cannot happen: one request, one answer
                logger.error("decode pool: the forker sent a worker (pid %d) nobody asked for; stopped it", pid)
            else:
                logger.warning("decode pool: the forker answered %.1f s late; its worker (pid %d) is "
                               "not needed any more, stopped", late_s, pid)
            return
        logger.warning("decode pool: the forker answered %.1f s late; its worker (pid %d) joins the pool",
                       late_s, pid)
        self._start(next(i for i in count() if i not in self._workers), pid, sock, as_probation)
        if owed.replacing and not as_probation:
            self._replaced += 1

    def _forker_lost(self, why: str) -> None:
        """The forker is gone for good (logged once): no worker can start again, and what waits
        fails once no member is left (`_dispatch`)."""
        if self._forker_gone or self._closed:
            return
        self._forker_gone = True
        self._owed = None  # its answer can never come (and its worker died with it)
        try:
            self._selector.unregister(self._control)
        except (KeyError, ValueError):
            pass
        logger.critical("decode pool: the forker process is gone (%s); no worker can be started again "
                        "(%d of %d left): restart joaderd", why, len(self._members()), self.num_workers)

    def _forker_exited(self) -> bool:
        """Whether the forker's process has exited (reaping it: `close` copes with that)."""
        try:
            pid, _ = os.waitpid(self._forker_pid, os.WNOHANG)
        except ChildProcessError:
            return True
        return pid != 0

    def _remind_owed(self) -> None:
        """While an answer is owed (every slice): a reminder every `SPAWN_TIMEOUT_S`, and a look
        at whether the forker has exited meanwhile (its EOF says so too)."""
        owed = self._owed
        now = time.monotonic()
        if owed is None or now - owed.reminded < SPAWN_TIMEOUT_S:
            return
        owed.reminded = now
        if self._forker_exited():
            self._forker_lost("its process has exited")
            self._dispatch()
            return
        logger.warning("decode pool: still waiting for the forker's answer (%.0f s so far; its process "
                       "is alive); %d of %d workers meanwhile", now - owed.since, len(self._members()),
                       self.num_workers)

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        limit = self.config.decode_timeout_s
        for worker in list(self._workers.values()):
            if worker.tasks and now - worker.started_s > limit:
                task = worker.tasks[0]
                self._timed_out += 1
                logger.error(
                    "decode pool: %sworker pid %d spent more than %g s (--decode-timeout-s) on %s; "
                    "killing it", "retiring " if worker.retiring else "", worker.pid, limit,
                    self._describe(task),
                )
                try:
                    os.kill(worker.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._worker_died(worker, "killed after the decode timeout", failure=(
                    f"decoding {display_path(self._path(task))} took longer than {limit:g} s "
                    f"(--decode-timeout-s) {self.config.max_attempts} times; the file or its storage hangs"
                ))

    def _worker_died(self, worker: _Worker, how: str, *, failure: str | None = None) -> None:
        """Replaces `worker` if the pool is below its target (never a retiring one); its running
        task is retried, or failed (with `failure` as the reason if given) once it was present at
        `max_attempts` deaths; its queued tasks go back to the queue."""
        if self._workers.get(worker.index) is not worker:
            return
        del self._workers[worker.index]
        try:
            self._selector.unregister(worker.sock)
        except (KeyError, ValueError):
            pass
        worker.sock.close()
        if failure is None:
            logger.error("decode pool: %sworker pid %d died (%s)",
                         "retiring " if worker.retiring else "", worker.pid, how)
        self._forget_staged(worker)
        queued = list(worker.tasks)
        running = queued.pop(0) if queued else None
        if isinstance(running, _Probe):
            self._drop_probe(running)  # not retried: the decodes will read those files themselves
        # the rest was never started: first in line again, in their order
        self._probes.extendleft(reversed([t for t in queued if isinstance(t, _Probe)]))
        tasks = [t for t in queued if isinstance(t, _Task)]
        # Whether a file explains the death (module docstring, "Suspects"); not presumed while
        # the pool is in a crash loop of deaths nothing explains.
        explained = running is not None and not self._replacement.crash_loop
        if isinstance(running, _Task):
            running.attempts += 1
            running.reason = failure or (
                f"the decode worker died {running.attempts} times while preparing "
                f"{display_path(self._path(running))} ({how}), the last time alone; the file crashes "
                "the decoder or the stage - check it (or remove it from the source)"
            )
            if worker.probation and running.attempts >= self.config.max_attempts:
                self._quarantine(running)
            elif worker.probation:  # not its last chance yet: again, still alone
                self._suspects.appendleft(running)
            else:
                self._retried += 1
                if running.task_id not in self._suspect_ids:
                    running.presumed = explained
                    self._to_lane(running)
                    logger.warning("decode pool: %s is a suspect now: retried alone, away from the "
                                   "other decodes", self._describe(running))
                else:  # cannot happen: suspects run in the probation worker only
                    self._suspects.appendleft(running)
        elif worker.probation:  # idle: nothing explains it (a member's replacement asks the policy)
            self._replacement.charge(time.monotonic())
        if worker.probation:
            self._probation = None
        self._pending.extendleft(reversed(tasks))
        if not self._closed and not worker.probation:
            # a no-op if it was retiring: the pool is at its target
            self._fill(replacing=True, explained=explained and not worker.retiring)
        self._dispatch()

    def _quarantine(self, task: _Task) -> None:
        """A suspect that killed the probation worker: fails as a file, and is remembered."""
        self._quarantined.add(task.key)
        logger.error("decode pool: quarantined %s: it killed a decode worker %d times, the last time "
                     "alone; reported as a failed item", self._describe(task), task.attempts)
        self._fail(task, task.reason)

    def _fill(self, *, replacing: bool, explained: bool = False) -> None:
        """Brings the members up to `num_workers`: takes back retiring workers first (oldest
        first), then starts new ones; rate-limited when `replacing` dead ones, except the first
        when a suspect `explained` its death (module docstring, "Suspects")."""
        free = 1 if explained else 0
        while len(self._members()) < self.num_workers:
            retiring = [w for w in self._workers.values() if w.retiring]
            if retiring:
                worker = min(retiring, key=lambda w: w.born)
                worker.retiring = False
                logger.info("decode pool: worker %d (pid %d) kept, no longer retiring", worker.index, worker.pid)
                continue
            if self._forker_gone:
                return
            if self._owed is not None:  # one request at a time: the rest once it is answered
                if not replacing:
                    logger.warning("decode pool: the forker has not answered an earlier request yet; "
                                   "%d of %d workers until it does", len(self._members()), self.num_workers)
                return
            if replacing and not free and not self._may_replace():
                return
            free = 0
            try:
                self._spawn(next(i for i in count() if i not in self._workers), replacing=replacing)
            except _NoWorker:
                return  # logged; tried again later (`_late_worker`, `_replace_deferred`)
            except OSError as error:
                self._forker_lost(f"cannot start a{' replacement' if replacing else ''} worker: {error}")
                return
            if replacing:
                self._replaced += 1

    def _may_replace(self) -> bool:
        """Whether a replacement may start now (`joader.server.replacement`); entering a crash
        loop is logged once, with when the pool will try again."""
        was = self._replacement.crash_loop
        allowed = self._replacement.allow(time.monotonic())
        if not allowed and not was and self._replacement.crash_loop:
            logger.critical(
                "decode pool: %d workers replaced within %g s (a crash loop? see the deaths above); "
                "replacing the next ones more slowly, from %g s up to %g s apart. %d of %d workers "
                "left; decodes wait meanwhile", self._replacement.config.max_per_window,
                self._replacement.config.window_s, self._replacement.config.first_backoff_s,
                self._replacement.config.max_backoff_s, len(self._members()), self.num_workers)
        return allowed

    def _replace_deferred(self) -> None:
        """Replacements (and a probation worker) a crash loop delayed, once their time has come
        (called every slice)."""
        if self._replacement.update(time.monotonic()):
            logger.warning("decode pool: no worker died for %g s; the crash loop is over",
                           self._replacement.config.healthy_after_s)
        if self._closed or self._forker_gone:
            return
        if self._owed is not None:  # nothing starts before its answer (`_late_worker`)
            self._remind_owed()
            return
        if time.monotonic() < self._replacement.retry_at():
            return
        if len(self._members()) < self.num_workers:
            self._fill(replacing=True)
            self._dispatch()
        elif self._suspects and self._probation is None:
            self._dispatch()

    def _retire_surplus(self) -> None:
        """Retires the members beyond `num_workers`: idle ones first (and stops them at once),
        then the least loaded, newest first among equals."""
        members = self._members()
        surplus = len(members) - self.num_workers
        if surplus <= 0:
            return
        for worker in sorted(members, key=lambda w: (len(w.tasks), -w.born))[:surplus]:
            worker.retiring = True
            if worker.tasks:
                logger.info("decode pool: worker %d (pid %d) retiring after its %d task(s)",
                            worker.index, worker.pid, len(worker.tasks))
            else:
                self._stop(worker)

    def _stop(self, worker: _Worker) -> None:
        """Stops a retiring worker (or the probation worker) that has no task left; the forker
        reaps it."""
        del self._workers[worker.index]
        if worker is self._probation:
            self._probation = None
        self._forget_staged(worker)
        try:
            self._selector.unregister(worker.sock)
        except (KeyError, ValueError):
            pass
        try:
            worker.sock.send(pickle.dumps(None))  # it exits on this, or on the EOF just after
        except OSError:
            pass  # already gone
        worker.sock.close()
        logger.info("decode pool: %s %d (pid %d) %s", "probation worker" if worker.probation else "worker",
                    worker.index, worker.pid, "stopped, no suspect left" if worker.probation else "retired")

    def _spawn(self, index: int, *, probation: bool = False, replacing: bool = False) -> _Worker:
        """Asks the forker for a worker and waits up to `SPAWN_TIMEOUT_S` for its answer (exit
        notices may come first). Raises `_ForkerGone` if the forker can never answer, and
        `_ForkerSlow` if it is alive but did not answer in time: the request is then owed
        (`_owed`), and `_late_worker` takes its answer. Callers do not call it while one is owed.
        """
        if self._owed is not None:  # its answer would be taken for this one's
            raise _ForkerSlow("an earlier request to the forker is still unanswered")
        try:
            self._control.send(b"spawn")
        except OSError as error:
            raise _ForkerGone(f"cannot ask it for a worker: {error}") from None
        sent = time.monotonic()
        deadline = sent + SPAWN_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._control], [], [], remaining)[0]:
                if self._forker_exited():
                    raise _ForkerGone("its process has exited")
                self._owed = _Owed(probation, replacing, sent, time.monotonic())
                logger.warning(
                    "decode pool: the forker (pid %d) did not answer within %g s, but its process is "
                    "alive (a loaded or swapping host?): it is slow, not gone. Its worker is taken "
                    "when it answers; %d of %d workers meanwhile", self._forker_pid, SPAWN_TIMEOUT_S,
                    len(self._members()), self.num_workers)
                raise _ForkerSlow(f"the forker did not answer within {SPAWN_TIMEOUT_S:g} s")
            message = _recv_with_fd(self._control)
            if message is None:
                continue
            data, fd = message
            if not data:
                raise _ForkerGone("its control socket closed")
            kind, pid, _ = pickle.loads(data)
            if kind == "exit":
                if fd is not None:  # cannot happen: only answers carry a socket
                    os.close(fd)
                log_exit(data)
                continue
            if fd is None:
                logger.error("decode pool: the forker's answer (worker pid %d) came without the worker's "
                             "socket (out of descriptors?); that worker exits by itself", pid)
                raise _NoWorker("the forker's answer came without the worker's socket")
            return self._start(index, pid, socket.socket(fileno=fd), probation)

    def _start(self, index: int, pid: int, sock: socket.socket, probation: bool) -> _Worker:
        """A worker the forker started, made a member (or the probation worker) under `index`."""
        worker = _Worker(index, pid, sock, self._born, probation)
        self._born += 1
        self._workers[index] = worker
        self._selector.register(sock, selectors.EVENT_READ, worker)
        if probation:
            self._probation = worker
            logger.info("decode pool: probation worker %d started (pid %d) for %d suspect(s)",
                        index, pid, len(self._suspects))
        else:
            logger.info("decode pool: worker %d started (pid %d)", index, pid)
        return worker

    def _fail(self, task: _Task, reason: str) -> None:
        self._ready.append(DecodeResult(task.task_id, False, reason, self._path(task), 0.0))

    def _fail_all(self, reason: str) -> None:
        while self._probes:
            self._drop_probe(self._probes.popleft())
        while self._pending:
            task = self._pending.popleft()
            self._fail(task, f"cannot decode {display_path(self._path(task))}: {reason}")

    def _fail_suspects(self, reason: str) -> None:
        while self._suspects:
            task = self._suspects.popleft()
            self._fail(task, f"cannot decode {display_path(self._path(task))}: {reason}")


def _reap(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.02)


def _recv_with_fd(sock: socket.socket) -> tuple[bytes, int | None] | None:
    """One message of the forker's and the descriptor passed with it (SCM_RIGHTS, or None);
    (b"", None) at EOF (or a broken socket); None if there is none now. Never blocks, as
    `_recv_nowait`; a descriptor beyond the first (none is ever sent) is closed.

    # NOTE: not `socket.recv_fds`: in Python 3.11 it ignores its `flags` argument (it never
    # passes them to `recvmsg`), so MSG_DONTWAIT did nothing and the consumer blocked in it when
    # `_spawn`, on another thread, had taken the message select saw.
    """
    fds = array.array("i")
    try:
        data, ancdata, _flags, _addr = sock.recvmsg(
            MAX_MESSAGE, socket.CMSG_SPACE(fds.itemsize), socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError:
        return b"", None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    for extra in fds[1:] if data else fds:
        os.close(extra)
    return data, (fds[0] if data and fds else None)


def _recv_nowait(sock: socket.socket) -> bytes | None:
    """One message, b"" at EOF (or a broken socket), None if there is none now.

    Never blocks: `_spawn` (which may run on the submitting thread, when a send finds a worker
    dead) can take the message select saw before the consumer thread got the lock.
    """
    try:
        return sock.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError:
        return b""
