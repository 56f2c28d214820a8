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
  and the task it was running is sent to another worker: a worker's death is not the file's
  failure. Tasks it had queued but not started are sent elsewhere without counting an attempt.
- a task running longer than `decode_timeout_s` (a hung NFS read, a pathological file): its
  worker is killed and replaced, and the task retried elsewhere.
- a task present at `max_attempts` (2) such deaths or timeouts fails, with the reason.
- replacements are never given up: in a crash loop (ten replacements within a minute) each next
  one waits longer, 1 s doubling to 30 s, until a minute passes without one
  (`joader.server.replacement`). Meanwhile tasks wait: a pool fault is not a file fault. Only
  when the forker itself is gone (no worker can ever be started again) do pending tasks fail.
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
"""

from __future__ import annotations

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
    crash_loop: bool = False  # workers died ten times within a minute: replacements slowed down
    restart_in_s: float = 0.0  # when the next delayed replacement starts (0: none waiting)


class _Task:
    __slots__ = ("attempts", "capacity", "item_id", "offset", "reason", "source_index", "task_id")

    def __init__(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        self.task_id = task_id
        self.source_index = source_index
        self.item_id = item_id
        self.offset = offset
        self.capacity = capacity
        self.attempts = 0  # deaths or timeouts of workers while running it
        self.reason = ""

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
    __slots__ = ("born", "index", "pid", "retiring", "sock", "started_s", "tasks")

    def __init__(self, index: int, pid: int, sock: socket.socket, born: int) -> None:
        self.index = index
        self.pid = pid
        self.sock = sock
        self.born = born  # the pool's count of workers started before this one: larger is newer
        self.tasks: deque[_Task | _Probe] = deque()  # sent, unfinished; the head is the one running
        self.started_s = 0.0  # when the head task started
        self.retiring = False  # gets no new task; stopped once `tasks` is empty


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
        self._forker_gone = False
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
        """Tasks submitted whose result has not been taken yet."""
        return len(self._tasks)

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
            keeper = self._workers.get(self._staged.pop((source_index, item_id), -1))
            if keeper is None or keeper.retiring or not self._send(keeper, task):
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
            return PoolStats(
                workers_configured=self.num_workers,
                workers_alive=len(workers),
                workers_busy=sum(1 for w in workers if w.tasks),
                workers_replaced=self._replaced,
                tasks_retried=self._retried,
                tasks_timed_out=self._timed_out,
                worker_pids=tuple(w.pid for w in workers),
                workers_retiring=len(self._workers) - len(workers),
                resizes=tuple(self._resizes),
                crash_loop=self._replacement.crash_loop,
                restart_in_s=(max(0.0, round(self._replacement.retry_at() - time.monotonic(), 1))
                              if len(workers) < self.num_workers and self._replacement.crash_loop else 0.0),
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
        return result

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
        """The live workers that are not retiring: the ones that get tasks."""
        return [w for w in self._workers.values() if not w.retiring]

    def _dispatch(self) -> None:
        """Send pending probes, then pending tasks, to the least loaded live workers (never to a
        retiring one)."""
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
        if (self._probes or self._pending) and not self._members() and self._forker_gone:
            self._fail_all("no decode worker is left and none can be started: the decode pool's forker "
                           "process is gone (see joaderd's log); restart joaderd")

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
                if not result.ok and result.nbytes > head.capacity:  # did not fit: the worker keeps it
                    self._staged[(head.source_index, head.item_id)] = worker.index
                    self._staged.move_to_end((head.source_index, head.item_id))
                    while len(self._staged) > _STAGED_KEYS:
                        self._staged.popitem(last=False)
            self._ready.append(result)
        worker.started_s = time.monotonic()  # the next queued task starts now
        if worker.retiring and not worker.tasks:
            self._stop(worker)
        self._dispatch()

    def _read_control(self) -> None:
        data = _recv_nowait(self._control)
        if data is None:
            return
        if not data:
            if not self._closed:
                logger.critical("decode pool: the forker process died; dead workers cannot be replaced")
                self._selector.unregister(self._control)
            return
        log_exit(data)

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
        if isinstance(running, _Task):
            running.attempts += 1
            running.reason = failure or (
                f"the decode worker died {self.config.max_attempts} times while preparing "
                f"{display_path(self._path(running))} ({how}); the file may crash the decoder - check it"
            )
            if running.attempts >= self.config.max_attempts:
                self._fail(running, running.reason)
            else:
                self._retried += 1
                tasks.insert(0, running)
        self._pending.extendleft(reversed(tasks))
        if not self._closed:
            self._fill(replacing=True)  # a no-op if it was retiring: the pool is at its target
        self._dispatch()

    def _fill(self, *, replacing: bool) -> None:
        """Brings the members up to `num_workers`: takes back retiring workers first (oldest
        first), then starts new ones; rate-limited when `replacing` dead ones."""
        while len(self._members()) < self.num_workers:
            retiring = [w for w in self._workers.values() if w.retiring]
            if retiring:
                worker = min(retiring, key=lambda w: w.born)
                worker.retiring = False
                logger.info("decode pool: worker %d (pid %d) kept, no longer retiring", worker.index, worker.pid)
                continue
            if replacing and not self._may_replace():
                return
            try:
                self._spawn(next(i for i in count() if i not in self._workers))
            except OSError as error:
                if not self._forker_gone:
                    logger.critical("decode pool: cannot start a%s worker: %s",
                                    " replacement" if replacing else "", error)
                self._forker_gone = True
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
        """Replacements a crash loop delayed, once their time has come (called every slice)."""
        if self._replacement.update(time.monotonic()):
            logger.warning("decode pool: no worker died for %g s; the crash loop is over",
                           self._replacement.config.healthy_after_s)
        if self._closed or self._forker_gone or len(self._members()) >= self.num_workers:
            return
        if time.monotonic() >= self._replacement.retry_at():
            self._fill(replacing=True)
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
        """Stops a retiring worker that has no task left; the forker reaps it."""
        del self._workers[worker.index]
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
        logger.info("decode pool: worker %d (pid %d) retired", worker.index, worker.pid)

    def _spawn(self, index: int) -> None:
        """Asks the forker for a worker, waiting for its reply (exit notices may come first)."""
        self._control.send(b"spawn")
        deadline = time.monotonic() + 30
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._control], [], [], remaining)[0]:
                raise OSError("the forker did not answer within 30 s")
            data, fds, _flags, _addr = socket.recv_fds(self._control, MAX_MESSAGE, 1)
            if not data:
                raise OSError("the forker process is gone")
            kind, pid, _ = pickle.loads(data)
            if kind == "exit":
                log_exit(data)
                continue
            sock = socket.socket(fileno=fds[0])
            worker = _Worker(index, pid, sock, self._born)
            self._born += 1
            self._workers[index] = worker
            self._selector.register(sock, selectors.EVENT_READ, worker)
            logger.info("decode pool: worker %d started (pid %d)", index, pid)
            return

    def _fail(self, task: _Task, reason: str) -> None:
        self._ready.append(DecodeResult(task.task_id, False, reason, self._path(task), 0.0))

    def _fail_all(self, reason: str) -> None:
        while self._probes:
            self._drop_probe(self._probes.popleft())
        while self._pending:
            task = self._pending.popleft()
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
