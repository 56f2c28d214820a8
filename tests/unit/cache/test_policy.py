"""RefCntPolicy: eviction order, pins, errors, and a randomized check against a brute-force model."""

from __future__ import annotations

import random

import pytest

from joader.cache.policy import PolicyStats, RefCntPolicy
from joader.errors import InvalidArgumentError, InvariantError

pytestmark = pytest.mark.timeout(60)


def test_lowest_refcount_is_the_victim() -> None:
    policy = RefCntPolicy()
    policy.insert("a", 2)
    policy.insert("b", 0)
    policy.insert("c", 1)
    assert policy.victim() == "b"
    policy.remove("b")
    assert policy.victim() == "c"
    policy.add_refcount("c", 5)
    assert policy.victim() == "a"
    assert len(policy) == 2 and "a" in policy and "b" not in policy


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
    policy.insert("old", 1)
    policy.insert("young", 0)
    policy.add_refcount("old", -1)  # now both at 0; "old" was inserted first
    assert policy.victim() == "old"


def test_pinned_items_are_never_victims_and_pins_nest() -> None:
    policy = RefCntPolicy()
    policy.insert("a", 0, pinned=1)
    assert policy.victim() is None
    policy.pin("a")
    policy.unpin("a")
    assert policy.is_pinned("a") and policy.victim() is None
    policy.unpin("a")
    assert not policy.is_pinned("a") and policy.victim() == "a"
    with pytest.raises(InvariantError, match="not pinned"):
        policy.unpin("a")


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
    policy.insert("fast", 1)  # oldest, one job needs it, a fast one: read soon
    policy.insert("slow-two", 2)  # two slow jobs need it: read late
    policy.insert("slow", 1)
    hazard = {"fast": 0.5, "slow-two": 0.02, "slow": 0.01}.__getitem__
    assert policy.victim() == "fast"  # plain RefCnt: lowest refcount, oldest
    assert policy.victim(hazard) == "slow"
    policy.remove("slow")
    assert policy.victim(hazard) == "slow-two"  # speed outweighs the count
    policy.insert("unneeded", 0)
    assert policy.victim(hazard) == "unneeded"  # nobody needs it this epoch: always first
    policy.pin("unneeded")
    policy.pin("slow-two")
    assert policy.victim(hazard) == "fast"  # pinned items never go


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


@pytest.mark.parametrize("seed", range(5))
def test_randomized_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
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
        elif op < 0.55:
            key, delta = rng.choice(keys), rng.choice([-1, 1, 2])
            if model.refcount[key] + delta < 0:
                with pytest.raises(InvariantError):
                    policy.add_refcount(key, delta)
            else:
                policy.add_refcount(key, delta)
                model.refcount[key] += delta
        elif op < 0.7:
            key = rng.choice(keys)
            policy.pin(key)
            model.pins[key] += 1
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
