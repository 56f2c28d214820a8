"""Issue 19's sweep trace: K plain training scripts on one source, in three arrival schedules.

K jobs (default 3) read one demo source through one joaderd with the README's defaults
(`--workers auto`, `--decoder turbo`, image size 256) except a quarter cache (a quarter of the
dataset's prepared items). Every job is a real separate process running the plain script,
`DataLoader(JoaderDataset("demo", indices=...), batch_size=B)`, no other option (the dataset
takes the batch size from the DataLoader); the last job trains on a subset (the first
`--subset` of the items, 3/4 by default), the others on the whole source. Schedules:

1. together, sleep-step: all start together; each step sleeps `--step-s` (an emulated GPU step);
2. together, CPU-bound: all start together; each step is a forward/backward pass of a small CNN
   on the batch, in the job's one torch thread (about 30-50 ms of CPU per batch of 32), no sleep;
3. staggered: sleep-step, and each job arrives (builds its dataset, attaching to joaderd) once
   the previous job has read half of its first epoch.

Each repetition also runs every job configuration alone (whole/subset x sleep/CPU), side by side
with the mixes. Reported per schedule (medians over `--reps`), from joaderd's status
(docs/status.md) after the jobs have gone:
- jobs served per decode = items_delivered / items_decoded; ideal sum|D_j| / |union D_j|
  (K for identical datasets): every item decoded once per epoch;
  "in-step bound" (`schedule_bound`) is what perfect sharing gives with the schedule's arrivals;
- decodes per item-epoch = items_decoded / (|union D_j| x epochs); ideal 1.0, independent
  loaders sum|D_j| / |union D_j|. Both include the next epoch's lookahead that joaderd prepares
  before a job's last epoch ends (decoded, never delivered);
- each pair's sharing rate: joaderd's count (`sharing_pairs`) of the rounds that gave both jobs
  the same item over the rounds both took part in, against its Theorem 1 bound
  |D1 n D2| / max(|D1|, |D2|), and beside "lock-step DSA": the same share in joaderd's sampler
  alone (`lockstep_pairs`, a simulation) when every job takes part in every round, one item each
  (equal speeds, no sitting out), with the schedule's arrivals and joaderd's --epoch-align. The
  bound assumes aligned epochs; jobs of unequal sizes at one speed drift apart, so the sampler
  alone gives the subset's pairs well under it. Measured above the lock-step figure: the jobs'
  speeds differed (a slower subset job keeps its epochs closer to the others'); below it:
  rounds a job sat out (its queue full) or lost at its start;
- each job's rate (samples/s over all its epochs, from its first batch request to its last batch)
  against the same configuration's rate alone, in the same repetition.

Diagnostics: `--timeline S` records joaderd's counters every S s (jobs' epochs and queues, pair
counts) into the JSON, from a poller process; `--server-arg=--pacing=rounds` passes joaderd an
extra argument (the reported figures use neither).

`--fast-job` adds issue 19 item 5: five whole-source jobs at steps of 0, 0.02, 0.04, 0.06 and
0.08 s, started together, quarter cache; the fastest job's rate beside the others against its
rate alone (median of the repetitions' ratios).

Usage: python -m bench.field.sweep_trace [--quick] [--fast-job] [--items 600] [--epochs 3] [--reps 3]
       (default about 5 minutes, 6 with --fast-job, on this project's 2-core machine; --quick
       about 1 minute)
       python -m bench.field.sweep_trace job ...   (one job process; the bench starts these)
Writes bench/results/sweep_trace-<timestamp>.json and prints tables.
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
from dataclasses import dataclass
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

SCHEDULES = ("together-sleep", "together-cpu", "staggered")
FAST_STEPS = (0.0, 0.02, 0.04, 0.06, 0.08)


# --------------------------------------------------------------------------------- one job


def tiny_cnn() -> Any:
    """The CPU-bound job's model: two strided convolutions and a linear head (about 30-50 ms of
    one core per forward/backward of a batch of 32 at 256x256 on this project's machine)."""
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 16, 5, stride=4), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def job_main(args: argparse.Namespace) -> int:
    """One training script: the plain README loop, a sleep or a CPU step per batch."""
    import torch
    from torch.utils.data import DataLoader

    from joader import JoaderDataset

    start, _, stop = args.indices.partition(":")
    indices = range(int(start), int(stop))

    def make() -> tuple[Any, Any]:
        dataset = JoaderDataset("demo", indices=indices, address=args.address)
        return dataset, DataLoader(dataset, batch_size=args.batch_size)

    dataset = loader = None
    if args.attach_first:  # together: attached before the common start, as a sweep's jobs are
        dataset, loader = make()
    step: Any = None
    if args.cpu_model:
        model = tiny_cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(images: torch.Tensor, labels: torch.Tensor) -> None:
            loss = torch.nn.functional.cross_entropy(model(images.float().div_(255)), labels % 10)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        step(torch.zeros((args.batch_size, 3, 256, 256), dtype=torch.uint8),
             torch.zeros(args.batch_size, dtype=torch.long))  # warm up before the start
    args.ready_file.touch()
    deadline = time.monotonic() + 600
    while not args.go_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {args.go_file} after 600 s")
        time.sleep(0.005)
    arrived_at = time.time()
    if dataset is None:  # staggered: arrives now
        dataset, loader = make()
    epochs = []
    samples = 0
    half_written = False
    started = time.perf_counter()
    started_at = time.time()
    step_s = 0.0
    for _ in range(args.epochs):
        epoch_started = time.perf_counter()
        count = 0
        for images, labels in loader:
            t = time.perf_counter()
            if step is not None:
                step(images, labels)
            elif args.step_s:
                time.sleep(args.step_s)
            step_s += time.perf_counter() - t
            count += len(labels)
            if not half_written and args.half_file and count * 2 >= len(dataset):
                args.half_file.touch()
                half_written = True
        epochs.append({"wall_s": round(time.perf_counter() - epoch_started, 4), "num_samples": count})
        samples += count
    wall_s = time.perf_counter() - started
    report = {"job_id": dataset.job_id, "num_items": len(dataset), "samples": samples, "wall_s": wall_s,
              "samples_per_s": samples / wall_s, "step_s": step_s, "epochs": epochs,
              "arrived_at": arrived_at, "started_at": started_at, "ended_at": time.time(),
              "torch_threads": torch.get_num_threads()}
    dataset.close()
    args.out.write_text(json.dumps(report))
    return 0


