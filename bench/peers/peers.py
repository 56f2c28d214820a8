"""joader beside TensorSocket: four jobs sharing one host's data preparation, two ways.

TensorSocket (PyPI `tensorsocket` 0.0.5) shares ONE data loader among several training jobs: a
producer process runs a DataLoader and publishes each batch over ZMQ to every consumer (a job);
all jobs see the same order, in lock-step with the slowest, and a job that arrives mid-epoch
waits for the next one. joader prepares each item once into a shared cache and gives each job
its own exactly-once, uniformly shuffled epoch at its own speed. This bench runs both, and four
independent DataLoaders, side by side in each repetition (their order rotated).

The run (as `bench/system/four_jobs.py`): 4 jobs x 2 epochs over the 1,200 demo JPEGs (500x375), batch
25, an emulated GPU step of 0.08 s per batch (a sleep), a random 224 crop + flip per image in the
job's own process (its job stage). Two scenarios:
- together: the jobs build their loaders, then start reading at once (a start file);
- staggered: each job arrives (builds its loader) once the previous one has read half an epoch
  (600 samples) of its own reading, as `bench/field/sweep_trace.py`'s staggered schedule.
Sides:
- joader: joaderd with the README's defaults (`--workers auto`), a cache of a quarter of the
  prepared dataset; each job `DataLoader(JoaderDataset("demo", transform=crop_flip,
  return_index=True), batch_size=25)` (the plain script; `return_index` to record the order);
- TensorSocket: a producer process running a DataLoader over an ImageFolder that does joaderd's
  shared stage with joaderd's decoder (`joader.stages`, turbo: simplejpeg with DCT scaling +
  OpenCV) in 2 DataLoader workers (joaderd's `auto` pool grows to 2 here), batch 25, shuffled;
  each job a `TensorConsumer(batch_size=25)` that applies its crop + flip to what it receives;
- DataLoaders: 4 independent DataLoaders over the same ImageFolder and decoder, 1 worker each
  (four_jobs' "turbo DataLoaders"), one torch thread in the training process.
The index of every item travels with it (TensorSocket: a third tensor in the batch), so each
job's order per epoch is recorded: exactly-once per epoch is checked, and two jobs' orders are
compared position by position.

What is reported, per scenario and side (medians over `--reps` repetitions):
- throughput: all samples over the span (first arrival to last job's end); share of the ideal:
  the GPU-bound span (every job steps back to back: 96 x 0.08 = 7.68 s together; staggered, each
  job arriving 24 steps after the previous, 3 x 1.92 + 7.68 = 13.44 s) over the measured span;
- CPU-seconds of every process of the side from the start (each job from its arrival) to the
  end (psutil, process trees): joaderd + its decode workers + forker and the jobs (their lease
  keepers); the producer + its DataLoader workers and the consumers; the jobs and their workers.
  Imports before the start are left out on every side;
- decodes: joaderd's `items_decoded`; the producer's dataset reads; the DataLoaders' reads
  (counted in the datasets, across their workers);
- exactly-once: every epoch of every job holds each of the 1,200 items once;
- order overlap: for two jobs, the share of positions where both got the same item, in the
  pairing of their epochs that matches most (TensorSocket staggered: a job's second epoch is the
  next job's first) - the mean over the 6 pairs and the largest pair; 1 means the jobs see one
  order, 1/1200 is independent shuffles;
- the wait from a job's arrival to its first batch (the largest over jobs): a TensorSocket job
  that arrives mid-epoch waits for the next producer epoch.

Fairness. Both sharing sides decode with the same code (`joader.stages`, turbo) on the same 2
cores; the job stage runs in the job's process on every side; TensorSocket's producer does not
read before the start (its DataLoader iterator is made on the first batch, as the baselines'
workers start on `iter()`), and in the together scenario it waits, as the other sides' jobs do,
until every consumer is built (all 4 registered) before the start file. TensorSocket 0.0.5 is
written for CUDA (it shares CUDA IPC handles); on this CPU-only machine it needs the
work-arounds of bench/peers/tensorsocket.py to run correctly and at a sensible cost (a subclass
or a pack function each; site-packages is not edited); each can be turned off (`--ts-fixes`) to
see what it fixes, and each keeps TensorSocket's design (one shared order, lock-step, late
joiners wait for the next epoch).

Usage: python -m bench.peers.peers [--reps 3] [--quick] [--scenarios together,staggered]
       [--sides joader,tensorsocket,dataloaders] [--ts-fixes all|none|-name,...]
Writes bench/results/peers-<timestamp>.json and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.peers.jobs import job_main, producer_main, tree_cpu

SIDES = ("joader", "tensorsocket", "dataloaders")
LABELS = {"joader": "joader", "tensorsocket": "TensorSocket", "dataloaders": "DataLoaders (1 worker/job)"}
SCENARIOS = ("together", "staggered")
FIXES = ("lastbatch", "pickle", "leave", "heartbeat", "spin")


# ---------------------------------------------------------------------------------- the bench


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_side(side: str, scenario: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of `args.jobs` jobs on one side in one scenario: reports and accounting."""
    from bench.common import Server, quarter_cache_bytes

    work = Path(tempfile.mkdtemp(prefix="peers-", dir="/tmp"))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}  # the plain script's environment
    together = scenario == "together"
    server = Server(root, quarter_cache_bytes(args.items), workers=args.server_workers) if side == "joader" else None
    producer = None
    procs: list[subprocess.Popen[bytes]] = []
    go = work / "go"
    ports = ",".join(map(str, free_ports(4)))
    started = time.monotonic()
    try:
        if side == "tensorsocket":
            command = [sys.executable, "-m", "bench.peers.peers", "producer", "--root", str(root), "--ports", ports,
                       "--workers", str(args.ts_workers), "--batch-size", str(args.batch_size),
                       "--prefetch-factor", str(args.ts_prefetch_factor),
                       "--min-consumers", str(args.jobs if together else 1), "--fixes", args.ts_fixes,
                       "--ready-file", str(work / "pready"), "--stop-file", str(work / "stop"),
                       "--out", str(work / "producer.json")]
            if together:
                command += ["--go-file", str(go)]
            producer = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(work / "producer.err", "wb"),
                                        env=env)
            wait_for([work / "pready"], [producer], work, "the producer")
        for i in range(args.jobs):
            command = [sys.executable, "-m", "bench.peers.peers", "job", side, "--epochs", str(args.epochs),
                       "--batch-size", str(args.batch_size), "--step-s", str(args.step_s), "--augment",
                       str(args.augment), "--items", str(args.items), "--ready-file", str(work / f"ready{i}"),
                       "--go-file", str(go if together or i == 0 else work / f"half{i - 1}"),
                       "--half-file", str(work / f"half{i}"), "--out", str(work / f"job{i}.json"),
                       "--fixes", args.ts_fixes]
            if together:
                command.append("--build-first")
            if side == "joader":
                command += ["--address", server.address]
            elif side == "dataloaders":
                command += ["--root", str(root), "--num-workers", str(args.dl_workers)]
            else:
                command += ["--ports", ports]
            procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                          stderr=open(work / f"job{i}.err", "wb"), env=env))
        wait_for([work / f"ready{i}" for i in range(args.jobs)], procs + ([producer] if producer else []), work,
                 "the jobs")
        time.sleep(0.3)  # every job now waits on its start file
        tree = server.proc.pid if server is not None else producer.pid if producer is not None else None
        before = tree_cpu(tree) if tree is not None else 0.0
        go.touch()
        deadline = time.monotonic() + args.timeout_s
        for i, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if producer is not None and producer.poll() is None:
                    producer.send_signal(signal.SIGUSR1)  # its main thread's stack, into producer.err
                    time.sleep(1.0)
                raise RuntimeError(f"{side} {scenario}: job {i} timed out:\n" + tails(work)) from None
            if code != 0:
                raise RuntimeError(f"{side} {scenario}: job {i} failed ({code}):\n" + tails(work))
        after = tree_cpu(tree) if tree is not None else 0.0
        status = server.status() if server is not None else None
        produced = None
        if producer is not None:
            (work / "stop").touch()
            producer.wait(timeout=60)
            produced = json.loads((work / "producer.json").read_text())
        reports = [json.loads((work / f"job{i}.json").read_text()) for i in range(args.jobs)]
    finally:
        for proc in procs + ([producer] if producer is not None else []):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    out = account(side, scenario, reports, after - before, status, produced, args)
    out["run_s"] = round(time.monotonic() - started, 1)
    out["loadavg"] = list(os.getloadavg())
    return out


