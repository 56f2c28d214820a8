"""The RefCnt eviction policy: which cached item to evict next. Pure: no I/O, no clock.

An item's *refcount* is the number of jobs that still need it in their current epoch (the caller
keeps it up to date with `set_refcount`/`add_refcount`, or `add_refcounts` for many items at
once). A *pinned* item has been handed out to at least one job and not yet acknowledged; it is
never a victim. Pins nest: several jobs may hold the same item.

The victim is an unpinned item with the lowest refcount (RefCnt, Xie et al. 2022). Among equal
refcounts, the one least recently inserted or unpinned goes first, so items that were just used
survive among equals (CoorDL's lesson: do not evict what is about to be reused).

`victim(hazard)` weighs RefCnt by the jobs' speeds (see its docstring): the caller's `hazard`
is evaluated on a few of the oldest items of each refcount bucket.

Keys are ints >= 0 (the server's item keys: dense, one per item of its sources); the per-key
state lives in arrays indexed by key (NOTE [ Buckets without per-item work ]).

NOTE [ Buckets without per-item work ]
A new epoch adds 1 to the refcount of every cached item of a job's dataset, and a job that
ends takes 1 from every item it had left: hundreds of thousands of keys at once, under the
registry's lock. `add_refcounts` does that with a handful of numpy and bitmap operations, not
one Python call per key, and the order (refcount, then age) survives it without sorting:

- every insert and last unpin gives the key a new *stamp*, the next tick of a private clock;
  an item's age is its stamp, and `_key_of[stamp]` says whose stamp it is;
- a *bucket* is the set of stamps of the unpinned keys of one refcount, a roaring bitmap: its
  oldest key is the key of its smallest stamp (`BitMap.min`, the `sample` oldest are its first
  elements), a key moves between buckets by its stamp (a discard and an add), and a bulk change
  moves a whole set of stamps from each bucket to the one `delta` above or below it (a bitmap
  difference and union per bucket; a handful of buckets: refcounts are small);
- stamps are renumbered 0..n-1 in order (`_renumber`, vectorized) when the clock has run
  `_RENUMBER_FACTOR` times ahead of the tracked keys (plus slack), so stamps fit a bitmap's 32
  bits and `_key_of` stays O(tracked keys): amortized O(1) per tick.

Cost: insert, remove, pin, unpin and a single refcount change are O(1) bitmap operations;
`add_refcounts` is O(len(keys)) in numpy plus O(buckets) bitmap operations; `victim` is
O(buckets x sample).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pyroaring import BitMap

from joader.errors import InvalidArgumentError, InvariantError

__all__ = ["PolicyStats", "RefCntPolicy"]

# Renumber the stamps when the clock has run this factor times ahead of the tracked keys
# (plus slack): `_key_of` stays O(tracked keys), stamps below 2**32, renumbering amortized O(1).
_RENUMBER_FACTOR = 2
_RENUMBER_SLACK = 1 << 16
# Fewer keys than this are pinned one by one: a bulk call's numpy operations cost about as
# much as this many single pins.
_BULK_PINS = 48
_MAX_KEY = 1 << 31  # keys and stamps are int32 (the items of all sources: 2 billion)


@dataclass(frozen=True)
class PolicyStats:
    """A snapshot of the policy's state."""

    num_items: int
    num_pinned: int  # items with at least one pin
    num_pins: int  # total pins (nested pins count once each)
    num_unneeded: int  # unpinned items with refcount 0: nobody needs them this epoch


def _view(values: array) -> np.ndarray:
    """A numpy view of an int array (dropped before the array grows)."""
    dtype = np.dtype(values.typecode)
    return np.frombuffer(values, dtype=dtype) if len(values) else np.empty(0, dtype)


def _bitmap(stamps: np.ndarray) -> BitMap:
    """A bitmap of non-negative stamps < 2**32, built in C from their bytes."""
    return BitMap(array("I", stamps.astype(np.uint32).tobytes()))


