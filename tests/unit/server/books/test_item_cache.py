"""Exact sizes in the item cache (server/books/item_sizes.py): probes, size first, the
size memory, files that change size, and the bound for pools and stages that can do neither.

Driven with a fake decode pool that answers probes and "decodes" (files results) only when the
test says so, and `check_invariants` after every step: every range of the allocator is an
item's (READY: its bytes; DECODING: what it was given; size first: none).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from joader.errors import InvariantError
from joader.server.books.cache_records import Filed
from joader.server.books.item_cache import ItemCache
from joader.server.books.item_sizes import MISFITS
from joader.server.books.records import ItemState, Source
from joader.stages import ItemSpec

pytestmark = pytest.mark.timeout(60)

NUM_ITEMS = 200
BOUND = 4096
ALIGN = 64


def size_of(item_id: int) -> int:
    """Item sizes of a `resize`-like stage: well below the bound, and all different."""
    return 500 + 37 * item_id % 1500


class Stage:
    """A variable stage that can read an item's size from its header (as `ImageStage`)."""

    name = "resize:8"
    spec = ItemSpec.variable(BOUND, "uint8", 3)

    def item_nbytes(self, data: bytes) -> int | None:  # never called here: the fake pool answers
        raise AssertionError


class UserStage:
    """A variable stage that cannot say a size before preparing (as a user stage)."""

    name = "pkg.mod:factory"
    spec = ItemSpec.variable(BOUND)


LISTING = SimpleNamespace(paths=tuple(f"{i}.jpg" for i in range(NUM_ITEMS)), labels=[0] * NUM_ITEMS)


class Pool:
    """A decode pool that runs nothing until told: `answer` the probes, `finish` the tasks."""

    def __init__(self, num_workers: int = 2, *, probes: bool = True, sizes_first: bool = True) -> None:
        self.num_workers = num_workers
        self.sizes_first = sizes_first
        self.tasks: list[tuple[int, int, int, int]] = []  # (key, item id, offset, capacity)
        self.probed: list[int] = []  # item ids asked for, not answered yet
        self.answers: list[tuple[int, int, int]] = []
        self.sizes = {i: size_of(i) for i in range(NUM_ITEMS)}  # what a decode finds now
        self.fill_before_eviction = 0.0  # the most items_bytes / capacity seen before any eviction
        self.used_before_eviction = 0.0  # the same of the allocator's used bytes (decodes in flight too)
        if probes:
            self.probe = self._probe
            self.take_sizes = self._take_sizes

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        assert source_index == 0 and capacity >= 0 and (capacity == 0 or offset >= 0)
        self.tasks.append((task_id, item_id, offset, capacity))

    def _probe(self, source_index: int, item_ids: list[int]) -> None:
        self.probed.extend(item_ids)

    def _take_sizes(self) -> list[tuple[int, int, int]]:
        answers, self.answers = self.answers, []
        return answers

    def answer(self, unknown: frozenset[int] = frozenset()) -> None:
        """Every probe out is answered (0 for the ids in `unknown`: a header it cannot read)."""
        self.answers += [(0, i, 0 if i in unknown else self.sizes[i]) for i in self.probed]
        self.probed = []

    def finish(self, cache: ItemCache, count: int | None = None, order: random.Random | None = None) -> None:
        """Files the results of `count` tasks (all), in submission order or shuffled: what a
        worker would answer for the range it was given."""
        tasks = self.tasks[: len(self.tasks) if count is None else count]
        del self.tasks[: len(tasks)]
        if order is not None:
            order.shuffle(tasks)
        for key, item_id, _offset, capacity in tasks:
            if not cache.evictions:
                self.fill_before_eviction = max(self.fill_before_eviction, cache.items_bytes() / cache.capacity_bytes)
                self.used_before_eviction = max(self.used_before_eviction,
                                                cache.allocator.stats().used_bytes / cache.capacity_bytes)
            nbytes = self.sizes[item_id]
            if nbytes <= capacity:
                filed = cache.file_result(key, True, None, 0.001, lambda item: 0, shape=(1, 1, nbytes), dtype="uint8",
                                          nbytes=nbytes, checksum=item_id)
            else:  # size first, or it outgrew its exact range: nothing written
                filed = cache.file_size(key, nbytes, f"{nbytes} bytes, {capacity} allocated", 0.001)
                assert filed == Filed(None, dispatch=True)  # nothing settled; the filer dispatches
            if filed.dispatch:  # what the registry's filing does (server/registry/filing.py)
                cache.dispatch_again()
            cache.check_invariants()


