"""The RefCnt eviction policy: which cached item to evict next. Pure: no I/O, no clock.

An item's *refcount* is the number of jobs that still need it in their current epoch (the caller
keeps it up to date with `set_refcount`/`add_refcount`). A *pinned* item has been handed out to
at least one job and not yet acknowledged; it is never a victim. Pins nest: several jobs may hold
the same item.

The victim is an unpinned item with the lowest refcount (RefCnt, Xie et al. 2022). Among equal
refcounts, the one least recently inserted or unpinned goes first, so items that were just used
survive among equals (CoorDL's lesson: do not evict what is about to be reused).

`victim(hazard)` weighs RefCnt by the jobs' speeds (see its docstring): the caller's `hazard`
is evaluated on a few of the oldest items of each refcount bucket.

Cost: every operation is O(log n) amortized plus O(number of distinct refcounts) for `victim`;
refcounts are small ints (at most the number of jobs), so that is a handful of buckets. Each
refcount bucket is a heap of `(stamp, key)` with lazy deletion: an entry is live when the key is
still unpinned, still has that refcount and still carries that stamp. A key whose refcount
changes keeps its stamp, which is why a plain insertion-ordered dict per bucket does not
suffice: it would land at the young end of its new bucket.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from joader.errors import InvalidArgumentError, InvariantError

__all__ = ["PolicyStats", "RefCntPolicy"]

# Rebuild a bucket's heap when stale entries outnumber live ones by this factor (plus slack), so
# memory stays O(live items) while rebuilds stay amortized O(1) per operation.
_COMPACT_FACTOR = 2
_COMPACT_SLACK = 32


@dataclass(frozen=True)
class PolicyStats:
    """A snapshot of the policy's state."""

    num_items: int
    num_pinned: int  # items with at least one pin
    num_pins: int  # total pins (nested pins count once each)
    num_unneeded: int  # unpinned items with refcount 0: nobody needs them this epoch