def poll_main(args: argparse.Namespace) -> int:
    """The timeline: joaderd's counters every `--interval` s (one process, one channel) until
    `--stop-file` appears."""
    from joader.client.tools.cli import fetch_status

    samples = []
    while not args.stop_file.exists():
        t = time.time()
        try:
            status = fetch_status(args.address)
        except Exception as error:  # noqa: BLE001 (a diagnostic: keep polling)
            samples.append({"t": t, "error": repr(error)})
        else:
            samples.append({
                "t": t, "decoded": status["items_decoded"], "delivered": status["items_delivered"],
                "workers": status["workers"]["configured"],
                "jobs": {j["job_id"]: [j["epoch"], j["epoch_delivered"], j["queued"], j["items_delivered"]]
                         for j in status["jobs"]},
                "pairs": [[p["a"], p["b"], p["rounds"], p["shared"]] for p in status.get("sharing_pairs", [])],
            })
        time.sleep(max(0.0, args.interval - (time.time() - t)))
    args.out.write_text(json.dumps(samples))
    return 0


def job_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.field.sweep_trace job")
    parser.add_argument("--address", required=True)
    parser.add_argument("--indices", required=True, help="START:STOP")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--cpu-model", action="store_true", help="a CNN forward/backward per step, no sleep")
    parser.add_argument("--attach-first", action="store_true", help="build the dataset before waiting for --go-file")
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--go-file", type=Path, required=True)
    parser.add_argument("--half-file", type=Path, help="touched once half of the first epoch is read")
    parser.add_argument("--out", type=Path, required=True)
    return parser


# --------------------------------------------------------------------------------- the bench