def make(capacity: int, stage: object = None) -> tuple[ItemCache, Source]:
    cache = ItemCache(capacity, retry_failed_s=60.0, clock=lambda: 0.0)
    return cache, Source("demo", LISTING, stage or Stage(), 0, seed=1)


def want(cache: ItemCache, source: Source, ids: range | list[int]) -> None:
    for seq, item_id in enumerate(ids):
        cache.want(source, item_id, seq, consumed=False, due_s=float(seq))
    cache.check_invariants()


def dispatch(cache: ItemCache, pool: Pool, limit: int = 4) -> None:
    cache.dispatch(pool, limit, lambda source: 0)
    cache.check_invariants()


def read_all(cache: ItemCache, source: Source, ids: range | list[int]) -> None:
    """The job read these (and acknowledged them): their pins go, they may be evicted."""
    for item_id in ids:
        cache.release(source.key_base + item_id)
    cache.check_invariants()


def test_probed_sizes_place_every_decode_exactly() -> None:
    cache, source = make(1 << 20)
    pool = Pool()
    want(cache, source, range(20))
    dispatch(cache, pool, limit=0)  # probes go out at once, whatever the decodes' limit
    assert sorted(pool.probed) == list(range(20)) and pool.tasks == []
    pool.answer()
    dispatch(cache, pool)
    assert [(item_id, capacity) for _, item_id, _, capacity in pool.tasks] == [(i, size_of(i)) for i in range(4)]
    while pool.tasks:
        pool.finish(cache)
        dispatch(cache, pool)
    assert cache.items_decoded == 20 and cache.decodes_exact == 20
    assert cache.decodes_at_bound == cache.decodes_sized_first == 0
    stats = cache.allocator.stats()
    assert stats.used_bytes == sum(cache.allocator.rounded(size_of(i)) for i in range(20))
    assert stats.num_holes == 1  # items side by side, one hole after them: no fragmentation


def test_a_head_whose_probe_is_out_goes_size_first_when_a_worker_would_idle() -> None:
    cache, source = make(1 << 20)
    pool = Pool(num_workers=2)
    want(cache, source, range(6))
    dispatch(cache, pool)  # nothing in flight: the head does not wait for its probe
    assert [capacity for *_, capacity in pool.tasks] == [0, 0]  # size first, until every worker has one
    assert all(cache.items[i].state is ItemState.DECODING and cache.items[i].offset == -1 for i in (0, 1))
    pool.finish(cache, 1)  # item 0 says its size: placed at once, exactly (the filer's dispatch_again)
    assert [(item_id, capacity) for _, item_id, _, capacity in pool.tasks] == [(1, 0), (0, size_of(0))]
    pool.finish(cache)
    assert cache.items[0].state is ItemState.READY and cache.items[0].nbytes == size_of(0)
    assert cache.items[1].state is ItemState.DECODING  # placed after its size came, not yet copied
    # with item 1 alone in flight, item 2 (its probe still out) went size first too
    assert [(item_id, capacity) for _, item_id, _, capacity in pool.tasks] == [(1, size_of(1)), (2, 0)]
    pool.answer()
    while pool.tasks or any(not cache.items[i].state.settled for i in range(6)):
        dispatch(cache, pool)
        pool.finish(cache)
    assert cache.items_decoded == 6 and cache.decodes_sized_first == 3 and cache.decodes_exact == 6
    assert cache.decodes_at_bound == 0 and cache.allocator.stats().num_holes == 1


