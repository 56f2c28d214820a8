"""Benchmark of joader.sampling: insert time, cost of a round, sharing rate against its bound.

(a) The paper's section 6 experiment: insert 128 datasets of 1-2M items each (random subsets of a
    2M-id space) into one DependentSampler; report the mean `add_job` time (the paper: 0.57 s;
    target: at most 0.05 s). Building the input bitmaps is excluded and timed apart, per method.
(b) The cost of one round per participating job, with 2, 8 and 32 jobs on 1.28M-item datasets,
    identical or a partially overlapping mix (target: at most 10 us per job with 8 jobs).
(c) For two jobs of equal size, the share of rounds that give both the same item, against the
    Theorem 1 bound |D1 ∩ D2| / max(|D1|, |D2|), for overlaps 0, 10, ..., 100% (target: within
    2%). Two extra rows show what happens when the epochs are not aligned (unequal sizes, a
    staggered start): the long-run rate falls below the dataset bound, while the rate still
    equals the mean of the per-round bound |R1 ∩ R2| / max(|R1|, |R2|), which DSA attains.

Usage: python -m bench.micro.sampler [--quick] [--seed 0] [--out PATH]. --quick runs in under a
minute with fewer datasets and rounds; the default is the full run. Prints a table and writes
JSON (default bench/results/sampler.json, or sampler-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import array
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from pyroaring import BitMap

from joader.sampling import DependentSampler, IndependentSampler, Sampler

RESULTS = Path(__file__).resolve().parents[1] / "results"
ID_SPACE = 2_000_000
ROUND_ITEMS = 1_280_000


def bitmap_from_mask(mask: np.ndarray) -> BitMap:
    """The fast path: numpy mask -> uint32 ids -> array.array -> BitMap (about 5 ms for 1.5M)."""
    ids = np.flatnonzero(mask).astype(np.uint32)
    return BitMap(array.array("I", ids.tobytes()))


def time_build_methods(gen: np.random.Generator) -> dict[str, float]:
    """Seconds to build one 1.5M-item bitmap, per construction method (why we use array.array)."""
    ids = np.flatnonzero(gen.random(ID_SPACE) < 0.75).astype(np.uint32)
    serialized = BitMap(array.array("I", ids.tobytes())).serialize()
    methods = {
        "array.array": lambda: BitMap(array.array("I", ids.tobytes())),
        "deserialize": lambda: BitMap.deserialize(serialized),
        "numpy array": lambda: BitMap(ids),
    }
    out = {}
    for name, build in methods.items():
        start = time.perf_counter()
        build()
        out[name] = time.perf_counter() - start
    return out


def bench_insert(num_datasets: int, seed: int) -> dict[str, Any]:
    gen = np.random.default_rng(seed)
    sampler = DependentSampler(seed=seed)
    insert_s: list[float] = []
    build_s: list[float] = []
    sizes: list[int] = []
    for i in range(num_datasets):
        start = time.perf_counter()
        density = gen.uniform(0.5, 1.0)  # 1M to 2M items of the 2M-id space
        dataset = bitmap_from_mask(gen.random(ID_SPACE) < density)
        build_s.append(time.perf_counter() - start)
        sizes.append(len(dataset))
        start = time.perf_counter()
        sampler.add_job(f"job{i}", dataset)
        insert_s.append(time.perf_counter() - start)
    return {
        "num_datasets": num_datasets,
        "min_items": min(sizes),
        "max_items": max(sizes),
        "mean_insert_s": statistics.fmean(insert_s),
        "max_insert_s": max(insert_s),
        "last_insert_s": insert_s[-1],
        "mean_build_input_s": statistics.fmean(build_s),
        "build_methods_s": time_build_methods(gen),
    }


def round_datasets(kind: str, num_jobs: int, gen: np.random.Generator) -> list[BitMap]:
    if kind == "identical":
        return [BitMap(range(ROUND_ITEMS))] * num_jobs
    # "mix": each job a random 1.28M-item subset of a 1.6M-id space (pairwise overlap ~80%)
    space = int(ROUND_ITEMS * 1.25)
    out = []
    for _ in range(num_jobs):
        ids = np.sort(gen.choice(space, size=ROUND_ITEMS, replace=False)).astype(np.uint32)
        out.append(BitMap(array.array("I", ids.tobytes())))
    return out


def bench_round(
    sampler_name: str, kind: str, num_jobs: int, num_rounds: int, seed: int
) -> dict[str, Any]:
    gen = np.random.default_rng(seed)
    sampler: Sampler = (DependentSampler if sampler_name == "dependent" else IndependentSampler)(
        seed=seed
    )
    jobs = [f"job{i}" for i in range(num_jobs)]
    for job_id, dataset in zip(jobs, round_datasets(kind, num_jobs, gen), strict=True):
        sampler.add_job(job_id, dataset)
    sample = sampler.sample
    sampler.sample(jobs)  # start the epochs outside the timing
    distinct = 0
    start = time.perf_counter()
    for _ in range(num_rounds):
        sample(jobs)
    elapsed = time.perf_counter() - start
    # distinct items per round, measured apart so the timing loop stays bare
    for _ in range(min(num_rounds, 2000)):
        distinct += len(set(sample(jobs).values()))
    return {
        "sampler": sampler_name,
        "datasets": kind,
        "num_jobs": num_jobs,
        "num_rounds": num_rounds,
        "us_per_round": elapsed / num_rounds * 1e6,
        "us_per_job": elapsed / num_rounds / num_jobs * 1e6,
        "distinct_items_per_round": distinct / min(num_rounds, 2000),
    }


def bench_sharing(
    num_items: int, overlap: float, seed: int, *, size_b: int | None = None, stagger: int = 0
) -> dict[str, Any]:
    """Two jobs: a = [0, N), b = an interval of size_b (default N) overlapping a by overlap*N."""
    size_b = num_items if size_b is None else size_b
    shared = round(overlap * min(num_items, size_b))
    start_b = num_items - shared
    sampler = DependentSampler(seed=seed)
    sampler.add_job("a", BitMap(range(num_items)))
    sampler.add_job("b", BitMap(range(start_b, start_b + size_b)))
    bound = shared / max(num_items, size_b)
    for _ in range(stagger):  # b joins late: a runs alone for `stagger` rounds
        sampler.sample(["a"])
    num_rounds = 2 * max(num_items, size_b)
    shares = 0
    per_round_bound = 0.0
    track = stagger > 0 or size_b != num_items
    for _ in range(num_rounds):
        if track:
            # an empty remaining set is refilled by this very round, so its bound uses D
            ra = sampler.remaining("a") or sampler.dataset("a")
            rb = sampler.remaining("b") or sampler.dataset("b")
            per_round_bound += ra.intersection_cardinality(rb) / max(len(ra), len(rb))
        picks = sampler.sample(["a", "b"])
        shares += picks["a"] == picks["b"]
    rate = shares / num_rounds
    return {
        "overlap": overlap,
        "items_a": num_items,
        "items_b": size_b,
        "stagger_rounds": stagger,
        "num_rounds": num_rounds,
        "share_rate": rate,
        "bound": bound,
        "abs_diff": abs(rate - bound),
        "mean_per_round_bound": per_round_bound / num_rounds if track else bound,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer datasets and rounds (<1 min)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    quick = args.quick
    out_path = args.out or RESULTS / ("sampler-quick.json" if quick else "sampler.json")

    num_datasets = 32 if quick else 128
    insert = bench_insert(num_datasets, args.seed)
    print(f"(a) insert {num_datasets} datasets of {insert['min_items']:,}-"
          f"{insert['max_items']:,} items: mean {insert['mean_insert_s'] * 1e3:.1f} ms, "
          f"max {insert['max_insert_s'] * 1e3:.1f} ms, last {insert['last_insert_s'] * 1e3:.1f} "
          f"ms (target <= 50 ms; paper 570 ms); input build "
          f"{insert['mean_build_input_s'] * 1e3:.1f} ms each")
    print("    build one 1.5M bitmap: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms" for k, v in insert["build_methods_s"].items()))

    rounds = []
    num_rounds = 5_000 if quick else 50_000
    print(f"\n(b) one round, {ROUND_ITEMS:,}-item datasets, all jobs participating")
    print(f"    {'sampler':<12}{'datasets':<11}{'jobs':>5}{'us/round':>10}{'us/job':>9}"
          f"{'distinct/round':>16}")
    for sampler_name in ("dependent", "independent"):
        for kind in ("identical", "mix"):
            for num_jobs in (2, 8, 32):
                row = bench_round(sampler_name, kind, num_jobs, num_rounds, args.seed)
                rounds.append(row)
                print(f"    {sampler_name:<12}{kind:<11}{num_jobs:>5}{row['us_per_round']:>10.1f}"
                      f"{row['us_per_job']:>9.2f}{row['distinct_items_per_round']:>16.2f}")

    sharing = []
    num_items = 20_000 if quick else 200_000
    print(f"\n(c) two jobs, {num_items:,} items each, {2 * num_items:,} rounds (two epochs)")
    print(f"    {'overlap':>8}{'share rate':>12}{'bound':>8}{'|diff|':>8}")
    for tenth in range(11):
        row = bench_sharing(num_items, tenth / 10, args.seed)
        sharing.append(row)
        print(f"    {tenth * 10:>7}%{row['share_rate']:>12.4f}{row['bound']:>8.3f}"
              f"{row['abs_diff']:>8.4f}")
    small = num_items // 10
    extras = [
        bench_sharing(small, 0.5, args.seed, size_b=small * 5 // 3),
        bench_sharing(small, 0.5, args.seed, stagger=small // 2),
    ]
    print("    not aligned (rate vs dataset bound vs mean per-round bound):")
    for row in extras:
        print(f"      a={row['items_a']}, b={row['items_b']}, b starts after "
              f"{row['stagger_rounds']} rounds: rate {row['share_rate']:.4f}, bound "
              f"{row['bound']:.3f}, per-round bound {row['mean_per_round_bound']:.4f}")
    sharing_max_diff = max(row["abs_diff"] for row in sharing)
    eight = [r for r in rounds if r["sampler"] == "dependent" and r["num_jobs"] == 8]
    summary = {
        "mean_insert_s": insert["mean_insert_s"],
        "insert_target_met": insert["mean_insert_s"] <= 0.05,
        "us_per_job_8_jobs_max": max(r["us_per_job"] for r in eight),
        "round_target_met": all(r["us_per_job"] <= 10 for r in eight),
        "sharing_max_abs_diff": sharing_max_diff,
        "sharing_target_met": sharing_max_diff <= 0.02,
    }
    print(f"\nsummary: {json.dumps(summary)}")
    result = {
        "mode": "quick" if quick else "full",
        "seed": args.seed,
        "python": sys.version.split()[0],
        "machine": platform.platform(),
        "summary": summary,
        "insert": insert,
        "rounds": rounds,
        "sharing": sharing,
        "sharing_not_aligned": extras,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
