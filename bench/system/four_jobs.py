"""Close to the limit: 4 plain jobs against the GPU-bound ideal, with every CPU-second accounted for.

The run is what a user runs with the README's defaults: 4 plain scripts (`bench/system/plain_job.py`),
each `DataLoader(JoaderDataset("demo", transform=crop_flip), batch_size=25)`, 2 epochs over 1,200
demo JPEGs of 500x375, a random 224 crop + flip per image in the job's process, an emulated GPU step
(a sleep per batch), launched together against one joaderd with its defaults (`--workers auto`, a
cache of a quarter of the prepared dataset); each job reads as soon as it is built (no start
barrier), and the figure is launch to end: process start-up is in it. One run measures every step
time of `--steps` (default 0.08, 0.04 and 0.02 s: the faster the GPU, the more the CPU is the
limit), medians of `--reps`.

Figures per step:
- samples/s launch to end (the first job's launch to the last job's last step): what the user
  waits for; and over the span (the first job's first read to the last step);
- of the ideal: the GPU-bound ideal, every job stepping back to back (96 steps x the step), over
  the span; and launch to end against that ideal plus the jobs' start-up (launch to built);
- decodes per item-epoch: joaderd's decodes / (items x epochs); 1.0 is every item once per epoch
  (the next epoch's lookahead, prepared before the jobs exit, adds a little);
- the CPU accounting, CPU-seconds by role over the whole run (launch to end): joaderd's main
  process (gRPC, scheduler), the forker (its own CPU only), the decode workers (live ones, and
  those the forker reaped: retired or dead), each job's training process (start-up: launch to
  its first read, then its loop in and outside `next()`), its lease keeper, its DataLoader workers
  if any; the CPU floor they imply (their sum / cores) beside the launch-to-end time.

Other sides, by flag (`--sides joader,turbo,pil`): turbo DataLoaders, 4 independent DataLoaders over
an ImageFolder doing joaderd's shared stage with joaderd's default decoder (simplejpeg with DCT
scaling + OpenCV) in DataLoader workers; Pillow DataLoaders, the same with the `pil` decoder. Their
worker count per job is searched (1, 2) in the first repetition of each step; the best is kept.

The earlier configuration (a fixed pool, every job reading at once from a start file once all are
built, start-up accounted apart): `--server-workers 2 --barrier`.

Usage: python -m bench.system.four_jobs [--steps 0.08,0.04,0.02] [--reps 3] [--jobs 4] [--items 1200]
       [--sides joader] [--server-workers auto] [--barrier] [--data DIR]
Writes bench/results/NAME.json (default four_jobs) and prints a table and the CPU accounting per step.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Server,
    demo_data,
    machine,
    median,
    print_table,
    quarter_cache_bytes,
    write_json,
)

SIDES = ("joader", "turbo", "pil")
LABELS = {"joader": "joader", "turbo": "turbo DataLoaders", "pil": "Pillow DataLoaders"}
TICK = os.sysconf("SC_CLK_TCK")


def proc_table() -> dict[int, tuple[int, float, float]]:
    """Every process: pid -> (parent, own utime + stime, reaped children's cutime + cstime), /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read().decode(errors="replace")
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK,
                                 (int(fields[13]) + int(fields[14])) / TICK)
    return table


def server_cpu(main: int) -> dict[str, float]:
    """joaderd's CPU by role, cumulative: its main process (own CPU), the forker (its child: own
    CPU), the decode workers (the forker's children, live, plus what the forker reaped of them).

    Roles come from the process tree, not from a list of worker pids taken once: under
    `--workers auto` workers start (and retire) during the run, and a list taken at the start
    counted the workers started later as the forker's CPU (issue 29: "the forker 4.64 CPU-s")."""
    table = proc_table()
    out = {"joaderd main": 0.0, "forker": 0.0, "decode workers": 0.0}
    if main not in table:
        return out
    out["joaderd main"] = table[main][1]
    for forker, (parent, own, reaped) in table.items():
        if parent == main:
            out["forker"] += own
            out["decode workers"] += reaped + sum(t[1] + t[2] for t in table.values() if t[0] == forker)
    return out


