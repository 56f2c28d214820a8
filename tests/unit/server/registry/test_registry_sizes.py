"""Exact sizes through the registry: a variable stage with a pool that places items size first
(the registry files a result that settles nothing and dispatches the placement itself),
jobs read every item exactly once with its own length, and the cache holds all it can."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from pyroaring import BitMap

from joader.server.pool.records import DecodeResult, NeedsBytes
from joader.server.registry.registry import Registry, RegistryConfig, Source
from joader.stages import ItemSpec
from tests.support.registry_driver import NUM_ITEMS, FakeClock, attach, make_registry, nxt

pytestmark = pytest.mark.timeout(60)

BOUND = 4000


def size_of(item_id: int) -> int:
    return 300 + 41 * item_id % 900


class SizesFirstPool:
    """Prepares nothing: a task of capacity 0 answers with the item's size (kept "in the worker"),
    a placement with exact room writes it; results come back in random order."""

    num_workers = 2
    sizes_first = True

    def __init__(self, seed: int, batches: bool = False) -> None:
        self.tasks: list[tuple[int, int, int]] = []  # (task id, item id, capacity)
        self.rng = random.Random(seed)
        self.batches = batches  # results filed as the results thread files them (`file_results`)

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        self.tasks.append((task_id, item_id, capacity))

    def finish(self, registry: Registry) -> None:
        if self.batches:
            self.finish_in_batches(registry)
            return
        while self.tasks:
            task_id, item_id, capacity = self.tasks.pop(self.rng.randrange(len(self.tasks)))
            nbytes = size_of(item_id)
            ok = nbytes <= capacity
            registry.file_result(task_id, ok, None if ok else f"{nbytes} bytes, {capacity} allocated", 0.001,
                                 shape=(1, 1, nbytes), dtype="uint8", nbytes=nbytes)
            registry.check_invariants()

    def finish_in_batches(self, registry: Registry) -> None:
        """The pool's own records, a random batch at a time: a size is a `NeedsBytes`."""
        while self.tasks:
            self.rng.shuffle(self.tasks)
            count = self.rng.randint(1, len(self.tasks))
            taken, self.tasks = self.tasks[:count], self.tasks[count:]
            results: list[DecodeResult | NeedsBytes] = []
            for task_id, item_id, capacity in taken:
                nbytes = size_of(item_id)
                results.append(
                    DecodeResult(task_id, True, None, f"{item_id}", 0.001, (1, 1, nbytes), "uint8", nbytes, 0)
                    if nbytes <= capacity else
                    NeedsBytes(task_id, f"{nbytes} bytes, {capacity} allocated", f"{item_id}", 0.001, (1, 1, nbytes),
                               "uint8", nbytes))
            registry.file_results(results)
            registry.check_invariants()


@pytest.mark.parametrize("batches", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_variable_stage_is_placed_exactly_and_read_whole(seed: int, batches: bool) -> None:
    """Filed one by one, or in batches of the pool's own records (a size is a `NeedsBytes`, never
    a failure: `items_failed` stays 0)."""
    listing = make_registry()[0].source("demo").listing
    stage = SimpleNamespace(name="pkg.mod:factory", size=None, spec=ItemSpec.variable(BOUND))
    pool = SizesFirstPool(seed, batches)
    capacity = sum(-(-size_of(i) // 64) * 64 for i in range(NUM_ITEMS)) + 8 * 1024  # holds every item
    registry = Registry([Source("varied", listing, stage, 0, seed=1)], capacity, pool,
                        RegistryConfig(lease_s=5.0, next_wait_s=0.0, linger_s=0.0, start_grace_s=0.0), FakeClock())
    job = attach(registry, "varied", BitMap(range(NUM_ITEMS)), "a", 4)
    for epoch in (1, 2, 3):
        order: list[int] = []
        acks: list[int] = []
        for _ in range(10_000):
            registry.schedule_once()
            registry.check_invariants()
            pool.finish(registry)
            result = nxt(registry, job.job_id, epoch, 4, acks)
            assert result.lengths == [size_of(i) for i in result.item_ids]
            acks, order = result.item_ids, order + result.item_ids
            if result.end_of_epoch:
                nxt(registry, job.job_id, epoch, 0, acks)
                break
        assert sorted(order) == list(range(NUM_ITEMS))
    status = registry.status()
    assert status["items_decoded"] == NUM_ITEMS and status["cache"]["evictions"] == 0  # one decode each
    assert status["items_failed"] == 0 and status["decodes"]["failures"] == 0
    decodes = status["decodes"]
    assert decodes["sized_first"] == NUM_ITEMS and decodes["exact"] == NUM_ITEMS and decodes["at_bound"] == 0
    assert status["cache"]["fragmentation"] == 0.0 and status["cache"]["items"] == NUM_ITEMS
