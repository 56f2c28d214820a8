"""The decode worker processes: the shared stage, run in parallel, writing into the arena.

Each worker maps the arena file read-write itself and writes a prepared sample straight into
its slot (`stage.prepare_into` on a numpy view): only small task and result tuples cross the
queues, never pixels.

Start the pool before any gRPC object exists in the process: forking while a gRPC channel or
server is live can crash the child (DESIGN.md, sec. 4). Workers are forked (`multiprocess`,
fork start method) so the source listings, which can hold a million paths, are inherited, not
pickled.

Workers ignore SIGINT (the parent owns shutdown, and a Ctrl-C in a terminal reaches the whole
process group) and exit on their own within about `_PARENT_CHECK_S` if the parent dies. That
check polls `os.getppid()` rather than using prctl(PR_SET_PDEATHSIG): the death signal fires when
the *thread* that forked exits, which would kill the pool if it were started from a helper
thread.

A worker that dies (an OOM kill, a crash in a native decoder) is not restarted: forking again
once gRPC is up is unsafe. Its current task is reported as failed, so the item is skipped rather
than waited for forever, and the pool goes on with the remaining workers (`workers_alive`).

`get_result` is meant for one consumer thread; `submit` may be called from any thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import queue
import select
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import multiprocess
import numpy as np

from joader.errors import DecodeError, InvalidArgumentError, JoaderError
from joader.sources.stage import item_nbytes, item_shape, prepare_into

__all__ = ["DecodePool", "DecodeResult", "SourceSpec"]

logger = logging.getLogger(__name__)

_PARENT_CHECK_S = 0.5
_JOIN_TIMEOUT_S = 5.0
_WORKER_CHECK_S = 1.0  # how often get_result looks for dead workers
_IDLE = -1


@dataclass(frozen=True)
class SourceSpec:
    """What a worker needs to find and prepare items of one source."""

    root: str
    paths: tuple[str, ...]  # relative to root; item id = position
    size: int  # side of the prepared sample


@dataclass(frozen=True)
class DecodeResult:
    task_id: int
    ok: bool
    error: str | None  # set when ok is False: names the file and the reason
    path: str
    decode_s: float


class DecodePool:
    """`num_workers` processes preparing items into arena slots, fed through a task queue."""

    def __init__(
        self,
        num_workers: int,
        arena_path: str,
        slot_bytes: int,
        sources: Sequence[SourceSpec],
    ) -> None:
        if num_workers <= 0:
            raise InvalidArgumentError(f"num_workers must be positive, got {num_workers}")
        for spec in sources:
            if item_nbytes(spec.size) > slot_bytes:
                raise InvalidArgumentError(
                    f"samples of size {spec.size} need {item_nbytes(spec.size)} bytes, more "
                    f"than a cache slot ({slot_bytes} bytes)"
                )
        try:
            arena_bytes = os.path.getsize(arena_path)
        except FileNotFoundError:
            raise JoaderError(f"decode pool: arena {arena_path} does not exist") from None
        self.num_workers = num_workers
        self.num_slots = arena_bytes // slot_bytes
        self._sources = tuple(sources)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[int, int]] = {}  # task id -> (source index, item id)
        self._ready: deque[DecodeResult] = deque()  # results made up for dead workers' tasks
        self._dead: set[int] = set()
        self._next_check_s = time.monotonic() + _WORKER_CHECK_S
        self._closed = False
        ctx = multiprocess.get_context("fork")
        self._tasks: Any = ctx.Queue()
        self._results = _ResultChannel(ctx)
        # Each worker's current task id (or _IDLE), so a dead worker's task can be failed.
        self._current: Any = ctx.RawArray("q", [_IDLE] * num_workers)
        self._workers = []
        shared = _WorkerContext(
            self._tasks, self._results, self._current, arena_path, slot_bytes, self._sources,
            parent_pid=os.getpid(),
        )  # fmt: skip
        for index in range(num_workers):
            worker = ctx.Process(
                target=_worker_main,
                args=(shared, index),
                name=f"joader-decode-{index}",
                daemon=True,  # if the parent exits without close(), multiprocess terminates them
            )
            worker.start()
            self._workers.append(worker)
        self._results.close_writer()
        logger.info("decode pool: started %d workers on arena %s", num_workers, arena_path)

    @property
    def in_flight(self) -> int:
        """Tasks submitted whose result has not been taken yet."""
        return len(self._pending)

    def submit(self, task_id: int, source_index: int, item_id: int, slot: int) -> None:
        """Queue one item for preparation into `slot`; does not block."""
        if self._closed:
            raise JoaderError("decode pool is closed")
        if not 0 <= source_index < len(self._sources):
            raise InvalidArgumentError(f"decode pool: no source with index {source_index}")
        num_items = len(self._sources[source_index].paths)
        if not 0 <= item_id < num_items:
            raise InvalidArgumentError(
                f"decode pool: item id {item_id} out of range 0..{num_items - 1}"
            )
        if not 0 <= slot < self.num_slots:
            raise InvalidArgumentError(
                f"decode pool: slot {slot} out of range 0..{self.num_slots - 1}"
            )
        with self._lock:
            if task_id in self._pending:
                raise InvalidArgumentError(f"decode pool: task id {task_id} is already in flight")
            self._pending[task_id] = (source_index, item_id)
        self._tasks.put((task_id, source_index, item_id, slot))

    def get_result(self, timeout_s: float | None) -> DecodeResult | None:
        """The next finished task, or None after `timeout_s` (None: wait indefinitely)."""
        if time.monotonic() >= self._next_check_s:
            self._check_workers()
        if self._ready:
            return self._ready.popleft()
        if self._closed or len(self._dead) == len(self._workers):
            # Nothing can arrive; still honour the timeout so a caller's loop does not spin.
            time.sleep(min(timeout_s, 1.0) if timeout_s is not None else 1.0)
            return None
        try:
            raw = self._results.get(timeout=timeout_s)
        except (queue.Empty, EOFError):  # EOF: every worker has exited
            self._check_workers()
            return self._ready.popleft() if self._ready else None
        except OSError:
            if self._closed:  # close() ran in another thread while we waited
                return None
            raise
        result = DecodeResult(*raw)
        with self._lock:
            self._pending.pop(result.task_id, None)
        return result

    def _check_workers(self) -> None:
        """Fail the tasks of workers that died; fail everything if none is left."""
        self._next_check_s = time.monotonic() + _WORKER_CHECK_S
        if self._closed:
            return
        newly_dead = [
            i for i, w in enumerate(self._workers) if i not in self._dead and not w.is_alive()
        ]
        if not newly_dead:
            return
        self._drain_results(keep=True)  # results they sent before dying are real
        for index in newly_dead:
            self._dead.add(index)
            worker = self._workers[index]
            logger.error(
                "decode pool: worker %s died (exit code %s); %d of %d workers left",
                worker.name, worker.exitcode, self.num_workers - len(self._dead), self.num_workers,
            )  # fmt: skip
            task_id = self._current[index]
            if task_id != _IDLE:
                self._fail(task_id, f"the decode worker died (exit code {worker.exitcode})")
        if len(self._dead) == len(self._workers):
            for task_id in list(self._pending):
                self._fail(task_id, "no decode worker is left (see the server log)")

    def _fail(self, task_id: int, reason: str) -> None:
        with self._lock:
            entry = self._pending.pop(task_id, None)
        if entry is None:
            return  # its real result arrived first
        spec = self._sources[entry[0]]
        path = os.path.join(spec.root, spec.paths[entry[1]])
        self._ready.append(
            DecodeResult(task_id, False, f"cannot decode {path}: {reason}", path, 0.0)
        )

    @property
    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self._workers]

    def workers_alive(self) -> int:
        """How many workers are running (a dead worker is a bug or an OOM kill: see the log)."""
        return sum(worker.is_alive() for worker in self._workers)

    def close(self) -> None:
        """Stop and join every worker; idempotent. Unfinished tasks are dropped."""
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._tasks.put(None)
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for worker in self._workers:
            # Keep draining results: a worker blocked on a full result pipe could not exit.
            while worker.is_alive() and time.monotonic() < deadline:
                self._drain_results()
                worker.join(timeout=0.05)
        for worker in self._workers:
            if worker.is_alive():
                logger.warning("decode pool: worker %s did not stop; terminating it", worker.name)
                worker.terminate()
                worker.join(timeout=_JOIN_TIMEOUT_S)
            if worker.is_alive():
                worker.kill()
                worker.join()
        self._tasks.cancel_join_thread()  # unread tasks must not block our exit
        self._tasks.close()
        self._results.close()
        self._workers.clear()
        logger.info("decode pool: stopped")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _drain_results(self, *, keep: bool = False) -> None:
        try:
            while True:
                raw = self._results.get_nowait()
                if keep:
                    result = DecodeResult(*raw)
                    with self._lock:
                        self._pending.pop(result.task_id, None)
                    self._ready.append(result)
        except (queue.Empty, EOFError, OSError):
            pass


class _ResultChannel:
    """Results from workers to the parent: one pipe, each result a single atomic write.

    Not a `Queue`: its feeder thread returns from `put` before the bytes are written, so a
    worker killed just after could lose a result that the parent then never fails. A result is
    a few hundred bytes; a message under PIPE_BUF goes out in one write(2), which is atomic
    among writers, so no lock is needed, and none can be left held by a killed worker. A rare
    oversized message (a huge error text) takes a lock.
    """

    def __init__(self, ctx: Any) -> None:
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._big_write_lock = ctx.Lock()
        # The parent's consumer thread and close() both read: a frame must not be split.
        self._read_lock = threading.Lock()

    def put(self, item: object) -> None:
        data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) + 4 <= select.PIPE_BUF:
            self._writer.send_bytes(data)
        else:
            with self._big_write_lock:
                self._writer.send_bytes(data)

    def get(self, timeout: float | None) -> Any:
        with self._read_lock:
            if not self._reader.poll(timeout):
                raise queue.Empty
            data = self._reader.recv_bytes()
        return pickle.loads(data)

    def get_nowait(self) -> Any:
        return self.get(0)

    def close_reader(self) -> None:
        """In a worker: without its copy of the read end, a write fails once the parent is gone."""
        self._reader.close()

    def close_writer(self) -> None:
        """In the parent, after forking: it never writes."""
        self._writer.close()

    def close(self) -> None:
        with self._read_lock:  # waits out a reader's poll; the workers' exit ends it by EOF
            for end in (self._reader, self._writer):
                if not end.closed:
                    end.close()


@dataclass(frozen=True)
class _WorkerContext:
    """What every worker inherits through fork (never pickled)."""

    tasks: Any
    results: _ResultChannel
    current: Any
    arena_path: str
    slot_bytes: int
    sources: tuple[SourceSpec, ...]
    parent_pid: int


def _worker_main(ctx: _WorkerContext, index: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # in case the parent installed a handler
    ctx.results.close_reader()
    fd = os.open(ctx.arena_path, os.O_RDWR)
    try:
        arena = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    while True:
        try:
            task = ctx.tasks.get(timeout=_PARENT_CHECK_S)
        except queue.Empty:
            if os.getppid() != ctx.parent_pid:
                return  # orphaned: the server died
            continue
        if task is None:
            return
        ctx.current[index] = task[0]
        result = _run_task(task, arena, ctx.slot_bytes, ctx.sources)
        try:
            ctx.results.put(result)  # written once this returns: a death now loses nothing
        except BrokenPipeError:
            return  # the parent is gone
        ctx.current[index] = _IDLE


def _run_task(
    task: tuple[int, int, int, int],
    arena: mmap.mmap,
    slot_bytes: int,
    sources: tuple[SourceSpec, ...],
) -> tuple[int, bool, str | None, str, float]:
    task_id, source_index, item_id, slot = task
    spec = sources[source_index]
    path = os.path.join(spec.root, spec.paths[item_id])
    start = time.perf_counter()
    out = np.frombuffer(arena, np.uint8, item_nbytes(spec.size), slot * slot_bytes)
    try:
        prepare_into(path, spec.size, out.reshape(item_shape(spec.size)))
    except DecodeError as exc:
        return (task_id, False, str(exc), path, time.perf_counter() - start)
    except Exception as exc:  # a bug must not kill the worker: report it with the task
        logging.getLogger(__name__).exception("decode worker: task %d failed", task_id)
        return (task_id, False, f"internal error preparing {path}: {exc!r}", path, 0.0)
    return (task_id, True, None, path, time.perf_counter() - start)
