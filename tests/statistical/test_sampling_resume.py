"""A resumed epoch's order still passes the uniformity test.

A job resumed with `add_job(..., remaining=R)` or `reset_epoch(job, R)` must receive R in a
uniformly random order, given everything before, whatever the other jobs do. For a fixed R that
means: over independent resumed epochs, the table C[position, item of R] is a sum of uniform
random permutation matrices, the null hypothesis of `permutation_chi2` (see
joader.sampling.checks and test_sampling_uniformity.py). Three ways to resume, each many times
(seeded), next to overlapping jobs that sit out at random, and so does the resumed job:

- "add_job": a sampler whose other jobs run on; the job is added with the fixed R (its dataset
  minus a fixed set of items it had received) and a fresh rng of its own, runs until R is
  exhausted, and is removed; the others go on for a random while before the next trial.
- "checkpoint": the real flow. In sampler 1 the job (whole dataset) runs alongside the others
  until it has received a fixed number of items; its state, remaining(job), is taken and it is
  removed; in sampler 2, with other jobs mid-epoch, it is re-added with that R and a fresh rng.
  R differs from trial to trial, so items are replaced by their rank within R: a uniform order
  of R is a uniform permutation of the ranks 0..|R|-1, whatever R is.
- "reset_epoch": in one long run, the job abandons its epoch at a random point and resets it to
  the fixed R.

Each resumed order is uniform given everything before it (earlier trials included), so the
orders of a table are independent uniform permutations under the null, as the test requires.

Thresholds: bins follow the sample size (expected count >= 5 per cell, at most |R| bins: here
20 x 20 cells of expected count TRIALS / 20); the family is 3 scenarios x 2 samplers, Bonferroni
at a family-wise false-failure rate of 1e-3. The power test runs the same "add_job" scenario,
same trials, same alpha, with every random stream slightly biased (10% of the numbers halved) and
must fail it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from pyroaring import BitMap
from scipy import stats

from joader.sampling import DependentSampler, IndependentSampler, Sampler
from joader.sampling.checks import MIN_EXPECTED_COUNT, permutation_chi2, position_table

pytestmark = pytest.mark.timeout(60)

SEED = 8
TRIALS = 1500
SCENARIOS = ["add_job", "checkpoint", "reset_epoch"]
SAMPLERS: dict[str, type[DependentSampler] | type[IndependentSampler]] = {
    "dependent": DependentSampler,
    "independent": IndependentSampler,
}
FAMILY_ALPHA = 1e-3
ALPHA = FAMILY_ALPHA / (len(SCENARIOS) * len(SAMPLERS))

ID_SPACE = 48
_setup = random.Random(SEED)
DATASET = BitMap(_setup.sample(range(ID_SPACE), 30))  # the resumed job's dataset
CONSUMED = BitMap(_setup.sample(sorted(DATASET), 10))  # what it had received at the checkpoint
RESUMED = DATASET - CONSUMED  # the fixed R of the "add_job" and "reset_epoch" scenarios
# the other jobs: an identical dataset, a subset of R (often first in chain order, so its stream
# drives the rounds), a partly overlapping one, and a wide one
OTHERS = {
    "twin": BitMap(DATASET),
    "inside": BitMap(_setup.sample(sorted(RESUMED), 12)),
    "partial": BitMap(_setup.sample(sorted(DATASET), 15) + _setup.sample(range(ID_SPACE), 10)),
    "wide": BitMap(_setup.sample(range(ID_SPACE), 40)),
}
RATES = {"twin": 0.9, "inside": 0.6, "partial": 0.75, "wide": 0.5, "job": 0.8}

RngFactory = Callable[[int], random.Random]


def with_others(cls: type[Sampler], seed: int, make_rng: RngFactory) -> Sampler:
    """A sampler with the other jobs; "twin" has a stream of its own, the rest the sampler's."""
    sampler = cls(rng=make_rng(seed))  # type: ignore[call-arg]
    for job_id, dataset in OTHERS.items():
        sampler.add_job(job_id, dataset, rng=make_rng(seed + 7) if job_id == "twin" else None)
    return sampler


def run_rounds(sampler: Sampler, driver: random.Random, count: int) -> None:
    """`count` rounds of the jobs registered, each sitting out at its own rate."""
    for _ in range(count):
        step(sampler, driver)


