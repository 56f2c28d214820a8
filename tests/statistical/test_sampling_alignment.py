"""Epoch alignment (`DependentSampler(align=...)`, issue 19): a late joiner's epochs stay
marginally uniform, and consecutive epochs of one job stay independent shuffles in the default
modes; the opt-in "always" mode trades that independence for sharing, and the figures say how
much.

Marginal uniformity: independent trials, each a fresh sampler where job b joins job a (same
dataset) after T rounds, T uniform in 1..N-1 from the trial's seed; the table C[position, item]
of b's first epoch over the trials is tested with `permutation_chi2` (the trials are independent
by construction). For "always", b's third epoch, after two aligned epoch starts.

Independence: one long run (b joins half an epoch after a), `cross_epoch_z` on each job's
consecutive epochs (same-half overlap, rank correlation), two-sided.

Thresholds: family of 2 uniformity tests + 2 modes x 2 jobs x 2 statistics = 10 tests at a
family-wise false-failure rate of 1e-3, Bonferroni: alpha = 1e-4 each (|z| < 3.89). Power: the
same z catches "always" (a frozen partition) with z in the tens, and the chi-square catches a
5%-biased sampler (tests/statistical/test_sampling_uniformity.py) at these sample sizes.
"""

from __future__ import annotations

import random
from statistics import NormalDist

import pytest
from pyroaring import BitMap

from joader.sampling import DependentSampler
from joader.sampling.checks import cross_epoch_z, permutation_chi2, position_table

pytestmark = pytest.mark.timeout(120)

ALPHA = 1e-3 / 10
Z_LIMIT = NormalDist().inv_cdf(1 - ALPHA / 2)
N = 24
TRIALS = 3000


def _late_joiner_epoch(align: str, seed: int, epoch: int) -> list[int]:
    """b's `epoch`-th epoch (1-based) when it joins a after a uniform number of rounds."""
    rng = random.Random(seed)
    sampler = DependentSampler(rng=random.Random(seed + 1), align=align)
    dataset = BitMap(range(N))
    sampler.add_job("a", dataset)
    for _ in range(rng.randrange(1, N)):
        sampler.sample(["a"])
    sampler.add_job("b", dataset)
    order: list[int] = []
    while True:
        picks = sampler.sample(["a", "b"])
        if sampler.epoch("b") == epoch:
            order.append(picks["b"])
            if len(order) == N:
                return order


@pytest.mark.parametrize(("align", "epoch"), [("first", 1), ("always", 3)])
def test_a_late_joiners_aligned_epoch_is_marginally_uniform(align: str, epoch: int) -> None:
    epochs = [_late_joiner_epoch(align, seed, epoch) for seed in range(TRIALS)]
    assert all(sorted(e) == list(range(N)) for e in epochs)  # exactly once
    result = permutation_chi2(position_table(epochs, BitMap(range(N))), N)
    print(f"align={align}, epoch {epoch} of a late joiner, {TRIALS} trials: chi2 p = {result.p_value:.3g}")
    assert result.p_value > ALPHA


def _long_run(align: str, epochs: int = 60, size: int = 200) -> dict[str, list[list[int]]]:
    """a alone for half an epoch, then a and b in every round, until b has `epochs` epochs."""
    sampler = DependentSampler(seed=7, align=align)
    dataset = BitMap(range(size))
    sampler.add_job("a", dataset)
    for _ in range(size // 2):
        sampler.sample(["a"])
    sampler.add_job("b", dataset)
    streams: dict[str, dict[int, list[int]]] = {"a": {}, "b": {}}
    shared = rounds = 0
    while sampler.epoch("b") <= epochs:
        picks = sampler.sample(["a", "b"])
        for job, item in picks.items():
            streams[job].setdefault(sampler.epoch(job), []).append(item)
        shared += picks["a"] == picks["b"]
        rounds += 1
    print(f"align={align}: the two jobs shared {shared / rounds:.3f} of {rounds} rounds")
    return {job: [e for e in by_epoch.values() if len(e) == size] for job, by_epoch in streams.items()}


@pytest.mark.parametrize("align", ["off", "first"])
def test_consecutive_epochs_stay_independent_shuffles(align: str) -> None:
    for job, epochs in _long_run(align).items():
        z_same, z_rho = cross_epoch_z(epochs[1:])  # from each job's second epoch on
        print(f"align={align}, job {job}: {len(epochs) - 1} epochs, same-half z {z_same:+.2f}, rank z {z_rho:+.2f}")
        assert abs(z_same) < Z_LIMIT and abs(z_rho) < Z_LIMIT


def test_power_always_aligning_freezes_a_partition_and_is_caught() -> None:
    """The opt-in mode: every round shared, and the same half first in every epoch of the job
    that joined late (the figure docs/decisions.md quotes)."""
    runs = _long_run("always")
    z_same, z_rho = cross_epoch_z(runs["b"][1:])
    print(f"align=always, job b: same-half z {z_same:+.1f}, rank z {z_rho:+.1f}")
    assert z_same > 10 * Z_LIMIT


class SometimesWrong(DependentSampler):
    """Aligns with a fixed set (the smallest ids) instead of the other job's remaining set in
    one trial of ten: the mistake the marginal argument rules out (P must be as random as the
    other job's epoch)."""

    def __init__(self, *args: object, wrong: bool, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.wrong = wrong

    def _aligned_phase(self, job_id: str) -> BitMap | None:
        phase = super()._aligned_phase(job_id)
        if phase is None or not self.wrong:
            return phase
        return BitMap(range(len(phase)))


def test_power_a_wrongly_chosen_first_phase_is_caught() -> None:
    epochs = []
    for seed in range(TRIALS):
        rng = random.Random(seed)
        sampler = SometimesWrong(rng=random.Random(seed + 1), align="first", wrong=seed % 10 == 0)
        dataset = BitMap(range(N))
        sampler.add_job("a", dataset)
        for _ in range(rng.randrange(1, N)):
            sampler.sample(["a"])
        sampler.add_job("b", dataset)
        order = [sampler.sample(["a", "b"])["b"] for _ in range(N)]
        epochs.append(order)
    result = permutation_chi2(position_table(epochs, BitMap(range(N))), N)
    print(f"a first phase wrong in 1 trial of 10: chi2 p = {result.p_value:.3g}")
    assert result.p_value < ALPHA