def wait_for(files: list[Path], procs: list[subprocess.Popen[bytes]], work: Path, what: str) -> None:
    deadline = time.monotonic() + 300
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{what} did not get ready:\n" + tails(work))
        time.sleep(0.01)


def tails(work: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(work.glob("*.err")))


def overlap(a: list[int], b: list[int]) -> float:
    n = min(len(a), len(b))
    return sum(1 for x, y in zip(a[:n], b[:n], strict=True) if x == y) / max(len(a), len(b), 1)


def ideal_span_s(scenario: str, args: argparse.Namespace) -> float:
    steps = args.epochs * args.items // args.batch_size
    per_job = steps * args.step_s
    if scenario == "together":
        return per_job
    return (args.jobs - 1) * (args.items // 2 // args.batch_size) * args.step_s + per_job


def account(side: str, scenario: str, reports: list[dict[str, Any]], server_cpu: float,
            status: dict[str, Any] | None, produced: dict[str, Any] | None, args: argparse.Namespace
            ) -> dict[str, Any]:
    first = min(r["arrived_at"] for r in reports)
    last = max(r["ended_at"] for r in reports)
    span = last - first
    samples = sum(r["samples"] for r in reports)
    items = set(range(args.items))
    exact = [[len(e["order"]) == args.items and set(e["order"]) == items for e in r["epochs"]] for r in reports]
    pairs = []
    for i in range(len(reports)):
        for j in range(i + 1, len(reports)):
            grid = [[overlap(ea["order"], eb["order"]) for eb in reports[j]["epochs"]] for ea in reports[i]["epochs"]]
            same_index = [grid[e][e] for e in range(min(len(grid), len(grid[0])))]
            pairs.append({"jobs": [i, j], "best": round(max(max(row) for row in grid), 4),
                          "same_index": round(sum(same_index) / len(same_index), 4)})
    jobs_cpu = sum(r["cpu_s"] for r in reports)
    decodes = (status["items_decoded"] if status is not None else produced["reads"] if produced is not None
               else sum(r["reads"] for r in reports))
    out: dict[str, Any] = {
        "side": side, "scenario": scenario, "samples": samples, "span_s": round(span, 3),
        "samples_per_s": round(samples / span, 1), "ideal_span_s": round(ideal_span_s(scenario, args), 3),
        "of_ideal": round(ideal_span_s(scenario, args) / span, 3),
        "cpu_s": round(jobs_cpu + server_cpu, 2), "cpu_jobs_s": round(jobs_cpu, 2),
        "cpu_shared_s": round(server_cpu, 2),  # joaderd's tree, or the producer's
        "decodes": decodes, "exact": all(all(e) for e in exact), "exact_per_job": exact,
        "epoch_sizes": [[len(e["order"]) for e in r["epochs"]] for r in reports],
        "overlap_best_mean": round(sum(p["best"] for p in pairs) / len(pairs), 4),
        "overlap_best_max": max(p["best"] for p in pairs),
        "overlap_same_index_mean": round(sum(p["same_index"] for p in pairs) / len(pairs), 4),
        "pairs": pairs,
        "arrived_s": [round(r["arrived_at"] - first, 3) for r in reports],
        "first_batch_wait_s": [round(r["first_batch_at"] - r["arrived_at"], 3) for r in reports],
        "job_span_s": [round(r["ended_at"] - r["arrived_at"], 3) for r in reports],
        "jobs_cpu_before_start_s": round(sum(r["cpu_before_start_s"] for r in reports), 2),
    }
    if status is not None:
        out.update({"items_delivered": status["items_delivered"], "workers": status["workers"].get("configured"),
                    "pair_sharing": [round(p["rate"], 3) for p in status.get("sharing_pairs", [])]})
    out["batch_times_s"] = [[round(t - first, 3) for t in r["batch_times"]] for r in reports]
    if produced is not None:
        produced["events"] = [(round(e[0] - first, 3), *e[1:]) for e in produced["events"]]
        out["producer"] = produced
        if produced["broadcasts"]:
            out["producer"]["mb_per_broadcast"] = round(produced["broadcast_bytes"] / produced["broadcasts"] / 1e6, 1)
    return out


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    from bench.common import median

    out: dict[str, Any] = {}
    for t in trials:
        out.setdefault(t["scenario"], {}).setdefault(t["side"], []).append(t)
    summary: dict[str, Any] = {}
    for scenario, sides in out.items():
        summary[scenario] = {}
        for side, runs in sides.items():
            s = {"runs": len(runs)}
            for key in ("samples_per_s", "of_ideal", "span_s", "cpu_s", "cpu_jobs_s", "cpu_shared_s", "decodes",
                        "overlap_best_mean", "overlap_best_max", "overlap_same_index_mean"):
                s[key] = round(median([r[key] for r in runs]), 4)
            s["exact"] = all(r["exact"] for r in runs)
            s["exact_runs"] = sum(r["exact"] for r in runs)
            s["epoch_sizes"] = runs[0]["epoch_sizes"]
            s["first_batch_wait_max_s"] = round(median([max(r["first_batch_wait_s"]) for r in runs]), 3)
            s["job_span_s"] = [round(median([r["job_span_s"][i] for r in runs]), 2)
                               for i in range(len(runs[0]["job_span_s"]))]
            if side == "tensorsocket":
                p = [r["producer"] for r in runs]
                s["producer"] = {k: median([x[k] for x in p]) for k in p[0] if isinstance(p[0][k], int | float)}
            summary[scenario][side] = s
    return summary


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] in ("job", "producer"):
        return sub_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repetition")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--step-s", type=float, default=0.08)
    parser.add_argument("--augment", type=int, default=224)
    parser.add_argument("--server-workers", default="auto", help="joaderd --workers (the README's default: auto)")
    parser.add_argument("--ts-workers", type=int, default=2, help="the TensorSocket producer's DataLoader workers")
    parser.add_argument("--ts-prefetch-factor", type=int, default=0,
                        help="the producer DataLoader's prefetch_factor (0: PyTorch's default, 2)")
    parser.add_argument("--dl-workers", type=int, default=1, help="workers per independent DataLoader")
    parser.add_argument("--ts-fixes", default="all",
                        help=f"TensorSocket work-arounds: all, none, or a list of {', '.join(FIXES)} "
                             "(-name: all but it)")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--timeout-s", type=float, default=240.0)
    parser.add_argument("--name", default="peers")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps = 1
    args.ts_fixes = parse_fixes(args.ts_fixes)
    sides = [s for s in args.sides.split(",") if s]
    scenarios = [s for s in args.scenarios.split(",") if s]
    if any(s not in SIDES for s in sides) or any(s not in SCENARIOS for s in scenarios):
        parser.error(f"--sides: some of {SIDES}; --scenarios: some of {SCENARIOS}")
    from bench.common import demo_data, machine, write_json

    root = demo_data(args.items)
    info = machine()
    began = time.monotonic()
    trials: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for scenario in scenarios:
            order = sides[rep % len(sides):] + sides[:rep % len(sides)]
            for side in order:
                try:
                    t = run_side(side, scenario, root, args)
                except RuntimeError as error:  # recorded (a work-around turned off may hang a job)
                    if args.ts_fixes == parse_fixes("all"):
                        raise
                    print(f"rep {rep} {scenario} {LABELS[side]}: FAILED {str(error)[:3000]}", flush=True)
                    trials.append({"side": side, "scenario": scenario, "rep": rep, "error": str(error)[-6000:]})
                    continue
                t["rep"] = rep
                trials.append(t)
                extra = ""
                if side == "tensorsocket":
                    p = t["producer"]
                    extra = (f", {p.get('mb_per_broadcast')} MB/broadcast, ack wait {p['ack_wait_s']} s, "
                             f"{p['ack_timeouts']} ack timeouts, {p['heart_failures']} heart drops")
                print(f"rep {rep} {scenario:9s} {LABELS[side]}: span {t['span_s']:.2f} s, {t['samples_per_s']:.0f}/s "
                      f"({100 * t['of_ideal']:.0f}% of ideal), CPU {t['cpu_s']:.1f} s, decodes {t['decodes']}, "
                      f"exact {t['exact']} {t['epoch_sizes'] if not t['exact'] else ''}, overlap "
                      f"{t['overlap_best_mean']:.3f}/{t['overlap_best_max']:.3f}, first batch wait "
                      f"{max(t['first_batch_wait_s']):.2f} s{extra}; load {t['loadavg'][0]:.2f}", flush=True)
    info["loadavg_at_end"] = list(os.getloadavg())
    info["wall_s"] = round(time.monotonic() - began, 1)
    summary = summarize([t for t in trials if "error" not in t])
    print_tables(summary, args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{args.name}-quick-{stamp}" if args.quick else f"{args.name}-{stamp}"
    path = write_json(name, {"machine": info, "args": vars(args), "summary": summary, "trials": trials,
                             "commit": git_commit()})
    print(f"\nwrote {path} ({info['wall_s']:.0f} s)")
    return 0


def print_tables(summary: dict[str, Any], args: argparse.Namespace) -> None:
    from bench.common import print_table

    for scenario, sides in summary.items():
        ideal = ideal_span_s(scenario, args)
        print(f"\n{scenario}: {args.jobs} jobs x {args.epochs} epochs x {args.items} items, batch {args.batch_size}, "
              f"step {args.step_s} s; ideal span {ideal:.2f} s "
              f"({args.jobs * args.epochs * args.items / ideal:.0f} samples/s); medians of {args.reps}")
        print_table(["side", "samples/s", "of ideal", "span s", "CPU-s", "decodes", "exact epochs",
                     "order overlap mean (max)", "first batch wait s (max)"],
                    [[LABELS[s], v["samples_per_s"], f"{100 * v['of_ideal']:.0f}%", v["span_s"], v["cpu_s"],
                      int(v["decodes"]), f"{v['exact_runs']}/{v['runs']}" + ("" if v["exact"] else
                                                                            f" {v['epoch_sizes']}"),
                      f"{v['overlap_best_mean']:.3f} ({v['overlap_best_max']:.3f})", v["first_batch_wait_max_s"]]
                     for s, v in sides.items()])


def parse_fixes(spec: str) -> str:
    chosen: set[str] = set()
    for part in spec.split(","):
        if part == "all":
            chosen |= set(FIXES)
        elif part == "none" or not part:
            continue
        elif part.startswith("-"):
            chosen.discard(part[1:])
        elif part in FIXES:
            chosen.add(part)
        else:
            raise SystemExit(f"--ts-fixes: unknown {part!r} (all, none, {', '.join(FIXES)})")
    return ",".join(f for f in FIXES if f in chosen)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def sub_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.peers job|producer")
    parser.add_argument("role", choices=("job", "producer"))
    parser.add_argument("side", nargs="?", choices=SIDES)
    parser.add_argument("--address")
    parser.add_argument("--root")
    parser.add_argument("--ports")
    parser.add_argument("--fixes", default="")
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--min-consumers", type=int, default=1)
    parser.add_argument("--prefetch-factor", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--step-s", type=float, default=0.08)
    parser.add_argument("--augment", type=int, default=224)
    parser.add_argument("--build-first", action="store_true")
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--go-file", type=Path)
    parser.add_argument("--half-file", type=Path)
    parser.add_argument("--stop-file", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return job_main(args) if args.role == "job" else producer_main(args)


if __name__ == "__main__":
    sys.exit(main())
