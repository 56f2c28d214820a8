"""Checks of the sampling guarantees, shared by the statistical tests and `joader verify`.

- `EpochRecorder` records what each job received, split into epochs, and checks that every
  complete epoch is a permutation of the job's dataset (exactly once), or of the remaining set
  it was resumed with (`EpochRecorder.resumed`).
- `position_table` and `permutation_chi2` test marginal uniformity: over E independent epochs of
  a job with N items, the table C[position, item] should look like a sum of E uniform random
  permutation matrices.
- `wilson_interval` and `martingale_z` judge a sharing rate.
- `cross_epoch_z` tests that one job's consecutive epochs are independent shuffles (what epoch
  alignment can break: the same half first every epoch).
- `same_position_matches`, `agreement_z` and `relative_positions` measure how two jobs' orders
  relate: how often they have the same item at the same position (high for jobs that share
  rounds; about 1/N for independent ones), and the joint table of an item's positions in both.

Why the chi-square statistic is rescaled. For one uniform random permutation matrix P (N x N),
Cov(vec P) = (1/(N-1)) (I - J/N) ⊗ (I - J/N), a projector of rank (N-1)^2 times 1/(N-1). Sum E
independent epochs and group positions into B_r bins of sizes r_a and items into B_c bins of
sizes c_b; the Pearson statistic X^2 = sum (O - e)^2 / e with e_ab = E r_a c_b / N then
converges to (N/(N-1)) * chi2((B_r - 1)(B_c - 1)) (the transformed covariance is N/(N-1) times a
Kronecker product of two projectors of ranks B_r - 1 and B_c - 1). So we test
X^2 (N-1)/N against chi2((B_r-1)(B_c-1)). The plain contingency-table test would be wrong here:
its hypergeometric null has smaller cell variances than independent permutations. Bins are
chosen so that every expected count is at least 5, the usual condition for the approximation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np
from pyroaring import AbstractBitMap

from joader.sampling.base import Sampler

__all__ = [
    "EpochRecorder",
    "UniformityResult",
    "chi2_sf",
    "agreement_z",
    "cross_epoch_z",
    "martingale_z",
    "permutation_chi2",
    "position_table",
    "relative_positions",
    "same_position_matches",
    "wilson_interval",
]

MIN_EXPECTED_COUNT = 5.0
MAX_BINS = 100


@dataclass
class EpochRecorder:
    """What each job received, epoch by epoch (epoch numbers from `Sampler.epoch`)."""

    datasets: dict[str, AbstractBitMap] = field(default_factory=dict)
    # job -> epoch number -> items in the order received
    streams: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    # (job, epoch) pairs abandoned by reset_epoch or by remove_job: never complete
    abandoned: set[tuple[str, int]] = field(default_factory=set)
    # (job, epoch) -> the items a resumed epoch covers (it is not the whole dataset)
    resumed_sets: dict[tuple[str, int], AbstractBitMap] = field(default_factory=dict)

    def record(self, sampler: Sampler, picks: Mapping[str, int]) -> None:
        """Call after every `sampler.sample(...)` with its result."""
        for job_id, item in picks.items():
            if job_id not in self.datasets:
                self.datasets[job_id] = sampler.dataset(job_id)
            epoch = sampler.epoch(job_id)
            self.streams.setdefault(job_id, {}).setdefault(epoch, []).append(item)

    def abandon(self, sampler: Sampler, job_id: str) -> None:
        """Call before `reset_epoch(job_id)` or `remove_job(job_id)`: the current epoch, if
        unfinished, will never complete."""
        epoch = sampler.epoch(job_id)
        received = self.streams.get(job_id, {}).get(epoch, [])
        if len(received) < len(self._epoch_items(job_id, epoch, sampler.dataset(job_id))):
            self.abandoned.add((job_id, epoch))

    def resumed(self, sampler: Sampler, job_id: str) -> None:
        """Call right after `add_job(job_id, ..., remaining=R)` or `reset_epoch(job_id, R)`:
        the job's next epoch covers R, not the whole dataset."""
        self.datasets.setdefault(job_id, sampler.dataset(job_id))
        self.resumed_sets[(job_id, sampler.epoch(job_id) + 1)] = sampler.remaining(job_id)

    def _epoch_items(self, job_id: str, epoch: int, dataset: AbstractBitMap) -> AbstractBitMap:
        """The items the job's epoch must deliver: its resumed set, or the dataset."""
        return self.resumed_sets.get((job_id, epoch), dataset)

    def complete_epochs(self, job_id: str) -> list[list[int]]:
        """The job's whole-dataset epochs that ran to their end (not the current one, not
        abandoned ones, not resumed ones: those cover less than the dataset)."""
        if job_id not in self.datasets:  # never received anything
            return []
        dataset_size = len(self.datasets[job_id])
        return [
            items
            for epoch, items in sorted(self.streams.get(job_id, {}).items())
            if len(items) == dataset_size and (job_id, epoch) not in self.abandoned
            and (job_id, epoch) not in self.resumed_sets
        ]

    def exactly_once_problems(self, job_id: str) -> list[str]:
        """Violations of "each epoch delivers every item exactly once"; empty if none.

        Every epoch must be free of repeats and inside the dataset (inside its remaining set,
        for a resumed epoch); every epoch except the job's last one must be complete unless it
        was abandoned.
        """
        if job_id not in self.datasets:
            return []
        epochs = sorted(self.streams.get(job_id, {}).items())
        problems = []
        for index, (epoch, items) in enumerate(epochs):
            covers = self._epoch_items(job_id, epoch, self.datasets[job_id])
            what = "the dataset" if covers is self.datasets[job_id] else "its resumed set"
            distinct = set(items)
            if len(distinct) != len(items):
                problems.append(f"job {job_id} epoch {epoch}: {len(items) - len(distinct)} "
                                "items received twice")
            outside = [x for x in distinct if x not in covers]
            if outside:
                problems.append(f"job {job_id} epoch {epoch}: items outside {what}, "
                                f"e.g. {outside[:5]}")
            last = index == len(epochs) - 1
            if not last and (job_id, epoch) not in self.abandoned and len(items) != len(covers):
                problems.append(f"job {job_id} epoch {epoch} ended after {len(items)} of "
                                f"{len(covers)} items")
        return problems


