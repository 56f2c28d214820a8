"""Exact sizes: how many bytes each decode is given, and how the cache finds them out.

A decode is given exactly its item's bytes whenever they are known (see NOTE [ Exact sizes, not
the bound ]), found in one of three ways, cheapest first:

- the size memory: every item's size, per source (a uint32 array), from the first time it is
  known; every later decode of it (after an eviction) is exact at once (`ItemSizes.known`).
- a *probe* (`DecodePool.probe`, `joader.server.pool.probes`): when an item of a stage that can
  read its output size from a file header (`ImageStage.item_nbytes`) starts waiting for its
  decode (`ItemSizes.want`), a decode worker reads that header, off the registry's lock; the
  answer is taken at the next `ItemCache.dispatch` (`ItemSizes.probe`). Decodes go earliest due
  first and items usually wait well ahead of their turn (the jobs' lookahead), so the answer is
  usually there first: for 90-93% of first decodes in bench/system/cache_fill.py (65% with a cache
  whose share per job is a dozen items, where decodes start just in time).
- *size first* (`DecodeSubmitter.sizes_first`): an item whose size is still unknown at its turn
  (its probe is out and a worker would otherwise idle; a header the stage cannot read; a user
  stage, which has no header to read) is sent with no range at all. Its worker prepares it,
  keeps the array and answers with its size (the pool's `NeedsBytes`, not a failure);
  `ItemCache.file_size` files it, and the filer dispatches at once its placement in exactly that
  many bytes, which the pool sends to the worker that kept the array: one extra round trip, no second decode.

A stage whose bound is the size of nearly every item (`bound_is_nominal`: `center-crop` without
upscale, S x S x C but for images smaller than S) gets neither: a first decode is given the
bound, and the rare smaller item is shrunk when it lands. A pool that has neither (the unit
tests' fakes) gets the bound for an item's first decode. A head whose probe is out waits for it
only while every worker has a decode to run: a result will dispatch again soon, and the wait
costs nothing then. `range_kind` is that choice.

Why not a round trip in the middle of every decode (the worker reads the header, asks, waits for
an offset, decodes): the allocation must happen under the registry's lock, which the results
thread takes only to file a result; a worker waiting for an offset would sit idle, and be killed
by the decode timeout when everything is pinned. Size first waits for nothing: the worker goes on
with its next task, and an item that cannot be placed yet waits in the demand like any other.

A size can be wrong when a file changes on disk after it was read: a smaller item is shrunk; a
larger one is not written, and comes back as "did not fit" like size first. Its decode failed:
it moves DECODING -> FAILED -> WAITING at once (the states' usual transitions; no failure is
counted or reported) and is placed again with the size it needs; after `MISFITS` such results in
a row (a stage whose output size changes from call to call) it is given the bound, which ends it.

Plain logic, no lock: the `ItemCache` calls it, under the registry's lock.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from joader.server.books.records import Item, ItemState, Source

__all__ = ["MISFITS", "NO_SIZE", "PROBES_AHEAD", "ItemSizes", "bound_is_nominal", "range_kind"]

PROBES_AHEAD = 512  # items whose probe may be out at once
MISFITS = 2  # an item that outgrew its exact size this often in a row is given its bound
NO_SIZE = 0  # in a size table: not known
_MAX_SIZE = 2**32 - 1  # sizes are kept as uint32; a larger item is always given its bound

# NOTE [ Exact sizes, not the bound ]
# A variable stage's item (`resize:S` keeps the aspect ratio) given the stage's upper bound
# (`Source.max_item_bytes`, 3 x S x 8S for resize) and shrunk when it lands leaves its freed
# tail behind as a hole. With several decodes in flight those tails become holes between items,
# too small for the next bound: with `resize:160` over 400 photos (42 MiB prepared) a 64 MiB
# cache given bounds made its first eviction at 17% full, held 39% after 3 epochs with 97% of
# its free bytes in crumbs, and decoded each item 2.35 times (bench/system/cache_fill.py). Given exact
# sizes it is 66% full, nothing evicted, 1 decode per item. So a decode is given exactly its
# item's bytes whenever they can be known before it runs.


def range_kind(*, known: int, misfits: int, size_coming_while_busy: bool,
               can_size_first: bool) -> Literal["exact", "wait", "sized_first", "at_bound"]:
    """How a waiting item's decode gets its range (the module docstring), in this order:
    `exact` when its size is `known` (and it has not outgrown it `MISFITS` times in a row);
    `wait` while its probe is out and every worker has a decode anyway
    (`size_coming_while_busy`); `sized_first` (no range: the result says the size) when the pool
    `can_size_first` the item; else `at_bound`, its stage's bound. Pure."""
    if known and misfits < MISFITS:
        return "exact"
    if size_coming_while_busy:
        return "wait"
    if can_size_first:
        return "sized_first"
    return "at_bound"