def test_a_size_settles_nothing_and_the_filer_not_the_cache_dispatches_its_placement() -> None:
    """NOTE [ The filer dispatches ] (server/books/item_cache.py): filing a size calls no pool."""
    cache, source = make(1 << 20)
    pool = Pool(num_workers=2)
    want(cache, source, range(2))
    dispatch(cache, pool)
    key, item_id, _, capacity = pool.tasks.pop(0)
    assert capacity == 0  # size first
    filed = cache.file_size(key, size_of(item_id), f"{size_of(item_id)} bytes, 0 allocated", 0.001)
    assert filed == Filed(None, dispatch=True)
    assert cache.items[key].state is ItemState.WAITING and [t[1] for t in pool.tasks] == [1]  # nothing submitted
    cache.check_invariants()
    cache.dispatch_again()
    assert [(t[1], t[3]) for t in pool.tasks] == [(1, 0), (item_id, size_of(item_id))]  # placed exactly
    assert cache.decode_failures == 0 and cache.num_failed == 0 and not source.failed


def test_an_unreadable_header_and_a_user_stage_go_size_first() -> None:
    cache, source = make(1 << 20)
    pool = Pool(num_workers=1)
    want(cache, source, range(3))
    dispatch(cache, pool, limit=1)
    pool.answer(unknown=frozenset({0, 1, 2}))
    while pool.tasks or any(not cache.items[i].state.settled for i in range(3)):
        pool.finish(cache)
        dispatch(cache, pool, limit=1)
    assert cache.decodes_sized_first == 3 and cache.decodes_at_bound == 0 and cache.items_decoded == 3

    cache, source = make(1 << 20, UserStage())
    pool = Pool()
    want(cache, source, range(5))
    dispatch(cache, pool)
    assert pool.probed == [] and [capacity for *_, capacity in pool.tasks] == [0] * 4
    while pool.tasks or any(not cache.items[i].state.settled for i in range(5)):
        pool.finish(cache)
        dispatch(cache, pool)
    assert cache.decodes_sized_first == 5 and cache.items_decoded == 5 and cache.allocator.stats().num_holes == 1


class CenterCropStage(Stage):
    """`center-crop` without upscale: its bound is the size of nearly every item (S x S x C),
    smaller only for an image smaller than S."""

    name = "center-crop:8"
    spec = ItemSpec.variable(BOUND, "uint8", 3)
    nominal_shape = (1, 1, BOUND)


def test_a_stage_whose_bound_is_its_items_size_is_neither_probed_nor_sized_first() -> None:
    cache, source = make(8 * BOUND, CenterCropStage())
    pool = Pool(num_workers=2)
    pool.sizes = {i: BOUND for i in range(NUM_ITEMS)}
    pool.sizes[3] = BOUND // 4  # an image smaller than S: a smaller square
    want(cache, source, range(6))
    dispatch(cache, pool)
    assert pool.probed == []  # no second read of each file
    assert [(item_id, capacity) for _, item_id, _, capacity in pool.tasks] == [(i, BOUND) for i in range(4)]
    while pool.tasks or any(not cache.items[i].state.settled for i in range(6)):
        pool.finish(cache)
        dispatch(cache, pool)
    assert cache.decodes_at_bound == 6 and cache.decodes_sized_first == 0 and cache.items_decoded == 6
    assert cache.items[3].nbytes == BOUND // 4  # shrunk when it landed
    assert cache.known_size(source, 3) == BOUND // 4  # and remembered: its next decode is exact
    read_all(cache, source, range(6))


def test_a_pool_that_can_do_neither_gets_the_bound_and_the_size_is_remembered() -> None:
    cache, source = make(3 * BOUND)
    pool = Pool(probes=False, sizes_first=False)
    want(cache, source, range(3))
    dispatch(cache, pool)
    assert [capacity for *_, capacity in pool.tasks] == [BOUND] * 3  # the old path
    pool.finish(cache)
    assert cache.decodes_at_bound == 3 and [cache.known_size(source, i) for i in range(3)] == [size_of(i) for i in range(3)]
    read_all(cache, source, range(3))
    for key in range(3):  # evicted (as the policy would, to make room)
        cache._evict(key)
    cache.check_invariants()
    want(cache, source, range(3))
    dispatch(cache, pool)
    assert [capacity for *_, capacity in pool.tasks] == [size_of(i) for i in range(3)]  # remembered: exact
    pool.finish(cache)
    assert cache.decodes_exact == 3 and cache.items_decoded == 6