@dataclass(frozen=True)
class UniformityResult:
    """A chi-square test of the position-by-item table of one job."""

    statistic: float
    df: int
    p_value: float
    num_epochs: int
    position_bins: int
    item_bins: int


def _bin_edges(size: int, bins: int) -> np.ndarray:
    """Bin index of each of `size` consecutive slots, `bins` groups as equal as possible."""
    return (np.arange(size) * bins) // size


def position_table(
    epochs: Sequence[Sequence[int]], dataset: Iterable[int], num_bins: int | None = None
) -> np.ndarray:
    """Counts C[position bin, item bin] over complete epochs; items binned by rank in D."""
    items = np.fromiter(dataset, dtype=np.int64)
    size = len(items)
    num_epochs = len(epochs)
    if num_bins is None:
        # expected count of a cell ~ E N / B^2 >= MIN_EXPECTED_COUNT
        num_bins = int(math.sqrt(num_epochs * size / MIN_EXPECTED_COUNT))
        num_bins = max(1, min(size, num_bins, MAX_BINS))
    bin_of = _bin_edges(size, num_bins)
    table = np.zeros((num_bins, num_bins), dtype=np.int64)
    if num_epochs == 0:
        return table
    ranks = np.searchsorted(items, np.asarray(epochs, dtype=np.int64))  # (E, N) item ranks
    rows = np.broadcast_to(bin_of, ranks.shape)
    np.add.at(table, (rows.ravel(), bin_of[ranks.ravel()]), 1)
    return table


def permutation_chi2(table: np.ndarray, dataset_size: int) -> UniformityResult:
    """Chi-square test that `table` is a (binned) sum of uniform random permutation matrices."""
    num_bins = table.shape[0]
    total = int(table.sum())
    num_epochs = total // dataset_size
    sizes = np.bincount(_bin_edges(dataset_size, num_bins), minlength=num_bins)
    expected = num_epochs * np.outer(sizes, sizes) / dataset_size
    df = (num_bins - 1) ** 2
    if df == 0 or num_epochs == 0:
        return UniformityResult(0.0, 0, 1.0, num_epochs, num_bins, num_bins)
    pearson = float(((table - expected) ** 2 / expected).sum())
    statistic = pearson * (dataset_size - 1) / dataset_size
    return UniformityResult(
        statistic, df, chi2_sf(statistic, df), num_epochs, num_bins, num_bins
    )


def chi2_sf(x: float, df: int) -> float:
    """P(chi2(df) > x): the regularized upper incomplete gamma Q(df/2, x/2).

    Series for x < a + 1, Lentz's continued fraction otherwise (Numerical Recipes, 6.2), so
    `joader verify` does not need scipy; the unit tests compare it with scipy.stats.chi2.sf.
    """
    if x <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    log_prefix = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = z + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return min(1.0, math.exp(log_prefix) * h)