@dataclass(frozen=True)
class JobSpec:
    stop: int  # the job reads items 0..stop-1
    step_s: float = 0.0
    cpu: bool = False

    @property
    def key(self) -> str:
        return f"{self.stop}-{'cpu' if self.cpu else f'sleep{self.step_s:g}'}"


class Clock:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f} s] {text}", flush=True)


def run_mix(root: Path, n: int, specs: list[JobSpec], args: argparse.Namespace, *, staggered: bool = False
            ) -> dict[str, Any]:
    """A fresh joaderd; `specs` as separate processes, together or staggered; their reports and
    joaderd's counters once they have gone."""
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="jbsweep-", dir="/tmp"))
    env = dict(os.environ)  # the plain script's environment: no thread variables
    env.setdefault("PYTHONWARNINGS", "ignore")
    procs: list[tuple[subprocess.Popen[bytes], Any]] = []
    poller: subprocess.Popen[bytes] | None = None
    timeline: list[dict[str, Any]] = []
    try:
        with Server(root, quarter_cache_bytes(n), workers=args.workers, extra=args.server_arg) as server:
            go = workdir / "go"
            if args.timeline:
                poller = subprocess.Popen([sys.executable, "-m", "bench.field.sweep_trace", "poll", "--address",
                                           server.address, "--interval", repr(args.timeline),
                                           "--stop-file", str(workdir / "stop"), "--out",
                                           str(workdir / "timeline.json")], env=env)
            for i, spec in enumerate(specs):
                command = [sys.executable, "-m", "bench.field.sweep_trace", "job", "--address", server.address,
                           "--indices", f"0:{spec.stop}", "--epochs", str(args.epochs),
                           "--batch-size", str(args.batch_size), "--step-s", repr(spec.step_s),
                           "--ready-file", str(workdir / f"ready{i}"), "--out", str(workdir / f"job{i}.json"),
                           "--go-file", str(go if i == 0 or not staggered else workdir / f"half{i - 1}"),
                           "--half-file", str(workdir / f"half{i}")]
                if spec.cpu:
                    command.append("--cpu-model")
                if not staggered:
                    command.append("--attach-first")
                err = open(workdir / f"job{i}.err", "wb")
                procs.append((subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env), err))
            deadline = time.monotonic() + 180
            while not all((workdir / f"ready{i}").exists() for i in range(len(specs))):
                for i, (proc, _) in enumerate(procs):
                    if proc.poll() is not None:
                        raise RuntimeError(f"job {i} exited ({proc.returncode}) before its start:\n"
                                           + (workdir / f"job{i}.err").read_text(errors="replace")[-3000:])
                if time.monotonic() > deadline:
                    raise TimeoutError("jobs not ready after 180 s")
                time.sleep(0.02)
            go.touch()
            deadline = time.monotonic() + args.job_timeout_s
            for i, (proc, err) in enumerate(procs):
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                err.close()
                if proc.returncode != 0:
                    raise RuntimeError(f"job {i} failed ({proc.returncode}):\n"
                                       + (workdir / f"job{i}.err").read_text(errors="replace")[-3000:]
                                       + "\njoaderd's log, its end:\n" + server.log()[-4000:])
            status = server.status()
            if poller is not None:
                (workdir / "stop").touch()
                poller.wait(timeout=60)
                timeline = json.loads((workdir / "timeline.json").read_text())
        reports = [json.loads((workdir / f"job{i}.json").read_text()) for i in range(len(specs))]
    finally:
        if poller is not None and poller.poll() is None:
            poller.kill()
            poller.wait()
        for proc, err in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()
        shutil.rmtree(workdir, ignore_errors=True)
    out = summarize(specs, reports, status, args.epochs) | {"run_s": round(time.monotonic() - began, 1)}
    if args.timeline:
        out["timeline"] = timeline
        out["job_ids"] = [r["job_id"] for r in reports]
    return out


