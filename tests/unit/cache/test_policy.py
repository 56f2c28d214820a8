"""RefCntPolicy: eviction order, pins, errors, and a randomized check against a brute-force model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from joader.cache import policy as policy_module
from joader.cache.policy import PolicyStats, RefCntPolicy
from joader.errors import InvalidArgumentError, InvariantError

pytestmark = pytest.mark.timeout(60)

# keys are item keys (ints >= 0); named for reading
A, B, C = 0, 1, 2
OLD, YOUNG = 10, 11
FAST, SLOW_TWO, SLOW, UNNEEDED = 20, 21, 22, 23


def test_lowest_refcount_is_the_victim() -> None:
    policy = RefCntPolicy()
    policy.insert(A, 2)
    policy.insert(B, 0)
    policy.insert(C, 1)
    assert policy.victim() == B
    policy.remove(B)
    assert policy.victim() == C
    policy.add_refcount(C, 5)
    assert policy.victim() == A
    assert len(policy) == 2 and A in policy and B not in policy


def test_ties_go_to_least_recently_inserted_or_unpinned() -> None:
    policy = RefCntPolicy()
    for key in range(3):
        policy.insert(key, 0)
    assert policy.victim() == 0
    policy.pin(0)
    assert policy.victim() == 1
    policy.unpin(0)  # used just now: it survives among equals
    assert policy.victim() == 1
    policy.remove(1)
    policy.remove(2)
    assert policy.victim() == 0


def test_refcount_change_keeps_age_among_equals() -> None:
    policy = RefCntPolicy()
    policy.insert(OLD, 1)
    policy.insert(YOUNG, 0)
    policy.add_refcount(OLD, -1)  # now both at 0; OLD was inserted first
    assert policy.victim() == OLD


def test_pinned_items_are_never_victims_and_pins_nest() -> None:
    policy = RefCntPolicy()
    policy.insert(A, 0, pinned=1)
    assert policy.victim() is None
    policy.pin(A)
    policy.unpin(A)
    assert policy.is_pinned(A) and policy.victim() is None
    policy.unpin(A)
    assert not policy.is_pinned(A) and policy.victim() == A
    with pytest.raises(InvariantError, match="not pinned"):
        policy.unpin(A)


def test_errors_name_the_problem() -> None:
    policy = RefCntPolicy()
    policy.insert(1, 1)
    with pytest.raises(InvariantError, match="already tracked"):
        policy.insert(1, 0)
    with pytest.raises(InvariantError, match="would drop to -1"):
        policy.add_refcount(1, -2)
    assert policy.refcount(1) == 1
    with pytest.raises(KeyError):
        policy.add_refcount(2, 1)
    with pytest.raises(KeyError):
        policy.pin(2)
    with pytest.raises(InvalidArgumentError):
        policy.insert(3, -1)
    assert RefCntPolicy().victim() is None


def test_statistics_snapshot() -> None:
    policy = RefCntPolicy()
    policy.insert(1, 0)
    policy.insert(2, 3, pinned=2)
    policy.insert(3, 0)
    assert policy.statistics() == PolicyStats(num_items=3, num_pinned=1, num_pins=2, num_unneeded=2)
    policy.remove(2)
    assert policy.statistics().num_pins == 0


def test_weighted_victim_prefers_what_only_slow_jobs_need() -> None:
    policy = RefCntPolicy()
    policy.insert(FAST, 1)  # oldest, one job needs it, a fast one: read soon
    policy.insert(SLOW_TWO, 2)  # two slow jobs need it: read late
    policy.insert(SLOW, 1)
    hazard = {FAST: 0.5, SLOW_TWO: 0.02, SLOW: 0.01}.__getitem__
    assert policy.victim() == FAST  # plain RefCnt: lowest refcount, oldest
    assert policy.victim(hazard) == SLOW
    policy.remove(SLOW)
    assert policy.victim(hazard) == SLOW_TWO  # speed outweighs the count
    policy.insert(UNNEEDED, 0)
    assert policy.victim(hazard) == UNNEEDED  # nobody needs it this epoch: always first
    policy.pin(UNNEEDED)
    policy.pin(SLOW_TWO)
    assert policy.victim(hazard) == FAST  # pinned items never go


class _Model:
    """Brute force: victim = min over unpinned keys of (refcount, last insert-or-unpin time)."""

    def __init__(self) -> None:
        self.refcount: dict[int, int] = {}
        self.pins: dict[int, int] = {}
        self.stamp: dict[int, int] = {}
        self.clock = 0

    def touch(self, key: int) -> None:
        self.clock += 1
        self.stamp[key] = self.clock

    def victim(self) -> int | None:
        free = [k for k in self.refcount if self.pins[k] == 0]
        return min(free, key=lambda k: (self.refcount[k], self.stamp[k])) if free else None

    def weighted_victim(self, hazard: dict[int, float], sample: int) -> int | None:
        """Refcount 0 first (oldest); else, of the `sample` oldest unpinned keys of each
        refcount, the lowest hazard, ties to the lower refcount and then the older."""
        free = sorted((k for k in self.refcount if self.pins[k] == 0), key=lambda k: (self.refcount[k], self.stamp[k]))
        if not free or self.refcount[free[0]] == 0:
            return free[0] if free else None
        candidates = [k for k in free if sum(1 for j in free if self.refcount[j] == self.refcount[k]
                                             and self.stamp[j] < self.stamp[k]) < sample]
        return min(candidates, key=lambda k: (hazard[k], self.refcount[k], self.stamp[k]))


def _bulk_step(policy: RefCntPolicy, model: _Model, rng: random.Random, keys: list[int]) -> None:
    """`add_refcounts` over a random subset (an epoch start, a close): all or nothing."""
    # every key at times (an epoch over all that is cached: the buckets are relabelled whole)
    subset = list(keys) if rng.random() < 0.3 else rng.sample(keys, rng.randrange(1, len(keys) + 1))
    delta = rng.choice([-1, -1, 1, 1, 2])
    if rng.random() < 0.05:  # an untracked key among them: nothing changes
        with pytest.raises(KeyError, match="not tracked"):
            policy.add_refcounts(np.array([*subset, 200 + rng.randrange(50)]), delta)
    elif any(model.refcount[key] + delta < 0 for key in subset):
        with pytest.raises(InvariantError, match="would drop to -1"):
            policy.add_refcounts(np.array(subset), delta)
    else:
        policy.add_refcounts(np.array(subset), delta)
        for key in subset:
            model.refcount[key] += delta
    assert {key: policy.refcount(key) for key in model.refcount} == model.refcount


def _unpin_many_step(policy: RefCntPolicy, model: _Model, rng: random.Random, keys: list[int]) -> None:
    """`unpin_many` (a reply's acknowledgements): each key's unpin in order, the last ones
    evictable in that order; a key twice (padding copies) or an unpinned key among them."""
    pinned = [key for key in keys if model.pins[key]]
    if not pinned:
        return
    batch = rng.sample(pinned, rng.randrange(1, len(pinned) + 1))
    if rng.random() < 0.2:
        batch.append(rng.choice(batch))  # twice: allowed while its pins last
    if rng.random() < 0.05 and len(pinned) < len(keys):  # an unpinned key: nothing changes
        batch.insert(rng.randrange(len(batch) + 1), next(key for key in keys if not model.pins[key]))
    if any(batch.count(key) > model.pins[key] for key in batch):
        if len(set(batch)) == len(batch):  # all or nothing (one by one, the ones before go)
            with pytest.raises(InvariantError):
                policy.unpin_many(batch)
        return
    policy.unpin_many(batch)
    for key in batch:
        model.pins[key] -= 1
        if model.pins[key] == 0:
            model.touch(key)


def _pin_many_step(policy: RefCntPolicy, model: _Model, rng: random.Random, keys: list[int]) -> None:
    """`pin_many` (a rank pinning its queue's head): every key pinned, a key twice as often
    as given (padding copies, an item queued for two epochs); an untracked key pins none."""
    batch = rng.sample(keys, rng.randrange(1, len(keys) + 1))
    if rng.random() < 0.3:
        batch += rng.choices(batch, k=rng.randrange(1, 4))
    if rng.random() < 0.05:
        batch.insert(rng.randrange(len(batch) + 1), 200 + rng.randrange(50))
        with pytest.raises(KeyError, match="not tracked"):
            policy.pin_many(batch)
        return
    policy.pin_many(batch)
    for key in batch:
        model.pins[key] += 1


@pytest.mark.parametrize("seed", range(5))
def test_randomized_against_brute_force(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    if seed % 2:  # stamps renumbered every few hundred ticks, not every 65k
        monkeypatch.setattr(policy_module, "_RENUMBER_SLACK", 8)
    policy, model = RefCntPolicy(), _Model()
    hazard = {key: rng.choice([0.5, 1.0, rng.random()]) for key in range(200)}  # ties too
    for _ in range(20_000):
        op = rng.random()
        keys = list(model.refcount)
        if op < 0.2 or not keys:
            key = rng.randrange(200)
            if key in model.refcount:
                continue
            refcount, pinned = rng.randrange(4), rng.choice([0, 0, 0, 1, 2])
            policy.insert(key, refcount, pinned)
            model.refcount[key], model.pins[key] = refcount, pinned
            model.touch(key)
        elif op < 0.3:
            key = rng.choice(keys)
            policy.remove(key)
            del model.refcount[key], model.pins[key], model.stamp[key]
        elif op < 0.36:
            _bulk_step(policy, model, rng, keys)
        elif op < 0.55:
            key, delta = rng.choice(keys), rng.choice([-1, 1, 2])
            if model.refcount[key] + delta < 0:
                with pytest.raises(InvariantError):
                    policy.add_refcount(key, delta)
            else:
                policy.add_refcount(key, delta)
                model.refcount[key] += delta
        elif op < 0.65:
            key = rng.choice(keys)
            policy.pin(key)
            model.pins[key] += 1
        elif op < 0.7:
            _pin_many_step(policy, model, rng, keys)
        elif op < 0.8:
            _unpin_many_step(policy, model, rng, keys)
        elif op < 0.85:
            key = rng.choice(keys)
            if model.pins[key] == 0:
                with pytest.raises(InvariantError):
                    policy.unpin(key)
            else:
                policy.unpin(key)
                model.pins[key] -= 1
                if model.pins[key] == 0:
                    model.touch(key)
        elif op < 0.92:
            assert policy.victim(lambda k: hazard[k], sample=2) == model.weighted_victim(hazard, 2)
        else:
            victim = model.victim()
            assert policy.victim() == victim
            if victim is not None and rng.random() < 0.5:  # evict it, as the cache would
                policy.remove(victim)
                del model.refcount[victim], model.pins[victim], model.stamp[victim]
        assert len(policy) == len(model.refcount)
    assert policy.victim() == model.victim()
    stats = policy.statistics()
    assert stats.num_pinned == sum(1 for p in model.pins.values() if p)
    assert stats.num_pins == sum(model.pins.values())
    assert stats.num_unneeded == sum(1 for k, p in model.pins.items() if not p and model.refcount[k] == 0)


def test_bulk_change_keeps_age_among_equals() -> None:
    """An epoch start adds 1 to many items at once; each keeps its age in its new bucket."""
    policy = RefCntPolicy()
    for key in range(10):
        policy.insert(key, 0)
    assert policy.victim() == 0
    policy.add_refcounts(np.arange(0, 10, 2), 1)  # the evens are needed again
    assert policy.victim() == 1 and policy.statistics().num_unneeded == 5
    policy.pin(1)
    policy.unpin(1)  # used just now: the youngest of the unneeded
    assert policy.victim() == 3
    policy.add_refcounts(np.arange(0, 10, 2), -1)  # a job that needed them ended
    assert policy.victim() == 0
    policy.add_refcounts(np.array([0, 4]), 1)
    policy.set_refcount(2, 1)  # one at a time, behind the bucket's oldest: same order
    hazard = {0: 0.5, 2: 0.1, 4: 0.3}.get
    assert policy.victim() == 3
    for key in (1, 3, 5, 6, 7, 8, 9):
        policy.remove(key)
    assert policy.victim() == 0 and policy.victim(lambda key: hazard(key, 1.0)) == 2


def test_bulk_change_is_all_or_nothing() -> None:
    policy = RefCntPolicy()
    policy.insert(3, 1)
    policy.insert(5, 0, pinned=1)
    with pytest.raises(InvariantError, match="refcount of 5 would drop to -1"):
        policy.add_refcounts(np.array([3, 5]), -1)
    with pytest.raises(KeyError, match="item 4 is not tracked"):
        policy.add_refcounts(np.array([3, 4]), 1)
    assert (policy.refcount(3), policy.refcount(5)) == (1, 0)
    policy.insert(1 << 20, 0)  # the arrays grow after a failed bulk change (no view left behind)
    policy.add_refcounts(np.array([3, 5]), 2)
    assert (policy.refcount(3), policy.refcount(5)) == (3, 2)
    policy.unpin(5)
    assert policy.victim() == 1 << 20
    policy.add_refcounts(np.array([], dtype=np.int64), 1)
    with pytest.raises(InvalidArgumentError, match="keys are ints in 0.."):
        policy.insert(-1, 0)


def test_stamps_are_renumbered_in_order() -> None:
    """Every insert and last unpin takes a new stamp: however long the cache runs, the stamps
    stay O(items) (renumbered, in order) and the order holds across a renumbering."""
    policy = RefCntPolicy()
    for key in range(50):
        policy.insert(key, key % 2)
    policy.pin(7)
    for round_ in range(200_000):
        key = round_ % 50
        if key != 7:
            policy.pin(key)
            policy.unpin(key)
        if round_ == 100_000:
            policy.add_refcounts(np.arange(0, 50, 2), 1)  # evens at 1, odds at 1: all equal
    assert len(policy._key_of) <= 2 * 50 + (1 << 16)
    assert policy.victim() == 0  # the oldest unpin among equals (round 199,950)
    policy.unpin(7)
    assert [policy.victim(lambda key: 1.0, sample=3)] == [0]
    for key in range(50):
        if key != 7:
            policy.remove(key)
    assert policy.victim() == 7 and policy.statistics().num_pins == 0
