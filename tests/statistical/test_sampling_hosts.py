"""A job across hosts (issue 20): each rank's order within its host's part is uniform.

A job of 3 ranks on 2 hosts (2 + 1) over 30 items; host 0 serves it its part (20 items, from
`host_part`) beside a second job of the same layout over the first 27 items (whose host-0 part
nearly coincides: they share). Host 0's joaderd runs DSA over both; each epoch of the first job
is dealt round-robin to its 2 local ranks (what `EpochShare` does for a fresh epoch): rank 0
gets host positions 0, 2, 4, ..., rank 1 positions 1, 3, 5, ....

Per trial (independent samplers, seeds 0..T-1), the first job's second epoch on host 0 (after a
first epoch that shared with the other job, so the state is not a fresh start) is recorded as
"rank 0's order, then rank 1's": a fixed re-indexing of the host's order, so it is a uniform
permutation of the part iff each rank's order is uniform and the two ranks' shares are a
uniform split. The item x position table over the trials is tested with `permutation_chi2`.

Thresholds: 2 tests (the order, and the power check), family-wise 1e-3, Bonferroni: alpha
5e-4 each. Power: the same test catches a host order that takes its part in id order in one
trial of ten.
"""

from __future__ import annotations

import random

import pytest
from pyroaring import BitMap

from joader.sampling import DependentSampler
from joader.sampling.checks import permutation_chi2, position_table
from joader.sampling.hosts import HostLayout, host_part, source_salt

pytestmark = pytest.mark.timeout(120)

ALPHA = 1e-3 / 2
TRIALS = 3000
SALT = source_salt("demo")
HOST0 = HostLayout(world_size=3, first_rank=0, local_ranks=2, local_rank=0)
PART = host_part(BitMap(range(30)), SALT, HOST0, drop_last=False)
OTHER = host_part(BitMap(range(27)), SALT, HOST0, drop_last=False)


def _ranks_order(seed: int, wrong: bool = False) -> list[int]:
    sampler = DependentSampler(rng=random.Random(seed))
    sampler.add_job("a", PART)
    sampler.add_job("b", OTHER)
    rng = random.Random(-seed - 1)
    order: list[int] = []
    while len(order) < len(PART):
        participants = ["a", "b"] if rng.random() < 0.8 else ["a"]  # b sits some rounds out
        picks = sampler.sample(participants)
        if sampler.epoch("a") == 2:
            order.append(picks["a"])
    if wrong:
        order = sorted(order)
    return order[0::2] + order[1::2]  # rank 0's items in its order, then rank 1's


def test_each_ranks_order_within_its_hosts_part_is_uniform() -> None:
    assert len(PART) == 20 and len(PART & OTHER) >= 16  # the two jobs' host-0 parts overlap
    epochs = [_ranks_order(seed) for seed in range(TRIALS)]
    assert all(sorted(e) == list(PART) for e in epochs)  # exactly once on the host
    result = permutation_chi2(position_table(epochs, PART), len(PART))
    print(f"host 0 of 2 (2 of 3 ranks), {len(PART)} items, beside an overlapping job, {TRIALS} trials: "
          f"chi2 {result.statistic:.1f} on {result.df} df, p = {result.p_value:.3g}")
    assert result.p_value > ALPHA


def test_power_a_host_order_by_id_in_one_trial_of_ten_is_caught() -> None:
    epochs = [_ranks_order(seed, wrong=seed % 10 == 0) for seed in range(TRIALS)]
    result = permutation_chi2(position_table(epochs, PART), len(PART))
    print(f"id order in 1 trial of 10: p = {result.p_value:.3g}")
    assert result.p_value < ALPHA
