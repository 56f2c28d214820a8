"""`joader analyze`'s prediction against a measured run: epoch time with 1 -> 2 decode workers.

Per repetition, the same job mix runs twice on the same data: served by one decode worker, then
(after a restart) by two. In the one-worker run, after a warm-up, `joader analyze --json`
watches for `--window` seconds and predicts each job's epoch time with two workers; then each
run's steady epoch time is measured as the job's items per epoch over its delivered samples/s
in a window of the same length (status snapshots). The error is (predicted - measured) /
measured, per job; medians over the repetitions.

The mix: 1,000 images (256 px, Pillow-free turbo decoding, as served by default), a quarter
cache, two jobs with a short step (0.02 s per batch of 32: prep-bound) and one with a long
step (0.25 s per batch: compute-bound). On this two-core machine the second worker shares the
cores with the jobs' processes and joaderd itself, which the model must account for.

Usage: python -m bench.analyze [--quick] [--reps 3] [--window 8] [--warmup 10]
Writes bench/results/analyze[-quick].json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Server,
    bench_env,
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

MIX = (("prep-a", 0.02), ("prep-b", 0.02), ("compute", 0.25))
BATCH = 32


def start_jobs(address: str) -> list[subprocess.Popen[bytes]]:
    return start_processes([simjob_command(name, address=address, epochs=100_000, batch_size=BATCH, step_s=step)
                            for name, step in MIX])


def measured_epoch_s(server: Server, window_s: float) -> dict[str, float]:
    """Each job's items per epoch over its delivered samples/s in a window."""
    before = {j["name"]: j for j in server.status()["jobs"]}
    started = time.monotonic()
    time.sleep(window_s)
    after = {j["name"]: j for j in server.status()["jobs"]}
    elapsed = time.monotonic() - started
    epochs = {}
    for name, job in after.items():
        rate = (job["items_delivered"] - before[name]["items_delivered"]) / elapsed
        epochs[name] = job["epoch_items"] / rate if rate > 0 else float("inf")
    return epochs


def analyze(server: Server, window_s: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "joader.client.cli", "analyze", "--json", "--interval", str(window_s),
                          "--address", server.address], capture_output=True, text=True, timeout=120, check=True,
                         env=bench_env())
    return json.loads(out.stdout)


def one_rep(root: Path, n: int, window_s: float, warmup_s: float) -> dict[str, Any]:
    result: dict[str, Any] = {}
    with Server(root, quarter_cache_bytes(n), workers=1) as server:
        jobs = start_jobs(server.address)
        try:
            time.sleep(warmup_s)
            report = analyze(server, window_s)
            result["measured_1"] = measured_epoch_s(server, window_s)
        finally:
            stop_processes(jobs)
    result["report"] = report
    result["predicted_2"] = {}
    result["predicted_1"] = {}
    result["bound"] = {}
    for job in report["jobs"]:
        by_workers = {w["workers"]: w for w in job["workers"]}
        result["predicted_2"][job["name"]] = by_workers[2]["epoch_s"]
        result["predicted_1"][job["name"]] = by_workers[1]["epoch_s"]
        result["bound"][job["name"]] = job["bound"]
    with Server(root, quarter_cache_bytes(n), workers=2) as server:
        jobs = start_jobs(server.address)
        try:
            time.sleep(warmup_s)
            result["measured_2"] = measured_epoch_s(server, window_s)
        finally:
            stop_processes(jobs)
    result["error_2"] = {name: (result["predicted_2"][name] - result["measured_2"][name]) / result["measured_2"][name]
                         for name in result["predicted_2"] if result["predicted_2"][name]}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repetition, shorter windows")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--window", type=float)
    parser.add_argument("--warmup", type=float)
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 3)
    window = args.window or (5.0 if args.quick else 8.0)
    warmup = args.warmup or (8.0 if args.quick else 10.0)
    root = demo_data(args.items)
    info = machine()
    runs = []
    for rep in range(reps):
        run = one_rep(root, args.items, window, warmup)
        runs.append(run)
        print(f"rep {rep}: " + ", ".join(
            f"{name} ({run['bound'][name]}): 1 worker {run['measured_1'][name]:.1f} s, 2 workers predicted "
            f"{run['predicted_2'][name]:.1f} s, measured {run['measured_2'][name]:.1f} s "
            f"({run['error_2'][name]:+.0%})" for name in run["error_2"]), flush=True)
    names = [name for name, _ in MIX]
    table = []
    for name in names:
        table.append({
            "job": name, "bound_at_1_worker": runs[0]["bound"][name],
            "measured_1_worker_epoch_s": round(median([r["measured_1"][name] for r in runs]), 2),
            "predicted_2_workers_epoch_s": round(median([r["predicted_2"][name] for r in runs]), 2),
            "measured_2_workers_epoch_s": round(median([r["measured_2"][name] for r in runs]), 2),
            "error": round(median([r["error_2"][name] for r in runs]), 4),
            "abs_error_reps": [round(abs(r["error_2"][name]), 4) for r in runs],
        })
    print(f"\nanalyze: predicted vs measured epoch time, 1 -> 2 decode workers, {args.items} images, "
          f"quarter cache, median of {reps}")
    print_table(["job", "bound (1 worker)", "1 worker s", "2 workers predicted s", "2 workers measured s", "error"],
                [[t["job"], t["bound_at_1_worker"], t["measured_1_worker_epoch_s"], t["predicted_2_workers_epoch_s"],
                  t["measured_2_workers_epoch_s"], f"{t['error']:+.1%}"] for t in table])
    data = {"machine": info, "items": args.items, "mix": MIX, "window_s": window, "warmup_s": warmup,
            "reps": reps, "table": table, "runs": runs,
            "command": "python -m bench.analyze" + (" --quick" if args.quick else "")}
    print(f"wrote {write_json('analyze-quick' if args.quick else 'analyze', data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