def wilson_interval(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion, two-sided level 1 - alpha."""
    if trials == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(1 - alpha / 2)
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    # at 0 or n successes the exact end is 0 or 1; the formula leaves a rounding residue
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def martingale_z(successes: int, probabilities_sum: float, variance_sum: float) -> float:
    """z-score of a count of events whose per-round conditional probabilities p_t are known.

    successes - sum p_t is a martingale with variance sum p_t (1 - p_t), so z is asymptotically
    standard normal however the p_t vary (the martingale central limit theorem). With zero
    variance (every p_t is 0 or 1) the count must match exactly: z is 0 or infinite.
    """
    diff = successes - probabilities_sum
    if variance_sum <= 0:
        return 0.0 if abs(diff) < 1e-6 else math.inf
    return diff / math.sqrt(variance_sum)


def two_sided_p(z: float) -> float:
    """Two-sided normal p-value of a z-score."""
    if math.isinf(z):
        return 0.0
    return 2 * (1 - NormalDist().cdf(abs(z)))


def cross_epoch_z(epochs: Sequence[Sequence[int]]) -> tuple[float, float]:
    """z-scores of two statistics over consecutive pairs of one job's complete epochs (each a
    permutation of the same N items), against independent uniform shuffles:

    - same half: X_e = |first half of epoch e ∩ first half of epoch e+1|, h = N // 2. Under
      independence X_e is hypergeometric, mean h^2/N, variance h^2 (N-h)^2 / (N^2 (N-1));
    - rank correlation: Spearman's rho between the items' positions in epochs e and e+1, mean 0,
      variance 1/(N-1).

    Why the sums' variances add: given epoch e+1, X_e and X_(e+1) depend on the independent
    epochs e and e+2 and their conditional laws do not depend on epoch e+1 (any fixed half
    meets a uniform half hypergeometrically), so consecutive terms are independent; likewise
    for rho. With 20 or more pairs the normal approximation is close. A frozen partition (the
    same half first every epoch) gives X_e = h: z in the tens at once."""
    if len(epochs) < 2:
        raise ValueError("cross_epoch_z needs at least two epochs")
    n = len(epochs[0])
    half = n // 2
    same_sum = rho_sum = 0.0
    centre = (n - 1) / 2
    scale = sum((i - centre) ** 2 for i in range(n))
    for a, b in zip(epochs, epochs[1:], strict=False):
        if len(a) != n or len(b) != n or set(a) != set(b):
            raise ValueError("cross_epoch_z: every epoch must be a permutation of the same items")
        same_sum += len(set(a[:half]) & set(b[:half]))
        where = {item: i for i, item in enumerate(b)}
        rho_sum += sum((i - centre) * (where[item] - centre) for i, item in enumerate(a)) / scale
    pairs = len(epochs) - 1
    mean = half * half / n
    variance = half * half * (n - half) ** 2 / (n * n * (n - 1))
    z_same = (same_sum - pairs * mean) / math.sqrt(pairs * variance)
    z_rho = rho_sum / math.sqrt(pairs / (n - 1))
    return z_same, z_rho


def same_position_matches(a_epochs: Sequence[Sequence[int]], b_epochs: Sequence[Sequence[int]]) -> int:
    """How many (epoch, position) pairs give jobs a and b the same item, over paired epochs
    (a's epoch e with b's epoch e; both permutations of the same items)."""
    return sum(x == y for a, b in zip(a_epochs, b_epochs, strict=True) for x, y in zip(a, b, strict=True))


def agreement_z(matches: int, epochs: int) -> float:
    """z-score of `same_position_matches` over `epochs` paired epochs against independence.

    If b's epoch is a uniform permutation independent of a's, the items' positions in b, read
    in a's order, are a uniform random permutation sigma, and the matches are its fixed points:
    mean 1 and variance 1 exactly (for N >= 2), whatever N. Paired epochs are independent of
    each other (each job's epochs are independent shuffles), so the sum over E epochs has mean
    E and variance E, and z = (matches - E) / sqrt(E) is close to normal for E >= 20 (a Poisson
    sum: for small E, compare with a Poisson(E) tail instead)."""
    return (matches - epochs) / math.sqrt(epochs)


def relative_positions(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """The position in b of each item of a, in a's order: a permutation of 0..N-1. Under
    independence of the two epochs it is a uniform random permutation, so the table of
    (position in a, position in b) over epochs is `position_table` of these, tested with
    `permutation_chi2` like one job's order (dataset = range(N))."""
    where = {item: i for i, item in enumerate(b)}
    if len(where) != len(a) or any(item not in where for item in a):
        raise ValueError("relative_positions: both epochs must be permutations of the same items")
    return [where[item] for item in a]