def run_side(side: str, root: Path, args: argparse.Namespace, workers: int, step_s: float) -> dict[str, Any]:
    """One run of `args.jobs` plain jobs on one side; their reports and joaderd's accounting."""
    work = Path(tempfile.mkdtemp(prefix="j4-", dir="/tmp"))
    server = Server(root, quarter_cache_bytes(args.items), workers=args.server_workers) if side == "joader" else None
    procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    start_file = work / "start"
    try:
        before = server_cpu(server.proc.pid) if server is not None else {}
        for i in range(args.jobs):
            command = [sys.executable, "-m", "bench.system.plain_job", side, "--out", str(work / f"job{i}.json"),
                       "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--step-s", str(step_s),
                       "--augment", str(args.augment), "--ready-file", str(work / f"ready{i}")]
            if args.barrier:
                command += ["--start-file", str(start_file)]
            if server is not None:
                command += ["--address", server.address]
                if args.prefetch is not None:
                    command += ["--prefetch", str(args.prefetch)]
            else:
                command += ["--root", str(root), "--num-workers", str(workers)]
            env = {**os.environ, "JOB_LAUNCHED_AT": repr(time.time()), "PYTHONWARNINGS": "ignore"}
            err = work / f"job{i}.err"
            procs.append((subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(err, "wb"), env=env),
                          work / f"job{i}.json", err))
        deadline = time.monotonic() + 300
        while args.barrier and not all((work / f"ready{i}").exists() for i in range(args.jobs)):
            if time.monotonic() > deadline or any(p.poll() is not None for p, _, _ in procs):
                raise RuntimeError(f"{side}: a job did not get ready:\n" + "\n".join(
                    e.read_text(errors="replace")[-2000:] for _, _, e in procs))
            time.sleep(0.01)
        if args.barrier:
            time.sleep(0.3)  # every job now waits on the start file (DataLoader workers started lazily)
            before = server_cpu(server.proc.pid) if server is not None else {}  # start-up apart, as before
            start_file.touch()
        for proc, _, err in procs:
            if proc.wait(timeout=900) != 0:
                raise RuntimeError(f"{side}: a job failed:\n{err.read_text(errors='replace')[-3000:]}")
        after = server_cpu(server.proc.pid) if server is not None else {}
        status = server.status() if server is not None else None
        reports = [json.loads(out.read_text()) for _, out, _ in procs]
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if server is not None:
            if args.keep_logs is not None:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                shutil.copy(server.log_path, args.keep_logs / f"joaderd-{step_s}-{time.strftime('%H%M%S')}.log")
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return account(side, workers, reports, {k: after[k] - before[k] for k in after}, status, args, step_s)


