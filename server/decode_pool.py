"""The decode workers: the shared stage, run in parallel, writing into the arena.

Each worker reads an item's bytes from its source (`ItemSource.read`), runs the source's stage
(`Stage.prepare`), and writes the result into the byte range joaderd allocated for it (the
stage's upper bound; joaderd shrinks it to the real size when the result arrives). Each worker
maps the arena file read-write itself: only small task and result tuples cross sockets, never
pixels.

Three processes kinds, and why:

- **joaderd** (the pool's owner) talks to every worker directly over a socket of its own
  (`AF_UNIX`, `SOCK_SEQPACKET`: one message per task or result, atomic, no framing). There is no
  shared task queue: a process killed while it waits on a shared `multiprocessing.Queue` dies
  holding the queue's read lock, and every other worker then blocks forever.
- **the forker**, forked once when the pool is created, before joaderd imports grpc. joaderd must
  never fork again once gRPC runs (a child of a process with live gRPC state can crash), yet dead
  and stuck workers must be replaced: the forker is single-threaded and has no gRPC, so it forks
  every worker on request and hands joaderd the worker's socket over SCM_RIGHTS. Create the pool
  from the main thread of a process that has not imported grpc.
- **the workers**, children of the forker.

The forker closes every descriptor it inherited and unmaps its inherited mapping of the arena
(so its children never get either). That matters for the arena's `flock`: a lock belongs to the
open file description, and both a descriptor and a memory mapping keep the description open, so
a child that kept either would keep the arena "alive" after joaderd died, and a restart would
not remove it. Workers map the arena themselves, through a description of their own.
Both set `PR_SET_PDEATHSIG` (SIGKILL) so that they die with their parent: the forker with joaderd
(it is forked from the thread that runs joaderd to its end; the death signal fires when the
*thread* that forked exits), the workers with the forker.

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

import ctypes
import logging
import mmap
import os
import pickle
import select
import selectors
import signal
import socket
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any, Self

import numpy as np

from joader.errors import DecodeError, InvalidArgumentError, JoaderError
from joader.proto import DTYPE_CODES
from joader.server.replacement import ReplacementPolicy
from joader.sources.safe_open import display_path

__all__ = ["DecodePool", "DecodeResult", "PoolConfig", "PoolStats", "SourceSpec"]

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 1 << 16
_ERROR_LIMIT = 2000  # characters of an error text; results must stay small messages
_SLICE_S = 0.1  # how often get_result looks at timeouts while it waits
_CLOSE_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1
_RESIZE_LOG = 20  # entries of the resize log kept for `stats()`


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


class _Worker:
    __slots__ = ("born", "index", "pid", "retiring", "sock", "started_s", "tasks")

    def __init__(self, index: int, pid: int, sock: socket.socket, born: int) -> None:
        self.index = index
        self.pid = pid
        self.sock = sock
        self.born = born  # the pool's count of workers started before this one: larger is newer
        self.tasks: deque[_Task] = deque()  # sent, unfinished; the head is the one running
        self.started_s = 0.0  # when the head task started
        self.retiring = False  # gets no new task; stopped once `tasks` is empty


class DecodePool:
    """Worker processes preparing items into the arena; see the module docstring."""

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
                _forker_main(child_end, _WorkerContext(arena_path, self._sources), parent, keep={child_end_fd})
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
        """Queue one item for preparation into `capacity` bytes at `offset`; never blocks."""
        if not 0 <= source_index < len(self._sources):
            raise InvalidArgumentError(f"decode pool: no source with index {source_index}")
        num_items = len(self._sources[source_index].source.paths)
        if not 0 <= item_id < num_items:
            raise InvalidArgumentError(f"decode pool: item id {item_id} out of range 0..{num_items - 1}")
        if offset < 0 or capacity <= 0 or offset + capacity > self.arena_bytes:
            raise InvalidArgumentError(
                f"decode pool: {capacity} bytes at {offset} are outside the arena ({self.arena_bytes} bytes)")
        with self._lock:
            if self._closed:
                raise JoaderError("decode pool is closed")
            if task_id in self._tasks:
                raise InvalidArgumentError(f"decode pool: task id {task_id} is already in flight")
            task = _Task(task_id, source_index, item_id, offset, capacity)
            self._tasks[task_id] = task
            self._pending.append(task)
            self._dispatch()

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
                        if not worker.sock.recv(_MAX_MESSAGE):
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

    def _path(self, task: _Task) -> str:
        return str(self._sources[task.source_index].source.paths[task.item_id])

    def _members(self) -> list[_Worker]:
        """The live workers that are not retiring: the ones that get tasks."""
        return [w for w in self._workers.values() if not w.retiring]

    def _dispatch(self) -> None:
        """Send pending tasks to the least loaded live workers (never to a retiring one)."""
        limit = self.config.tasks_per_worker
        while self._pending:
            members = self._members()
            if not members:
                break
            worker = min(members, key=lambda w: len(w.tasks))
            if len(worker.tasks) >= limit:
                return
            task = self._pending.popleft()
            try:
                worker.sock.send(task.message())
            except OSError:
                self._pending.appendleft(task)
                self._worker_died(worker, "its socket closed")
                continue
            if not worker.tasks:
                worker.started_s = time.monotonic()
            worker.tasks.append(task)
        if self._pending and not self._members() and self._forker_gone:
            self._fail_all("no decode worker is left and none can be started: the decode pool's forker "
                           "process is gone (see joaderd's log); restart joaderd")

    def _read_worker(self, worker: _Worker) -> None:
        if self._workers.get(worker.index) is not worker:
            return  # already handled
        data = _recv_nowait(worker.sock)
        if data is None:
            return
        if not data:
            self._worker_died(worker, "its connection closed")
            return
        result = DecodeResult(*pickle.loads(data))
        if worker.tasks and worker.tasks[0].task_id == result.task_id:
            worker.tasks.popleft()
        worker.started_s = time.monotonic()  # the next queued task starts now
        self._ready.append(result)
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
        _log_exit(data)

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
                    display_path(self._path(task)),
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
        tasks = list(worker.tasks)
        if tasks:
            running = tasks[0]
            running.attempts += 1
            running.reason = failure or (
                f"the decode worker died {self.config.max_attempts} times while preparing "
                f"{display_path(self._path(running))} ({how}); the file may crash the decoder - check it"
            )
            if running.attempts >= self.config.max_attempts:
                self._fail(running, running.reason)
                tasks = tasks[1:]
            else:
                self._retried += 1
            self._pending.extendleft(reversed(tasks))  # first in line, in their order
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
            data, fds, _flags, _addr = socket.recv_fds(self._control, _MAX_MESSAGE, 1)
            if not data:
                raise OSError("the forker process is gone")
            kind, pid, _ = pickle.loads(data)
            if kind == "exit":
                _log_exit(data)
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
        while self._pending:
            task = self._pending.popleft()
            self._fail(task, f"cannot decode {display_path(self._path(task))}: {reason}")


# ----------------------------------------------------------------------------- child processes


@dataclass(frozen=True)
class _WorkerContext:
    """What every worker inherits through fork (never pickled)."""

    arena_path: str
    sources: tuple[SourceSpec, ...]


def _forker_main(control: socket.socket, ctx: _WorkerContext, parent: int, keep: set[int]) -> None:
    _close_inherited(keep)
    _unmap(os.path.realpath(ctx.arena_path))
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    children: set[int] = set()
    try:
        while True:
            ready, _, _ = select.select([control], [], [], 0.5)
            for pid, how in _reaped(children):
                try:
                    control.send(pickle.dumps(("exit", pid, how)))
                except OSError:
                    return
            if not ready:
                continue
            try:
                message = control.recv(64)
            except OSError:
                return
            if not message:  # the pool closed, or joaderd died
                return
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                try:
                    keep_fd = theirs.fileno()
                    _worker_main(theirs, ctx, keep={keep_fd})
                finally:
                    os._exit(0)
            theirs.close()
            children.add(pid)
            try:
                socket.send_fds(control, [pickle.dumps(("spawned", pid, ""))], [ours.fileno()])
            except OSError:
                return
            finally:
                ours.close()
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _reaped(children: set[int]) -> Iterable[tuple[int, str]]:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        if os.WIFSIGNALED(status):
            yield pid, f"killed by signal {os.WTERMSIG(status)}"
        else:
            yield pid, f"exit code {os.waitstatus_to_exitcode(status)}"


def _worker_main(sock: socket.socket, ctx: _WorkerContext, keep: set[int]) -> None:
    _close_inherited(keep)
    _die_with_parent(os.getppid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; joaderd owns it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fd = os.open(ctx.arena_path, os.O_RDWR | os.O_CLOEXEC)
    try:
        arena = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping stays; no descriptor (and no lock) is kept
    while True:
        try:
            data = sock.recv(_MAX_MESSAGE)
        except OSError:
            return
        if not data:
            return  # joaderd closed its end
        task = pickle.loads(data)
        if task is None:
            return
        result = _run_task(task, arena, ctx.sources)
        try:
            sock.send(pickle.dumps(result))
        except OSError:
            return  # joaderd is gone


def _run_task(
    task: tuple[int, int, int, int, int],
    arena: mmap.mmap,
    sources: tuple[SourceSpec, ...],
) -> tuple[Any, ...]:
    """Reads, prepares and writes one item; returns a `DecodeResult`'s fields."""
    task_id, source_index, item_id, offset, capacity = task
    spec = sources[source_index]
    path = str(spec.source.paths[item_id])
    start = time.perf_counter()
    try:
        array = np.ascontiguousarray(spec.stage.prepare(spec.source.read(item_id), path))
        problem = _check_output(array, spec.stage, capacity)
        if problem:
            raise DecodeError(f"cannot prepare {path}: {problem}")
        written = array.reshape(-1).view(np.uint8)
        np.frombuffer(arena, np.uint8, array.nbytes, offset)[:] = written
        checksum = zlib.crc32(written)  # ~0.03 ms per 196 KB: a client's copy is checked against it
    except DecodeError as exc:
        return (task_id, False, display_path(str(exc))[:_ERROR_LIMIT], path, time.perf_counter() - start)
    except Exception as exc:  # a bug (or a user stage's error) must not kill the worker
        logging.getLogger(__name__).exception("decode worker: task %d failed", task_id)
        message = f"stage {spec.stage.name} failed on {path}: {type(exc).__name__}: {exc}"
        return (task_id, False, display_path(message)[:_ERROR_LIMIT], path, time.perf_counter() - start)
    return (task_id, True, None, path, time.perf_counter() - start, tuple(array.shape), array.dtype.name, array.nbytes,
            checksum)