class RefCntPolicy:
    """RefCnt eviction order over hashable keys (the server uses int slot or item ids)."""

    def __init__(self) -> None:
        self._refcount: dict[Hashable, int] = {}
        self._pins: dict[Hashable, int] = {}  # only keys with pins > 0
        self._stamp: dict[Hashable, int] = {}  # time of last insert-or-unpin
        self._clock = 0
        self._heaps: dict[int, list[tuple[int, Hashable]]] = {}
        self._live: dict[int, int] = {}  # refcount -> number of unpinned keys, only if > 0
        self._num_pins = 0

    # -- queries -----------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._refcount

    def __len__(self) -> int:
        return len(self._refcount)

    def refcount(self, key: Hashable) -> int:
        """The refcount of `key` (KeyError if it is not tracked)."""
        return self._refcount[self._require(key)]

    def is_pinned(self, key: Hashable) -> bool:
        self._require(key)
        return key in self._pins

    def pin_count(self, key: Hashable) -> int:
        self._require(key)
        return self._pins.get(key, 0)

    def victim(self, hazard: Callable[[Hashable], float] | None = None, sample: int = 4) -> Hashable | None:
        """The unpinned key to evict next, or None if every item is pinned (or none is cached).

        Plain RefCnt without `hazard`. With it (key -> how soon the item will be read again:
        the sum, over the jobs that still need it, of each job's rate over its remaining items;
        see `joader.server.pacing`), an item nobody needs (refcount 0) still goes first;
        otherwise the `sample` oldest items of every refcount bucket are the candidates and the
        one read again last (lowest hazard) goes, ties to the lower refcount, then the older.
        So an item only a slow job still needs goes before one a fast job will read soon, even
        if the slow one is needed by more jobs: RefCnt weighted by speed (Lobster's reuse
        distance). Sampling keeps a victim O(buckets x sample x log n).
        """
        if not self._live:
            return None
        lowest = min(self._live)
        if hazard is None or lowest == 0:
            return self._oldest(lowest, 1)[0]
        best: tuple[float, Hashable] | None = None
        for refcount in sorted(self._live):
            for key in self._oldest(refcount, sample):
                score = hazard(key)
                if best is None or score < best[0]:
                    best = (score, key)
        assert best is not None
        return best[1]

    def statistics(self) -> PolicyStats:
        return PolicyStats(
            num_items=len(self._refcount),
            num_pinned=len(self._pins),
            num_pins=self._num_pins,
            num_unneeded=self._live.get(0, 0),
        )

    # -- updates -----------------------------------------------------------------------------

    def insert(self, key: Hashable, refcount: int, pinned: int = 0) -> None:
        """Track a newly cached item with `refcount` and `pinned` pins."""
        if key in self._refcount:
            raise InvariantError(f"cache policy: item {key!r} is already tracked")
        _check_non_negative("refcount", refcount)
        _check_non_negative("pinned", pinned)
        self._refcount[key] = refcount
        self._stamp[key] = self._tick()
        if pinned:
            self._pins[key] = pinned
            self._num_pins += pinned
        else:
            self._enter_bucket(key)

    def remove(self, key: Hashable) -> None:
        """Stop tracking `key` (it was evicted or dropped). Pinned items may be removed too."""
        self._require(key)
        if key in self._pins:
            self._num_pins -= self._pins.pop(key)
        else:
            self._leave_bucket(key)
        del self._refcount[key]
        del self._stamp[key]

    def set_refcount(self, key: Hashable, refcount: int) -> None:
        self._require(key)
        _check_non_negative("refcount", refcount)
        old = self._refcount[key]
        if refcount == old:
            return
        unpinned = key not in self._pins
        if unpinned:
            self._leave_bucket(key)
        self._refcount[key] = refcount
        if unpinned:
            self._enter_bucket(key)

    def add_refcount(self, key: Hashable, delta: int) -> None:
        """Add `delta` to the refcount; going below 0 is a caller bug and raises."""
        self._require(key)
        new = self._refcount[key] + delta
        if new < 0:
            raise InvariantError(
                f"cache policy: refcount of {key!r} would drop to {new}; every decrement must "
                "match an earlier increment"
            )
        self.set_refcount(key, new)

    def pin(self, key: Hashable) -> None:
        self._require(key)
        if key not in self._pins:
            self._leave_bucket(key)
            self._pins[key] = 0
        self._pins[key] += 1
        self._num_pins += 1

    def unpin(self, key: Hashable) -> None:
        """Drop one pin; the last unpin makes the item evictable again, as the youngest."""
        self._require(key)
        pins = self._pins.get(key, 0)
        if pins == 0:
            raise InvariantError(
                f"cache policy: unpin of {key!r}, which is not pinned; every unpin must match a pin"
            )
        self._num_pins -= 1
        if pins > 1:
            self._pins[key] = pins - 1
            return
        del self._pins[key]
        self._stamp[key] = self._tick()
        self._enter_bucket(key)

    # -- internals ---------------------------------------------------------------------------

    def _require(self, key: Hashable) -> Hashable:
        if key not in self._refcount:
            raise KeyError(f"cache policy: item {key!r} is not tracked")
        return key

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _is_live_entry(self, refcount: int, stamp: int, key: Hashable) -> bool:
        return (
            self._refcount.get(key) == refcount
            and self._stamp.get(key) == stamp
            and key not in self._pins
        )

    def _enter_bucket(self, key: Hashable) -> None:
        refcount = self._refcount[key]
        heap = self._heaps.setdefault(refcount, [])
        heapq.heappush(heap, (self._stamp[key], key))
        live = self._live.get(refcount, 0) + 1
        self._live[refcount] = live
        if len(heap) > _COMPACT_FACTOR * live + _COMPACT_SLACK:
            self._compact(refcount)

    def _leave_bucket(self, key: Hashable) -> None:
        # The heap entry stays behind as a stale entry; `victim` and `_compact` skip it.
        refcount = self._refcount[key]
        live = self._live[refcount] - 1
        if live:
            self._live[refcount] = live
        else:
            del self._live[refcount]
            del self._heaps[refcount]

    def _oldest(self, refcount: int, count: int) -> list[Hashable]:
        """The `count` least recently inserted or unpinned live keys of a bucket (oldest first),
        dropping the stale entries in front of them."""
        heap = self._heaps[refcount]
        taken: list[tuple[int, Hashable]] = []
        seen: set[Hashable] = set()
        while heap and len(taken) < count:
            stamp, key = heapq.heappop(heap)
            if key not in seen and self._is_live_entry(refcount, stamp, key):
                seen.add(key)
                taken.append((stamp, key))
        for entry in taken:
            heapq.heappush(heap, entry)
        return [key for _, key in taken]

    def _compact(self, refcount: int) -> None:
        seen: set[Hashable] = set()
        entries = []
        for stamp, key in self._heaps[refcount]:
            if key not in seen and self._is_live_entry(refcount, stamp, key):
                seen.add(key)
                entries.append((stamp, key))
        heapq.heapify(entries)
        self._heaps[refcount] = entries


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise InvalidArgumentError(f"cache policy: {name} must be >= 0, got {value}")
