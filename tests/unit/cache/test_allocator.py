"""The byte allocator against a brute-force model: a bytearray of owners, first scanned for
the smallest free run (best fit), checked after every operation."""

from __future__ import annotations

import random

import pytest

from joader.cache.allocator import ByteAllocator
from joader.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(60)


class Model:
    """Units of `align` bytes, each free (0) or owned by an allocation id."""

    def __init__(self, units: int) -> None:
        self.owner = [0] * units

    def runs(self) -> list[tuple[int, int]]:
        runs, start = [], None
        for i, o in enumerate([*self.owner, 1]):
            if o == 0 and start is None:
                start = i
            elif o != 0 and start is not None:
                runs.append((i - start, start))
                start = None
        return runs

    def best_fit(self, units: int) -> int | None:
        fitting = [run for run in self.runs() if run[0] >= units]
        return min(fitting)[1] if fitting else None


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_allocation_matches_a_brute_force_model(seed: int) -> None:
    rng = random.Random(seed)
    align, units = 64, 400
    allocator, model = ByteAllocator(units * align, align), Model(units)
    live: dict[int, int] = {}  # offset -> units
    next_id = 1
    for _ in range(3000):
        action = rng.random()
        if action < 0.5 or not live:
            nbytes = rng.choice([1, 63, 64, 65, 500, 3000, rng.randint(1, 40 * align)])
            need = max(1, -(-nbytes // align))
            expected = model.best_fit(need)
            offset = allocator.allocate(nbytes)
            assert (offset // align if offset is not None else None) == expected
            if offset is not None:
                for u in range(offset // align, offset // align + need):
                    model.owner[u] = next_id
                live[offset] = need
                next_id += 1
        elif action < 0.85:
            offset = rng.choice(list(live))
            allocator.free(offset)
            for u in range(offset // align, offset // align + live.pop(offset)):
                model.owner[u] = 0
        else:
            offset = rng.choice(list(live))
            keep = rng.randint(1, live[offset] * align)
            allocator.shrink(offset, keep)
            kept = max(1, -(-keep // align))
            for u in range(offset // align + kept, offset // align + live[offset]):
                model.owner[u] = 0
            live[offset] = kept
        allocator.check()
        stats = allocator.stats()
        assert stats.used_bytes == sum(live.values()) * align
        runs = model.runs()
        assert stats.largest_free_bytes == (max(runs)[0] * align if runs else 0)
        assert stats.num_holes == len(runs)


def test_freed_neighbours_merge_and_stats_show_fragmentation() -> None:
    allocator = ByteAllocator(10 * 64)
    offsets = [allocator.allocate(64) for _ in range(10)]
    assert allocator.allocate(1) is None
    for offset in offsets[::2]:
        allocator.free(offset)  # five one-unit holes
    stats = allocator.stats()
    assert stats.free_bytes == 5 * 64 and stats.largest_free_bytes == 64
    assert stats.fragmentation == pytest.approx(0.8)
    assert allocator.allocate(128) is None  # no hole fits, although 320 bytes are free
    for offset in offsets[1::2]:
        allocator.free(offset)
    assert allocator.stats().num_holes == 1 and allocator.allocate(640) == 0


def test_bad_calls_name_the_problem() -> None:
    allocator = ByteAllocator(1024)
    with pytest.raises(InvalidArgumentError, match="positive"):
        allocator.allocate(0)
    with pytest.raises(InvalidArgumentError, match="no allocation"):
        allocator.free(64)
    offset = allocator.allocate(100)
    assert offset is not None
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        allocator.shrink(offset, 1000)