def account(side: str, workers: int, reports: list[dict[str, Any]], server: dict[str, float],
            status: dict[str, Any] | None, args: argparse.Namespace, step_s: float) -> dict[str, Any]:
    launched = min(r["launched_at"] for r in reports)
    started = min(r["started_at"] for r in reports)
    ended = max(r["ended_at"] for r in reports)
    span = ended - started
    samples = sum(r["samples"] for r in reports)
    gpu_floor = max(r["steps"] for r in reports) * step_s
    built = median([r["ready_at"] - r["launched_at"] for r in reports])

    def helpers(kind: str) -> float:
        return sum(r["cpu"].get("helpers_by_kind", {}).get(kind, 0.0) for r in reports)

    cpu = {
        **server,
        "jobs: start-up (launch to first read)": sum(r["cpu"]["started"] for r in reports),
        "jobs: loop in next()": sum(r["next_cpu_s"] for r in reports),
        "jobs: loop outside next()": sum(r["cpu"]["ended"] - r["cpu"]["started"] - r["next_cpu_s"] for r in reports),
        "jobs: lease keepers": helpers("lease keeper"),
        "jobs: DataLoader workers": helpers("DataLoader workers") + helpers("reaped"),
    }
    total = sum(cpu.values())
    # With a start barrier, the span's CPU leaves the jobs' start-up out (accounted apart).
    in_span = total - (cpu["jobs: start-up (launch to first read)"] if args.barrier else 0.0)
    cores = len(os.sched_getaffinity(0))
    out = {
        "side": side, "step_s": step_s, "workers_per_job": workers if side != "joader" else None,
        "samples": samples, "span_s": round(span, 3),
        "launch_to_end_s": round(ended - launched, 3),
        "samples_per_s": round(samples / (ended - launched), 1),
        "span_samples_per_s": round(samples / span, 1),
        "gpu_floor_s": round(gpu_floor, 3), "of_ideal": round(gpu_floor / span, 3),
        # launch to end against the GPU floor after a job's start-up (launch to built, median)
        "of_ideal_with_start_up": round((built + gpu_floor) / (ended - launched), 3),
        "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
        "cpu_per_job_s": [{"start-up": round(r["cpu"]["started"], 3),
                           "loop": round(r["cpu"]["ended"] - r["cpu"]["started"], 3),
                           **{k: round(v, 3) for k, v in r["cpu"].get("helpers_by_kind", {}).items()}}
                          for r in reports],
        "cpu_total_s": round(total, 3), "cpu_floor_s": round(in_span / cores, 3),
        "first_batch_s": round(median([r["first_batch_at"] - r["started_at"] for r in reports]), 3),
        "start_up_wall_s": round(median([r["started_at"] - r["launched_at"] for r in reports]), 3),
        # launch to built (imported, dataset and loader made; joader: attached), before any barrier
        "built_wall_s": round(built, 3),
        "start_skew_s": round(max(r["started_at"] for r in reports) - started, 3),
        "data_wait_s": round(sum(r["wait_s"] - r["next_cpu_s"] for r in reports), 3),
        "job_span_s": [round(r["ended_at"] - r["started_at"], 3) for r in reports],
        "waits": [r["waits"] for r in reports],
    }
    if status is not None:
        out.update({"items_decoded": status["items_decoded"], "items_delivered": status["items_delivered"],
                    "decodes_per_item_epoch": round(status["items_decoded"] / (args.items * args.epochs), 3),
                    "decode_s": status["decodes"].get("decode_s"), "sharing": status["sharing"],
                    "pair_sharing": [round(p["rate"], 2) for p in status["sharing_pairs"]],
                    "evictions": status["cache"]["evictions"], "lookups": status["cache"]["lookups"],
                    "workers": {k: status["workers"].get(k) for k in ("mode", "configured", "alive", "resizes")}})
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("samples_per_s", "span_samples_per_s", "of_ideal", "of_ideal_with_start_up", "span_s",
            "launch_to_end_s", "cpu_total_s", "cpu_floor_s", "gpu_floor_s", "data_wait_s", "first_batch_s",
            "start_up_wall_s", "built_wall_s", "start_skew_s", "items_decoded", "decodes_per_item_epoch")
    out: dict[str, Any] = {"runs": len(runs), "workers_per_job": runs[0]["workers_per_job"]}
    out.update({k: median([r[k] for r in runs]) for k in keys if k in runs[0]})
    out["cpu_s"] = {k: round(median([r["cpu_s"][k] for r in runs]), 2) for k in runs[0]["cpu_s"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--steps", default="0.08,0.04,0.02", help="emulated GPU step times, s, one run each")
    parser.add_argument("--step-s", dest="steps", help=argparse.SUPPRESS)  # the old flag: one step
    parser.add_argument("--augment", type=int, default=224)
    parser.add_argument("--server-workers", default="auto", help="joaderd --workers (default auto, the README's)")
    parser.add_argument("--sides", default="joader", help=f"some of {','.join(SIDES)} (default joader)")
    parser.add_argument("--baseline-workers", default="1,2", help="worker counts searched per baseline job")
    parser.add_argument("--barrier", action="store_true",
                        help="every job reads at once from a start file once all are built, start-up accounted "
                             "apart (the earlier configuration); default: each reads as soon as it is built")
    parser.add_argument("--no-barrier", dest="barrier", action="store_false", help=argparse.SUPPRESS)  # the default now
    parser.add_argument("--prefetch", type=int, help="joader side: JoaderDataset(prefetch=N) (default: not given)")
    parser.add_argument("--data", type=Path, metavar="DIR",
                        help="an ImageFolder to use instead of the generated demo data (--items is then "
                             "its number of images)")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR", help="copy each joaderd's log into DIR")
    parser.add_argument("--name", default="four_jobs")
    args = parser.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    if any(s not in SIDES for s in sides):
        parser.error(f"--sides: some of {', '.join(SIDES)}")
    steps = [float(s) for s in str(args.steps).split(",") if s]
    if args.data is not None:
        from joader.sources.imagefolder import list_image_folder

        root = args.data.resolve()
        args.items = len(list_image_folder(str(root)).paths)
        args.data = str(root)
    else:
        root = demo_data(args.items)
    # What an installed joader has: compiled modules (an editable install under
    # PYTHONDONTWRITEBYTECODE has none, and every job would compile them again; `make` does this too).
    repo = Path(__file__).resolve().parents[2]
    for package in ("joader", "server", "client", "bench"):
        compileall.compile_dir(str(repo / package), quiet=1)
    info = machine()
    search = [int(w) for w in args.baseline_workers.split(",")]
    trials: list[dict[str, Any]] = []
    summary: dict[str, dict[str, Any]] = {}
    for step_s in steps:
        best: dict[str, int] = {}
        for rep in range(args.reps):
            order = sides[rep % len(sides):] + sides[:rep % len(sides)]
            for side in order:
                candidates = [0] if side == "joader" else ([best[side]] if side in best else search)
                results = []
                for w in candidates:
                    t = run_side(side, root, args, w, step_s)
                    t["rep"] = rep
                    t["loadavg"] = list(os.getloadavg())
                    trials.append(t)
                    results.append(t)
                    decodes = (f", {t['decodes_per_item_epoch']:.2f} decodes/item-epoch, "
                               f"{len(t['workers']['resizes'] or ())} resizes" if "items_decoded" in t else "")
                    print(f"step {step_s} rep {rep} {LABELS[side]}{f' w={w}' if side != 'joader' else ''}: "
                          f"launch to end {t['launch_to_end_s']:.2f} s, {t['samples_per_s']:.0f}/s; span "
                          f"{t['span_s']:.2f} s ({100 * t['of_ideal']:.0f}% of ideal){decodes}; load "
                          f"{t['loadavg'][0]:.2f}", flush=True)
                if side != "joader" and side not in best:
                    best[side] = max(results, key=lambda r: r["samples_per_s"])["workers_per_job"]
        for side in sides:
            runs = [t for t in trials if t["side"] == side and t["step_s"] == step_s
                    and (side == "joader" or t["workers_per_job"] == best[side])]
            summary[f"{side}@{step_s}"] = {"side": side, "step_s": step_s, **summarize(runs)}
    info["loadavg_at_end"] = list(os.getloadavg())
    report(summary, steps, sides, args)
    path = write_json(args.name, {"machine": info, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "summary": summary, "trials": trials})
    print(f"\nwrote {path}")
    return 0


def report(summary: dict[str, dict[str, Any]], steps: list[float], sides: list[str], args: argparse.Namespace) -> None:
    print(f"\n{args.jobs} jobs x {args.epochs} epochs x {args.items} items, batch {args.batch_size}; joaderd "
          f"--workers {args.server_workers}; {'a start barrier' if args.barrier else 'no start barrier'}; "
          f"medians of {args.reps}")
    print_table(["step s", "side", "workers/job", "samples/s launch->end", "samples/s span", "ideal /s",
                 "of ideal (span)", "of ideal + start-up", "launch->end s", "decodes/item-epoch"],
                [[v["step_s"], LABELS[v["side"]], v["workers_per_job"] or "-", v["samples_per_s"],
                  v["span_samples_per_s"], round(args.jobs * args.batch_size / v["step_s"]),
                  f"{100 * v['of_ideal']:.0f}%", f"{100 * v['of_ideal_with_start_up']:.0f}%", v["launch_to_end_s"],
                  v.get("decodes_per_item_epoch", "-")] for v in summary.values()])
    for step_s in steps:
        cols = [summary[f"{s}@{step_s}"] for s in sides]
        roles = list(dict.fromkeys(k for v in cols for k in v["cpu_s"]))
        print(f"\nstep {step_s} s: CPU-seconds by role, all jobs together, "
              f"{'from the start barrier' if args.barrier else 'launch to end'}")
        print_table(["role", *[LABELS[s] for s in sides]],
                    [[role, *[v["cpu_s"].get(role, "-") for v in cols]] for role in roles]
                    + [["all roles", *[v["cpu_total_s"] for v in cols]],
                       ["CPU floor (CPU / cores) s", *[v["cpu_floor_s"] for v in cols]],
                       ["GPU floor s", *[v["gpu_floor_s"] for v in cols]],
                       ["launch to end s", *[v["launch_to_end_s"] for v in cols]],
                       ["span (first read to end) s", *[v["span_s"] for v in cols]],
                       ["data wait (in next(), off CPU) s", *[v["data_wait_s"] for v in cols]],
                       ["launch to built, per job s", *[v["built_wall_s"] for v in cols]],
                       ["first reads' skew s", *[v["start_skew_s"] for v in cols]]])


if __name__ == "__main__":
    sys.exit(main())
