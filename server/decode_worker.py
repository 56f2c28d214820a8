"""A decode worker: the shared stage, run in a process of its own, writing into the arena.

Each worker reads an item's bytes from its source (`ItemSource.read`), runs the source's stage
(`Stage.prepare`), and writes the result into the byte range joaderd allocated for it (the
stage's upper bound; joaderd shrinks it to the real size when the result arrives), with the
crc32 of what it wrote (a client may check its copy against it). Each worker maps the arena file
read-write itself: only small task and result tuples cross its socket, never pixels. It talks to
joaderd over that socket alone (`AF_UNIX`, `SOCK_SEQPACKET`: one message per task or result,
atomic, no framing); there is no shared task queue, because a process killed while it waits on a
shared `multiprocessing.Queue` dies holding the queue's read lock, and every other worker then
blocks forever.

Workers are forked by the forker (`joader.server.forker`); this module is what runs in them, and
the process hygiene both share: close every inherited descriptor (a `flock` belongs to the open
file description, so a child that kept joaderd's arena descriptor would keep the arena "alive"
after joaderd died), and die with the parent (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import pickle
import signal
import socket
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from joader.errors import DecodeError
from joader.proto import DTYPE_CODES
from joader.sources.safe_open import display_path

__all__ = ["MAX_MESSAGE", "WorkerContext", "close_inherited", "die_with_parent", "run_task", "worker_main"]

MAX_MESSAGE = 1 << 16
ERROR_LIMIT = 2000  # characters of an error text; results must stay small messages
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerContext:
    """What every worker inherits through fork (never pickled)."""

    arena_path: str
    sources: tuple[Any, ...]  # joader.server.decode_pool.SourceSpec


def worker_main(sock: socket.socket, ctx: WorkerContext, keep: set[int]) -> None:
    close_inherited(keep)
    die_with_parent(os.getppid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; joaderd owns it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fd = os.open(ctx.arena_path, os.O_RDWR | os.O_CLOEXEC)
    try:
        arena = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping stays; no descriptor (and no lock) is kept
    while True:
        try:
            data = sock.recv(MAX_MESSAGE)
        except OSError:
            return
        if not data:
            return  # joaderd closed its end
        task = pickle.loads(data)
        if task is None:
            return
        result = run_task(task, arena, ctx.sources)
        try:
            sock.send(pickle.dumps(result))
        except OSError:
            return  # joaderd is gone


def run_task(
    task: tuple[int, int, int, int, int],
    arena: mmap.mmap,
    sources: tuple[Any, ...],
) -> tuple[Any, ...]:
    """Reads, prepares and writes one item; returns a `DecodeResult`'s fields."""
    task_id, source_index, item_id, offset, capacity = task
    spec = sources[source_index]
    path = str(spec.source.paths[item_id])
    start = time.perf_counter()
    try:
        array = np.ascontiguousarray(spec.stage.prepare(spec.source.read(item_id), path))
        problem = check_output(array, spec.stage, capacity)
        if problem:
            raise DecodeError(f"cannot prepare {path}: {problem}")
        written = array.reshape(-1).view(np.uint8)
        np.frombuffer(arena, np.uint8, array.nbytes, offset)[:] = written
        checksum = zlib.crc32(written)  # ~0.03 ms per 196 KB: a client's copy is checked against it
    except DecodeError as exc:
        return (task_id, False, display_path(str(exc))[:ERROR_LIMIT], path, time.perf_counter() - start)
    except Exception as exc:  # a bug (or a user stage's error) must not kill the worker
        logging.getLogger(__name__).exception("decode worker: task %d failed", task_id)
        message = f"stage {spec.stage.name} failed on {path}: {type(exc).__name__}: {exc}"
        return (task_id, False, display_path(message)[:ERROR_LIMIT], path, time.perf_counter() - start)
    return (task_id, True, None, path, time.perf_counter() - start, tuple(array.shape), array.dtype.name, array.nbytes,
            checksum)


def check_output(array: np.ndarray, stage: Any, capacity: int) -> str | None:
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


def close_inherited(keep: set[int]) -> None:
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


def die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the EOF on the control socket still ends us
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(0)
