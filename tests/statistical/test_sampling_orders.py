"""A job's order (`JoaderDataset(order=...)`, issue 29 item 3): what "shared" gives up and what
"independent" keeps, through the real Scheduler and sampler (`server/scheduling/scheduler.py`,
`DependentSampler`) on a job table without a registry (`tests/support/job_books.py`).

The drive: three jobs on one 20-item dataset (identical: the strongest correlation DSA makes),
each reading its rank's queue at a fixed speed (items per tick, a ratio): equal speeds, or
unequal ones, where the slower jobs' queues fill and they sit rounds out; or drifting (0, 1 or
2 items a tick, from a stream of the drive's own) with joaderd's in-step rules on
(server/scheduling/in_step.py: a job behind planned ahead, rounds held for it), whose decisions read the
measured rates and queue lengths. Speeds never come from the sampler's streams, so the
participation pattern never depends on a future draw (the condition of the proof in
joader/sampling/dependent.py). Each tick runs `Scheduler.run_round` once and each job takes its
items from the head of its queue; the order a job reads is its picks' order.

What is checked, per configuration and job:
- uniformity: the table C[position, item] over the job's complete epochs against a sum of
  independent uniform permutation matrices (`permutation_chi2`, 600 epochs);
- cross-epoch independence: `cross_epoch_z` on its consecutive epochs (same half, rank
  correlation), two-sided;
- "shared" (the default): the jobs' same-position agreement (epoch e of one against epoch e of
  the other) is reported; at equal speeds it is checked to be far above chance (it is 1.0:
  every round is shared): the correlation users give up by default. At unequal speeds the
  epochs drift apart and the same-position figure falls to about chance while the jobs still
  share many rounds (reported, with the pairs' shared rounds);
- "independent": against each shared job, (1) same item in the same round, where under
  independence a round with both has P = |R_s ∩ R_x| / (|R_s| |R_x|) given the past (the
  independent job's pick is uniform on its R from its own stream, the other's uniform on its R
  by DSA's claim): matches minus sum P is a martingale, z two-sided (`martingale_z`); (2)
  same-position agreement, the fixed points of a uniform permutation per paired epoch (mean 1,
  variance 1: `agreement_z`), two-sided; (3) the joint table of an item's position in both
  jobs (`relative_positions`), a sum of uniform permutation matrices under independence.

Thresholds: 7 configurations x 3 jobs x 3 statistics + 4 configurations x 2 partners x 3
statistics + 2 x 3 shared pairs = 93 tests, Bonferroni at a family-wise false-failure rate of
1e-3: alpha = 1e-3 / 93 each (|z| < 4.40). The drifting configurations are checked to have
exercised the rules (rounds past the lookahead, holds).

Power (the same statistics, alpha and sample sizes): a job whose opt-out is ignored (run as
"shared") gives round-match z in the hundreds at either speed and same-position z and
chi-square far past the threshold at equal speeds; a 5% leak (one round in twenty the
independent job takes the other's pick when it still needs it) is caught by the round-match z
and the same-position z. At unequal speeds the per-position statistics are weak against a
correlated pair (the epochs drift, so even two shared jobs agree at about chance by position):
the round-match z carries the power there. The uniformity and cross-epoch statistics are the
ones whose power tests/statistical/test_sampling_uniformity.py (a 5% bias) and
test_sampling_alignment.py (a frozen partition) show, at smaller sample sizes than here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist

import pytest
from pyroaring import BitMap

from joader.sampling import DependentSampler
from joader.sampling.checks import (
    agreement_z,
    cross_epoch_z,
    martingale_z,
    permutation_chi2,
    position_table,
    relative_positions,
    same_position_matches,
)
from joader.server.books.records import Source
from tests.support.job_books import books

pytestmark = pytest.mark.timeout(300)  # the module fixture drives 5 configurations

ALPHA = 1e-3 / 93
Z_LIMIT = NormalDist().inv_cdf(1 - ALPHA / 2)
N = 20
EPOCHS = 600
CAPACITY = 4  # each job's queue: a round runs when one is below it, jobs below twice it take part

Speeds = dict[str, tuple[int, int]]  # job -> (items, per ticks)
EQUAL: Speeds = {"a": (1, 1), "b": (1, 1), "c": (1, 1)}
UNEQUAL: Speeds = {"a": (1, 1), "b": (2, 3), "c": (1, 2)}
C_FASTEST: Speeds = {"a": (1, 2), "b": (2, 3), "c": (1, 1)}
# Drifting: each tick a job reads 0, 1 or 2 items, drawn from a stream of its own (never the
# sampler's), around a mean of 1, 1 and 0.85 items per tick; joaderd's in-step rules on (a job
# behind planned ahead within a horizon of 3 lookaheads, rounds held for it on a "busy host").
DRIFT: Speeds = {"a": (0, 0), "b": (0, 0), "c": (0, 0)}
DRIFT_MEANS = {"a": 1.0, "b": 1.0, "c": 0.85}
CONFIGS: dict[str, tuple[str, Speeds]] = {  # name -> (c's order, speeds); a and b are shared
    "shared-equal": ("shared", EQUAL),
    "shared-unequal": ("shared", UNEQUAL),
    "shared-drift-in-step": ("shared", DRIFT),
    "independent-equal": ("independent", EQUAL),
    "independent-unequal": ("independent", UNEQUAL),
    "independent-fastest": ("independent", C_FASTEST),
    "independent-drift-in-step": ("independent", DRIFT),
}
INDEPENDENT_CONFIGS = [name for name, (order, _) in CONFIGS.items() if order == "independent"]


@dataclass
class Run:
    epochs: dict[str, list[list[int]]]  # job -> its complete epochs, in order
    # rounds with c and a partner x in them: (partner, P(same item) under independence, same?)
    rounds_with_c: list[tuple[str, float, bool]] = field(default_factory=list)
    pair_rounds: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # by job names
    planned_past_lookahead: int = 0  # rounds a job took part in with more than 2 x CAPACITY queued
    holds: int = 0  # rounds held for a job behind (server/scheduling/in_step.py)


def _drive(c_order: str, speeds: Speeds, *, seed: int = 0, epochs: int = EPOCHS,
           sampler: type[DependentSampler] = DependentSampler) -> Run:
    table, scheduler, source, clock = books(num_items=N, slots=400)
    source.sampler = sampler(seed=source.seed, align=source.epoch_align)
    drift = speeds is DRIFT
    if drift:  # joaderd's in-step rules: NOTE [ Planning a lagging job ahead ] and the hold
        scheduler._max_hold_s = 0.05
        scheduler.host_busy = True
    jobs = {}
    for i, name in enumerate(("a", "b", "c")):
        order = c_order if name == "c" else "shared"
        job, _ = table.attach(source, BitMap(range(N)), name, 4, seed=1000 * seed + i, order=order)
        job.reading, job.queue_capacity, job.cache_share = True, CAPACITY, 10_000
        job.plan_horizon, job.cpu_bound = 3 * CAPACITY, True
        jobs[name] = job
    names = {job.job_id: name for name, job in jobs.items()}
    run = Run({name: [] for name in jobs})
    _record_rounds(source, names, run)
    steps = random.Random(f"speeds:{seed}")  # the jobs' speeds: never the sampler's stream
    got: dict[str, dict[int, list[int]]] = {name: {} for name in jobs}
    # Epochs of exactly N items so far, per job: kept as they change (counting them again each
    # tick over every epoch read grew with the drive: about a third of its CPU at 600 epochs).
    complete = dict.fromkeys(jobs, 0)
    tick = 0
    while min(complete.values()) < epochs:
        tick += 1
        clock.now += 0.01
        lengths = {name: len(job.ranks[0].queue) for name, job in jobs.items()}
        if scheduler.run_round(source, table.jobs):
            if drift:
                scheduler._cache.decode_rate.add(clock.now, 1)
                run.planned_past_lookahead += sum(
                    1 for name, job in jobs.items()
                    if lengths[name] >= 2 * CAPACITY and len(job.ranks[0].queue) > lengths[name])
        for name, job in jobs.items():
            if drift:
                mean = DRIFT_MEANS[name]
                take = 2 if steps.random() < mean / 2 else (1 if steps.random() < 0.5 else 0)
            else:
                items, per = speeds[name]
                take = (tick * items) // per - ((tick - 1) * items) // per
            rank = job.ranks[0]
            rank.last_read_s = clock.now
            if take:
                job.rate.add(clock.now, min(take, len(rank.queue)))
            head = [rank.queue[i] for i in range(min(take, len(rank.queue)))]
            if head:
                scheduler.drop_queue(rank, _first(len(head)))  # read: out of the queue, unpinned
            for entry in head:
                rank.claimed_epoch = max(rank.claimed_epoch, entry.epoch)  # its pass reads it
                order = got[name].setdefault(entry.epoch, [])
                order.append(entry.item_id)
                complete[name] += (len(order) == N) - (len(order) == N + 1)
    for name, by_epoch in got.items():
        run.epochs[name] = [order for _, order in sorted(by_epoch.items()) if len(order) == N]
        assert all(sorted(order) == list(range(N)) for order in run.epochs[name])  # exactly once
    run.pair_rounds = {tuple(sorted((names[a], names[b]))): counts  # type: ignore[misc]
                       for (a, b), counts in source.pair_rounds.items()}
    run.holds = source.holds
    return run


def _first(count: int) -> Callable[[object], bool]:
    """A `drop_queue` predicate for the first `count` entries (it visits them in order)."""
    seen = [0]

    def drop(_: object) -> bool:
        seen[0] += 1
        return seen[0] <= count

    return drop


def _record_rounds(source: Source, names: dict[str, str], run: Run) -> None:
    """Wraps the source's sampler: for each round with c and another job x, the probability
    that both get the same item if their picks are independent given the past, and whether
    they did."""
    sampler = source.sampler
    plain = sampler.sample

    def sample(job_ids: list[str]) -> dict[str, int]:
        by_name = {names[j]: j for j in job_ids}
        current = {name: sampler.remaining(j) or sampler.dataset(j) for name, j in by_name.items()}
        picks = plain(job_ids)
        if "c" in by_name:
            for x in by_name.keys() - {"c"}:
                p = current["c"].intersection_cardinality(current[x]) / (len(current["c"]) * len(current[x]))
                run.rounds_with_c.append((x, p, picks[by_name["c"]] == picks[by_name[x]]))
        return picks

    sampler.sample = sample  # type: ignore[method-assign]


class _Runs(dict[str, Run]):
    """Each configuration driven when a test first asks for it, once per process.

    NOTE [ A module fixture under pytest-xdist ]
    `make test` spreads a module's tests over its pytest processes, and every process that ran
    one of them drove all seven configurations (about 100 CPU-s each time on this machine);
    consecutive tests (one configuration's) mostly land in one process, which now drives only
    the configurations its tests read. The figures are the same: `_drive` is seeded."""

    def __missing__(self, name: str) -> Run:
        order, speeds = CONFIGS[name]
        run = self[name] = _drive(order, speeds)
        return run


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    return _Runs()


def _agreement(run: Run, x: str, y: str) -> tuple[int, int]:
    """(same-position matches, paired epochs) of jobs x and y."""
    paired = min(len(run.epochs[x]), len(run.epochs[y]))
    return same_position_matches(run.epochs[x][:paired], run.epochs[y][:paired]), paired


def _round_z(run: Run, partner: str) -> tuple[float, int, float]:
    rounds = [(p, same) for x, p, same in run.rounds_with_c if x == partner]
    matches = sum(same for _, same in rounds)
    expected = sum(p for p, _ in rounds)
    return martingale_z(matches, expected, sum(p * (1 - p) for p, _ in rounds)), matches, expected


def _joint_chi2_p(run: Run, x: str, y: str) -> float:
    paired = min(len(run.epochs[x]), len(run.epochs[y]))
    joint = [relative_positions(a, b) for a, b in zip(run.epochs[x][:paired], run.epochs[y][:paired], strict=True)]
    return permutation_chi2(position_table(joint, BitMap(range(N))), N).p_value


# ----------------------------------------------------------------------------- both modes

@pytest.mark.parametrize("job", ["a", "b", "c"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_each_jobs_epochs_are_uniform_permutations(runs: dict[str, Run], config: str, job: str) -> None:
    epochs = runs[config].epochs[job]
    assert len(epochs) >= EPOCHS
    result = permutation_chi2(position_table(epochs, BitMap(range(N))), N)
    print(f"{config}, job {job}: {len(epochs)} epochs, item x position chi2 p = {result.p_value:.3g}")
    assert result.p_value > ALPHA


@pytest.mark.parametrize("job", ["a", "b", "c"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_jobs_consecutive_epochs_are_independent_shuffles(runs: dict[str, Run], config: str, job: str) -> None:
    z_same, z_rho = cross_epoch_z(runs[config].epochs[job])
    print(f"{config}, job {job}: same-half z {z_same:+.2f}, rank z {z_rho:+.2f}")
    assert abs(z_same) < Z_LIMIT and abs(z_rho) < Z_LIMIT


# ----------------------------------------------------------------------------- shared: the trade

@pytest.mark.parametrize(("x", "y"), [("a", "b"), ("a", "c"), ("b", "c")])
@pytest.mark.parametrize("config", ["shared-equal", "shared-unequal"])
def test_shared_jobs_orders_are_correlated_by_design(runs: dict[str, Run], config: str, x: str, y: str) -> None:
    """The correlation users give up by default: jobs that read together get the same item at
    the same position (at equal speeds, every round is shared: agreement 1.0). At unequal
    speeds their epochs drift apart: they still share rounds, but rarely at the same position
    of the same epoch number."""
    run = runs[config]
    matches, paired = _agreement(run, x, y)
    rounds, shared = run.pair_rounds[(x, y)]
    print(f"{config}, {x}+{y}: same item at the same position {matches / (paired * N):.3f} "
          f"(chance {1 / N:.3f}) over {paired} epochs; shared {shared} of {rounds} rounds together "
          f"({shared / rounds:.3f})")
    if config == "shared-equal":
        assert matches / (paired * N) > 0.9
        assert agreement_z(matches, paired) > Z_LIMIT
    # identical datasets: far more shared rounds than chance (independent shuffles share a round
    # with P = |R1 ∩ R2| / (|R1| |R2|), at most 1/|R|: about 0.1 averaged over epochs of 20)
    assert shared / rounds > 0.25


# ----------------------------------------------------------------------------- independent

@pytest.mark.parametrize("partner", ["a", "b"])
@pytest.mark.parametrize("config", INDEPENDENT_CONFIGS)
def test_the_independent_job_is_independent_of_each_shared_job(runs: dict[str, Run], config: str, partner: str) -> None:
    run = runs[config]
    z_round, round_matches, round_expected = _round_z(run, partner)
    matches, paired = _agreement(run, "c", partner)
    z_position = agreement_z(matches, paired)
    p_joint = _joint_chi2_p(run, "c", partner)
    print(f"{config}, c vs {partner}: same item in a round {round_matches} (independence: "
          f"{round_expected:.1f}, z {z_round:+.2f}); same position {matches / (paired * N):.4f} "
          f"(chance {1 / N:.4f}, z {z_position:+.2f}) over {paired} epochs; joint positions chi2 "
          f"p = {p_joint:.3g}")
    assert ("c", partner) not in run.pair_rounds and (partner, "c") not in run.pair_rounds  # no shared round
    assert abs(z_round) < Z_LIMIT
    assert abs(z_position) < Z_LIMIT
    assert p_joint > ALPHA


class LeakySampler(DependentSampler):
    """One round in twenty, an independent job takes another participant's pick instead of its
    own when it still needs it (its own goes back: still exactly once): a 5% leak of the
    correlation the opt-out must remove."""

    leak = 0.05

    def _sample_with_solo(self, job_ids):  # type: ignore[no-untyped-def]
        picks = super()._sample_with_solo(job_ids)
        coin = self.__dict__.setdefault("_coin", random.Random(99))
        for job_id in job_ids:
            if job_id not in self._solo or coin.random() >= self.leak:
                continue
            remaining = self._solo[job_id]
            others = [item for other, item in picks.items() if other not in self._solo and item in remaining]
            if others:
                remaining.add(picks[job_id])
                remaining.remove(others[0])
                picks[job_id] = others[0]
        return picks


@pytest.mark.parametrize("speeds", ["equal", "unequal"])
def test_power_a_job_whose_opt_out_is_ignored_is_caught(speeds: str) -> None:
    run = _drive("shared", EQUAL if speeds == "equal" else UNEQUAL, seed=1)
    z_round, _, _ = _round_z(run, "a")
    matches, paired = _agreement(run, "c", "a")
    z_position = agreement_z(matches, paired)
    p_joint = _joint_chi2_p(run, "c", "a")
    print(f"opt-out ignored, {speeds} speeds: round z {z_round:+.1f}, same-position z "
          f"{z_position:+.1f}, joint chi2 p = {p_joint:.3g}")
    assert z_round > 10 * Z_LIMIT
    if speeds == "equal":
        assert z_position > 10 * Z_LIMIT and p_joint < ALPHA


@pytest.mark.parametrize("speeds", ["equal", "unequal"])
def test_power_a_five_percent_leak_is_caught(speeds: str) -> None:
    run = _drive("independent", EQUAL if speeds == "equal" else UNEQUAL, seed=2, sampler=LeakySampler)
    z_round, matches_round, expected = _round_z(run, "a")
    matches, paired = _agreement(run, "c", "a")
    z_position = agreement_z(matches, paired)
    print(f"5% leak, {speeds} speeds: round matches {matches_round} (independence {expected:.1f}, "
          f"z {z_round:+.1f}); same-position z {z_position:+.1f}")
    assert z_round > Z_LIMIT
    if speeds == "equal":
        assert z_position > Z_LIMIT


@pytest.mark.parametrize("config", ["shared-drift-in-step", "independent-drift-in-step"])
def test_the_drifting_drive_exercised_the_in_step_rules(runs: dict[str, Run], config: str) -> None:
    """The drift configurations test what they mean to: jobs took part in rounds beyond twice
    their lookahead (planned ahead), and rounds were held for a job behind."""
    run = runs[config]
    print(f"{config}: {run.planned_past_lookahead} rounds planned past the lookahead, {run.holds} holds")
    assert run.planned_past_lookahead > 100
    if config == "shared-drift-in-step":  # the slower job c is waited for (when independent, never)
        assert run.holds >= 10
