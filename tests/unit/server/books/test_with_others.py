"""Per job, its copies another job received too, whichever came first (`ItemCache.with_others`,
status's `items_with_others`, `joader top`'s SHARED): issue 38's job that paid for the decodes
of four jobs read "SHARED 17%", since only the copies another job had received first counted."""

from __future__ import annotations

import random

import pytest

from joader.server.books.item_cache import ItemCache
from tests.unit.server.books.test_item_books import _cached, _decode

pytestmark = pytest.mark.timeout(60)


def _deliver(cache: ItemCache, job: str, keys: list[int]) -> None:
    for key in keys:  # queued first: a planned read each
        cache.plan(key)
    cache.deliver_ready(job, keys)


def test_the_job_that_paid_for_the_decodes_counts_them_once_another_job_receives_them() -> None:
    cache, source = _cached(range(10))
    keys = [source.key_base + i for i in range(10)]
    _deliver(cache, "leader", keys)
    assert cache.with_others.get("leader", 0) == 0  # nobody else has them yet
    for job in ("b", "c", "d"):
        _deliver(cache, job, keys[:8])
    assert cache.with_others == {"leader": 8, "b": 8, "c": 8, "d": 8}
    _deliver(cache, "leader", keys)  # a later epoch: reused, counted once
    assert cache.with_others["leader"] == 8
    cache.forget_job("b")
    assert "b" not in cache.with_others


def test_a_new_copy_counts_again_after_an_eviction() -> None:
    cache, source = _cached(range(4), slots=4)
    key = source.key_base
    cache.deliver("a", key)
    cache.deliver("b", key)
    _decode(cache, source, range(4, 8))  # 0-3 evicted
    _decode(cache, source, range(0, 1))
    cache.deliver("b", key)
    assert cache.with_others == {"a": 1, "b": 1}
    cache.deliver("a", key)
    assert cache.with_others == {"a": 2, "b": 2}


@pytest.mark.parametrize("seed", range(6))
def test_bulk_and_single_deliveries_count_what_a_brute_force_count_does(seed: int) -> None:
    rng = random.Random(seed)
    bulk, source = _cached(range(30))
    single, _ = _cached(range(30))
    got: dict[str, set[int]] = {}
    for _ in range(60):
        job = f"job-{rng.randrange(4)}"
        keys = [source.key_base + rng.randrange(30) for _ in range(rng.randrange(1, 9))]
        for cache in (bulk, single):
            for key in keys:
                cache.plan(key)
        bulk.deliver_ready(job, keys)
        for key in keys:
            single.deliver(job, key)
            single.unplan(key)
        got.setdefault(job, set()).update(keys)
        brute = {j: sum(1 for k in mine if any(k in theirs for o, theirs in got.items() if o != j))
                 for j, mine in got.items()}
        assert {j: n for j, n in bulk.with_others.items() if n} == {j: n for j, n in brute.items() if n}
        assert bulk.with_others == single.with_others
