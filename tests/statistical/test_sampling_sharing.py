"""Guarantee 3, maximal sharing: two jobs receive the same item as often as Theorem 1 allows.

Theorem 1 (Xie et al.): for two jobs with remaining sets R1, R2, no pair of marginally uniform
draws gives the same item with probability above |R1 ∩ R2| / max(|R1|, |R2|), and DSA attains
it. The tests check three faces of that:

- aligned epochs (equal sizes, same start, both in every round): the share of rounds equals the
  dataset bound |D1 ∩ D2| / max(|D1|, |D2|), from disjoint to identical datasets; a Wilson
  interval at the level below must contain the bound. (It is in fact exact: every shared item
  is consumed by a shared round, so each epoch has exactly |D1 ∩ D2| shared rounds; asserted.)
- every round, whatever the epochs: with unequal sizes, staggered starts or sitting out, the
  epochs drift apart and the long-run rate falls below the dataset bound, but each round still
  shares with probability p_t = |R1 ∩ R2| / max(|R1|, |R2|) of its current sets. The count of
  shared rounds minus sum p_t is a martingale with variance sum p_t (1 - p_t), so its z-score
  is tested against the normal quantile.
- DSA against the independent baseline, whose per-round probability is |R1 ∩ R2| / (|R1| |R2|).

Threshold: the family has 7 x 3 + 3 x 3 + 3 = 33 tests; each is two-sided at
alpha = 1e-4 / 33 (Bonferroni), a family-wise false-failure rate of 1e-4.
"""

from __future__ import annotations

import random
from statistics import NormalDist

import pytest
from pyroaring import AbstractBitMap, BitMap

from joader.sampling import DependentSampler, IndependentSampler, Sampler
from joader.sampling.checks import martingale_z, wilson_interval

pytestmark = pytest.mark.timeout(60)

SEEDS = [0, 1, 2]
OVERLAPS = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
ALPHA = 1e-4 / 33
Z_LIMIT = NormalDist().inv_cdf(1 - ALPHA / 2)


def current_sets(sampler: Sampler, job_id: str) -> AbstractBitMap:
    """The set this round draws from: R, or D when R is empty (the round refills it)."""
    return sampler.remaining(job_id) or sampler.dataset(job_id)


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("seed", SEEDS)
def test_aligned_epochs_share_at_the_theorem1_bound(seed: int, overlap: float) -> None:
    size, num_epochs = 200, 10
    shared = round(overlap * size)
    sampler = DependentSampler(seed=seed)
    sampler.add_job("a", BitMap(range(size)))
    sampler.add_job("b", BitMap(range(size - shared, 2 * size - shared)))
    bound = shared / size
    per_epoch = []
    for _ in range(num_epochs):
        picks = [sampler.sample(["a", "b"]) for _ in range(size)]
        per_epoch.append(sum(p["a"] == p["b"] for p in picks))
    shares, rounds = sum(per_epoch), size * num_epochs
    low, high = wilson_interval(shares, rounds, ALPHA)
    assert low <= bound <= high, (shares / rounds, bound)
    assert per_epoch == [shared] * num_epochs


def drifting_pair(case: str, seed: int) -> tuple[Sampler, random.Random, dict[str, float]]:
    """Two overlapping jobs whose epochs do not stay aligned."""
    rng = random.Random(seed)
    sampler = DependentSampler(seed=seed)
    rates = {"a": 1.0, "b": 1.0}
    if case == "unequal":  # the example: 600 and 1000 items, 300 shared
        sampler.add_job("a", BitMap(range(600)))
        sampler.add_job("b", BitMap(range(300, 1300)))
    elif case == "staggered":  # equal sizes, b starts when a is a third through
        sampler.add_job("a", BitMap(range(500)))
        for _ in range(170):
            sampler.sample(["a"])
        sampler.add_job("b", BitMap(range(200, 700)))
    else:  # "sitting_out": random subsets, both skipping rounds at their own rates
        sampler.add_job("a", BitMap(rng.sample(range(1000), 400)))
        sampler.add_job("b", BitMap(rng.sample(range(1000), 700)))
        rates = {"a": 0.9, "b": 0.6}
    return sampler, rng, rates


@pytest.mark.parametrize("case", ["unequal", "staggered", "sitting_out"])
@pytest.mark.parametrize("seed", SEEDS)
def test_every_round_shares_at_the_bound_of_its_current_sets(seed: int, case: str) -> None:
    sampler, rng, rates = drifting_pair(case, seed)
    shares, p_sum, var_sum, both = 0, 0.0, 0.0, 0
    for _ in range(6000):
        participants = [j for j in ("a", "b") if rng.random() < rates[j]]
        if len(participants) == 2:
            ra, rb = current_sets(sampler, "a"), current_sets(sampler, "b")
            p = ra.intersection_cardinality(rb) / max(len(ra), len(rb))
            p_sum += p
            var_sum += p * (1 - p)
            both += 1
        picks = sampler.sample(participants)
        if len(picks) == 2:
            shares += picks["a"] == picks["b"]
    z = martingale_z(shares, p_sum, var_sum)
    assert abs(z) < Z_LIMIT, (shares, p_sum, z)
    # and Theorem 1 remains an upper bound on the long-run rate
    da, db = sampler.dataset("a"), sampler.dataset("b")
    bound = da.intersection_cardinality(db) / max(len(da), len(db))
    assert wilson_interval(shares, both, ALPHA)[0] <= bound


@pytest.mark.parametrize("seed", SEEDS)
def test_identical_datasets_share_every_round(seed: int) -> None:
    sampler = DependentSampler(seed=seed)
    for job_id in ("a", "b", "c", "d"):
        sampler.add_job(job_id, BitMap(range(100, 400, 3)))
    for _ in range(1000):  # ten epochs
        picks = sampler.sample(["d", "a", "c", "b"])
        assert len(set(picks.values())) == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_dsa_shares_far_more_than_independent_sampling(seed: int) -> None:
    """Half-overlapping datasets: DSA shares half the rounds; independent shuffles share only
    by chance, at their own per-round probability |R1 ∩ R2| / (|R1| |R2|) (checked with the
    same martingale z-test, so the baseline is measured, not assumed)."""
    counts = {}
    for sampler in (DependentSampler(seed=seed), IndependentSampler(seed=seed)):
        sampler.add_job("a", BitMap(range(200)))
        sampler.add_job("b", BitMap(range(100, 300)))
        shares, p_sum, var_sum = 0, 0.0, 0.0
        for _ in range(2000):
            ra, rb = current_sets(sampler, "a"), current_sets(sampler, "b")
            p = ra.intersection_cardinality(rb) / (len(ra) * len(rb))
            p_sum, var_sum = p_sum + p, var_sum + p * (1 - p)
            picks = sampler.sample(["a", "b"])
            shares += picks["a"] == picks["b"]
        counts[type(sampler).__name__] = shares
        if isinstance(sampler, IndependentSampler):
            assert abs(martingale_z(shares, p_sum, var_sum)) < Z_LIMIT
    assert counts["DependentSampler"] == 1000  # 100 shared items x 10 aligned epochs
    assert counts["DependentSampler"] > 20 * (counts["IndependentSampler"] + 1)