class ItemSizes:
    """The size memory, the probes out and waiting, and each item's misfits in a row (the
    module docstring)."""

    def __init__(self) -> None:
        # per source (by key_base), each item's bytes once known (NO_SIZE: not yet), from a
        # probe or a decode
        self._sizes: dict[int, np.ndarray] = {}
        self._to_probe: deque[int] = deque()  # keys waiting for a decode, size unknown, not probed yet
        self._probing: set[int] = set()  # keys whose probe is out
        self._probed_sources: dict[int, Source] = {}  # pool source index -> source, for probe answers
        self._misfits: dict[int, int] = {}  # key -> times in a row it outgrew an exact size

    def known(self, source: Source, item_id: int) -> int:
        """The item's exact bytes if known (a probe or a decode said so), else 0; a fixed-size
        stage's items are always known."""
        if source.stage.spec.shape is not None:
            return source.max_item_bytes
        sizes = self._sizes.get(source.key_base)
        return int(sizes[item_id]) if sizes is not None else NO_SIZE

    def remember(self, source: Source, item_id: int, nbytes: int) -> None:
        if nbytes > min(_MAX_SIZE, source.max_item_bytes) or source.stage.spec.shape is not None:
            return  # never more than the bound: a decode is never given more
        sizes = self._sizes.get(source.key_base)
        if sizes is None:
            sizes = self._sizes[source.key_base] = np.zeros(source.num_items, np.uint32)
        sizes[item_id] = max(1, nbytes)  # an empty item still takes one unit of the arena

    def probing(self, key: int) -> bool:
        """Whether the item's probe is out."""
        return key in self._probing

    def misfits(self, key: int) -> int:
        """How many times in a row the item outgrew an exact size."""
        return self._misfits.get(key, 0)

    def misfit(self, key: int) -> None:
        """The item outgrew the exact size it was given (its file changed since it was read)."""
        self._misfits[key] = self._misfits.get(key, 0) + 1

    def fitted(self, key: int) -> None:
        """The item settled (or was dropped): its misfits in a row are over."""
        self._misfits.pop(key, None)

    def want(self, item: Item) -> None:
        """`item` waits for a decode: ask for its size if its stage can read it from a header
        (and its bound is not the size nearly every item has: `bound_is_nominal`)."""
        source = item.source
        if (source.stage.spec.shape is None and callable(getattr(source.stage, "item_nbytes", None))
                and not bound_is_nominal(source)
                and item.key not in self._probing and self.known(source, item.item_id) == NO_SIZE):
            self._to_probe.append(item.key)

    def probe(self, pool: Any, source_index: Callable[[Source], int], items: Mapping[int, Item]) -> None:
        """Takes the probes' answers, then sends probes for waiting `items` (up to
        `PROBES_AHEAD` out at once, in the order they started waiting: roughly the order they
        are due). `pool` is a `DecodeSubmitter`; one without probes gets none."""
        take: Callable[[], list[tuple[int, int, int]]] | None = getattr(pool, "take_sizes", None)
        probe: Callable[[int, Sequence[int]], None] | None = getattr(pool, "probe", None)
        if take is None or probe is None:
            self._to_probe.clear()
            return
        for index, item_id, nbytes in take():
            source = self._probed_sources[index]
            self._probing.discard(source.key_base + item_id)
            if nbytes > 0:
                self.remember(source, item_id, nbytes)
        batches: dict[int, list[int]] = {}
        while self._to_probe and len(self._probing) < PROBES_AHEAD:
            key = self._to_probe.popleft()
            item = items.get(key)
            if (item is None or item.state is not ItemState.WAITING or key in self._probing
                    or self.known(item.source, item.item_id) != NO_SIZE):
                continue
            index = source_index(item.source)
            self._probed_sources[index] = item.source
            batches.setdefault(index, []).append(item.item_id)
            self._probing.add(key)
        for index, ids in batches.items():
            probe(index, ids)


def bound_is_nominal(source: Source) -> bool:
    """Whether the stage's bound is the size of nearly every item: its `nominal_shape` (the
    shape items have but for images smaller than S: `center-crop` without upscale) fills the
    bound exactly. Such an item's first decode is given the bound at once: no probe (a second
    read of the file and a round trip per item, about 0.1 ms of a worker's 1.6 ms decode, for
    nothing) and no size-first round trip; the rare smaller item is shrunk when it lands, and
    its size remembered for its later decodes."""
    nominal = getattr(source.stage, "nominal_shape", None)
    if not nominal:
        return False
    spec = source.stage.spec
    return _fills_bound(tuple(nominal), spec.dtype, spec.max_nbytes)


@functools.lru_cache(maxsize=64)
def _fills_bound(nominal: tuple[int, ...], dtype: str, max_nbytes: int) -> bool:
    """`bound_is_nominal`'s arithmetic, once per stage (it runs per dispatched decode)."""
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        return False
    return math.prod(nominal) * itemsize == max_nbytes