def step(sampler: Sampler, driver: random.Random) -> dict[str, int]:
    participants = [j for j in sampler.jobs() if driver.random() < RATES[j]]
    driver.shuffle(participants)
    return sampler.sample(participants)


def finish_epoch(sampler: Sampler, driver: random.Random, size: int) -> list[int]:
    """Rounds until "job" has received `size` items; its items in order."""
    order: list[int] = []
    while len(order) < size:
        picks = step(sampler, driver)
        if "job" in picks:
            order.append(picks["job"])
    return order


def resumed_orders(scenario: str, cls: type[Sampler], make_rng: RngFactory = random.Random,
                   trials: int = TRIALS) -> tuple[list[list[int]], int]:
    """The resumed epochs' orders (items of RESUMED, or ranks within R for "checkpoint")."""
    driver = random.Random(f"{SEED}-{scenario}-{cls.__name__}")
    sampler = with_others(cls, SEED, make_rng)
    orders = []
    if scenario == "reset_epoch":
        sampler.add_job("job", DATASET, rng=make_rng(SEED + 1))
    before = with_others(cls, SEED + 2, make_rng) if scenario == "checkpoint" else None
    for trial in range(trials):
        fresh_rng = make_rng(SEED * 1_000_003 + trial * len(SCENARIOS) + SCENARIOS.index(scenario))
        if scenario == "add_job":
            sampler.add_job("job", DATASET, remaining=RESUMED, rng=fresh_rng)
            order = finish_epoch(sampler, driver, len(RESUMED))
            sampler.remove_job("job")
            run_rounds(sampler, driver, driver.randrange(30))
        elif scenario == "checkpoint":
            assert before is not None
            run_rounds(before, driver, driver.randrange(30))
            before.add_job("job", DATASET)
            finish_epoch(before, driver, len(CONSUMED))
            remaining = before.remaining("job")  # the checkpointed state
            before.remove_job("job")
            run_rounds(sampler, driver, driver.randrange(30))
            sampler.add_job("job", DATASET, remaining=remaining, rng=fresh_rng)
            items = finish_epoch(sampler, driver, len(remaining))
            sampler.remove_job("job")
            assert sorted(items) == list(remaining)
            order = [remaining.rank(x) - 1 for x in items]  # rank within R: 0..|R|-1
        else:
            run_rounds(sampler, driver, driver.randrange(40))  # the job mid-epoch, at random
            sampler.reset_epoch("job", RESUMED)
            order = finish_epoch(sampler, driver, len(RESUMED))
        orders.append(order)
    size = len(DATASET) - len(CONSUMED)
    items = list(RESUMED) if scenario != "checkpoint" else list(range(size))
    for order in orders:
        assert sorted(order) == items  # exactly once, and exactly R
    return orders, size


def uniformity_p(orders: list[list[int]], size: int) -> float:
    items = sorted(orders[0])
    table = position_table(orders, items)
    result = permutation_chi2(table, size)
    bins = table.shape[0]
    assert result.num_epochs == len(orders) and result.df == (bins - 1) ** 2 > 0, result
    assert len(orders) * size / bins**2 >= MIN_EXPECTED_COUNT  # every expected count >= 5
    p_value = float(stats.chi2.sf(result.statistic, result.df))
    assert p_value == pytest.approx(result.p_value, rel=1e-6, abs=1e-12)
    return p_value


@pytest.mark.parametrize("sampler_name", list(SAMPLERS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_resumed_epoch_order_is_uniform(scenario: str, sampler_name: str) -> None:
    orders, size = resumed_orders(scenario, SAMPLERS[sampler_name])
    assert size == 20
    assert uniformity_p(orders, size) > ALPHA


class SlightlyBiasedRandom(random.Random):
    """A stream whose numbers are halved 10% of the time: slightly biased towards 0."""

    def random(self) -> float:
        u = super().random()
        return u / 2 if super().random() < 0.10 else u


def test_power_a_slight_bias_is_caught() -> None:
    """DSA fed 10%-biased streams (the resumed job's, the other jobs', the sampler's), in the
    "add_job" scenario with the same trials and alpha: rejected (p far below alpha), so a pass
    above is evidence, not a formality."""
    orders, size = resumed_orders("add_job", DependentSampler, SlightlyBiasedRandom)
    assert uniformity_p(orders, size) < ALPHA
