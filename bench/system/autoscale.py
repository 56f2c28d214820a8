"""`--workers auto` against fixed decode pools, for a prep-bound and a compute-bound job mix.

Each configuration serves the same mix on the same data (1,000 images, a quarter cache):
`--workers auto` (the default), and every fixed count from 1 to the CPUs joaderd may use (the
old default was all of them). After a warm-up (auto needs a few periods to settle), the window
measures the jobs' aggregate samples/s, the CPU seconds their processes got (what the pool left
to training) and the decode workers' CPU, and auto's pool size and resize log.

- prep-bound: two jobs whose step is short (0.02 s of sleep per batch of 32): data is the
  bottleneck, and more decode workers should help until the cores run out.
- compute-bound: two jobs whose step needs a core (0.12 s of CPU per batch of 32, as a CPU model
  or a heavy per-job pipeline would): data is not the bottleneck; decode workers should take no
  more CPU than feeding them needs.

Usage: python -m bench.system.autoscale [--quick] [--reps 3] [--warmup 16] [--window 20]
Writes bench/results/autoscale[-quick].json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import (
    Server,
    demo_data,
    machine,
    median,
    print_table,
    quarter_cache_bytes,
    simjob_command,
    start_processes,
    stop_processes,
    write_json,
)

MIXES = {
    "prep-bound": [("prep-a", 0.02, 0.0), ("prep-b", 0.02, 0.0)],
    "compute-bound": [("cpu-a", 0.0, 0.12), ("cpu-b", 0.0, 0.12)],
}
BATCH = 32


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def run_config(root: Path, n: int, mix: str, workers: str, warmup_s: float, window_s: float) -> dict[str, Any]:
    with Server(root, quarter_cache_bytes(n), workers=workers) as server:
        jobs = start_processes([simjob_command(name, address=server.address, epochs=100_000, batch_size=BATCH,
                                               step_s=step, step_cpu_s=step_cpu)
                                for name, step, step_cpu in MIXES[mix]])
        try:
            time.sleep(warmup_s)
            before = server.status()
            job_pids = [job.pid for job in jobs]
            worker_pids = list(before["workers"]["pids"])
            jobs_cpu, workers_cpu, started = cpu_s(job_pids), cpu_s(worker_pids), time.monotonic()
            sizes = []
            while time.monotonic() - started < window_s:
                time.sleep(1.0)
                sizes.append(server.status()["workers"]["configured"])
            after = server.status()
            elapsed = time.monotonic() - started
            jobs_cpu = cpu_s(job_pids) - jobs_cpu
            workers_cpu = cpu_s(list(set(worker_pids) | set(after["workers"]["pids"]))) - workers_cpu
        finally:
            stop_processes(jobs)
    delivered = after["items_delivered"] - before["items_delivered"]
    return {
        "mix": mix, "workers": workers, "samples_per_s": round(delivered / elapsed, 1),
        "jobs_cores": round(jobs_cpu / elapsed, 3), "decode_worker_cores": round(workers_cpu / elapsed, 3),
        "pool_sizes": sizes, "mean_pool_size": round(sum(sizes) / max(1, len(sizes)), 2),
        "stalls": {j["name"]: (j.get("stall") or {}).get("fraction") for j in after["jobs"]},
        "resizes": after["workers"].get("resizes", []),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repetition, shorter windows")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--warmup", type=float)
    parser.add_argument("--window", type=float)
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 3)
    warmup = args.warmup or (12.0 if args.quick else 16.0)
    window = args.window or (12.0 if args.quick else 20.0)
    cpus = len(os.sched_getaffinity(0))
    configs = ["auto", *[str(k) for k in range(1, cpus + 1)]]
    root = demo_data(args.items)
    info = machine()
    runs = []
    for rep in range(reps):
        for mix in MIXES:
            for workers in configs:
                run = run_config(root, args.items, mix, workers, warmup, window)
                run["rep"] = rep
                runs.append(run)
                print(f"rep {rep} {mix} workers={workers}: {run['samples_per_s']:.0f} samples/s, jobs "
                      f"{run['jobs_cores']:.2f} cores, decode workers {run['decode_worker_cores']:.2f} cores, "
                      f"pool {run['mean_pool_size']:.1f}", flush=True)
    table = []
    for mix in MIXES:
        rows = {w: [r for r in runs if r["mix"] == mix and r["workers"] == w] for w in configs}
        summary = {w: {"samples_per_s": median([r["samples_per_s"] for r in rs]),
                       "jobs_cores": median([r["jobs_cores"] for r in rs]),
                       "decode_worker_cores": median([r["decode_worker_cores"] for r in rs]),
                       "mean_pool_size": median([r["mean_pool_size"] for r in rs])} for w, rs in rows.items()}
        best = max((w for w in configs if w != "auto"), key=lambda w: summary[w]["samples_per_s"])
        table.append({"mix": mix, "by_workers": summary, "best_fixed": best,
                      "auto_vs_best_fixed": round(summary["auto"]["samples_per_s"] / summary[best]["samples_per_s"], 3),
                      "auto_vs_all_cpus": round(summary["auto"]["samples_per_s"] / summary[str(cpus)]["samples_per_s"], 3)})
    print(f"\nautoscale: {args.items} images, quarter cache, {cpus} CPUs, median of {reps} "
          f"(warm-up {warmup:g} s, window {window:g} s)")
    print_table(["mix", "workers", "samples/s", "jobs' cores", "decode workers' cores", "pool size"],
                [[t["mix"], w, s["samples_per_s"], s["jobs_cores"], s["decode_worker_cores"], s["mean_pool_size"]]
                 for t in table for w, s in t["by_workers"].items()])
    for t in table:
        print(f"{t['mix']}: auto = {t['auto_vs_best_fixed']:.3f}x the best fixed ({t['best_fixed']} workers), "
              f"{t['auto_vs_all_cpus']:.3f}x all {cpus} CPUs")
    data = {"machine": info, "items": args.items, "mixes": MIXES, "reps": reps, "warmup_s": warmup,
            "window_s": window, "table": table, "runs": runs,
            "command": "python -m bench.system.autoscale" + (" --quick" if args.quick else "")}
    print(f"wrote {write_json('autoscale-quick' if args.quick else 'autoscale', data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