def test_a_file_that_grew_is_placed_again_and_the_bound_ends_a_size_that_keeps_changing() -> None:
    cache, source = make(1 << 20)
    pool = Pool(num_workers=1)
    want(cache, source, [7])
    dispatch(cache, pool)
    pool.finish(cache)  # size first
    pool.finish(cache)
    read_all(cache, source, [7])
    cache._evict(7)
    pool.sizes[7] = size_of(7) + 1000  # the file was replaced by a larger image
    want(cache, source, [7])
    dispatch(cache, pool)
    assert pool.tasks[0][3] == size_of(7)  # its remembered size
    pool.finish(cache)  # did not fit: placed again at once with what it needs
    assert cache.decodes_refitted == 1 and pool.tasks[0][3] == size_of(7) + 1000
    pool.finish(cache)
    assert cache.items[7].state is ItemState.READY and cache.items[7].nbytes == size_of(7) + 1000
    assert cache.decode_failures == 0 and not source.failed  # not a failure: nobody is told

    read_all(cache, source, [7])
    cache._evict(7)
    want(cache, source, [7])
    for attempt in range(MISFITS):  # a stage whose output grows every time it runs
        dispatch(cache, pool)
        assert pool.tasks[0][3] == cache.known_size(source, 7)
        pool.sizes[7] += 64 * (attempt + 1)
        pool.finish(cache)
    assert pool.tasks[0][3] == BOUND  # the bound: the end of it
    pool.finish(cache)
    assert cache.items[7].state is ItemState.READY and cache.decodes_at_bound == 1


def test_a_cache_of_mixed_sizes_is_nearly_full_before_its_first_eviction() -> None:
    """Exact ranges fill the arena from one end: the first eviction comes when less than an
    item is left, whatever order decodes land in. Here items are 1-2% of the arena each, up to
    four decodes in flight hold their ranges, and rounding to 64 bytes costs 2.5%."""
    capacity = 100 * 1000
    cache, source = make(capacity)
    pool = Pool(num_workers=2)
    rng = random.Random(3)
    for start in range(0, NUM_ITEMS, 8):  # a job reading 8 at a time, each read as soon as ready
        ids = list(range(start, start + 8))
        want(cache, source, ids)
        if start % 16:
            pool.answer()  # half the batches find their probes answered
        while pool.tasks or any(not cache.items[i].state.settled for i in ids):
            dispatch(cache, pool)
            pool.finish(cache, order=rng)
        read_all(cache, source, ids)
    assert cache.items_decoded == NUM_ITEMS and cache.decodes_at_bound == 0 and cache.evictions > 0
    assert pool.used_before_eviction > 0.97 and pool.fill_before_eviction > 0.92
    assert cache.items_bytes() > 0.9 * cache.capacity_bytes


@pytest.mark.parametrize("seed", range(4))
def test_random_steps_keep_the_books(seed: int) -> None:
    """Wants, probes answered or not, results in any order, files that change size, reads and
    evictions, in random steps: the invariants hold after each, and every decode is placed."""
    rng = random.Random(seed)
    cache, source = make(40 * 1000)
    pool = Pool(num_workers=rng.choice([1, 2, 3]), probes=seed % 2 == 0)
    pinned: list[int] = []
    for step in range(1500):
        action = rng.random()
        if action < 0.3:
            ids = rng.sample(range(NUM_ITEMS), rng.randint(1, 6))
            want(cache, source, ids)
            pinned += ids
        elif action < 0.45:
            pool.answer(unknown=frozenset(rng.sample(range(NUM_ITEMS), 5)))
        elif action < 0.7:
            dispatch(cache, pool, limit=2 * pool.num_workers)
        elif action < 0.85:
            pool.finish(cache, rng.randint(1, 3), order=rng)
        elif action < 0.97 and pinned:
            settled = [i for i in pinned if cache.items.get(i) is not None and cache.items[i].state.settled]
            for item_id in rng.sample(settled, min(len(settled), rng.randint(1, 4))):
                pinned.remove(item_id)
                cache.release(item_id)
            cache.check_invariants()
        else:
            item_id = rng.randrange(NUM_ITEMS)
            pool.sizes[item_id] = rng.randint(1, BOUND)  # a file replaced on disk
        assert cache.allocator.stats().used_bytes <= cache.capacity_bytes, step
    for _ in range(100):  # drain: every wanted item is placed, or waits for pins to go
        pool.answer()
        dispatch(cache, pool, limit=2 * pool.num_workers)
        pool.finish(cache)
    waiting = [i for i in set(pinned) if not cache.items[i].state.settled]
    assert not waiting or cache.policy.victim() is None  # nothing left to evict: all pinned
    assert cache.decode_failures == 0
    for _ in range(500):  # the job reads what is ready as it comes: every wanted item gets placed
        for item_id in [i for i in pinned if cache.items[i].state.settled]:
            pinned.remove(item_id)
            cache.release(item_id)
        dispatch(cache, pool, limit=2 * pool.num_workers)
        pool.finish(cache)
    assert not pinned and not pool.tasks and cache.pins() == 0


