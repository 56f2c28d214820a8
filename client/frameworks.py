"""What the code that drives a `JoaderDataset` expects of it, found by looking at who calls.

A DataLoader never tells its dataset its batch size, and accelerate never tells it that it
re-deals what the dataset yields. Both matter to joader, and both are visible on the call
stack at the moment the dataset is used, so this module looks there (a bounded walk up the
frames, only when a pass starts or `len()`/`set_epoch()` is called, never per item):

- `loader_batch_size`: torch's `_IterableDatasetFetcher.fetch(possibly_batched_index)` (also
  used by torchdata's StatefulDataLoader) takes one item per element of that list to collate a
  batch. joaderd replies in whole batches of the size asked, so when the dataset asks in the
  loader's batch size, every DataLoader worker collates whole batches and the epoch has exactly
  `len(loader)` of them (asked in another size, each worker's last batch was short: up to
  num_workers - 1 extra batches, and a progress bar or LR schedule sized by `len()` was off).
- `accelerate_wrapper`: accelerate's `prepare()` wraps an IterableDataset's loader in a
  `DataLoaderDispatcher` (the default: rank 0 reads for all ranks and broadcasts), or, with
  `dispatch_batches=False`, the dataset in an `IterableDatasetShard` (each rank reads the whole
  stream and keeps one slice of each `batch_size * num_processes` chunk). joader already gives
  each rank its own share, so under the dispatcher rank 0 must read the whole job and the
  others nothing, and under the shard each rank would keep half of half.

Only CPython frames and these libraries' own names are relied on; when nothing is found, the
callers fall back to what the user passed.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

DISPATCHER = "DataLoaderDispatcher"
SHARD = "IterableDatasetShard"
_ACCELERATE_TYPES = (DISPATCHER, SHARD)
_MAX_DEPTH = 24


def _frames(start: FrameType | None, depth: int) -> Any:
    frame = start
    while frame is not None and depth > 0:
        yield frame
        frame = frame.f_back
        depth -= 1


def loader_batch_size(skip: int = 1, depth: int = 6) -> int | None:
    """The batch size of the DataLoader fetch that is asking for an item, if one is."""
    for frame in _frames(sys._getframe(skip), depth):
        if frame.f_code.co_name != "fetch":
            continue
        fetcher = frame.f_locals.get("self")
        index = frame.f_locals.get("possibly_batched_index")
        if getattr(fetcher, "auto_collation", False) and isinstance(index, list | tuple) and index:
            return len(index)
        return None
    return None


def loader_fetcher(skip: int = 1, depth: int = 6) -> Any | None:
    """The DataLoader fetcher (torch's `_IterableDatasetFetcher`) whose `fetch` is asking for
    an item, if one is: what collates the items into a batch (`collate_fn`)."""
    for frame in _frames(sys._getframe(skip), depth):
        if frame.f_code.co_name == "fetch":
            return frame.f_locals.get("self")
    return None


def accelerate_wrapper(skip: int = 1, depth: int = _MAX_DEPTH) -> tuple[str, Any] | None:
    """("DataLoaderDispatcher" | "IterableDatasetShard", the object) if accelerate's wrapper is
    on the call stack, else None. `type()`, not `__class__`: accelerate's loader adapters report
    the DataLoader's class as theirs."""
    for frame in _frames(sys._getframe(skip), depth):
        owner = frame.f_locals.get("self")
        if owner is None:
            continue
        kind = type(owner)
        if kind.__module__.startswith("accelerate.") and kind.__name__ in _ACCELERATE_TYPES:
            return kind.__name__, owner
    return None


def process_index(dispatcher: Any, default: int) -> int:
    """This process's index in accelerate's state (the dispatcher's), else `default`."""
    state = getattr(dispatcher, "state", None)
    index = getattr(state, "process_index", None)
    return index if isinstance(index, int) else default


def _fit_loop(frame: FrameType | None, depth: int) -> Any:
    """Lightning's `_FitLoop` on the call stack from `frame`, if one is."""
    for caller in _frames(frame, depth):
        owner = caller.f_locals.get("self")
        kind = type(owner)
        if kind.__name__ == "_FitLoop" and kind.__module__.endswith("loops.fit_loop"):
            return owner
    return None


def lightning_epoch_done(skip: int = 1, depth: int = _MAX_DEPTH) -> bool:
    """Whether a Lightning fit loop on the call stack (saving a checkpoint) has processed every
    batch of its current epoch. Lightning resumes such a checkpoint at the NEXT epoch, and its
    next epoch then read the loader's empty rest of the saved one: it trained nothing."""
    loop = _fit_loop(sys._getframe(skip), depth)
    try:
        processed = loop.epoch_loop.batch_progress.current.processed
        total = loop.max_batches
    except AttributeError:  # none found (None), or a Lightning of another shape
        return False
    return isinstance(total, int) and total > 0 and processed >= total


def lightning_resume_at(done: int, skip: int = 1, depth: int = _MAX_DEPTH) -> bool:
    """Under a Lightning fit loop loading a checkpoint's loader state, its count of the current
    epoch's batches moved to `done` ready: an elastic resume's rank reads its share of the
    epoch's rest, not the old rank's, and Lightning ends the epoch when the count reaches the
    loader's length (`joader.client.loader`). Every counter (ready, started, processed,
    completed) moves by the same amount: a checkpoint saved at a batch's end has one fewer
    completed, which Lightning's restart adds back (`_TrainingEpochLoop.reset`). Whether one was
    found."""
    loop = _fit_loop(sys._getframe(skip), depth)
    try:
        current = loop.epoch_loop.batch_progress.current
        shift = done - current.ready
        for name in ("ready", "started", "processed", "completed"):
            setattr(current, name, max(0, getattr(current, name) + shift))
    except AttributeError:
        return False
    return True


SHARD_MESSAGE = (
    "accelerate wrapped this JoaderDataset in an IterableDatasetShard (prepare() with "
    "dispatch_batches=False), which keeps one slice of every batch_size x num_processes items a "
    "rank reads; joaderd already gives each rank its own share, so each rank would train on 1/{n} "
    "of it. Leave the DataLoader out of accelerator.prepare() (prepare the model and optimizer "
    "only; each rank's loader reads its own share), or keep accelerate's default dispatch_batches")
