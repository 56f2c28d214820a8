"""The cache's books per item at scale (issue 37): refcount changes in bulk, who received a
copy (NOTE [ Who received a copy ] in recipients.py), and what an `Item` holds (NOTE [ An
item's footprint ] in records.py)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from pyroaring import BitMap

from joader.server.books.item_cache import ItemCache
from joader.server.books.records import NEVER_DUE, Source
from joader.stages import ItemSpec

pytestmark = pytest.mark.timeout(60)

NUM_ITEMS = 40
NBYTES = 1024


class _Pool:
    num_workers = 2

    def __init__(self) -> None:
        self.tasks: list[int] = []

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        self.tasks.append(task_id)


def _cached(ids: range, slots: int = NUM_ITEMS) -> tuple[ItemCache, Source]:
    """A cache of `slots` items with `ids` decoded into it and read (unpinned), refcount 0; each
    result carries a shape and a dtype of its own, as a decode result's message does."""
    stage = SimpleNamespace(name="fixed", spec=ItemSpec.fixed((1, 1, NBYTES), "uint8"))
    listing = SimpleNamespace(paths=[f"{i}.jpg" for i in range(NUM_ITEMS)], labels=[0] * NUM_ITEMS)
    source = Source("books", listing, stage, 100, seed=1)
    cache = ItemCache(slots * NBYTES, retry_failed_s=60.0, clock=lambda: 0.0)
    _decode(cache, source, ids)
    return cache, source


def _decode(cache: ItemCache, source: Source, ids: range) -> None:
    pool = _Pool()
    for item_id in ids:
        cache.want(source, item_id, item_id, consumed=False, due_s=float(item_id))
    cache.dispatch(pool, 1 << 20, lambda source: 0)
    for key in pool.tasks:
        cache.file_result(key, True, None, 0.0, lambda item: 0, shape=tuple([1, 1, NBYTES]),
                          dtype="".join(["uint", "8"]), nbytes=NBYTES, checksum=key)
        cache.release(key)
    cache.check_invariants()


def test_add_refcount_changes_the_cached_items_of_the_ids_only() -> None:
    cache, source = _cached(range(0, 30))
    keys = [source.key_base + i for i in range(30)]
    cache.add_refcount(source, BitMap(range(10, 40)), 2)  # 30-39 are not cached: nothing to change
    assert [cache.policy.refcount(key) for key in keys] == [0] * 10 + [2] * 20
    cache.add_refcount(source, BitMap(range(20, 40)), -1)
    assert [cache.policy.refcount(key) for key in keys] == [0] * 10 + [2] * 10 + [1] * 10
    assert cache.policy.victim() == keys[0]
    cache.add_refcount(source, BitMap(), 1)
    cache.add_refcount(source, BitMap(range(0, 10)), 1)
    assert cache.policy.victim() == keys[0]  # all at 1 now but 10-19: the oldest of the lowest
    cache.check_invariants()