def _check_output(array: np.ndarray, stage: Any, capacity: int) -> str | None:
    """Why a stage's output cannot be cached, or None."""
    if array.dtype.name not in DTYPE_CODES:
        return f"stage {stage.name} returned dtype {array.dtype}; use one of {', '.join(DTYPE_CODES)}"
    fixed = stage.spec.shape
    if fixed is not None and tuple(array.shape) != tuple(fixed):
        return f"stage {stage.name} returned shape {tuple(array.shape)}, not its declared {tuple(fixed)}"
    if array.nbytes > capacity:
        return (f"stage {stage.name} returned {array.nbytes} bytes, more than its declared bound "
                f"({capacity}); raise the stage's max_item_bytes")
    return None


def _close_inherited(keep: set[int]) -> None:
    """Closes every descriptor but 0, 1, 2 and `keep` (in particular joaderd's arena lock)."""
    keep = keep | {0, 1, 2}
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _unmap(path: str) -> None:
    """Unmaps every inherited mapping of `path`.

    A mapping holds a reference to the open file description it was made from, and so does the
    `flock` on it: joaderd's own mapping of the arena, inherited by fork, would keep the lock
    held after joaderd died as surely as an inherited descriptor. The forker never touches the
    memory; the Python object that owned it in joaderd is never used here.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    with open("/proc/self/maps") as maps:
        lines = maps.readlines()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].rstrip("\n").removesuffix(" (deleted)") == path:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            libc.munmap(start, end - start)


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the EOF on the control socket still ends us
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(0)


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
        return sock.recv(_MAX_MESSAGE, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _log_exit(message: bytes) -> None:
    """The forker's notice of how a worker exited (usually after its EOF was handled)."""
    kind, pid, how = pickle.loads(message)
    if kind == "exit":
        logger.info("decode pool: worker pid %d exited (%s)", pid, how)