def summarize(specs: list[JobSpec], reports: list[dict[str, Any]], status: dict[str, Any], epochs: int
              ) -> dict[str, Any]:
    union = max(s.stop for s in specs)  # every dataset is a prefix 0..stop-1
    total = sum(s.stop for s in specs)
    decoded, delivered = status["items_decoded"], status["items_delivered"]
    ids = [r["job_id"] for r in reports]
    pairs = []
    for i in range(len(specs)):
        for j in range(i + 1, len(specs)):
            found = [p for p in status.get("sharing_pairs", []) if {p["a"], p["b"]} == {ids[i], ids[j]}]
            p = found[0] if found else {"rounds": 0, "shared": 0, "rate": None, "bound": None}
            bound = min(specs[i].stop, specs[j].stop) / max(specs[i].stop, specs[j].stop)
            pairs.append({"jobs": [i, j], "rounds": p["rounds"], "shared": p["shared"], "rate": p["rate"],
                          "bound": p["bound"] if p["bound"] is not None else round(bound, 4)})
    t0 = min(r["arrived_at"] for r in reports)
    return {
        "samples_per_s": [round(r["samples_per_s"], 1) for r in reports],
        "wall_s": [round(r["wall_s"], 3) for r in reports],
        "arrived_s": [round(r["arrived_at"] - t0, 3) for r in reports],
        "exact_epochs": all(e["num_samples"] == s.stop for r, s in zip(reports, specs, strict=True)
                            for e in r["epochs"]),
        "torch_threads": [r["torch_threads"] for r in reports],
        "items_decoded": decoded, "items_delivered": delivered,
        "served_per_decode": round(delivered / decoded, 4) if decoded else None,
        "ideal_served_per_decode": round(total / union, 4),
        "decodes_per_item_epoch": round(decoded / (union * epochs), 4),
        "independent_decodes_per_item_epoch": round(total / union, 4),
        "sharing_within_epoch": status["sharing"]["within_epoch"],
        "decodes_cancelled": status["decodes"]["cancelled"],
        "evictions": status["cache"]["evictions"], "hit_rate": status["cache"]["hit_rate"],
        "pairs": pairs,
        "workers": {"configured": status["workers"]["configured"], "mode": status["workers"].get("mode"),
                    "resizes": status["workers"].get("resizes", [])},
    }


def lockstep_pairs(sizes: list[int], arrivals: list[int], epochs: int, align: str, seeds: int = 5) -> list[float]:
    """Each pair's share of rounds in joaderd's sampler (DSA on the chain tree) when every job
    present takes part in every round, one item per round (equal speeds, no sitting out): job i
    joins at round `arrivals[i]` and leaves after `epochs` epochs of its items; `align` is
    joaderd's --epoch-align. What the sampler alone allows for this schedule; mean over `seeds`
    seeds, pairs in (0,1), (0,2), ... order."""
    from itertools import combinations

    from joader.sampling import DependentSampler

    pairs = list(combinations(range(len(sizes)), 2))
    totals = [[0, 0] for _ in pairs]
    for seed in range(seeds):
        sampler = DependentSampler(seed, align=align)
        done = [0] * len(sizes)
        present = [False] * len(sizes)
        round_no = 0
        while any(d < epochs * size for d, size in zip(done, sizes, strict=True)):
            for i, size in enumerate(sizes):
                if not present[i] and done[i] == 0 and round_no >= arrivals[i]:
                    sampler.add_job(f"j{i}", range(size))
                    present[i] = True
            here = [i for i in range(len(sizes)) if present[i]]
            if here:
                picks = sampler.sample([f"j{i}" for i in here])
                for q, (a, b) in enumerate(pairs):
                    if present[a] and present[b]:
                        totals[q][0] += 1
                        totals[q][1] += picks[f"j{a}"] == picks[f"j{b}"]
                for i in here:
                    done[i] += 1
                    if done[i] == epochs * sizes[i]:
                        sampler.remove_job(f"j{i}")
                        present[i] = False
            round_no += 1
    return [round(shared / rounds, 4) if rounds else 0.0 for rounds, shared in totals]