def test_an_epoch_start_is_not_a_call_per_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each job's new epoch added 1 to every cached item of its dataset one Python call at a
    time (67% of the main process's GIL in a warm 4-job window at 128k items, 1.1-1.85 s of
    waiting at every epoch boundary): now one bulk change, whatever the number of items."""
    cache, source = _cached(range(30))
    calls: list[int] = []
    bulk = getattr(cache.policy, "add_refcounts", None)

    def counted(keys: object, delta: int) -> None:
        calls.append(delta)
        bulk(keys, delta)  # type: ignore[misc]

    def refused(*args: object) -> None:
        raise AssertionError("a refcount changed one item at a time")

    monkeypatch.setattr(cache.policy, "add_refcounts", counted, raising=False)
    monkeypatch.setattr(cache.policy, "add_refcount", refused)
    monkeypatch.setattr(cache.policy, "set_refcount", refused)
    cache.add_refcount(source, BitMap(range(NUM_ITEMS)), 1)
    cache.add_refcount(source, BitMap(range(NUM_ITEMS)), -1)
    assert calls == [1, -1]


def test_deliveries_count_reuse_and_sharing_per_copy() -> None:
    cache, source = _cached(range(4), slots=4)
    key = source.key_base
    assert cache.deliver("a", key) == (False, False)  # its first delivery
    assert cache.deliver("a", key) == (True, False)  # the same copy again: reused
    assert cache.deliver("b", key) == (False, True)  # another job's decode: shared
    assert cache.deliver("b", key + 1) == (False, False)
    _decode(cache, source, range(4, 8))  # a full cache: 0-3 are evicted, 4-7 take their place
    assert key not in cache.items
    _decode(cache, source, range(0, 1))
    assert cache.deliver("b", key) == (False, False)  # a new decode is a new copy
    assert cache.deliver("a", key) == (False, True)


def test_what_a_job_received_goes_with_the_job() -> None:
    """Before, every `Item` kept the id of every job it went to, forever: memory grew with the
    number of jobs that ever ran."""
    cache, source = _cached(range(10))
    for job in range(50):
        for item_id in range(10):
            cache.deliver(f"job-{job}", source.key_base + item_id)
        cache.forget_job(f"job-{job}")
    assert not cache.recipients._served_to
    assert not any(hasattr(item, "served") or hasattr(item, "__dict__") for item in cache.items.values())
    assert cache.deliver("later", source.key_base) == (False, True)


def test_cached_items_share_their_form_and_due_time() -> None:
    cache, source = _cached(range(3))
    first, second = (cache.items[source.key_base + i] for i in range(2))
    assert first.shape == (1, 1, NBYTES) and first.dtype == "uint8" and first.nbytes == NBYTES
    assert first.form is second.form
    assert first.due_s is NEVER_DUE and second.due_s is NEVER_DUE
    assert first.key is next(key for key in cache.items if key == first.key)  # the dict's own int


def test_an_items_waiters_exist_only_while_someone_waits() -> None:
    """Who waits for an item is an entry of the cache's `waiters` from the first waiter until it
    settles, or until it is dropped unwanted: not a slot of every item (NOTE [ An item's footprint ])."""
    cache = ItemCache(4 * NBYTES, retry_failed_s=60.0, clock=lambda: 0.0)
    listing = SimpleNamespace(paths=[f"{i}.jpg" for i in range(4)], labels=[0] * 4)
    source = Source("s", listing, SimpleNamespace(name="fixed", spec=ItemSpec.fixed((1, 1, NBYTES), "uint8")), 7, seed=1)
    first = cache.want(source, 0, 1, consumed=False)
    second = cache.want(source, 1, 2, consumed=False)
    job, other = object(), object()
    cache.add_waiter(first, job)
    cache.add_waiter(first, other)
    cache.add_waiter(second, job)
    assert cache.waiters == {7: [job, other], 8: [job]}
    assert cache.take_waiters(7) == [job, other] and cache.take_waiters(7) == []
    cache.release(8)  # every job that wanted it left: dropped at the next dispatch, its waiters with it
    cache.dispatch(_Pool(), 1 << 20, lambda source: 0)
    assert 8 not in cache.items and cache.waiters == {}
    assert sys.getsizeof(first) <= 80  # six slots with the object's and the GC's headers


class _NoWalk(dict):  # type: ignore[type-arg]
    """The cache's items, refusing to be walked."""

    def values(self):  # type: ignore[no-untyped-def]
        raise AssertionError("status walked every item")

    def items(self):  # type: ignore[no-untyped-def]
        raise AssertionError("status walked every item")


def test_status_figures_are_kept_not_counted() -> None:
    """Status asks for these every 2 s (the autoscaler): they were sums over every item, 0.58 s
    at 128k cached items under the registry's lock."""
    cache, source = _cached(range(10))
    pool = _Pool()
    for item_id in (10, 11, 12):
        cache.want(source, item_id, item_id, consumed=False)
    cache.dispatch(pool, 1, lambda source: 0)  # 10 decodes, 11 and 12 wait
    cache.want(source, 3, 0, consumed=False)  # a cached item pinned twice
    cache.want(source, 3, 0, consumed=False)
    cache.check_invariants()
    walked, cache.items = cache.items, _NoWalk(cache.items)
    figures = (cache.items_bytes(), cache.decodes_in_flight(), cache.pinned_items(), cache.pins())
    assert figures == (10 * NBYTES, 3, 4, 5)
    cache.items = walked
    cache.file_result(pool.tasks.pop(), False, "unreadable", 0.0, lambda item: 0)
    cache.release(source.key_base + 3)
    cache.check_invariants()
    assert (cache.decodes_in_flight(), cache.pinned_items(), cache.pins()) == (2, 4, 4)


@pytest.mark.parametrize("seed", range(6))
def test_a_replys_deliveries_in_bulk_count_and_unplan_as_one_by_one(seed: int) -> None:
    """`deliver_ready` (a whole reply, in bitmap and numpy operations) against `deliver` and
    `unplan` per key: the same (reused, shared) counts, planned reads and refcounts, for
    replies with a key twice (padding copies) too, over several jobs."""
    import random

    rng = random.Random(seed)
    bulk, source = _cached(range(30))
    single, _ = _cached(range(30))
    for _ in range(40):
        job = f"job-{rng.randrange(3)}"
        keys = [source.key_base + rng.randrange(30) for _ in range(rng.randrange(1, 9))]
        if rng.random() < 0.7:
            keys = list(dict.fromkeys(keys))  # mostly distinct, as replies are
        for cache in (bulk, single):
            for key in keys:  # queued: planned, with a reference each (a padding copy's)
                cache.plan(key)
        want = [0, 0]
        for key in keys:
            reused, shared = single.deliver(job, key)
            want[0] += reused
            want[1] += shared
            single.unplan(key)
        assert list(bulk.deliver_ready(job, keys)) == want
        assert bulk.planned == single.planned
        assert {k: bulk.policy.refcount(k) for k in bulk.items} == {k: single.policy.refcount(k) for k in single.items}
    bulk.check_invariants()
