"""Byte ranges of the arena for items of any size: best fit, coalescing, aligned.

Fixed slots (3*S*S each, the largest S of all sources) wasted the difference on every smaller
item, and could not hold items whose size is only known after decoding (`resize:S` keeps the
aspect ratio; user stages return any shape). Here an item gets exactly its bytes, rounded up to
`align` (64: a cache line, and aligned for any dtype).

Why best fit with coalescing, not a buddy or slab allocator: a buddy allocator rounds up to a
power of two (up to 50% waste: 196,608 bytes of a 256x256x3 item would take 262,144), and a slab
per size class strands memory in half-empty slabs when the mix of sizes changes. Best fit keeps
the waste below `align` per item, and freed neighbours merge again. External fragmentation
remains possible (many free holes, none large enough); `fragmentation` reports it, and the
cache evicts more victims when no hole fits (`ItemCache._allocate`).

Variable items are allocated at their stage's upper bound before decoding and shrunk in place to
their real size when the decode lands (`shrink`), so no pixel is ever copied twice.

Pure bookkeeping: no memory is touched. O(log n) per operation in the number of free holes
(a sorted list of (size, offset) for best fit, and dicts by start and end for coalescing).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from joader.cache.interning import Interner
from joader.errors import InvalidArgumentError

__all__ = ["AllocatorStats", "ByteAllocator"]

_MAX_SIZE_OBJECTS = 4096  # distinct allocation sizes whose int objects are shared


@dataclass(frozen=True)
class AllocatorStats:
    capacity_bytes: int
    used_bytes: int  # allocated, including alignment
    free_bytes: int
    largest_free_bytes: int
    num_allocations: int
    num_holes: int

    @property
    def fragmentation(self) -> float:
        """Share of the free bytes not in the largest hole (0: one hole; near 1: crumbs)."""
        if not self.free_bytes:
            return 0.0
        return 1.0 - self.largest_free_bytes / self.free_bytes


class ByteAllocator:
    """Allocates aligned byte ranges of `[0, capacity)` (see the module docstring)."""

    def __init__(self, capacity: int, align: int = 64) -> None:
        if align <= 0 or align & (align - 1):
            raise InvalidArgumentError(f"align must be a power of two, got {align}")
        self.align = align
        self.capacity = capacity - capacity % align
        self._allocated: dict[int, int] = {}  # offset -> size (one int object per distinct size)
        # NOTE: a size computed per allocation is an int object of its own (28-32 bytes per
        # cached item, issue 37); the items of a source mostly share a few sizes, so the dict's
        # values are taken from here (bounded: sizes beyond it are kept as they come).
        self._size_objects = Interner(_MAX_SIZE_OBJECTS)
        self._by_start: dict[int, int] = {}  # hole offset -> size
        self._by_end: dict[int, int] = {}  # hole end -> offset
        self._holes: list[tuple[int, int]] = []  # sorted (size, offset)
        self._used = 0
        if self.capacity > 0:
            self._add_hole(0, self.capacity)

    def rounded(self, nbytes: int) -> int:
        return max(self.align, -(-nbytes // self.align) * self.align)

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a new range of at least `nbytes`, or None if no hole is large enough."""
        if nbytes <= 0:
            raise InvalidArgumentError(f"allocate: nbytes must be positive, got {nbytes}")
        size = self.rounded(nbytes)
        index = bisect.bisect_left(self._holes, (size, -1))
        if index == len(self._holes):
            return None
        hole_size, offset = self._holes[index]
        self._remove_hole(offset, hole_size)
        if hole_size > size:
            self._add_hole(offset + size, hole_size - size)
        self._allocated[offset] = self._size_objects.get(size)
        self._used += size
        return offset

    def free(self, offset: int) -> None:
        size = self._allocated.pop(offset, None)
        if size is None:
            raise InvalidArgumentError(f"free: no allocation at offset {offset}")
        self._used -= size
        self._release(offset, size)

    def shrink(self, offset: int, nbytes: int) -> None:
        """Keeps the first `nbytes` of the allocation at `offset`; the rest is free again."""
        size = self._allocated.get(offset)
        if size is None:
            raise InvalidArgumentError(f"shrink: no allocation at offset {offset}")
        keep = self.rounded(nbytes)
        if keep > size:
            raise InvalidArgumentError(f"shrink: {nbytes} bytes do not fit the {size} allocated")
        if keep == size:
            return
        self._allocated[offset] = self._size_objects.get(keep)
        self._used -= size - keep
        self._release(offset + keep, size - keep)

    def size_of(self, offset: int) -> int:
        return self._allocated[offset]

    def allocations(self) -> dict[int, int]:
        """offset -> size of every allocation (a copy; for invariant checks)."""
        return dict(self._allocated)

    def stats(self) -> AllocatorStats:
        free = self.capacity - self._used
        largest = self._holes[-1][0] if self._holes else 0
        return AllocatorStats(self.capacity, self._used, free, largest, len(self._allocated), len(self._holes))

    # ----------------------------------------------------------------------------- holes

    def _release(self, offset: int, size: int) -> None:
        """Returns a range to the holes, merged with the holes on either side."""
        before = self._by_end.get(offset)
        if before is not None:
            before_size = self._by_start[before]
            self._remove_hole(before, before_size)
            offset, size = before, size + before_size
        after_size = self._by_start.get(offset + size)
        if after_size is not None:
            self._remove_hole(offset + size, after_size)
            size += after_size
        self._add_hole(offset, size)

    def _add_hole(self, offset: int, size: int) -> None:
        self._by_start[offset] = size
        self._by_end[offset + size] = offset
        bisect.insort(self._holes, (size, offset))

    def _remove_hole(self, offset: int, size: int) -> None:
        del self._by_start[offset]
        del self._by_end[offset + size]
        index = bisect.bisect_left(self._holes, (size, offset))
        del self._holes[index]

    def check(self) -> None:
        """Raises AssertionError if holes and allocations do not tile `[0, capacity)` exactly."""
        ranges = sorted([(o, s, "a") for o, s in self._allocated.items()] + [(o, s, "h") for o, s in self._by_start.items()])
        position, last_kind = 0, None
        for offset, size, kind in ranges:
            assert offset == position, f"gap or overlap at {position}: next range starts at {offset}"
            assert size > 0 and offset % self.align == 0, (offset, size)
            assert not (kind == "h" and last_kind == "h"), f"two adjacent holes at {offset}"
            position, last_kind = offset + size, kind
        assert position == self.capacity, (position, self.capacity)
        assert sorted(self._holes) == self._holes == sorted((s, o) for o, s in self._by_start.items())
        assert self._used == sum(self._allocated.values())
