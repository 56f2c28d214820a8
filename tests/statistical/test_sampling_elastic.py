"""An elastic resume's rest is dealt in uniformly random orders (issue 40).

A checkpoint of 2 ranks that had consumed a fixed set C of a 30-item job resumes on 3 ranks
(NOTE [ An elastic resume ] in server/registry/resumes.py): the rest R (18 items) is dealt by the
real registry and scheduler (fake pool and clock, `tests.support.registry_driver`), 6 items to
each new rank. Under the null (each rank's share a uniformly random third of R, each in a
uniformly random order, as DistributedSampler would deal a fresh shuffle of R), the ranks'
orders put one after the other are a uniformly random permutation of R: that is what
`permutation_chi2` tests, over independent resumes (each trial a fresh registry and job seed),
binned to the sample size (18 x 18 cells of expected count TRIALS / 18 >= 5). Each rank's own
order is a third of that table (rows 0-5, 6-11, 12-17), also tested, Bonferroni over the 4
tests at a family-wise false-failure rate of 1e-3.

The power check runs the same trials with the resumed epoch's random stream slightly biased
(10% of its numbers halved) and must fail.
"""

from __future__ import annotations

import random
import types
from typing import Any

import numpy as np
import pytest
from pyroaring import BitMap

from joader.sampling.checks import MIN_EXPECTED_COUNT, permutation_chi2, position_table
from joader.server.books.records import RestShare
from joader.server.scheduling import scheduler
from tests.support.registry_driver import attach, make_registry, nxt, pump

pytestmark = pytest.mark.timeout(120)

SEED = 40
TRIALS = 1000
DATASET = BitMap(range(30))
CONSUMED = BitMap(random.Random(SEED).sample(range(30), 12))  # what the 2 old ranks had consumed
REST = DATASET - CONSUMED
NEW_RANKS = 3
SHARE = len(REST) // NEW_RANKS
ALPHA = 1e-3 / (1 + NEW_RANKS)


def _resumed_orders(trial: int) -> list[list[int]]:
    """Each new rank's order of its share of the rest, in one resume."""
    registry, pool, _ = make_registry(num_slots=40)
    job = None
    for rank in range(NEW_RANKS):
        job = attach(registry, "demo", DATASET, "elastic", SHARE, rank=rank, world_size=NEW_RANKS,
                     seed=SEED * 100_000 + trial)
    assert job is not None
    report: dict[str, Any] = {"resume_epoch": 2, "resume_consumed": BitMap(CONSUMED),
                              "resume_rest": RestShare(SHARE, len(CONSUMED))}
    got: list[list[int]] = [[] for _ in range(NEW_RANKS)]
    acks: list[list[int]] = [[] for _ in range(NEW_RANKS)]
    done = [False] * NEW_RANKS
    for _ in range(500):
        pump(registry, pool)
        for rank in range(NEW_RANKS):
            if not done[rank]:
                reply = nxt(registry, job.job_id, 10 + rank, SHARE, acks[rank], rank=rank, pid=100 + rank, **report)
                acks[rank], done[rank] = reply.item_ids, reply.end_of_epoch
                got[rank] += reply.item_ids
        if all(done):
            assert [len(order) for order in got] == [SHARE] * NEW_RANKS
            return got
    raise AssertionError(f"the resumed epoch did not end: {[len(order) for order in got]}")


def _tables() -> tuple[np.ndarray, list[np.ndarray]]:
    """The position-by-item table of the ranks' orders put one after the other, and each rank's rows."""
    permutations = [[item for order in _resumed_orders(trial) for item in order] for trial in range(TRIALS)]
    bins = len(REST)
    assert TRIALS / bins >= MIN_EXPECTED_COUNT
    table = position_table(permutations, REST, bins)
    return table, [table[rank * SHARE:(rank + 1) * SHARE] for rank in range(NEW_RANKS)]


def _p_values() -> list[float]:
    table, per_rank = _tables()
    whole = permutation_chi2(table, len(REST)).p_value
    ranks = []
    for rows in per_rank:  # a rank's rows: each position holds every item of R with probability 1/|R|
        expected = TRIALS / len(REST)
        pearson = float(((rows - expected) ** 2 / expected).sum())
        ranks.append(permutation_chi2_rows(pearson, rows.shape))
    return [whole, *ranks]


def permutation_chi2_rows(pearson: float, shape: tuple[int, ...]) -> float:
    """P-value of a rank's rows: each row (a position) is a multinomial over the |R| items
    (df |R| - 1 per row), rows of one permutation dependent only through the items they
    exclude, which the (|R| - 1) / |R| factor of `permutation_chi2` accounts for."""
    from joader.sampling.checks import chi2_sf

    rows, items = shape
    return chi2_sf(pearson * (items - 1) / items, rows * (items - 1))


def test_each_new_ranks_order_of_the_rest_is_uniform() -> None:
    p_values = _p_values()
    print(f"elastic resume 2 -> 3 ranks, {TRIALS} resumes: p-values (all ranks, rank 0, 1, 2) "
          f"{[f'{p:.3g}' for p in p_values]}, alpha {ALPHA:.2g} each")
    assert min(p_values) > ALPHA, f"an elastic resume's order is not uniform: p-values {p_values}"


class _Biased(random.Random):
    """A stream whose numbers are halved 10% of the time: slightly biased towards 0."""

    def random(self) -> float:
        u = super().random()
        return u / 2 if super().random() < 0.10 else u


def test_power_a_slight_bias_of_the_resumed_stream_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    biased = types.SimpleNamespace(Random=_Biased)
    monkeypatch.setattr(scheduler, "random", biased)
    p_values = _p_values()
    print(f"biased resumed stream: p-values {[f'{p:.3g}' for p in p_values]}")
    assert min(p_values) < ALPHA, f"the test missed a 10% bias: p-values {p_values}"
