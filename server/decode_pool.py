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

`get_result` is meant for one consumer thread; `submit` may be called from any thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import signal
import threading
import time
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
        self._in_flight = 0
        self._closed = False
        ctx = multiprocess.get_context("fork")
        self._tasks: Any = ctx.Queue()
        self._results: Any = ctx.Queue()
        self._workers = []
        parent_pid = os.getpid()
        for index in range(num_workers):
            worker = ctx.Process(
                target=_worker_main,
                args=(
                    self._tasks,
                    self._results,
                    arena_path,
                    slot_bytes,
                    self._sources,
                    parent_pid,
                ),
                name=f"joader-decode-{index}",
                daemon=True,  # if the parent exits without close(), multiprocess terminates them
            )
            worker.start()
            self._workers.append(worker)
        logger.info("decode pool: started %d workers on arena %s", num_workers, arena_path)

    @property
    def in_flight(self) -> int:
        """Tasks submitted whose result has not been taken yet."""
        return self._in_flight

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
            self._in_flight += 1
        self._tasks.put((task_id, source_index, item_id, slot))

    def get_result(self, timeout_s: float | None) -> DecodeResult | None:
        """The next finished task, or None after `timeout_s` (None: wait indefinitely)."""
        if self._closed:
            return None
        try:
            raw = self._results.get(timeout=timeout_s)
        except queue.Empty:
            return None
        with self._lock:
            self._in_flight -= 1
        return DecodeResult(*raw)

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
        for q in (self._tasks, self._results):
            q.cancel_join_thread()  # unread items must not block our exit
            q.close()
        self._workers.clear()
        logger.info("decode pool: stopped")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _drain_results(self) -> None:
        try:
            while True:
                self._results.get_nowait()
        except queue.Empty:
            pass


def _worker_main(
    tasks: Any,
    results: Any,
    arena_path: str,
    slot_bytes: int,
    sources: tuple[SourceSpec, ...],
    parent_pid: int,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # in case the parent installed a handler
    fd = os.open(arena_path, os.O_RDWR)
    try:
        arena = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        while True:
            try:
                task = tasks.get(timeout=_PARENT_CHECK_S)
            except queue.Empty:
                if os.getppid() != parent_pid:
                    return  # orphaned: the server died
                continue
            if task is None:
                return
            results.put(_run_task(task, arena, slot_bytes, sources))
    finally:
        # On exit nobody may read the rest: do not block on flushing it.
        results.cancel_join_thread()


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
