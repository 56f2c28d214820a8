"""Issue 29's field bench: jobs that really train, in four schedules, against independent loaders.

What runs. One joaderd per run with the README's defaults (`--workers auto`, decoder turbo,
pacing, epoch alignment, lookahead, seed) except the cache, `--cache-fraction` (a quarter) of the
prepared dataset, plus any `--server-arg`. Each job is a separate process
(`python -m bench.field.field job ...`) running the README's plain script,
`DataLoader(JoaderDataset("digits", indices=range(n), return_index=True), batch_size=32)`
(`return_index` only so that the job can check what it received), and really training: a small
CNN (conv 1->16 3x3, relu, maxpool, conv 16->32 3x3, relu, maxpool, linear to 10; a 3-channel
input for `--data demo`, whose 256x256 images are average-pooled to 32x32 first), SGD at the
job's learning rate (a sweep: 0.01, 0.03, 0.1, ...), cross-entropy, `torch.set_num_threads(1)`,
uint8 -> float / 255 in the loop. `--cost K` (a job's step cost) makes each step K forward /
backward passes of the batch (gradients accumulated, one optimizer step).

Data. `--data digits` (default): scikit-learn's digits, `train_test_split(test_size=0.2,
random_state=0)`, the 1,437 training images written once as an ImageFolder of 8x8 gray PNGs
(class folders 0..9, values 0..16 scaled to 0..255) under $JOADER_BENCH_DATA; joaderd serves them
through its built-in stage `center-crop:32/L` (`--image-size 32 --mode L`), so a job sees (1, 32, 32) uint8 tensors. `--data demo`: the demo JPEGs
(`bench.common.demo_data`, `--items`, default 1,200), the default stage (center-crop 256, RGB).

The baseline, same run, same schedule: each job reads with its own torch DataLoader over the
same ImageFolder (shuffle=True with a seeded generator, 1 worker, persistent) whose dataset
runs the SAME shared stage in the worker (`joader.stages.build_stage` with joaderd's kind, size,
mode, upscale and default decoder; four_jobs' "turbo DataLoaders"); one torch thread.

Schedules (`--schedules`, K = `--jobs`, default 3; learning rates from `--lrs`):
- together: K jobs, built (attached) first, then all start at once (a go file, as sweep_trace);
- together-nb: the same K jobs launched together with no barrier (each reads once built);
- staggered: job i arrives (builds its dataset) once job i-1 has read half of its first epoch;
- speeds: K jobs together with step costs 1x, 2x, 4x, ... (2^i);
- queue: 2K jobs through K slots (GPUs freeing in a sweep): K start together (go file), and
  each time one ends the next is launched cold (process start, import, attach, read); every
  job has the same `--epochs` (the later ones are not shortened).
Each repetition also runs every distinct job configuration (step cost, epochs) alone, on each
side, for the rates alone (the learning rate does not change a step's cost).

Measured, per job (its own report): process start (psutil), the go/arrival, first batch, every
batch's arrival time and size, per-epoch end times and item counts, every index received per
epoch (exactly once: sorted ids == its indices; duplicates, missing, wrong labels counted), per
epoch train loss / accuracy (the last is the "final": proof it trained), its CPU: utime+stime
of the process, its reaped children and its live descendants (/proc) at its end, after closing
the dataset, so the DataLoader worker (baseline) and the lease keeper (joader) count, and so do
the job's imports. Per run: joaderd's status after the jobs (docs/status.md: items_delivered,
items_decoded, sharing_pairs) and joaderd's process tree CPU (joaderd, its decode workers and
forker, live or reaped, from start to after the jobs) read just before it stops.

Reported per schedule (medians over `--reps`):
- jobs served per decode = items_delivered / items_decoded (baseline: 1, every item read is a
  decode), against bounds:
  * trivial: sum |D_j| / |union D_j| (= the number of jobs; every item decoded once per epoch
    and shared by all, as if all jobs were always in step);
  * in-step (together, staggered; `bench.field.sweep_trace.schedule_bound`): every job present reads
    the same item in every round at equal speeds, nothing reused across rounds (3 together over
    5 epochs: 3; each half an epoch after the previous: 15/6 = 2.5);
  * timeline (every schedule, from the MEASURED per-job batch times): perfect sharing without
    reuse across time means an item read by several jobs at time t was decoded once for all of
    them, and no decode serves a read in another time bin. Within a bin a job's reads are
    distinct items (one epoch reads each item once), so the bin needs at least max_j d_j(bin)
    decodes, d_j(bin) being job j's deliveries in it: decodes >= sum over bins of max_j
    d_j(bin), bound = deliveries / that. Each job's cumulative count is piecewise linear
    between its batch arrivals (a batch's items spread over the gap since the previous batch;
    the first over the median gap), so bins need not align with batches; bins are `--bin-s`
    (0.5 s) wide, and 0.25 s / 1 s are kept in the JSON: narrower bins see the jobs' jitter
    and give a lower bound. At equal speeds in step it is ~K (the in-step bound), at speeds
    1x/2x/4x the fastest job present sets each bin. The cache beats both (an epoch's last
    items kept for the next epoch's first reads; a slow job reading what a fast one left).
- pair sharing: joaderd's sharing_pairs, rounds that gave both jobs the same item over the
  rounds both took part in (pairs that shared no round, e.g. queue jobs never together, left
  out);
- each job's rate: samples/s from its first batch to its last, (samples - first batch) /
  (last batch time - first batch time), against the rate alone of its configuration on the
  same side, same repetition;
- makespan: first job process launched to the last job's end (as a sweep sees it); also the
  read span, first go (start of reading) to last end;
- CPU-seconds: joaderd's tree + every job's (start-up, loop, DataLoader worker or lease keeper);
  the baseline: its jobs only. The harness's own getrusage(RUSAGE_CHILDREN) over the run (every
  reaped process, less the `joader status` calls) is kept as a cross-check;
- decodes: joaderd's items_decoded; baseline: items read (every read is a decode);
- exactly once: every job, every epoch, both sides.

Usage: python -m bench.field.field [--quick] [--schedules together,together-nb,staggered,speeds,queue]
       [--data digits|demo] [--jobs 3] [--epochs 5] [--reps 3] [--cache-fraction 0.25]
       [--server-arg=--pacing=rounds ...] [--sides joader,baseline]
       python -m bench.field.field job ...     (one training job; the bench starts these)
Writes bench/results/field-<timestamp>.json and prints tables.
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.field.field_bounds import in_step_bound, start_lead, timeline_bound
from bench.field.field_job import SIDES, job_main, job_parser

SCHEDULES = ("together", "together-nb", "staggered", "speeds", "queue")
LRS = (0.01, 0.03, 0.1, 0.02, 0.05, 0.2)


# --------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Data:
    name: str  # the joaderd source's name
    root: Path
    n: int
    channels: int
    size: int
    mode: str
    upscale: bool

    @property
    def item_nbytes(self) -> int:
        return self.channels * self.size * self.size

    def server_args(self) -> list[str]:
        args = ["--image-size", str(self.size), "--mode", self.mode]
        return args + (["--upscale", self.name] if self.upscale else [])


def digits_data() -> Data:
    """scikit-learn's digits, the training split (1,437 images), as an ImageFolder of 8x8 gray
    PNGs (written once under $JOADER_BENCH_DATA)."""
    import numpy as np
    from PIL import Image

    from bench.common import DATA_DIR

    root = DATA_DIR / "digits-train"
    if not (root / ".complete").exists():
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        x_train, _, y_train, _ = train_test_split(digits.images, digits.target, test_size=0.2, random_state=0)
        tmp = root.with_name(root.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        for i, (image, label) in enumerate(zip(x_train, y_train, strict=True)):
            folder = tmp / str(int(label))
            folder.mkdir(parents=True, exist_ok=True)
            pixels = np.clip(np.rint(image * (255 / 16)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(folder / f"{i:04d}.png")
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
        (root / ".complete").touch()
    n = sum(1 for _ in root.rglob("*.png"))
    for path in root.rglob("*.png"):
        path.read_bytes()  # warm the page cache
    return Data("digits", root, n, channels=1, size=32, mode="L", upscale=True)


def demo(num_items: int) -> Data:
    from bench.common import IMAGE_SIZE, demo_data

    return Data("demo", demo_data(num_items), num_items, channels=3, size=IMAGE_SIZE, mode="RGB", upscale=False)


# --------------------------------------------------------------------------------- the bench


@dataclass(frozen=True)
class JobSpec:
    lr: float
    cost: int
    epochs: int
    seed: int
    go: str = "together"  # together: a common go file; none: reads once built; after:<i>: job i's half file
    attach_first: bool = True
    later: bool = False  # queue: launched when a slot frees

    @property
    def config(self) -> str:
        return f"cost{self.cost}-e{self.epochs}"


def schedule_specs(schedule: str, args: argparse.Namespace) -> list[JobSpec]:
    k, e = args.jobs, args.epochs
    lrs = [float(x) for x in args.lrs.split(",")]
    lr = [lrs[i % len(lrs)] for i in range(2 * k)]
    if schedule == "together":
        return [JobSpec(lr[i], 1, e, i) for i in range(k)]
    if schedule == "together-nb":
        return [JobSpec(lr[i], 1, e, i, go="none", attach_first=False) for i in range(k)]
    if schedule == "staggered":
        return [JobSpec(lr[i], 1, e, i, go="together" if i == 0 else f"after:{i - 1}", attach_first=False)
                for i in range(k)]
    if schedule == "speeds":
        return [JobSpec(lr[i], 2 ** i, e, i) for i in range(k)]
    if schedule == "queue":
        return [JobSpec(lr[i], 1, e, i, go="together" if i < k else "none", attach_first=i < k, later=i >= k)
                for i in range(2 * k)]
    raise ValueError(schedule)


@dataclass
class Run:
    reports: list[dict[str, Any]] = field(default_factory=list)
    status: dict[str, Any] | None = None
    server_cpu_s: float = 0.0
    server_main_cpu_s: float = 0.0
    rusage_cpu_s: float = 0.0
    launched_first: float = 0.0


def _start_server(data: Data, cache_bytes: int, extra: list[str]) -> Any:
    """A joaderd with the defaults but the cache (and `extra`), serving `data` as its name."""
    from bench.common import Server

    return Server(data.root, cache_bytes, source=data.name, settings=data.server_args(), extra=extra)


def run_jobs(side: str, specs: list[JobSpec], data: Data, args: argparse.Namespace) -> Run:
    """One run: a fresh joaderd (joader side), `specs` as job processes in their schedule."""
    from bench.common import children_cpu_s
    from joader.stages.image import DEFAULT_DECODER
    from joader.testing.simjob import pid_cpu_s, tree_cpu_s

    work = Path(tempfile.mkdtemp(prefix="jbfield-", dir="/tmp"))
    env = dict(os.environ)  # the plain script's environment: no thread variables
    env.setdefault("PYTHONWARNINGS", "ignore")
    rusage_before = children_cpu_s()
    server = _start_server(data, int(data.n * data.item_nbytes * args.cache_fraction), args.server_arg) \
        if side == "joader" else None
    procs: dict[int, tuple[subprocess.Popen[bytes], Any]] = {}
    run = Run()
    go = work / "go"

    def launch(i: int) -> None:
        spec = specs[i]
        command = [sys.executable, "-m", "bench.field.field", "job", "--side", side, "--source", data.name,
                   "--root", str(data.root), "--n", str(data.n), "--channels", str(data.channels),
                   "--size", str(data.size), "--mode", data.mode, "--decoder", DEFAULT_DECODER,
                   "--epochs", str(spec.epochs), "--lr", repr(spec.lr), "--cost", str(spec.cost),
                   "--seed", str(spec.seed), "--ready-file", str(work / f"ready{i}"),
                   "--half-file", str(work / f"half{i}"), "--out", str(work / f"job{i}.json"),
                   "--launched-at", repr(time.time())]
        if data.upscale:
            command.append("--upscale")
        if server is not None:
            command += ["--address", server.address]
        if spec.attach_first:
            command.append("--attach-first")
        if spec.go == "together":
            command += ["--go-file", str(go)]
        elif spec.go.startswith("after:"):
            command += ["--go-file", str(work / f"half{spec.go.partition(':')[2]}")]
        err = open(work / f"job{i}.err", "wb")
        procs[i] = (subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env), err)

    def failed(i: int) -> RuntimeError:
        text = (work / f"job{i}.err").read_text(errors="replace")[-3000:]
        log = ("\njoaderd's log, its end:\n" + server.log()[-3000:]) if server is not None else ""
        return RuntimeError(f"{side} job {i} failed ({procs[i][0].returncode}):\n{text}{log}")

    try:
        first = [i for i, s in enumerate(specs) if not s.later]
        run.launched_first = time.time()
        for i in first:
            launch(i)
        barrier = [i for i in first if specs[i].go != "none"]
        deadline = time.monotonic() + 300
        while not all((work / f"ready{i}").exists() for i in barrier):
            for i in first:
                if procs[i][0].poll() is not None and procs[i][0].returncode != 0:
                    raise failed(i)
            if time.monotonic() > deadline:
                raise TimeoutError("jobs not ready after 300 s")
            time.sleep(0.01)
        go.touch()
        waiting = [i for i, s in enumerate(specs) if s.later]
        done: set[int] = set()
        deadline = time.monotonic() + args.job_timeout_s
        while len(done) < len(specs):
            for i, (proc, err) in list(procs.items()):
                if i in done or proc.poll() is None:
                    continue
                err.close()
                if proc.returncode != 0:
                    raise failed(i)
                done.add(i)
                if waiting:  # a slot is free: the next job of the queue starts
                    launch(waiting.pop(0))
            if time.monotonic() > deadline:
                raise TimeoutError(f"{side}: jobs still running after {args.job_timeout_s} s")
            time.sleep(0.01)
        if server is not None:
            run.status = server.status()
            run.server_cpu_s = tree_cpu_s(server.proc.pid)
            run.server_main_cpu_s = pid_cpu_s(server.proc.pid)
        run.reports = [json.loads((work / f"job{i}.json").read_text()) for i in range(len(specs))]
    finally:
        for proc, err in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()
        status_cpu = 0.0
        if server is not None:
            status_cpu = server.status_cpu_s
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    run.rusage_cpu_s = round(children_cpu_s() - rusage_before - status_cpu, 3)
    return run


def summarize(side: str, schedule: str, specs: list[JobSpec], run: Run, data: Data,
              alone: dict[str, float], bins: tuple[float, ...]) -> dict[str, Any]:
    reports = run.reports
    go0 = min(r["go_at"] for r in reports)
    end = max(r["ended_at"] for r in reports)
    jobs_cpu = sum(r["cpu_s"] for r in reports)
    timelines = [[(r["go_at"] + t, c) for t, c in r["batches"]] for r in reports]
    read = sum(r["samples"] for r in reports)
    out: dict[str, Any] = {
        "makespan_s": round(end - run.launched_first, 3),
        "read_span_s": round(end - go0, 3),
        "jobs": [{
            "lr": r["lr"], "cost": r["cost"], "epochs": len(r["epochs"]),
            "launched_s": round(r["launched_at"] - run.launched_first, 3),
            "go_s": round(r["go_at"] - go0, 3), "first_batch_s": round(r["first_batch_at"] - go0, 3),
            "ended_s": round(r["ended_at"] - go0, 3),
            "epoch_ends_s": [round(e["ended_at"] - go0, 3) for e in r["epochs"]],
            "items_per_epoch": [e["items"] for e in r["epochs"]],
            "samples_per_s": r["samples_per_s"], "alone_samples_per_s": alone.get(spec.config),
            "x_alone": round(r["samples_per_s"] / alone[spec.config], 3)
            if r["samples_per_s"] and alone.get(spec.config) else None,
            "exactly_once": r["exactly_once"],
            "epoch_faults": [{k: e[k] for k in ("duplicates", "missing", "foreign", "wrong_labels")}
                             for e in r["epochs"] if not e["exactly_once"] or e["wrong_labels"]],
            "first_train_loss": r["first_train_loss"], "final_train_loss": r["final_train_loss"],
            "final_train_acc": r["final_train_acc"], "cpu_s": r["cpu_s"], "cpu_loop_s": r["cpu_loop_s"],
            "torch_threads": r["torch_threads"], "job_id": r["job_id"],
        } for r, spec in zip(reports, specs, strict=True)],
        "exactly_once": all(r["exactly_once"] for r in reports),
        "jobs_cpu_s": round(jobs_cpu, 3),
        "rusage_cpu_s": run.rusage_cpu_s,
        "items_read": read,
        "timeline_bounds": {f"{b:g}": timeline_bound(timelines, b) for b in bins},
        "start_lead_items": start_lead(timelines),
        "trivial_bound": float(len(specs)),  # sum |D_j| / |union D_j|: every job reads all items
    }
    if side == "baseline" or run.status is None:
        out |= {"items_decoded": read, "items_delivered": read, "served_per_decode": 1.0,
                "cpu_s": round(jobs_cpu, 3)}
        return out
    status = run.status
    decoded, delivered = status["items_decoded"], status["items_delivered"]
    ids = [r["job_id"] for r in reports]
    pairs = []
    for p in status.get("sharing_pairs", []):
        if p["a"] in ids and p["b"] in ids and p["rounds"]:
            pairs.append({"jobs": sorted([ids.index(p["a"]), ids.index(p["b"])]), "rounds": p["rounds"],
                          "shared": p["shared"], "rate": p["rate"], "bound": p["bound"]})
    pairs.sort(key=lambda p: p["jobs"])
    out |= {
        "items_decoded": decoded, "items_delivered": delivered,
        "served_per_decode": round(delivered / decoded, 4) if decoded else None,
        "pairs": pairs,
        "server_cpu_s": round(run.server_cpu_s, 3), "server_main_cpu_s": round(run.server_main_cpu_s, 3),
        "cpu_s": round(run.server_cpu_s + jobs_cpu, 3),
        "evictions": status["cache"]["evictions"], "hit_rate": status["cache"]["hit_rate"],
        "decodes_cancelled": status["decodes"]["cancelled"],
        "workers": {"configured": status["workers"]["configured"], "resizes": status["workers"].get("resizes", [])},
        "sharing": status["sharing"],
    }
    return out


class Clock:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f} s] {text}", flush=True)


def run_bench(data: Data, args: argparse.Namespace, log: Clock) -> dict[str, Any]:
    from bench.common import median

    schedules = [s for s in args.schedules.split(",") if s]
    sides = [s for s in args.sides.split(",") if s]
    bins = tuple(sorted({args.bin_s, 0.25, 1.0}))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {side: [] for side in sides} for s in schedules}
    alone_all: list[dict[str, dict[str, float]]] = []
    for rep in range(args.reps):
        alone: dict[str, dict[str, float]] = {side: {} for side in sides}
        configs = {sp.config: sp for s in schedules for sp in schedule_specs(s, args)}
        for side in sides:
            for config, sp in sorted(configs.items()):
                run = run_jobs(side, [replace(sp, go="together", attach_first=True, later=False)], data, args)
                alone[side][config] = run.reports[0]["samples_per_s"]
                log(f"rep {rep} {side} alone {config}: {alone[side][config]} samples/s, "
                    f"final loss {run.reports[0]['final_train_loss']} acc {run.reports[0]['final_train_acc']}")
        alone_all.append(alone)
        for schedule in schedules:
            specs = schedule_specs(schedule, args)
            order = sides if rep % 2 == 0 else sides[::-1]
            for side in order:
                run = run_jobs(side, specs, data, args)
                out = summarize(side, schedule, specs, run, data, alone[side], bins)
                runs[schedule][side].append(out)
                tb = out["timeline_bounds"][f"{args.bin_s:g}"]["bound"]
                pairs = " ".join(f"{p['jobs'][0]}-{p['jobs'][1]}:{p['rate']:.2f}" for p in out.get("pairs", []))
                log(f"rep {rep} {schedule} {side}: served/decode {out['served_per_decode']} (timeline bound {tb}), "
                    f"start lead {out['start_lead_items']} items, "
                    f"decodes {out['items_decoded']}, makespan {out['makespan_s']} s, CPU {out['cpu_s']} s, "
                    f"x alone {[j['x_alone'] for j in out['jobs']]}, exactly once {out['exactly_once']}"
                    + (f", pairs {pairs}" if pairs else ""))
    summary: dict[str, Any] = {}
    for schedule, by_side in runs.items():
        specs = schedule_specs(schedule, args)
        summary[schedule] = {"in_step_bound": in_step_bound(schedule, data.n, len(specs), args.epochs)}
        for side, reps in by_side.items():
            if not reps:
                continue
            k = len(reps[0]["jobs"])
            s: dict[str, Any] = {
                "served_per_decode": median([r["served_per_decode"] for r in reps]),
                "timeline_bound": {b: median([r["timeline_bounds"][b]["bound"] for r in reps])
                                   for b in reps[0]["timeline_bounds"]},
                "trivial_bound": reps[0]["trivial_bound"],
                "start_lead_items": median([r["start_lead_items"] for r in reps]),
                "items_decoded": median([r["items_decoded"] for r in reps]),
                "items_delivered": median([r["items_delivered"] for r in reps]),
                "makespan_s": median([r["makespan_s"] for r in reps]),
                "read_span_s": median([r["read_span_s"] for r in reps]),
                "cpu_s": median([r["cpu_s"] for r in reps]),
                "jobs_cpu_s": median([r["jobs_cpu_s"] for r in reps]),
                "rusage_cpu_s": median([r["rusage_cpu_s"] for r in reps]),
                "samples_per_s": [median([r["jobs"][i]["samples_per_s"] or 0 for r in reps]) for i in range(k)],
                "x_alone": [median([r["jobs"][i]["x_alone"] or 0 for r in reps]) for i in range(k)],
                "final_train_acc": [median([r["jobs"][i]["final_train_acc"] for r in reps]) for i in range(k)],
                "final_train_loss": [median([r["jobs"][i]["final_train_loss"] for r in reps]) for i in range(k)],
                "exactly_once": all(r["exactly_once"] for r in reps),
                "reps": reps,
            }
            if side == "joader":
                s["server_cpu_s"] = median([r["server_cpu_s"] for r in reps])
                rates = [p["rate"] for r in reps for p in r["pairs"] if p["rate"] is not None]
                s["pair_rates"] = {"min": min(rates), "median": median(rates), "max": max(rates)} if rates else None
                s["pairs_per_rep"] = [[(p["jobs"], p["rate"]) for p in r["pairs"]] for r in reps]
            summary[schedule][side] = s
    return {"schedules": summary, "alone": alone_all}


def print_results(data: dict[str, Any]) -> None:
    from bench.common import print_table

    b = f"{data['bin_s']:g}"
    schedules = data["results"]["schedules"]
    print(f"\n{data['data']} ({data['num_items']} items), {data['jobs']} jobs, {data['epochs']} epochs, batch 32, "
          f"cache {data['cache_fraction']:g} of the prepared data, server args {data['server_args'] or 'none'}; "
          f"medians of {data['reps']}:")
    rows = []
    for name, s in schedules.items():
        j, base = s.get("joader"), s.get("baseline")
        if j is None:
            continue
        pr = j.get("pair_rates")
        rows.append([name, j["served_per_decode"], j["timeline_bound"][b], s["in_step_bound"] or "-",
                     j["trivial_bound"], int(j["items_decoded"]), int(base["items_decoded"]) if base else "-",
                     f"{pr['min']:.2f}-{pr['max']:.2f}" if pr else "-", int(j.get("start_lead_items", 0)),
                     "yes" if j["exactly_once"] and (base is None or base["exactly_once"]) else "NO"])
    print_table(["schedule", "served/decode", f"timeline bound ({b} s)", "in-step bound", "trivial",
                 "decodes", "baseline decodes", "pair sharing", "start lead (items)", "exactly once"], rows)
    print()
    rows = []
    for name, s in schedules.items():
        j, base = s.get("joader"), s.get("baseline")
        if j is None or base is None:
            continue
        rows.append([name, j["makespan_s"], base["makespan_s"], round(base["makespan_s"] / j["makespan_s"], 2),
                     j["read_span_s"], base["read_span_s"], j["cpu_s"], j["server_cpu_s"], base["cpu_s"],
                     round(base["cpu_s"] / j["cpu_s"], 2)])
    print_table(["schedule", "makespan s", "baseline", "baseline/joader", "read span s", "baseline",
                 "CPU-s", "of which joaderd", "baseline CPU-s", "baseline/joader"], rows)
    print()
    rows = []
    for name, s in schedules.items():
        for side in ("joader", "baseline"):
            if side not in s:
                continue
            v = s[side]
            for i in range(len(v["samples_per_s"])):
                job = v["reps"][0]["jobs"][i]
                rows.append([name, side, f"j{i}", job["lr"], job["cost"], v["samples_per_s"][i], v["x_alone"][i],
                             v["final_train_loss"][i], v["final_train_acc"][i]])
    print_table(["schedule", "side", "job", "lr", "cost", "samples/s", "x alone", "final loss", "final acc"], rows)
    alone = data["results"]["alone"]
    if alone:
        print("\nrates alone (samples/s, per repetition):")
        for side in alone[0]:
            for config in alone[0][side]:
                print(f"  {side} {config}: {[a[side][config] for a in alone]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        return job_main(job_parser().parse_args(argv[1:]))
    from bench.common import machine, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs, one repetition")
    parser.add_argument("--data", choices=("digits", "demo"), default="digits")
    parser.add_argument("--items", type=int, default=1200, help="--data demo: the number of demo images")
    parser.add_argument("--jobs", type=int, default=3, help="K: jobs per schedule (the queue: 2K through K slots)")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--reps", type=int)
    parser.add_argument("--lrs", default=",".join(map(str, LRS)), help="the sweep's learning rates, job by job")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, of {', '.join(SCHEDULES)}")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="joaderd's cache, of the prepared dataset")
    parser.add_argument("--bin-s", type=float, default=0.5, help="the timeline bound's bin (s)")
    parser.add_argument("--job-timeout-s", type=float, default=600)
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="an extra joaderd argument (repeatable; e.g. --server-arg=--pacing=rounds)")
    parser.add_argument("--name", default="field", help="results file: bench/results/NAME-<timestamp>.json")
    args = parser.parse_args(argv)
    for schedule in filter(None, args.schedules.split(",")):
        if schedule not in SCHEDULES:
            parser.error(f"unknown schedule {schedule!r}")
    for side in filter(None, args.sides.split(",")):
        if side not in SIDES:
            parser.error(f"unknown side {side!r}")
    args.epochs = args.epochs or (2 if args.quick else 5)
    args.reps = args.reps or (1 if args.quick else 3)
    log = Clock()
    data = digits_data() if args.data == "digits" else demo(args.items)
    out: dict[str, Any] = {
        "command": ("python -m bench.field.field " + " ".join(argv)).strip(), "machine": machine(),
        "data": data.name, "root": str(data.root), "num_items": data.n, "jobs": args.jobs, "epochs": args.epochs,
        "reps": args.reps, "cache_fraction": args.cache_fraction,
        "cache_bytes": int(data.n * data.item_nbytes * args.cache_fraction), "server_args": args.server_arg,
        "stage": {"size": data.size, "mode": data.mode, "upscale": data.upscale}, "lrs": args.lrs,
        "bin_s": args.bin_s, "quick": args.quick,
    }
    out["results"] = run_bench(data, args, log)
    out["machine"]["loadavg_at_end"] = list(os.getloadavg())
    out["elapsed_s"] = round(time.monotonic() - log.started, 1)
    print_results(out)
    path = write_json(f"{args.name}-{time.strftime('%Y%m%d-%H%M%S')}", out)
    print(f"\nwrote {path} ({out['elapsed_s']} s; load average at start {out['machine']['loadavg_at_start']}, "
          f"at end {out['machine']['loadavg_at_end']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
