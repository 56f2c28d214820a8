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
registry's lock. `add_refcounts` does that with a handful of numpy operations, not one Python
call per key, and the order (refcount, then age) survives it without sorting anything:

- every insert and last unpin gives the key a new *stamp* (a tick of a private clock) and
  appends (key, stamp) to one *log*, which is therefore in stamp order. The log entry is the
  key's *current* one while the key still carries that stamp.
- a bucket (the unpinned keys of one refcount) is found by scanning the log from the bucket's
  *cursor*, a stamp before which the log holds no key of the bucket (a scan moves the cursor to
  the first key it finds). A key that a bulk change moves into a bucket keeps its stamp; the
  bucket's cursor moves back to the oldest moved key's stamp, so the next scan finds them all
  in their place (one vectorized pass; bulk changes come once per epoch and job).
- a key that a single change (`set_refcount`, a queue entry's read planned or done) moves into a
  bucket behind that bucket's cursor goes into the bucket's small heap of (stamp, key) instead,
  so single changes never send a cursor back. The bucket's oldest key is the older of the log's
  first live key and the heap's first live entry.
- nothing is deleted eagerly: an entry is live while its key is tracked, unpinned, has the
  bucket's refcount and still carries the entry's stamp. Stale entries are skipped, and the log
  and the heaps are compacted when stale entries outnumber live ones (amortized O(1)).

Cost: insert, remove, pin, unpin and a single refcount change are O(1) (a heap push, O(log n),
for a single change behind its bucket's cursor); `add_refcounts` is O(len(keys)) in numpy;
`victim` is amortized O(1) plus O(number of distinct refcounts), a handful.
"""

from __future__ import annotations

import bisect
import heapq
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from joader.errors import InvalidArgumentError, InvariantError

__all__ = ["PolicyStats", "RefCntPolicy"]

# Compact the log (or a bucket's heap) when it holds more than this factor times its size after
# the last compaction (plus slack): memory stays O(live keys), compactions amortized O(1).
_COMPACT_FACTOR = 2
_COMPACT_SLACK = 1024
_HEAP_SLACK = 32
_PYTHON_SCAN = 8  # log entries a scan looks at one by one before numpy's chunks
_FIRST_CHUNK = 64  # log entries a scan looks at first; each further chunk is larger
_LAST_CHUNK = 1 << 16


@dataclass(frozen=True)
class PolicyStats:
    """A snapshot of the policy's state."""

    num_items: int
    num_pinned: int  # items with at least one pin
    num_pins: int  # total pins (nested pins count once each)
    num_unneeded: int  # unpinned items with refcount 0: nobody needs them this epoch


def _view(values: array) -> np.ndarray:
    """A numpy view of an int64 array (dropped before the array grows)."""
    return np.frombuffer(values, dtype=np.int64) if len(values) else np.empty(0, np.int64)


class RefCntPolicy:
    """RefCnt eviction order over int keys >= 0 (the server's item keys)."""

    def __init__(self) -> None:
        # Per key (index): refcount, pins, stamp (-1: not tracked). array.array: fast single
        # access from Python; numpy views of them for the bulk operations.
        self._refcount = array("q")
        self._pins = array("q")
        self._stamp = array("q")
        self._size = 0  # tracked keys
        self._clock = 0
        self._log_keys = array("q")  # (key, stamp) of every insert and last unpin, stamp order
        self._log_stamps = array("q")
        self._log_floor = 0  # the log's length after its last compaction
        self._cursor: dict[int, int] = {}  # refcount -> stamp to scan the log from (absent: 0)
        self._heaps: dict[int, list[tuple[int, int]]] = {}  # refcount -> (stamp, key) moved in behind its cursor
        self._heap_floor: dict[int, int] = {}
        self._live: dict[int, int] = {}  # refcount -> number of unpinned keys, only if > 0
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
        see `joader.server.pacing`), an item nobody needs (refcount 0) still goes first;
        otherwise the `sample` oldest items of every refcount bucket are the candidates and the
        one read again last (lowest hazard) goes, ties to the lower refcount, then the older.
        So an item only a slow job still needs goes before one a fast job will read soon, even
        if the slow one is needed by more jobs: RefCnt weighted by speed (Lobster's reuse
        distance). Sampling keeps a victim O(buckets x sample).
        """
        if not self._live:
            return None
        lowest = min(self._live)
        if hazard is None or lowest == 0:
            return self._oldest(lowest, 1)[0]
        best: tuple[float, int] | None = None
        for refcount in sorted(self._live):
            for key in self._oldest(refcount, sample):
                score = hazard(key)
                if best is None or score < best[0]:
                    best = (score, key)
        assert best is not None
        return best[1]

    def statistics(self) -> PolicyStats:
        return PolicyStats(
            num_items=self._size,
            num_pinned=self._num_pinned,
            num_pins=self._num_pins,
            num_unneeded=self._live.get(0, 0),
        )

    # -- updates -----------------------------------------------------------------------------

    def insert(self, key: int, refcount: int, pinned: int = 0) -> None:
        """Track a newly cached item with `refcount` and `pinned` pins."""
        if key in self:
            raise InvariantError(f"cache policy: item {key!r} is already tracked")
        if not isinstance(key, int) or key < 0:
            raise InvalidArgumentError(f"cache policy: keys are ints >= 0, got {key!r}; pass the item's key")
        _check_non_negative("refcount", refcount)
        _check_non_negative("pinned", pinned)
        self._grow(key + 1)
        self._size += 1
        self._refcount[key] = refcount
        self._pins[key] = pinned
        self._stamp[key] = -1
        if pinned:
            self._num_pinned += 1
            self._num_pins += pinned
            self._stamp[key] = self._tick()  # tracked; its log entry comes with its last unpin
        else:
            self._log(key)
            self._live[refcount] = self._live.get(refcount, 0) + 1

    def remove(self, key: int) -> None:
        """Stop tracking `key` (it was evicted or dropped). Pinned items may be removed too."""
        self._require(key)
        pins = self._pins[key]
        if pins:
            self._num_pinned -= 1
            self._num_pins -= pins
            self._pins[key] = 0
        else:
            self._leave(self._refcount[key])
        self._stamp[key] = -1
        self._refcount[key] = 0
        self._size -= 1

    def set_refcount(self, key: int, refcount: int) -> None:
        self._require(key)
        _check_non_negative("refcount", refcount)
        old = self._refcount[key]
        if refcount == old:
            return
        self._refcount[key] = refcount
        if self._pins[key]:
            return
        self._leave(old)
        self._live[refcount] = self._live.get(refcount, 0) + 1
        stamp = self._stamp[key]
        if stamp < self._cursor.get(refcount, 0):  # behind the bucket's log scan: its heap
            heap = self._heaps.setdefault(refcount, [])
            heapq.heappush(heap, (stamp, key))
            if len(heap) > _COMPACT_FACTOR * self._heap_floor.get(refcount, 0) + _HEAP_SLACK:
                self._compact_heap(refcount)

    def add_refcount(self, key: int, delta: int) -> None:
        """Add `delta` to the refcount; going below 0 is a caller bug and raises."""
        self._require(key)
        new = self._refcount[key] + delta
        if new < 0:
            raise InvariantError(
                f"cache policy: refcount of {key!r} would drop to {new}; every decrement must "
                "match an earlier increment"
            )
        self.set_refcount(key, new)

    def add_refcounts(self, keys: np.ndarray, delta: int) -> None:
        """Add `delta` to the refcount of every key of `keys` (distinct, tracked), in a few numpy
        operations (NOTE [ Buckets without per-item work ]). All or nothing: an untracked key
        (KeyError) or a refcount that would drop below 0 (InvariantError) changes none."""
        keys = np.asarray(keys, dtype=np.int64)
        error = self._bulk_error(keys, delta)
        if error is not None:  # raised here, with no view of the arrays alive in a traceback
            raise error
        if not len(keys) or delta == 0:
            return
        stamps, refcounts = _view(self._stamp), _view(self._refcount)
        old = refcounts[keys]
        new = old + delta
        refcounts[keys] = new
        free = _view(self._pins)[keys] == 0
        if not free.all():
            old, new, keys = old[free], new[free], keys[free]
        if not len(keys):
            return
        for refcount, count in enumerate(np.bincount(old).tolist()):
            if count:
                self._leave(refcount, count)
        moved = stamps[keys]
        for refcount, count in enumerate(np.bincount(new).tolist()):
            if count:
                self._live[refcount] = self._live.get(refcount, 0) + count
                oldest = int(moved[new == refcount].min())
                if oldest < self._cursor.get(refcount, 0):
                    self._cursor[refcount] = oldest

    def _bulk_error(self, keys: np.ndarray, delta: int) -> Exception | None:
        """Why `add_refcounts(keys, delta)` may not run: an untracked key, or a refcount that
        would drop below 0; None if it may."""
        stamps = _view(self._stamp)
        bad = keys[(keys < 0) | (keys >= len(stamps))]
        if not len(bad):
            bad = keys[stamps[keys] < 0]
        if len(bad):
            return KeyError(f"cache policy: item {int(bad[0])} is not tracked")
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
            self._leave(self._refcount[key])
            self._num_pinned += 1
        self._pins[key] = pins + 1
        self._num_pins += 1

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
        if pins > 1:
            return
        self._num_pinned -= 1
        self._log(key)
        refcount = self._refcount[key]
        self._live[refcount] = self._live.get(refcount, 0) + 1

    # -- internals ---------------------------------------------------------------------------

    def _require(self, key: int) -> int:
        if key not in self:
            raise KeyError(f"cache policy: item {key!r} is not tracked")
        return key

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _grow(self, size: int) -> None:
        have = len(self._stamp)
        if size <= have:
            return
        extra = max(size, 2 * have, 1024) - have
        self._refcount.extend(array("q", bytes(8 * extra)))
        self._pins.extend(array("q", bytes(8 * extra)))
        self._stamp.extend(array("q", [-1]) * extra)

    def _leave(self, refcount: int, count: int = 1) -> None:
        live = self._live[refcount] - count
        if live:
            self._live[refcount] = live
        else:
            del self._live[refcount]

    def _log(self, key: int) -> None:
        """A new stamp for `key` and its entry at the log's end (compacting the log first if stale
        entries outnumber the live ones)."""
        stamp = self._tick()
        self._stamp[key] = stamp
        if len(self._log_keys) > _COMPACT_FACTOR * self._log_floor + _COMPACT_SLACK:
            self._compact_log()
        self._log_keys.append(key)
        self._log_stamps.append(stamp)

    def _compact_log(self) -> None:
        keys, stamps = _view(self._log_keys), _view(self._log_stamps)
        current = _view(self._stamp)[keys] == stamps
        keys, stamps = keys[current].tobytes(), stamps[current].tobytes()
        self._log_keys, self._log_stamps = array("q"), array("q")
        self._log_keys.frombytes(keys)
        self._log_stamps.frombytes(stamps)
        self._log_floor = len(self._log_keys)

    def _is_live(self, refcount: int, stamp: int, key: int) -> bool:
        return self._stamp[key] == stamp and self._refcount[key] == refcount and not self._pins[key]

    def _oldest(self, refcount: int, count: int) -> list[int]:
        """The `count` least recently inserted or unpinned live keys of a bucket, oldest first:
        the log's first from the bucket's cursor, and its heap's."""
        found = self._scan_log(refcount, count)
        heap = self._heaps.get(refcount)
        if heap:
            found += self._heap_oldest(refcount, heap, count)
            found.sort()
        keys: list[int] = []
        for _, key in found:
            if key not in keys:
                keys.append(key)
        return keys[:count]

    def _scan_log(self, refcount: int, count: int) -> list[tuple[int, int]]:
        """Up to `count` live (stamp, key) of the bucket from its cursor on, oldest first; moves
        the cursor to the first one (past the log's end if none)."""
        position = bisect.bisect_left(self._log_stamps, self._cursor.get(refcount, 0))
        found: list[tuple[int, int]] = []
        log_keys, log_stamps = self._log_keys, self._log_stamps
        end = min(len(log_keys), position + _PYTHON_SCAN)
        while position < end and len(found) < count:  # the common case: a live key at the cursor
            key, stamp = log_keys[position], log_stamps[position]
            if self._is_live(refcount, stamp, key):
                found.append((stamp, key))
            position += 1
        keys, stamps = _view(log_keys), _view(log_stamps)
        key_stamps, refcounts, pins = _view(self._stamp), _view(self._refcount), _view(self._pins)
        chunk = _FIRST_CHUNK
        while position < len(keys) and len(found) < count:
            part_keys, part_stamps = keys[position:position + chunk], stamps[position:position + chunk]
            live = np.flatnonzero((key_stamps[part_keys] == part_stamps) & (refcounts[part_keys] == refcount)
                                  & (pins[part_keys] == 0))[: count - len(found)]
            found += zip(part_stamps[live].tolist(), part_keys[live].tolist(), strict=True)
            position += chunk
            chunk = min(4 * chunk, _LAST_CHUNK)
        self._cursor[refcount] = found[0][0] if found else self._clock + 1
        return found

    def _heap_oldest(self, refcount: int, heap: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
        """Up to `count` live entries of the bucket's heap, oldest first, dropping the stale ones
        in front of them."""
        taken: list[tuple[int, int]] = []
        while heap and len(taken) < count:
            stamp, key = heapq.heappop(heap)
            if self._is_live(refcount, stamp, key) and (stamp, key) not in taken:
                taken.append((stamp, key))
        for entry in taken:
            heapq.heappush(heap, entry)
        if not heap:
            del self._heaps[refcount]
        return taken

    def _compact_heap(self, refcount: int) -> None:
        entries = sorted({entry for entry in self._heaps[refcount] if self._is_live(refcount, *entry)})
        self._heaps[refcount] = entries  # sorted: a heap
        self._heap_floor[refcount] = len(entries)


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise InvalidArgumentError(f"cache policy: {name} must be >= 0, got {value}")
