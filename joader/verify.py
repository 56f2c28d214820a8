"""`python -m joader.verify` (or `joader verify`): check the sampling guarantees on your job mix.

Simulates the given jobs with the chosen sampler for a number of epochs, every job sitting out
rounds at random, and prints per job:

- exactly once: whether every complete epoch was a permutation of the job's dataset;
- uniformity: the p-value of the position-by-item chi-square test (see joader.sampling.checks);

and per pair of jobs: the share of rounds (where both took part) that gave both the same item,
beside the Theorem 1 bound of the datasets |D1 ∩ D2| / max(|D1|, |D2|) and the mean per-round
bound |R1 ∩ R2| / max(|R1|, |R2|) of the sets the rounds actually drew from, with the p-value
of the share count against the per-round bound (a martingale z-test). The dataset bound is
reached when the two jobs' epochs stay aligned (equal sizes, no sitting out); otherwise the
epochs drift apart and the per-round bound is the one DSA attains.

With more than two jobs the pairwise bounds cannot all be met at once: the chain shares only
items held by a whole suffix of the size order (see joader.sampling.chain), so the pair table is
information, checked only one-sidedly (no pair may share more than its per-round bound). With
`--sampler independent` the pair rates are tested against chance, |R1 ∩ R2| / (|R1| |R2|).

Example:
    python -m joader.verify --job a=0:600 --job b=300:1300 --epochs 200 --seed 0 --sit-out 0.1

A range a:b is half-open; several ranges or single ids are separated by commas
(`--job c=0:100,500:600,999`). The exit status is 0 when every check passes at the family-wise
level --alpha (Bonferroni over all the tests printed), 1 otherwise, 2 on bad arguments.
Keep datasets small (hundreds to a few thousand items): the simulation runs
epochs x max |D| rounds and the uniformity test needs many epochs.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import random
import sys
from dataclasses import dataclass
from typing import TextIO

from pyroaring import BitMap

from joader.errors import InvalidArgumentError
from joader.sampling import SAMPLERS, Sampler, make_sampler
from joader.sampling.checks import (
    EpochRecorder,
    martingale_z,
    permutation_chi2,
    position_table,
    two_sided_p,
)

logger = logging.getLogger(__name__)

__all__ = ["main", "parse_job", "simulate"]


def parse_job(text: str) -> tuple[str, BitMap]:
    """Parse NAME=RANGES, e.g. "a=0:600" or "c=0:100,500:600,999", into (name, dataset)."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise InvalidArgumentError(
            f"bad job {text!r}: write NAME=RANGES, e.g. a=0:600 or c=0:100,500:600"
        )
    dataset = BitMap()
    for part in spec.split(","):
        try:
            if ":" in part:
                low, high = (int(x) for x in part.split(":"))
                if not 0 <= low < high:
                    raise ValueError
                dataset.add_range(low, high)
            else:
                dataset.add(int(part))
        except ValueError:
            raise InvalidArgumentError(
                f"bad range {part!r} in job {name!r}: use START:STOP with 0 <= START < STOP, "
                "or a single non-negative id"
            ) from None
    return name, dataset


@dataclass
class PairStats:
    """Sharing counts of one pair of jobs over the rounds where both took part."""

    rounds: int = 0
    shares: int = 0
    p_sum: float = 0.0  # sum of the Theorem 1 per-round bounds
    var_sum: float = 0.0
    chance_sum: float = 0.0  # sum of the per-round chance |R1 ∩ R2| / (|R1| |R2|)
    chance_var: float = 0.0


def simulate(
    jobs: dict[str, BitMap],
    *,
    epochs: int,
    seed: int,
    sit_out: float,
    sampler_name: str = "dependent",
) -> tuple[EpochRecorder, dict[tuple[str, str], PairStats], int]:
    """Run rounds until every job has `epochs` complete epochs; returns what was recorded,
    per-pair sharing counts and the number of rounds."""
    sampler: Sampler = make_sampler(sampler_name, seed)
    for name, dataset in jobs.items():
        sampler.add_job(name, dataset)
    rng = random.Random(seed + 1)  # participation, independent of the sampler's draws
    recorder = EpochRecorder()
    pairs = {pair: PairStats() for pair in itertools.combinations(jobs, 2)}
    current = {name: sampler.dataset(name) for name in jobs}
    max_rounds = math.ceil(epochs * max(len(d) for d in jobs.values()) / (1 - sit_out) * 3) + 100
    rounds = 0
    while rounds < max_rounds:
        # epoch() counts started epochs: once it exceeds `epochs`, that many are complete
        if all(sampler.epoch(name) > epochs for name in jobs):
            break
        participants = [name for name in jobs if rng.random() >= sit_out]
        for name in participants:
            current[name] = sampler.remaining(name) or sampler.dataset(name)
        taking_part = set(participants)
        for (first, second), stats in pairs.items():
            if first in taking_part and second in taking_part:
                r1, r2 = current[first], current[second]
                common = r1.intersection_cardinality(r2)
                p = common / max(len(r1), len(r2))
                chance = common / (len(r1) * len(r2))
                stats.rounds += 1
                stats.p_sum += p
                stats.var_sum += p * (1 - p)
                stats.chance_sum += chance
                stats.chance_var += chance * (1 - chance)
        picks = sampler.sample(participants)
        recorder.record(sampler, picks)
        for (first, second), stats in pairs.items():
            if first in picks and second in picks and picks[first] == picks[second]:
                stats.shares += 1
        rounds += 1
    return recorder, pairs, rounds