def epoch_align(args: argparse.Namespace) -> str:
    """joaderd's --epoch-align in these runs: a --server-arg's, else joaderd's default."""
    from joader.server.config import ServerConfig

    align = ServerConfig(sources=()).epoch_align
    for i, arg in enumerate(args.server_arg):
        if arg.startswith("--epoch-align="):
            align = arg.partition("=")[2]
        elif arg == "--epoch-align" and i + 1 < len(args.server_arg):
            align = args.server_arg[i + 1]
    return align


def lockstep_arrivals(schedule: str, specs: list[JobSpec]) -> list[int]:
    """Arrival rounds in the lock-step model: staggered, each job half an epoch after the previous."""
    arrivals = [0]
    for spec in specs[:-1]:
        arrivals.append(arrivals[-1] + (spec.stop // 2 if schedule == "staggered" else 0))
    return arrivals


def schedule_bound(specs: list[JobSpec], arrivals: list[int], epochs: int) -> float:
    """Jobs served per decode if every job present read the same item in every round and nothing
    were reused across rounds (one item per job per round, equal speeds): deliveries over the
    rounds in which some job reads. Staggered arrivals lower it below sum|D_j| / |union D_j|: the
    first job reads alone before the others arrive and the last one alone after they leave
    (3 identical jobs half an epoch apart: 9/4 over 3 epochs, 15/6 over 5). A cache can beat it
    by keeping items across rounds (an epoch's last items are the next epoch's first hits)."""
    ends = [a + s.stop * epochs for a, s in zip(arrivals, specs, strict=True)]
    return round(sum(s.stop for s in specs) * epochs / (max(ends) - min(arrivals)), 4)


def schedule_specs(schedule: str, args: argparse.Namespace, n: int) -> list[JobSpec]:
    sub = max(1, round(n * args.subset))
    stops = [n] * (args.jobs - 1) + [sub]
    if schedule == "together-cpu":
        return [JobSpec(stop, cpu=True) for stop in stops]
    return [JobSpec(stop, step_s=args.step_s) for stop in stops]


def run_bench(root: Path, n: int, args: argparse.Namespace, log: Clock) -> dict[str, Any]:
    schedules = [s for s in args.schedules.split(",") if s]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in schedules}
    for rep in range(args.reps):
        alone: dict[str, float] = {}
        for spec in sorted({sp for s in schedules for sp in schedule_specs(s, args, n)}, key=lambda sp: sp.key):
            alone[spec.key] = run_mix(root, n, [spec], args)["samples_per_s"][0]
            log(f"rep {rep} alone {spec.key}: {alone[spec.key]} samples/s")
        for schedule in schedules:
            specs = schedule_specs(schedule, args, n)
            mix = run_mix(root, n, specs, args, staggered=schedule == "staggered")
            mix["alone_samples_per_s"] = [alone[s.key] for s in specs]
            mix["ratio_to_alone"] = [round(r / a, 4) for r, a in zip(mix["samples_per_s"], mix["alone_samples_per_s"],
                                                                      strict=True)]
            runs[schedule].append(mix)
            pairs = " ".join(f"{p['jobs'][0]}-{p['jobs'][1]} {p['rate']}/{p['bound']}" for p in mix["pairs"])
            log(f"rep {rep} {schedule}: served/decode {mix['served_per_decode']} (ideal "
                f"{mix['ideal_served_per_decode']}), decodes/item-epoch {mix['decodes_per_item_epoch']}, "
                f"pairs {pairs}, samples/s {mix['samples_per_s']} (x alone {mix['ratio_to_alone']}), "
                f"workers {mix['workers']['configured']}, arrived {mix['arrived_s']}, run {mix['run_s']} s")
    out = {}
    for schedule, reps in runs.items():
        k = len(reps[0]["samples_per_s"])
        specs = schedule_specs(schedule, args, n)
        lockstep = lockstep_pairs([s.stop for s in specs], lockstep_arrivals(schedule, specs), args.epochs,
                                  epoch_align(args))
        out[schedule] = {
            "jobs": [{"items": s.stop, "step_s": s.step_s, "cpu": s.cpu} for s in schedule_specs(schedule, args, n)],
            "served_per_decode": median([r["served_per_decode"] for r in reps]),
            "ideal_served_per_decode": reps[0]["ideal_served_per_decode"],
            "schedule_bound": schedule_bound(specs, lockstep_arrivals(schedule, specs), args.epochs),
            "decodes_per_item_epoch": median([r["decodes_per_item_epoch"] for r in reps]),
            "independent_decodes_per_item_epoch": reps[0]["independent_decodes_per_item_epoch"],
            "items_decoded": median([r["items_decoded"] for r in reps]),
            "items_delivered": median([r["items_delivered"] for r in reps]),
            "sharing_within_epoch": median([r["sharing_within_epoch"] for r in reps]),
            "pairs": [{"jobs": p["jobs"], "bound": p["bound"], "lockstep": lockstep[q],
                       "rate": median([r["pairs"][q]["rate"] or 0.0 for r in reps]),
                       "rates": [r["pairs"][q]["rate"] for r in reps]}
                      for q, p in enumerate(reps[0]["pairs"])],
            "samples_per_s": [median([r["samples_per_s"][i] for r in reps]) for i in range(k)],
            "alone_samples_per_s": [median([r["alone_samples_per_s"][i] for r in reps]) for i in range(k)],
            "ratio_to_alone": [median([r["ratio_to_alone"][i] for r in reps]) for i in range(k)],
            "exact_epochs": all(r["exact_epochs"] for r in reps),
            "reps": reps,
        }
    return out


def run_fast_job(root: Path, n: int, args: argparse.Namespace, log: Clock) -> dict[str, Any]:
    steps = [float(s) for s in args.fast_steps.split(",")]
    specs = [JobSpec(n, step_s=s) for s in steps]
    reps = []
    for rep in range(args.reps):
        alone = run_mix(root, n, [specs[0]], args)["samples_per_s"][0]
        mix = run_mix(root, n, specs, args)
        mix["alone_fastest"] = alone
        mix["fastest_ratio"] = round(mix["samples_per_s"][0] / alone, 4)
        reps.append(mix)
        log(f"rep {rep} fast-job: samples/s {mix['samples_per_s']}, fastest alone {alone}, "
            f"ratio {mix['fastest_ratio']}, served/decode {mix['served_per_decode']}, "
            f"workers {mix['workers']['configured']}, run {mix['run_s']} s")
    return {
        "steps_s": steps,
        "samples_per_s": [median([r["samples_per_s"][i] for r in reps]) for i in range(len(specs))],
        "alone_fastest": median([r["alone_fastest"] for r in reps]),
        "fastest_ratio": median([r["fastest_ratio"] for r in reps]),
        "fastest_ratios": [r["fastest_ratio"] for r in reps],
        "served_per_decode": median([r["served_per_decode"] for r in reps]),
        "decodes_per_item_epoch": median([r["decodes_per_item_epoch"] for r in reps]),
        "reps": reps,
    }


def print_results(data: dict[str, Any]) -> None:
    schedules = data.get("schedules", {})
    if schedules:
        print(f"\n{data['jobs']} jobs, {data['num_items']} images (last job: first {data['subset_items']}), "
              f"{data['epochs']} epochs, batch {data['batch_size']}, quarter cache; medians of {data['reps']}:")
        print_table(["schedule", "served/decode", "ideal", "in-step bound", "decodes/item-epoch", "independent", "decodes",
                     "deliveries", "within-epoch"],
                    [[name, s["served_per_decode"], s["ideal_served_per_decode"], s.get("schedule_bound", "-"),
                      s["decodes_per_item_epoch"],
                      s["independent_decodes_per_item_epoch"], int(s["items_decoded"]), int(s["items_delivered"]),
                      s["sharing_within_epoch"]] for name, s in schedules.items()])
        print()
        print_table(["schedule", "pair", "shared rate", "bound", "rate / bound", "lock-step DSA", "reps"],
                    [[name, f"j{p['jobs'][0]}-j{p['jobs'][1]}", p["rate"], p["bound"],
                      round(p["rate"] / p["bound"], 3) if p["bound"] else "-", p["lockstep"], p["rates"]]
                     for name, s in schedules.items() for p in s["pairs"]])
        print()
        print_table(["schedule", "job", "items", "alone samples/s", "together samples/s", "x alone"],
                    [[name, f"j{i}", job["items"], s["alone_samples_per_s"][i], s["samples_per_s"][i],
                      s["ratio_to_alone"][i]] for name, s in schedules.items() for i, job in enumerate(s["jobs"])])
    fast = data.get("fast_job")
    if fast:
        print(f"\nfast job: {len(fast['steps_s'])} jobs at steps {fast['steps_s']} s, quarter cache, medians of {data['reps']}:")
        print_table(["step s", "together samples/s"], [[s, r] for s, r in zip(fast["steps_s"], fast["samples_per_s"],
                                                                               strict=True)])
        print(f"fastest job: {fast['samples_per_s'][0]} samples/s beside the others, {fast['alone_fastest']} alone: "
              f"keeps {fast['fastest_ratio']:.1%} (reps {fast['fastest_ratios']}); served/decode "
              f"{fast['served_per_decode']}, decodes/item-epoch {fast['decodes_per_item_epoch']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        return job_main(job_parser().parse_args(argv[1:]))
    if argv[:1] == ["poll"]:
        poll = argparse.ArgumentParser(prog="python -m bench.field.sweep_trace poll")
        poll.add_argument("--address", required=True)
        poll.add_argument("--interval", type=float, default=0.5)
        poll.add_argument("--stop-file", type=Path, required=True)
        poll.add_argument("--out", type=Path, required=True)
        return poll_main(poll.parse_args(argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 images, 2 epochs, one repetition")
    parser.add_argument("--items", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--reps", type=int)
    parser.add_argument("--jobs", type=int, default=3, help="K jobs; the last one on the subset")
    parser.add_argument("--subset", type=float, default=0.75, help="the last job's share of the items")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--step-s", type=float, default=0.05, help="the emulated GPU step (sleep)")
    parser.add_argument("--workers", default="auto", help="joaderd --workers (README default: auto)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma-separated, of {', '.join(SCHEDULES)} ('' for none)")
    parser.add_argument("--fast-job", action="store_true", help="also issue 19 item 5: five jobs at different speeds")
    parser.add_argument("--fast-steps", default=",".join(map(str, FAST_STEPS)),
                        help="the --fast-job jobs' steps in s, fastest first (default: the first is data-bound)")
    parser.add_argument("--job-timeout-s", type=float, default=300)
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="an extra joaderd argument (repeatable; e.g. --server-arg=--pacing=rounds)")
    parser.add_argument("--timeline", type=float, default=0.0, metavar="S",
                        help="also record joaderd's counters every S s (a poller process; a diagnostic)")
    args = parser.parse_args(argv)
    for schedule in filter(None, args.schedules.split(",")):
        if schedule not in SCHEDULES:
            parser.error(f"unknown schedule {schedule!r}")
    n = args.items or (300 if args.quick else 600)
    args.epochs = args.epochs or (2 if args.quick else 3)
    args.reps = args.reps or (1 if args.quick else 3)
    log = Clock()
    root = demo_data(n)
    command = "python -m bench.field.sweep_trace " + " ".join(argv)
    data: dict[str, Any] = {
        "command": command.strip(), "machine": machine(), "num_items": n, "jobs": args.jobs,
        "subset_items": max(1, round(n * args.subset)), "epochs": args.epochs, "batch_size": args.batch_size,
        "step_s": args.step_s, "reps": args.reps, "cache_bytes": quarter_cache_bytes(n), "workers": args.workers,
        "server_args": args.server_arg,
        "quick": args.quick,
    }
    if args.schedules:
        data["schedules"] = run_bench(root, n, args, log)
    if args.fast_job:
        data["fast_job"] = run_fast_job(root, n, args, log)
    data["machine"]["loadavg_at_end"] = list(os.getloadavg())
    data["elapsed_s"] = round(time.monotonic() - log.started, 1)
    print_results(data)
    path = write_json(f"sweep_trace-{time.strftime('%Y%m%d-%H%M%S')}", data)
    print(f"\nwrote {path} ({data['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
