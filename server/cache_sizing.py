"""`--cache-size auto`: the arena sized from the data, so that a user never has to.

The rule (`auto_cache_size`, pure: every input is an argument):

- want the whole prepared dataset: for each source, its items times the bytes of one prepared
  item (`PreparedSource.item_bytes`: exactly what every item takes for a fixed-size stage, and
  for `center-crop`, whose bound is the size of every image at least S; the stage's bound for a
  variable one; `Source.max_item_bytes` in every case), each rounded up to the allocator's
  64-byte units, plus a margin of 1/16 (NOTE [ The margin of an auto cache ]);
- at most half of what the shared-memory filesystem can hold now (`shm_free_bytes`): the arena is
  allocated in full at start (`posix_fallocate`), and DataLoader workers make their batches in
  the same /dev/shm (a full one is `SharedMemoryFullError` in the training process);
- at most a quarter of the host's RAM (`ram_bytes`): tmpfs pages are RAM that the training
  processes, their workers and the page cache of the source files also need;
- at least what the arena takes (`min_bytes`: one item of the largest source): below that
  joaderd cannot serve at all. When the caps are below it, the arena is tried at that size and
  its allocation names the fix if /dev/shm cannot hold it.

The explicit default (`--cache-size 1GiB`) stays what a plain `joaderd` gets; "auto" is opt-in
(a client that starts joaderd for itself passes it). `host_memory` is the one impure part: what
/dev/shm and the host have now.

NOTE [ The margin of an auto cache ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For a fixed-size stage one copy of each item, each rounded to 64 bytes, is all the arena ever
holds at once when everything fits: decodes in flight are items of the dataset too, padding
copies and later epochs reuse the cached item, and clients copy items out. So the sum is exact,
and the margin is for what it does not count: a file rewritten larger under joaderd (placed
again at its new size), the tails a decode given its bound leaves when it lands smaller
(`center-crop` of a small image), best fit's holes once the cache holds items of several
sources. 1/16 is cheap next to the caps; for a variable stage the bound already overshoots
(`resize` items are given 3 x S x 8S, most take a sixth of that), so "the whole dataset" is then
an upper bound, and the caps usually decide.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from joader.cache.arena import DEFAULT_SHM_DIR, Arena, format_size

__all__ = ["MARGIN_DIVISOR", "CacheSize", "PreparedSource", "auto_cache_size", "host_memory", "prepared_bytes"]

MARGIN_DIVISOR = 16  # NOTE [ The margin of an auto cache ]
SHM_SHARE_DIVISOR = 2  # at most half of /dev/shm's free space
RAM_SHARE_DIVISOR = 4  # at most a quarter of the host's RAM


@dataclass(frozen=True)
class PreparedSource:
    """One source as the sizing sees it: `items` of at most `item_bytes` each once prepared;
    `exact` when (nearly) every item takes exactly that: a fixed-size stage, or a bound that is
    the size of nearly every item (`item_sizes.bound_is_nominal`: `center-crop`)."""

    name: str
    items: int
    item_bytes: int
    exact: bool


@dataclass(frozen=True)
class CacheSize:
    """The chosen arena size and why (the log line and status's `cache_sizing`)."""

    size_bytes: int
    dataset_bytes: int  # every source prepared, in the allocator's units (no margin)
    reason: str  # the whole prepared dataset, or the cap or floor that decided

    def describe(self) -> str:
        """The log line: "cache 375.0 MiB = the whole prepared dataset (...)"."""
        if self.reason.startswith("the whole"):
            return f"cache {format_size(self.size_bytes)} = {self.reason}"
        return f"cache {format_size(self.size_bytes)}, {self.reason}"


def prepared_bytes(sources: Sequence[PreparedSource]) -> int:
    """Every source's items prepared, each rounded up to the allocator's 64-byte units."""
    return sum(s.items * _round_up(max(1, s.item_bytes), Arena.ALIGN) for s in sources)


def auto_cache_size(sources: Sequence[PreparedSource], *, shm_free_bytes: int, ram_bytes: int,
                    min_bytes: int, shm_dir: str = DEFAULT_SHM_DIR) -> CacheSize:
    """The arena's size for `--cache-size auto` (the module docstring's rule). Pure."""
    dataset = prepared_bytes(sources)
    wanted = _round_up(dataset + -(-dataset // MARGIN_DIVISOR), Arena.ALIGN)
    estimate = "" if all(s.exact for s in sources) else ", at the stage's bound per item"
    whole = (f"the whole prepared dataset ({format_size(dataset)} for {_count(sources)}"
             f"{estimate}, plus 1/{MARGIN_DIVISOR})")
    floor = _round_up(max(min_bytes, Arena.ALIGN), Arena.ALIGN)
    caps = [
        (_round_down(shm_free_bytes // SHM_SHARE_DIVISOR, Arena.ALIGN),
         f"capped at half of {shm_dir} free ({format_size(shm_free_bytes)} free); the prepared dataset "
         f"is {format_size(dataset)}"),
        (_round_down(ram_bytes // RAM_SHARE_DIVISOR, Arena.ALIGN),
         f"capped at a quarter of the host's RAM ({format_size(ram_bytes)}); the prepared dataset is "
         f"{format_size(dataset)}"),
    ]
    size, reason = wanted, whole
    for cap, why in caps:
        if cap < size:
            size, reason = cap, why
    if size < floor:
        size, reason = floor, (
            f"raised to the least the arena takes (one item of {format_size(min_bytes)}) over its caps "
            f"(half of {shm_dir} free: {format_size(caps[0][0])}, a quarter of the RAM: "
            f"{format_size(caps[1][0])}); free space in {shm_dir} (in Docker raise --shm-size)")
    return CacheSize(size, dataset, reason)


def host_memory(shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> tuple[int, int]:
    """What `auto_cache_size` is capped by, now: (bytes free in `shm_dir`, the host's RAM)."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize, int(psutil.virtual_memory().total)


def _count(sources: Sequence[PreparedSource]) -> str:
    total = sum(s.items for s in sources)
    return f"{total:,} items" + (f" in {len(sources)} sources" if len(sources) > 1 else "")


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _round_down(value: int, unit: int) -> int:
    return value - value % unit