class RefCntPolicy:
    """RefCnt eviction order over int keys >= 0 (the server's item keys)."""

    def __init__(self) -> None:
        # Per key (index): refcount, pins, stamp (-1: not tracked). array.array: fast single
        # access from Python; numpy views of them for the bulk operations.
        self._refcount = array("i")  # (refcounts and pins: at most jobs and queue entries)
        self._pins = array("i")
        # int32 (4 bytes per key, issue 37's memory per cached item): keys are below 2**31
        # (`insert` checks), stamps below 2 x tracked keys + slack (`_renumber`).
        self._stamp = array("i")
        self._size = 0  # tracked keys
        self._key_of = array("i")  # stamp -> key (stale for stamps no bucket holds)
        self._buckets: dict[int, BitMap] = {}  # refcount -> stamps of its unpinned keys, only if any
        self._num_pinned = 0
        self._num_pins = 0

    # -- queries -----------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and 0 <= key < len(self._stamp) and self._stamp[key] >= 0

    def __len__(self) -> int:
        return self._size

    def refcount(self, key: int) -> int:
        """The refcount of `key` (KeyError if it is not tracked)."""
        return self._refcount[self._require(key)]

    def is_pinned(self, key: int) -> bool:
        return self._pins[self._require(key)] > 0

    def pin_count(self, key: int) -> int:
        return self._pins[self._require(key)]

    def victim(self, hazard: Callable[[int], float] | None = None, sample: int = 4) -> int | None:
        """The unpinned key to evict next, or None if every item is pinned (or none is cached).

        Plain RefCnt without `hazard`. With it (key -> how soon the item will be read again:
        the sum, over the jobs that still need it, of each job's rate over its remaining items;
        see `joader.server.books.pacing`), an item nobody needs (refcount 0) still goes first;
        otherwise the `sample` oldest items of every refcount bucket are the candidates and the
        one read again last (lowest hazard) goes, ties to the lower refcount, then the older.
        So an item only a slow job still needs goes before one a fast job will read soon, even
        if the slow one is needed by more jobs: RefCnt weighted by speed (Lobster's reuse
        distance). Sampling keeps a victim O(buckets x sample).
        """
        buckets = self._buckets
        if not buckets:
            return None
        lowest = min(buckets)
        key_of = self._key_of
        if hazard is None or lowest == 0:
            return key_of[buckets[lowest].min()]
        best: tuple[float, int] | None = None
        for refcount in sorted(buckets):
            for stamp in itertools.islice(buckets[refcount], sample):
                key = key_of[stamp]
                score = hazard(key)
                if best is None or score < best[0]:
                    best = (score, key)
        assert best is not None
        return best[1]

    def statistics(self) -> PolicyStats:
        unneeded = self._buckets.get(0)
        return PolicyStats(
            num_items=self._size,
            num_pinned=self._num_pinned,
            num_pins=self._num_pins,
            num_unneeded=len(unneeded) if unneeded is not None else 0,
        )

    # -- updates -----------------------------------------------------------------------------

    def insert(self, key: int, refcount: int, pinned: int = 0) -> None:
        """Track a newly cached item with `refcount` and `pinned` pins."""
        if key in self:
            raise InvariantError(f"cache policy: item {key!r} is already tracked")
        if not isinstance(key, int) or not 0 <= key < _MAX_KEY:
            raise InvalidArgumentError(
                f"cache policy: keys are ints in 0..{_MAX_KEY - 1}, got {key!r}; pass the item's key")
        _check_non_negative("refcount", refcount)
        _check_non_negative("pinned", pinned)
        self._grow(key + 1)
        self._size += 1
        self._refcount[key] = refcount
        self._pins[key] = pinned
        self._stamp[key] = 0  # tracked; a pinned key's stamp means nothing until its last unpin
        if pinned:
            self._num_pinned += 1
            self._num_pins += pinned
        else:
            self._enter(key, refcount)

    def remove(self, key: int) -> None:
        """Stop tracking `key` (it was evicted or dropped). Pinned items may be removed too."""
        self._require(key)
        pins = self._pins[key]
        if pins:
            self._num_pinned -= 1
            self._num_pins -= pins
            self._pins[key] = 0
        else:
            self._leave(self._refcount[key], self._stamp[key])
        self._stamp[key] = -1
        self._refcount[key] = 0
        self._size -= 1

    def set_refcount(self, key: int, refcount: int) -> None:
        self._require(key)
        _check_non_negative("refcount", refcount)
        self._move(key, self._refcount[key], refcount)

    def add_refcount(self, key: int, delta: int) -> None:
        """Add `delta` to the refcount; going below 0 is a caller bug and raises."""
        self._require(key)
        old = self._refcount[key]
        new = old + delta
        if new < 0:
            raise InvariantError(
                f"cache policy: refcount of {key!r} would drop to {new}; every decrement must "
                "match an earlier increment"
            )
        self._move(key, old, new)

    def add_refcounts(self, keys: np.ndarray, delta: int) -> None:
        """Add `delta` to the refcount of every key of `keys` (distinct, tracked), in a few numpy
        and bitmap operations (NOTE [ Buckets without per-item work ]). All or nothing: an
        untracked key (KeyError) or a refcount that would drop below 0 (InvariantError) changes
        none."""
        keys = np.asarray(keys, dtype=np.int64)
        error = self._bulk_error(keys, delta)
        if error is not None:  # raised here, with no view of the arrays alive in a traceback
            raise error
        if not len(keys) or delta == 0:
            return
        refcounts = _view(self._refcount)
        old = refcounts[keys]
        refcounts[keys] = old + delta
        free = _view(self._pins)[keys] == 0
        moving_count = int(np.count_nonzero(free))
        if moving_count and moving_count == sum(len(bucket) for bucket in self._buckets.values()):
            # Every evictable key moves by `delta` (an epoch of a job over all that is cached, the
            # sweep's usual case): each bucket keeps its stamps and takes its new refcount. At
            # 1.28M cached items, moving the stamps took about 0.1 s under the lock, per job.
            self._buckets = {refcount + delta: bucket for refcount, bucket in self._buckets.items()}
            return
        stamps = _view(self._stamp)[keys[free]]
        old = old[free]
        moving: list[tuple[int, BitMap]] = []
        for refcount, count in enumerate(np.bincount(old).tolist()):
            if count:  # every stamp leaves its bucket before any arrives: buckets may chain
                moved = _bitmap(stamps[old == refcount])
                bucket = self._buckets[refcount]
                bucket.difference_update(moved)
                if not bucket:
                    del self._buckets[refcount]
                moving.append((refcount + delta, moved))
        for refcount, moved in moving:
            self._bucket(refcount).update(moved)

    def _untracked(self, keys: np.ndarray) -> int | None:
        """The first of `keys` (int64) the policy does not track, or None."""
        stamps = _view(self._stamp)
        bad = keys[(keys < 0) | (keys >= len(stamps))]
        if not len(bad):
            bad = keys[stamps[keys] < 0]
        return int(bad[0]) if len(bad) else None

    def _bulk_error(self, keys: np.ndarray, delta: int) -> Exception | None:
        """Why `add_refcounts(keys, delta)` may not run: an untracked key, or a refcount that
        would drop below 0; None if it may."""
        untracked = self._untracked(keys)
        if untracked is not None:
            return KeyError(f"cache policy: item {untracked} is not tracked")
        if delta < 0:
            new = _view(self._refcount)[keys] + delta
            below = np.flatnonzero(new < 0)
            if len(below):
                return InvariantError(
                    f"cache policy: refcount of {int(keys[below[0]])} would drop to {int(new[below[0]])}; "
                    "every decrement must match an earlier increment")
        return None

    def pin(self, key: int) -> None:
        self._require(key)
        pins = self._pins[key]
        if not pins:
            self._leave(self._refcount[key], self._stamp[key])
            self._num_pinned += 1
        self._pins[key] = pins + 1
        self._num_pins += 1

    def pin_many(self, keys: list[int]) -> None:
        """`pin` for each key (a key given twice is pinned twice), in a few numpy and bitmap
        operations: the keys pinned for the first time leave their buckets. All or nothing:
        an untracked key pins none (KeyError)."""
        if len(keys) < _BULK_PINS:
            for key in keys:
                self._require(key)  # all or nothing: every key checked first
            for key in keys:
                self.pin(key)
            return
        ids = np.fromiter(keys, np.int64, len(keys))
        if len(set(keys)) == len(keys):
            counts: np.ndarray | int = 1
        else:
            ids, counts = np.unique(ids, return_counts=True)
        untracked = self._untracked(ids)
        if untracked is not None:
            raise KeyError(f"cache policy: item {untracked} is not tracked")
        pins = _view(self._pins)
        before = pins[ids]
        pins[ids] = before + counts
        del pins
        self._num_pins += len(keys)
        first = ids[before == 0]
        if not len(first):
            return
        self._num_pinned += len(first)
        stamps = _view(self._stamp)[first]
        refcounts = _view(self._refcount)[first]
        for refcount in np.unique(refcounts).tolist():
            bucket = self._buckets[refcount]
            bucket.difference_update(_bitmap(stamps[refcounts == refcount]))
            if not bucket:
                del self._buckets[refcount]

    def unpin(self, key: int) -> None:
        """Drop one pin; the last unpin makes the item evictable again, as the youngest."""
        self._require(key)
        pins = self._pins[key]
        if pins == 0:
            raise InvariantError(
                f"cache policy: unpin of {key!r}, which is not pinned; every unpin must match a pin"
            )
        self._num_pins -= 1
        self._pins[key] = pins - 1
        if pins == 1:
            self._num_pinned -= 1
            self._enter(key, self._refcount[key])

    def unpin_many(self, keys: list[int]) -> None:
        """`unpin` for each key, in order: the keys whose last pin goes become evictable as the
        youngest, in the order given. Distinct keys (a reply's acknowledgements) take a few
        numpy and bitmap operations, all or nothing (an untracked or unpinned key changes
        none); a key given twice (padding copies) sends them one by one, through `unpin`."""
        if len(set(keys)) != len(keys):
            for key in keys:
                self.unpin(key)
            return
        if not keys:
            return
        ids = np.fromiter(keys, np.int64, len(keys))
        untracked = self._untracked(ids)
        if untracked is not None:
            raise KeyError(f"cache policy: item {untracked} is not tracked")
        pins = _view(self._pins)
        before = pins[ids]
        if not before.all():
            raise InvariantError(
                f"cache policy: unpin of {int(ids[np.argmin(before)])}, which is not pinned; "
                "every unpin must match a pin")
        pins[ids] = before - 1
        self._num_pins -= len(ids)
        last = ids[before == 1]
        del pins  # no view of the arrays alive when `_key_of` grows
        if not len(last):
            return
        self._num_pinned -= len(last)
        if len(self._key_of) + len(last) >= _RENUMBER_FACTOR * self._size + _RENUMBER_SLACK:
            self._renumber()
        first = len(self._key_of)
        self._key_of.extend(array("i", last.astype(np.int32).tobytes()))
        new = np.arange(first, first + len(last), dtype=np.int64)
        _view(self._stamp)[last] = new
        refcounts = _view(self._refcount)[last]
        for refcount in np.unique(refcounts).tolist():
            self._bucket(refcount).update(_bitmap(new[refcounts == refcount]))

    # -- internals ---------------------------------------------------------------------------

    def _require(self, key: int) -> int:
        try:
            if key >= 0 and self._stamp[key] >= 0:  # (a negative index would wrap around)
                return key
        except (IndexError, TypeError):
            pass
        raise KeyError(f"cache policy: item {key!r} is not tracked")

    def _move(self, key: int, old: int, refcount: int) -> None:
        """A tracked key's refcount goes from `old` to `refcount`; unpinned, it keeps its stamp
        (its age among its new equals)."""
        if refcount == old:
            return
        self._refcount[key] = refcount
        if not self._pins[key]:
            stamp = self._stamp[key]
            self._leave(old, stamp)
            self._bucket(refcount).add(stamp)

    def _grow(self, size: int) -> None:
        have = len(self._stamp)
        if size <= have:
            return
        extra = max(size, 2 * have, 1024) - have
        self._refcount.extend(array("i", bytes(4 * extra)))
        self._pins.extend(array("i", bytes(4 * extra)))
        self._stamp.extend(array("i", [-1]) * extra)

    def _bucket(self, refcount: int) -> BitMap:
        bucket = self._buckets.get(refcount)
        if bucket is None:
            bucket = self._buckets[refcount] = BitMap()
        return bucket

    def _enter(self, key: int, refcount: int) -> None:
        """`key` becomes evictable as the youngest of its bucket: a new stamp."""
        if len(self._key_of) >= _RENUMBER_FACTOR * self._size + _RENUMBER_SLACK:
            self._renumber()
        stamp = len(self._key_of)
        self._key_of.append(key)
        self._stamp[key] = stamp
        self._bucket(refcount).add(stamp)

    def _leave(self, refcount: int, stamp: int) -> None:
        bucket = self._buckets[refcount]
        bucket.discard(stamp)
        if not bucket:
            del self._buckets[refcount]

    def _renumber(self) -> None:
        """Stamps 0..n-1 for the n evictable keys, in their order (NOTE [ Buckets without
        per-item work ]); pinned keys get theirs at their last unpin."""
        refcounts = sorted(self._buckets)
        stamps = np.frombuffer(BitMap.union(*self._buckets.values()).to_array(), dtype=np.uint32) if refcounts \
            else np.empty(0, np.uint32)
        keys = _view(self._key_of)[stamps.astype(np.int64)]
        order = np.arange(len(keys), dtype=np.int64)
        _view(self._stamp)[keys] = order
        buckets = _view(self._refcount)[keys]
        self._buckets = {refcount: _bitmap(order[buckets == refcount]) for refcount in refcounts}
        self._key_of = array("i", keys.astype(np.int32).tobytes())


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise InvalidArgumentError(f"cache policy: {name} must be >= 0, got {value}")
