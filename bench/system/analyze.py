"""`joader analyze` against measured runs: its stall for the setting measured, and for 1 -> 2 workers.

Two configurations, each served by one decode worker, then (after a restart) by two:

- data-bound: two jobs with a short step (0.02 s per batch of 32, a sleep), a quarter cache:
  the one worker is the limit;
- compute-bound: issue 38's case, four jobs whose step is CPU work (0.05 s of CPU per batch of
  32, as CPU training is), a whole-dataset cache: the jobs' own steps fill the cores.

Per repetition and configuration: once every job is in its second epoch and after a warm-up,
`joader analyze --json` watches `--window`
seconds with one worker. Its figures: the measured stall, the model's stall for that very
setting (fit on the same window: the error analyze states and prints), and its prediction for
two workers. Then joaderd restarts with two workers and `joader analyze` measures again: the
measured stall and epoch time with two workers, against the prediction. Medians over the
repetitions; every repetition's errors are kept in the JSON.

Usage: python -m bench.system.analyze [--quick] [--reps 3] [--window 6] [--warmup 10] [--items 600]
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
    full_cache_bytes,
    machine,
    median,
    print_table,
    quarter_cache_bytes,
    simjob_command,
    start_processes,
    stop_processes,
    write_json,
)

BATCH = 32
# name -> (cache, jobs: (name, sleep s per batch, CPU s per batch))
CONFIGS: dict[str, tuple[str, list[tuple[str, float, float]]]] = {
    "data-bound": ("quarter", [("prep-a", 0.02, 0.0), ("prep-b", 0.02, 0.0)]),
    "compute-bound": ("whole", [(f"cpu-{i}", 0.0, 0.05) for i in range(4)]),
}


def analyze(server: Server, window_s: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "analyze", "--json", "--interval", str(window_s),
                          "--address", server.address], capture_output=True, text=True, timeout=120, check=True,
                         env=bench_env())
    return json.loads(out.stdout)


def past_first_epoch(server: Server, num_jobs: int, timeout_s: float = 180.0) -> None:
    """Until every job is in its second epoch: with a whole-dataset cache the first one decodes
    and the rest do not, and a window across the change is not a steady one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        jobs = server.status()["jobs"]
        if len(jobs) == num_jobs and all(job["epoch"] >= 2 for job in jobs):
            return
        time.sleep(1.0)
    raise TimeoutError(f"the jobs did not reach their second epoch within {timeout_s:g} s")


def run_with(root: Path, items: int, config: str, workers: int, window_s: float, warmup_s: float) -> dict[str, Any]:
    """joaderd with `workers` decode workers and the configuration's jobs: analyze's report."""
    cache, jobs = CONFIGS[config]
    cache_bytes = quarter_cache_bytes(items) if cache == "quarter" else full_cache_bytes(items)
    with Server(root, cache_bytes, workers=workers) as server:
        procs = start_processes([simjob_command(name, address=server.address, epochs=100_000, batch_size=BATCH,
                                                step_s=sleep_s, step_cpu_s=cpu_s) for name, sleep_s, cpu_s in jobs])
        try:
            past_first_epoch(server, len(jobs))
            time.sleep(warmup_s)
            return analyze(server, window_s)
        finally:
            stop_processes(procs)


def one_rep(root: Path, items: int, config: str, window_s: float, warmup_s: float) -> dict[str, Any]:
    one = run_with(root, items, config, 1, window_s, warmup_s)
    two = run_with(root, items, config, 2, window_s, warmup_s)
    measured_two = {j["name"]: j["measured"] for j in two["jobs"]}
    jobs = {}
    for job in one["jobs"]:
        predicted = {w["workers"]: w for w in job["workers"]}[2]
        after = measured_two[job["name"]]
        jobs[job["name"]] = {
            "bound": job["bound"],
            "stall_1": job["measured"]["stall"], "model_1": job["model_check"]["predicted_stall"],
            "error_1": job["model_check"]["error"],
            "predicted_stall_2": predicted["stall"], "stall_2": after["stall"],
            "error_2": round(predicted["stall"] - after["stall"], 4),
            "epoch_1_s": job["measured"]["epoch_s"], "predicted_epoch_2_s": predicted["epoch_s"],
            "epoch_2_s": after["epoch_s"],
            "epoch_error_2": round((predicted["epoch_s"] - after["epoch_s"]) / after["epoch_s"], 4),
        }
    return {"jobs": jobs, "report_1": one, "report_2": two}


def summarize(config: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name in runs[0]["jobs"]:
        figures = [r["jobs"][name] for r in runs]

        def mid(key: str, figures: list[dict[str, Any]] = figures) -> float:
            return round(median([f[key] for f in figures]), 4)

        rows.append({"config": config, "job": name, "bound": figures[0]["bound"],
                     **{key: mid(key) for key in ("stall_1", "model_1", "error_1", "predicted_stall_2", "stall_2",
                                                   "error_2", "epoch_1_s", "predicted_epoch_2_s", "epoch_2_s",
                                                   "epoch_error_2")},
                     "max_abs_error_1": max(abs(f["error_1"]) for f in figures),
                     "max_abs_error_2": max(abs(f["error_2"]) for f in figures)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repetition, shorter windows")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--items", type=int, default=600)
    parser.add_argument("--window", type=float)
    parser.add_argument("--warmup", type=float)
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 3)
    window = args.window or (4.0 if args.quick else 6.0)
    warmup = args.warmup or (8.0 if args.quick else 10.0)
    root = demo_data(args.items)
    info = machine()
    runs: dict[str, list[dict[str, Any]]] = {config: [] for config in CONFIGS}
    for rep in range(reps):
        for config in CONFIGS:
            run = one_rep(root, args.items, config, window, warmup)
            runs[config].append(run)
            print(f"rep {rep} {config}: " + ", ".join(
                f"{name} stall {j['stall_1']:.1%} (model {j['model_1']:.1%}); 2 workers predicted "
                f"{j['predicted_stall_2']:.1%} / {j['predicted_epoch_2_s']:.2f} s, measured {j['stall_2']:.1%} / "
                f"{j['epoch_2_s']:.2f} s" for name, j in run["jobs"].items()), flush=True)
    table = [row for config in CONFIGS for row in summarize(config, runs[config])]
    print(f"\nanalyze: stall measured against modelled, 1 decode worker (now) and 2 (predicted), "
          f"{args.items} images, median of {reps}")
    print_table(["config", "job", "bound", "stall 1w", "model 1w", "stall 2w predicted", "stall 2w measured",
                 "epoch 2w predicted s", "epoch 2w measured s"],
                [[t["config"], t["job"], t["bound"], f"{t['stall_1']:.1%}", f"{t['model_1']:.1%}",
                  f"{t['predicted_stall_2']:.1%}", f"{t['stall_2']:.1%}", t["predicted_epoch_2_s"], t["epoch_2_s"]]
                 for t in table])
    data = {"machine": info, "items": args.items, "configs": CONFIGS, "batch_size": BATCH, "window_s": window,
            "warmup_s": warmup, "reps": reps, "table": table, "runs": runs,
            "command": "python -m bench.system.analyze" + (" --quick" if args.quick else "")}
    write_json("analyze-quick" if args.quick else "analyze", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