def test_an_item_a_queue_will_still_read_is_evicted_after_every_item_nobody_will_read() -> None:
    """NOTE [ Planned reads ]: a queue entry counts as a reference until it leaves its queue,
    pinned or not. Twenty items were read by a leader (their pins released); five of them wait
    in a lagging job's queue. Decoding twenty more evicts the fifteen nobody will read first,
    and the five planned ones only once those are gone; their refcount follows plan/unplan."""
    pool = Pool(probes=False, sizes_first=False)
    for i in range(NUM_ITEMS):
        pool.sizes[i] = 1024
    fixed = SimpleNamespace(name="center-crop:8", spec=ItemSpec.fixed((1, 1, 1024), "uint8"))
    cache, source = make(25 * 1024, fixed)  # room for 25 items
    first = range(20)
    want(cache, source, first)
    while pool.tasks or any(not cache.items[source.key_base + i].state.settled for i in first):
        dispatch(cache, pool)
        pool.finish(cache)
    planned = [3, 7, 11, 15, 19]
    for item_id in planned:
        cache.plan(source.key_base + item_id)
    read_all(cache, source, first)
    assert [cache.policy.refcount(source.key_base + i) for i in planned] == [1] * 5
    want(cache, source, range(20, 40))
    while pool.tasks or any(not cache.items[source.key_base + i].state.settled for i in range(20, 40)):
        dispatch(cache, pool)
        pool.finish(cache)
    kept = {i for i in first if source.key_base + i in cache.items}
    assert set(planned) <= kept and cache.evictions >= 15
    assert kept == set(planned)  # 25 slots: the 20 new items and the 5 planned ones
    key = source.key_base + planned[0]
    cache.unplan(key)
    assert cache.policy.refcount(key) == 0 and key not in cache.planned
    with pytest.raises(InvariantError):
        cache.unplan(key)


class BatchingPool(Pool):
    """A pool whose slot holds several decodes, taken together (`submit_many`)."""

    def __init__(self, tasks_per_slot: int) -> None:
        super().__init__(num_workers=1)
        self.tasks_per_slot = tasks_per_slot
        self.calls: list[int] = []  # decodes per `submit_many` call

    def submit_many(self, tasks: list[tuple[int, int, int, int, int]]) -> None:
        self.calls.append(len(tasks))
        for task in tasks:
            self.submit(*task)


def test_a_dispatch_hands_the_pool_a_slot_of_decodes_per_slot_of_its_limit_together() -> None:
    """NOTE [ Decode tasks in batches ] (joader.server.pool.batching): the limit counts slots of
    `tasks_per_slot` decodes, and one dispatch submits what it planned in one call."""
    cache, source = make(NUM_ITEMS * BOUND)
    pool = BatchingPool(tasks_per_slot=4)
    want(cache, source, range(20))
    pool.answer()  # nothing probed yet: the first dispatch asks
    dispatch(cache, pool, limit=2)
    pool.answer()
    dispatch(cache, pool, limit=2)
    assert pool.in_flight == 8 and pool.calls[-1] == 8 - sum(pool.calls[:-1])
    assert [task[1] for task in pool.tasks] == list(range(8))  # earliest due first
    pool.finish(cache, count=3)
    dispatch(cache, pool, limit=2)
    assert pool.in_flight == 8 and pool.calls[-1] == 3  # the three freed, in one call
    pool.finish(cache)
    while cache.decodes_in_flight():
        pool.answer()
        dispatch(cache, pool, limit=2)
        pool.finish(cache)
    assert cache.items_decoded == 20 and all(
        source.checksums is not None and source.checksums[i] == i for i in range(20))
