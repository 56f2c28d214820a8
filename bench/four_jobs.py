"""Close to the limit: 4 plain jobs against the GPU-bound ideal, with every CPU-second accounted for.

The run (the issue's, and the README's defaults): 4 jobs x 2 epochs over 1,200 demo JPEGs of
500x375, batch 25, a random 224 crop + flip per image in the job's process, an emulated GPU step
of 0.08 s per batch (a sleep), each job a plain script (`bench/plain_job.py`). Three sides, side
by side in each repetition, their order rotated:
- joader: one joaderd (`--workers 2`, a cache of a quarter of the prepared dataset), each job
  `DataLoader(JoaderDataset("demo", transform=crop_flip), batch_size=25)`;
- turbo DataLoaders: 4 independent DataLoaders over an ImageFolder doing joaderd's shared stage
  with joaderd's default decoder (simplejpeg with DCT scaling + OpenCV), in DataLoader workers;
- Pillow DataLoaders: the same with the `pil` decoder (Pillow, `draft`).
The baselines' worker count per job is searched (1, 2) in the first repetition; the best is kept.

Every job starts reading at once (a start file, once all are built), so the span (first read to
last step) is the training; start-up (import, attach, workers) is accounted for apart. The GPU-bound
ideal: every job steps back to back, 96 steps x 0.08 s = 7.68 s, 1,250 samples/s for the four.

The CPU accounting (median over repetitions), per side: CPU-seconds by role - joaderd's main
process (gRPC, scheduler), its decode workers, the jobs' start-up (process start to the start
barrier: import, attach or worker start), the jobs' loops inside `next()` (copies, the job stage,
gRPC), the jobs' loops outside it, their helper processes (the lease keeper; the baselines'
DataLoader workers, which decode) - and the floors they imply: CPU during the span / cores,
beside the GPU floor and the measured span. Where the span exceeds both floors, the time is in
waits (`data wait`: the loops' time in `next()` beyond their CPU there).

Usage: python -m bench.four_jobs [--reps 3] [--jobs 4] [--items 1200] [--sides joader,turbo,pil] [--data DIR]
Writes bench/results/four_jobs.json and prints the tables.
"""

from __future__ import annotations

import argparse
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


def pid_cpu_s(pid: int) -> float:
    """utime + stime of `pid` and its reaped children (/proc), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return 0.0
    fields = stat[stat.rfind(")") + 2:].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read().decode(errors="replace")
            except OSError:
                continue
            parents[int(entry)] = int(stat[stat.rfind(")") + 2:].split()[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p:
                found.append(child)
                frontier.append(child)
    return found


def server_cpu(server: Server, worker_pids: set[int]) -> dict[str, float]:
    """joaderd's CPU by role: the main process, its decode workers, the rest (the forker)."""
    main = server.proc.pid
    out = {"joaderd main": pid_cpu_s(main), "decode workers": 0.0, "forker": 0.0}
    for pid in descendants(main):
        out["decode workers" if pid in worker_pids else "forker"] += pid_cpu_s(pid)
    return out


