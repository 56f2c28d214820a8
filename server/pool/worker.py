"""A decode worker: the shared stage, run in a process of its own, writing into the arena.

Each worker reads an item's bytes from its source (`ItemSource.read`), runs the source's stage
(`Stage.prepare`), and writes the result into the byte range joaderd allocated for it, with the
crc32 of what it wrote (a client may check its copy against it). The range is the item's exact
size whenever joaderd knows it (`joader.server.books.item_sizes`). When it does not,
the task comes with no range at all (capacity 0, *size first*), or with the stage's upper bound
(shrunk by joaderd when the result arrives) from a pool that cannot do size first.

An item that does not fit its range (size first; or a size read before, and the file changed
since) is not written: the result says how many bytes it needs (a `NeedsBytes`), and the
worker keeps the prepared array (`Staging`, a few items). joaderd allocates exactly that and
sends the task again, to this worker (`DecodePool`), which then only copies the kept array into
the arena: one extra round trip over the socket, no second decode. A kept array is dropped after
its copy, or when newer ones push it out; a task that finds none decodes from scratch.

Besides decodes a worker runs *probes* (`run_probe`): for a batch of items it reads each file
and asks the stage for the item's exact size from the file's header (`item_nbytes`, e.g.
`ImageStage.item_nbytes`: no pixel is decoded), so that most decodes get an exact range in the
first place.

Each worker maps the arena file
read-write itself: only small task and result tuples cross its socket, never pixels. It talks to
joaderd over that socket alone (`AF_UNIX`, `SOCK_STREAM`, each message framed by its length:
`joader.server.wire`); a message holds one task, a batch of tasks (NOTE [ Decode tasks in
batches ] in batching.py) or one result, sent as each task finishes. There is no shared task
queue, because a process killed while it waits on a shared `multiprocessing.Queue` dies holding
the queue's read lock, and every other worker then blocks forever.

Workers are forked by the forker (`joader.server.pool.forker`); this module is what runs in them, and
the process hygiene both share: close every inherited descriptor (a `flock` belongs to the open
file description, so a child that kept joaderd's arena descriptor would keep the arena "alive"
after joaderd died), and die with the parent (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import signal
import socket
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from joader.errors import DecodeError
from joader.proto import DTYPE_CODES
from joader.server.heap import keep_heap
from joader.server.pool.records import MAX_MESSAGE, PROBE, DecodeResult, NeedsBytes, ProbeSizes
from joader.server.wire import READ_BYTES, Inbox, send_message
from joader.sources.safe_open import display_path

__all__ = ["MAX_MESSAGE", "PROBE", "Staging", "WorkerContext", "close_inherited", "die_with_parent",
           "keep_heap", "run_probe", "run_task", "worker_main"]

ERROR_LIMIT = 2000  # characters of an error text; results must stay small messages
_PR_SET_PDEATHSIG = 1
# prepared arrays a worker keeps for the copy joaderd asks for next (a batch of size-first tasks,
# up to `batching.MAX_TASKS_PER_SLOT` of them, keeps each)
STAGED_ITEMS = 64
STAGED_BYTES = 256 << 20  # ... and their bytes at most (the newest is kept whatever its size)
STAGED_S = 10.0  # ... for this long at most: a placement comes within milliseconds, unless the
# cache is all pinned; a later decode of the item must read its file again (it may have changed)


@dataclass(frozen=True)
class WorkerContext:
    """What every worker inherits through fork (never pickled)."""

    arena_path: str
    sources: tuple[Any, ...]  # joader.server.pool.records.SourceSpec


def worker_main(sock: socket.socket, ctx: WorkerContext, keep: set[int]) -> None:
    close_inherited(keep)
    die_with_parent(os.getppid())
    keep_heap()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; joaderd owns it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fd = os.open(ctx.arena_path, os.O_RDWR | os.O_CLOEXEC)
    try:
        arena = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping stays; no descriptor (and no lock) is kept
    staging = Staging()
    inbox = Inbox()
    while True:
        if not inbox.messages:
            try:
                data = sock.recv(READ_BYTES)
            except OSError:
                return
            if not data:
                return  # joaderd closed its end
            inbox.feed(data)
            continue
        task = inbox.messages.popleft()
        if task is None:
            return
        if isinstance(task, list):  # a batch of decode tasks (NOTE [ Decode tasks in batches ], batching.py)
            for one in task:  # each answered as it finishes: a result is never held back
                if not _answer(sock, run_task(one, arena, ctx.sources, staging)):
                    return
            continue
        result: ProbeSizes | DecodeResult | NeedsBytes
        if task[0] == PROBE:
            result = run_probe(task, ctx.sources)
        else:
            result = run_task(task, arena, ctx.sources, staging)
        if not _answer(sock, result):
            return


def _answer(sock: socket.socket, result: ProbeSizes | DecodeResult | NeedsBytes) -> bool:
    """Sends one result, at once (NOTE [ One read per batch of results ] in wire.py); False
    if joaderd is gone."""
    try:
        send_message(sock, result)
    except OSError:
        return False
    return True


class Staging:
    """Prepared arrays that did not fit their range, kept for the copy joaderd asks for next
    (by source index and item id): at most `STAGED_ITEMS`, `STAGED_BYTES` (oldest out first),
    each for `STAGED_S` at most."""

    def __init__(self, max_items: int = STAGED_ITEMS, max_bytes: int = STAGED_BYTES, max_age_s: float = STAGED_S,
                 clock: Any = time.monotonic) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        self._arrays: OrderedDict[tuple[int, int], tuple[np.ndarray, float]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._arrays)

    def put(self, key: tuple[int, int], array: np.ndarray) -> None:
        self.take(key)
        self._arrays[key] = (array, self._clock())
        self._bytes += array.nbytes
        while len(self._arrays) > 1 and (len(self._arrays) > self.max_items or self._bytes > self.max_bytes):
            _, (old, _) = self._arrays.popitem(last=False)
            self._bytes -= old.nbytes

    def take(self, key: tuple[int, int]) -> np.ndarray | None:
        """The array kept for `key` (now no longer kept), or None (none, or too old)."""
        kept = self._arrays.pop(key, None)
        if kept is None:
            return None
        array, since = kept
        self._bytes -= array.nbytes
        return array if self._clock() - since <= self.max_age_s else None


def run_task(
    task: tuple[int, int, int, int, int],
    arena: mmap.mmap,
    sources: tuple[Any, ...],
    staging: Staging | None = None,
) -> DecodeResult | NeedsBytes:
    """Reads, prepares and writes one item (or copies the array `staging` kept of it); returns
    its `DecodeResult`. Capacity 0 (size first) or too small: nothing is written, the
    array is kept in `staging`, and the result is a `NeedsBytes`: how many bytes the item needs."""
    task_id, source_index, item_id, offset, capacity = task
    spec = sources[source_index]
    path = str(spec.source.paths[item_id])
    start = time.perf_counter()
    try:
        array = staging.take((source_index, item_id)) if staging is not None else None
        if array is None:
            array = np.ascontiguousarray(spec.stage.prepare(spec.source.read(item_id), path))
        problem = check_output(array, spec.stage, capacity)
        if problem == _DID_NOT_FIT or (problem is None and capacity == 0):
            # nothing written: joaderd allocates what it needs (an empty item: one unit) and asks again
            if staging is not None:
                staging.put((source_index, item_id), array)
            return NeedsBytes(task_id, f"{display_path(path)}: {array.nbytes} bytes, {capacity} allocated",
                              path, time.perf_counter() - start, tuple(array.shape), array.dtype.name,
                              max(array.nbytes, 1))
        if problem:
            raise DecodeError(f"cannot prepare {path}: {problem}")
        written = array.reshape(-1).view(np.uint8)
        np.frombuffer(arena, np.uint8, array.nbytes, offset)[:] = written
        # ~0.03 ms per 196 KB: a client's copy is checked against it (an ndarray is a buffer; numpy's
        # stubs do not say so to zlib's)
        checksum = zlib.crc32(written)  # type: ignore[arg-type]
    except DecodeError as exc:
        return DecodeResult(task_id, False, display_path(str(exc))[:ERROR_LIMIT], path, time.perf_counter() - start)
    except Exception as exc:  # a bug (or a user stage's error) must not kill the worker
        logging.getLogger(__name__).exception("decode worker: task %d failed", task_id)
        message = f"stage {spec.stage.name} failed on {path}: {type(exc).__name__}: {exc}"
        return DecodeResult(task_id, False, display_path(message)[:ERROR_LIMIT], path, time.perf_counter() - start)
    return DecodeResult(task_id, True, None, path, time.perf_counter() - start, tuple(array.shape), array.dtype.name,
                        array.nbytes, checksum)


_DID_NOT_FIT = "did not fit"


def check_output(array: np.ndarray, stage: Any, capacity: int) -> str | None:
    """Why a stage's output cannot be cached, or None; `_DID_NOT_FIT` when it is within the
    stage's bound but larger than `capacity` (an exact range, from a size read before)."""
    if array.dtype.name not in DTYPE_CODES:
        return f"stage {stage.name} returned dtype {array.dtype}; use one of {', '.join(DTYPE_CODES)}"
    fixed = stage.spec.shape
    if fixed is not None and tuple(array.shape) != tuple(fixed):
        return f"stage {stage.name} returned shape {tuple(array.shape)}, not its declared {tuple(fixed)}"
    bound = stage.spec.max_nbytes
    if array.nbytes > bound:
        return (f"stage {stage.name} returned {array.nbytes} bytes, more than its declared bound "
                f"({bound}); raise the stage's max_item_bytes")
    if array.nbytes > capacity:
        return _DID_NOT_FIT
    return None


def run_probe(task: tuple[Any, ...], sources: tuple[Any, ...]) -> ProbeSizes:
    """The exact sizes of a batch of items, from their files' headers (0: not known).

    A probe never fails: a file that cannot be read, or whose header the stage cannot read, is
    0 (its decode gets the stage's bound, and reports the file's fault itself). Reading the
    whole file (`ItemSource.read`) costs tens of microseconds from the page cache, where the
    decode finds it again shortly after.
    """
    _, probe_id, source_index, item_ids = task
    spec = sources[source_index]
    read_size = getattr(spec.stage, "item_nbytes", None)
    sizes = []
    for item_id in item_ids:
        nbytes = 0
        if read_size is not None:
            try:
                nbytes = int(read_size(spec.source.read(item_id)) or 0)
            except Exception:
                nbytes = 0
        sizes.append((item_id, nbytes))
    return ProbeSizes(probe_id, tuple(sizes))


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
