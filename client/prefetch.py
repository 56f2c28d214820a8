"""Read-ahead for a training process that reads joader itself (num_workers=0, the plain script).

Without DataLoader workers, every piece of a batch's client work - waiting for joaderd's reply,
copying the items out of the arena, the job's `transform` - ran inside the training loop's
`next()`, one after the other with its step. Measured on four plain jobs (bench/system/four_jobs.py:
batch 25, a random crop and flip, an emulated 0.08 s GPU step), that was 5-6 ms per batch, 0.84 s
of each job's 8.5 s span: the gap between the jobs and their GPU-bound ideal. A DataLoader over a
map dataset hides the same work in its workers; `prefetched` hides it in one thread of the
training process, which runs while the loop steps (a sleep, a GPU kernel, torch's own kernels:
all release the GIL), `depth` replies ahead.

The thread only produces; what the loop is given is decided in the loop's thread: the reader
marks an item yielded (`Progress`, what `state_dict` saves) when the loop takes it, not when it
was read ahead, so a checkpoint never counts an item the loop has not seen. Read-ahead items were
acknowledged (copied out of the arena) and are on the client board as received, which is what a
restarted joaderd must not deal again: the loop still gets them from the queue.

Errors travel to the loop and are raised there, with their traceback. When the loop stops early
(a `break`, a new `iter()`), closing the generator stops the thread, which closes its source (the
reader then gives back what it prefetched from joaderd) before it ends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")

_END = object()
_POLL_S = 0.1  # how often a producer blocked on a full queue looks for a stop
_JOIN_S = 10.0  # a stopped producer finishes its current request (joaderd answers within ~1 s)


def prefetched(source: Iterator[T], depth: int, name: str) -> Iterator[T]:
    """`source`'s values, produced by a thread of this name up to `depth` values ahead."""
    slots: queue.Queue[tuple[bool, object]] = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(entry: tuple[bool, object]) -> bool:
        while not stop.is_set():
            try:
                slots.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for value in source:
                if not put((True, value)):
                    return
        except BaseException as error:  # noqa: BLE001  raised in the loop's thread instead
            put((False, error))
            return
        finally:
            source.close()  # type: ignore[attr-defined]  # a generator: its cleanup runs here
        put((True, _END))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            ok, value = slots.get()
            if not ok:
                assert isinstance(value, BaseException)
                raise value
            if value is _END:
                return
            yield value  # type: ignore[misc]
    finally:
        stop.set()
        if thread is not threading.current_thread():
            thread.join(_JOIN_S)