def run_side(side: str, root: Path, args: argparse.Namespace, workers: int) -> dict[str, Any]:
    """One run of `args.jobs` plain jobs on one side; their reports and joaderd's accounting."""
    work = Path(tempfile.mkdtemp(prefix="j4-", dir="/tmp"))
    server = Server(root, quarter_cache_bytes(args.items), workers=args.server_workers) if side == "joader" else None
    procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    start_file = work / "start"
    try:
        for i in range(args.jobs):
            command = [sys.executable, "-m", "bench.plain_job", side, "--out", str(work / f"job{i}.json"),
                       "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--step-s", str(args.step_s),
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
        worker_pids = set(server.status()["workers"]["pids"]) if server is not None else set()
        before = server_cpu(server, worker_pids) if server is not None else {}
        start_file.touch()
        for proc, _, err in procs:
            if proc.wait(timeout=900) != 0:
                raise RuntimeError(f"{side}: a job failed:\n{err.read_text(errors='replace')[-3000:]}")
        after = server_cpu(server, worker_pids) if server is not None else {}
        status = server.status() if server is not None else None
        reports = [json.loads(out.read_text()) for _, out, _ in procs]
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return account(side, workers, reports, {k: after[k] - before[k] for k in after}, status, args)


def account(side: str, workers: int, reports: list[dict[str, Any]], server: dict[str, float],
            status: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
    started = min(r["started_at"] for r in reports)
    ended = max(r["ended_at"] for r in reports)
    span = ended - started
    samples = sum(r["samples"] for r in reports)
    gpu_floor = max(r["steps"] for r in reports) * args.step_s
    cpu = {
        **server,
        "jobs: start-up": sum(r["cpu"]["started"] for r in reports),
        "jobs: in next()": sum(r["next_cpu_s"] for r in reports),
        "jobs: outside next()": sum(r["cpu"]["ended"] - r["cpu"]["started"] - r["next_cpu_s"] for r in reports),
        "jobs: helpers" if side == "joader" else "jobs: DataLoader workers": sum(r["cpu"]["helpers"] for r in reports),
    }
    # In the span: all but the jobs' start-up (the baselines' workers decode during the span;
    # their start-up is a fork and a few imports, counted in the span here: an upper bound).
    in_span = sum(v for k, v in cpu.items() if k != "jobs: start-up")
    cores = len(os.sched_getaffinity(0))
    out = {
        "side": side, "workers_per_job": workers if side != "joader" else None,
        "samples": samples, "span_s": round(span, 3),
        "launch_to_end_s": round(ended - min(r["launched_at"] for r in reports), 3),
        "samples_per_s": round(samples / span, 1),
        "gpu_floor_s": round(gpu_floor, 3), "of_ideal": round(gpu_floor / span, 3),
        "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
        "cpu_in_span_s": round(in_span, 3), "cpu_floor_s": round(in_span / cores, 3),
        "first_batch_s": round(median([r["first_batch_at"] - r["started_at"] for r in reports]), 3),
        "start_up_wall_s": round(median([r["started_at"] - r["launched_at"] for r in reports]), 3),
        # launch to built (imported, dataset and loader made; joader: attached), before any barrier
        "built_wall_s": round(median([r["ready_at"] - r["launched_at"] for r in reports]), 3),
        "data_wait_s": round(sum(r["wait_s"] - r["next_cpu_s"] for r in reports), 3),
        "job_span_s": [round(r["ended_at"] - r["started_at"], 3) for r in reports],
        "waits": [r["waits"] for r in reports],
    }
    if status is not None:
        out.update({"items_decoded": status["items_decoded"], "items_delivered": status["items_delivered"],
                    "decode_s": status["decodes"].get("decode_s"), "sharing": status["sharing"],
                    "pair_sharing": [round(p["rate"], 2) for p in status["sharing_pairs"]],
                    "evictions": status["cache"]["evictions"], "lookups": status["cache"]["lookups"]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--step-s", type=float, default=0.08)
    parser.add_argument("--augment", type=int, default=224)
    parser.add_argument("--server-workers", default="2", help="joaderd --workers (default 2, as the issue's run)")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--baseline-workers", default="1,2", help="worker counts searched per baseline job")
    parser.add_argument("--no-barrier", dest="barrier", action="store_false",
                        help="each job reads as soon as it is built (plain scripts launched together), "
                             "not all at once after every job is ready")
    parser.add_argument("--prefetch", type=int, help="joader side: JoaderDataset(prefetch=N) (default: not given)")
    parser.add_argument("--data", type=Path, metavar="DIR",
                        help="an ImageFolder to use instead of the generated demo data (--items is then "
                             "its number of images)")
    parser.add_argument("--name", default="four_jobs")
    args = parser.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    if any(s not in SIDES for s in sides):
        parser.error(f"--sides: some of {', '.join(SIDES)}")
    if args.data is not None:
        from joader.sources.imagefolder import list_image_folder

        root = args.data.resolve()
        args.items = len(list_image_folder(str(root)).paths)
        args.data = str(root)
    else:
        root = demo_data(args.items)
    info = machine()
    search = [int(w) for w in args.baseline_workers.split(",")]
    best: dict[str, int] = {}
    trials: list[dict[str, Any]] = []
    for rep in range(args.reps):
        order = sides[rep % len(sides):] + sides[:rep % len(sides)]
        for side in order:
            candidates = [0] if side == "joader" else ([best[side]] if side in best else search)
            results = []
            for w in candidates:
                t = run_side(side, root, args, w)
                t["rep"] = rep
                trials.append(t)
                results.append(t)
                print(f"rep {rep} {LABELS[side]}{f' w={w}' if side != 'joader' else ''}: span {t['span_s']:.2f} s, "
                      f"{t['samples_per_s']:.0f}/s ({100 * t['of_ideal']:.0f}% of ideal), "
                      f"CPU floor {t['cpu_floor_s']:.2f} s", flush=True)
            if side != "joader" and side not in best:
                best[side] = max(results, key=lambda r: r["samples_per_s"])["workers_per_job"]
    info["loadavg_at_end"] = list(os.getloadavg())

    kept = {s: [t for t in trials if t["side"] == s and (s == "joader" or t["workers_per_job"] == best[s])]
            for s in sides}
    summary: dict[str, Any] = {}
    for side, runs in kept.items():
        summary[side] = {
            "runs": len(runs), "workers_per_job": runs[0]["workers_per_job"],
            "samples_per_s": median([r["samples_per_s"] for r in runs]),
            "of_ideal": median([r["of_ideal"] for r in runs]),
            "span_s": median([r["span_s"] for r in runs]),
            "launch_to_end_s": median([r["launch_to_end_s"] for r in runs]),
            "cpu_s": {k: round(median([r["cpu_s"][k] for r in runs]), 2) for k in runs[0]["cpu_s"]},
            "cpu_floor_s": median([r["cpu_floor_s"] for r in runs]),
            "gpu_floor_s": median([r["gpu_floor_s"] for r in runs]),
            "data_wait_s": median([r["data_wait_s"] for r in runs]),
            "first_batch_s": median([r["first_batch_s"] for r in runs]),
            "start_up_wall_s": median([r["start_up_wall_s"] for r in runs]),
            "built_wall_s": median([r["built_wall_s"] for r in runs]),
        }
        if side == "joader":
            summary[side]["items_decoded"] = median([r["items_decoded"] for r in runs])
    if "joader" in summary:
        for side in sides:
            if side != "joader":
                ratios = [j["samples_per_s"] / b["samples_per_s"] for j, b in
                          zip(kept["joader"], kept[side], strict=False)]
                summary["joader"][f"x_{side}"] = round(median(ratios), 2)

    ideal = args.jobs * args.epochs * args.items / (args.epochs * args.items / args.batch_size * args.step_s)
    print(f"\n{args.jobs} jobs x {args.epochs} epochs x {args.items} items, batch {args.batch_size}, step "
          f"{args.step_s} s; GPU-bound ideal {ideal:.0f} samples/s; medians of {args.reps}")
    print_table(["side", "workers/job", "samples/s", "of ideal", "span s", "launch->end s", "joader x"],
                [[LABELS[s], v["workers_per_job"] or "-", v["samples_per_s"], f"{100 * v['of_ideal']:.0f}%",
                  v["span_s"], v["launch_to_end_s"],
                  summary.get("joader", {}).get(f"x_{s}", "-") if s != "joader" else "-"]
                 for s, v in summary.items()])
    roles = list(dict.fromkeys(k for v in summary.values() for k in v["cpu_s"]))
    print("\nCPU-seconds by role (all jobs together)")
    print_table(["role", *[LABELS[s] for s in summary]],
                [[role, *[v["cpu_s"].get(role, "-") for v in summary.values()]] for role in roles]
                + [["CPU floor (span's CPU / cores) s", *[v["cpu_floor_s"] for v in summary.values()]],
                   ["GPU floor s", *[v["gpu_floor_s"] for v in summary.values()]],
                   ["measured span s", *[v["span_s"] for v in summary.values()]],
                   ["data wait (in next(), off CPU) s", *[v["data_wait_s"] for v in summary.values()]],
                   ["first batch after start s", *[v["first_batch_s"] for v in summary.values()]],
                   ["launch to built, per job s", *[v["built_wall_s"] for v in summary.values()]],
                   ["launch to first read, per job s", *[v["start_up_wall_s"] for v in summary.values()]]])
    path = write_json(args.name, {"machine": info, "args": vars(args), "ideal_samples_per_s": ideal,
                                  "summary": summary, "trials": trials})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