def report(
    jobs: dict[str, BitMap],
    recorder: EpochRecorder,
    pairs: dict[tuple[str, str], PairStats],
    *,
    alpha: float,
    sampler_name: str,
    out: TextIO,
) -> bool:
    """Print the tables; True when every check passes at family-wise level `alpha`."""
    num_tests = len(jobs) + len(pairs)
    per_test = alpha / max(1, num_tests)
    ok = True
    print(f"{'job':<12}{'items':>8}{'epochs':>8}  {'exactly once':<14}{'uniformity p':>13}"
          f"{'chi2':>10}{'df':>7}", file=out)
    for name, dataset in jobs.items():
        problems = recorder.exactly_once_problems(name)
        complete = recorder.complete_epochs(name)
        result = permutation_chi2(position_table(complete, dataset), len(dataset))
        passed = not problems and result.p_value > per_test
        ok &= passed
        print(f"{name:<12}{len(dataset):>8}{len(complete):>8}  "
              f"{'ok' if not problems else f'FAIL ({len(problems)})':<14}"
              f"{result.p_value:>13.4g}{result.statistic:>10.1f}{result.df:>7}"
              f"{'' if passed else '  <-- FAIL'}", file=out)
        for problem in problems[:5]:
            print(f"    {problem}", file=out)
    # what a pair's share count is tested against (see the module docstring)
    if sampler_name == "independent":
        mode, label = "chance", "p (vs chance)"
    elif len(jobs) == 2:
        mode, label = "bound", "p (vs per-round)"
    else:
        mode, label = "at most", "p (<= per-round)"
    if pairs:
        print(f"\n{'pair':<20}{'rounds':>8}{'share rate':>12}{'bound':>8}{'per-round bound':>17}"
              f"{label:>18}", file=out)
    for (first, second), stats in pairs.items():
        d1, d2 = jobs[first], jobs[second]
        bound = d1.intersection_cardinality(d2) / max(len(d1), len(d2))
        rate = stats.shares / stats.rounds if stats.rounds else 0.0
        mean_bound = stats.p_sum / stats.rounds if stats.rounds else 0.0
        if mode == "chance":
            z = martingale_z(stats.shares, stats.chance_sum, stats.chance_var)
        else:
            z = martingale_z(stats.shares, stats.p_sum, stats.var_sum)
        if mode == "at most":  # one-sided: only sharing above the bound is a failure
            p_value = 1.0 if z <= 0 else two_sided_p(z) / 2
        else:
            p_value = two_sided_p(z)
        passed = p_value > per_test
        ok &= passed
        print(f"{first + '/' + second:<20}{stats.rounds:>8}{rate:>12.4f}{bound:>8.4f}"
              f"{mean_bound:>17.4f}{p_value:>18.4g}{'' if passed else '  <-- FAIL'}", file=out)
    if mode == "at most":
        print("(more than two jobs: the chain shares only items held by a whole suffix of the "
              "size order,\n so pairs may share less than their bound; see "
              "joader.sampling.chain)", file=out)
    print(f"\n{'all checks pass' if ok else 'SOME CHECKS FAIL'} at family-wise alpha {alpha:g} "
          f"({num_tests} tests, {per_test:.2g} each)", file=out)
    return ok


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="joader verify",
        description="Simulate a job mix and check exactly-once epochs, marginal uniformity "
        "and sharing against the Theorem 1 bound.",
        epilog="example: --job a=0:600 --job b=300:1300 --epochs 200 --seed 0 --sit-out 0.1",
    )
    parser.add_argument("--job", action="append", required=True, metavar="NAME=RANGES",
                        help="a job and its item ids, e.g. a=0:600 or c=0:100,500:600 "
                        "(repeat for each job)")
    parser.add_argument("--epochs", type=int, default=200,
                        help="complete epochs per job to simulate (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sit-out", type=float, default=0.0,
                        help="probability that a job sits out a round (default 0)")
    parser.add_argument("--sampler", choices=sorted(SAMPLERS), default="dependent")
    parser.add_argument("--alpha", type=float, default=1e-3,
                        help="family-wise false-failure rate (default 1e-3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 pass, 1 a check failed, 2 bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        jobs: dict[str, BitMap] = {}
        for text in args.job:
            name, dataset = parse_job(text)
            if name in jobs:
                raise InvalidArgumentError(f"job {name!r} given twice; use distinct names")
            jobs[name] = dataset
        if args.epochs < 1:
            raise InvalidArgumentError(f"--epochs must be at least 1, got {args.epochs}")
        if not 0 <= args.sit_out < 1:
            raise InvalidArgumentError(f"--sit-out must be in [0, 1), got {args.sit_out}")
    except InvalidArgumentError as error:
        parser.print_usage(sys.stderr)
        print(f"joader verify: error: {error}", file=sys.stderr)
        return 2
    recorder, pairs, rounds = simulate(
        jobs, epochs=args.epochs, seed=args.seed, sit_out=args.sit_out,
        sampler_name=args.sampler,
    )
    print(f"{args.sampler} sampler, seed {args.seed}, {rounds} rounds, sit-out "
          f"{args.sit_out:g}\n")
    return 0 if report(
        jobs, recorder, pairs, alpha=args.alpha, sampler_name=args.sampler, out=sys.stdout
    ) else 1


if __name__ == "__main__":
    sys.exit(main())
