"""A training script written the plain way, timed by role: what `bench/system/four_jobs.py` runs.

    python -m bench.system.plain_job joader --source demo --address A --out job.json [--start-file F]
    python -m bench.system.plain_job turbo  --root ROOT --num-workers 2 --out job.json
    python -m bench.system.plain_job pil    --root ROOT --num-workers 2 --out job.json

The script is the README's: `DataLoader(JoaderDataset("demo", transform=...), batch_size=B)`,
nothing else (no `batch_size=` on the dataset, no thread setting, no environment variables).
The baselines are what a careful user writes without joader: a map-style ImageFolder doing the
same shared stage as joaderd (`joader.stages`, decoder `turbo`: simplejpeg with DCT scaling and
OpenCV's resize; or `pil`: Pillow with `draft`) in `--num-workers` DataLoader workers, shuffled by
PyTorch, one torch thread in the training process. The job stage on every side: a random 224 x 224
crop and a flip per image (`--augment`); the emulated GPU step is a sleep per batch (no CPU).

What the report says, per phase, so that the bench can account for every CPU-second:
- `launched_at` (the harness's clock when it started the process, `JOB_LAUNCHED_AT`),
  `imported_at`, `ready_at` (dataset and loader built: for joader, attached), `started_at`
  (after the start barrier), `first_batch_at`, `ended_at`: wall-clock `time.time()` stamps;
- the CPU seconds of this process (all its threads) at each stamp, and at the end those of its
  live descendants (DataLoader workers, the lease keeper), read from /proc;
- `wait_s`: wall time the loop spent inside `next()` (data not ready, plus the job stage run
  there when num_workers=0), `next_cpu_s`: this process's CPU in `next()`, `step_s`: in the step.
"""

from __future__ import annotations

import os
import time

LAUNCHED_AT = float(os.environ.get("JOB_LAUNCHED_AT", "0") or 0)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from joader.testing.simjob import RandomCropFlip, tree_cpu_s  # noqa: E402


def _cpu() -> float:
    return time.process_time()  # this process, every thread


class Folder(Dataset):
    """The baseline's dataset: an ImageFolder doing joaderd's shared stage in the DataLoader
    worker (the same code, `joader.stages`, so both sides decode alike), then the job stage."""

    def __init__(self, root: str, decoder: str, image_size: int, transform: Any) -> None:
        from joader.sources.imagefolder import list_image_folder

        self.listing = list_image_folder(root)
        self.decoder = decoder
        self.image_size = image_size
        self.transform = transform
        self._stage: Any = None

    def __len__(self) -> int:
        return len(self.listing.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self._stage is None:  # built in the worker
            from joader.stages import build_stage

            self._stage = build_stage("center-crop", size=self.image_size, decoder=self.decoder)
        image = torch.from_numpy(self._stage.prepare(self.listing.read(i), self.listing.paths[i]))
        return self.transform(image), int(self.listing.labels[i])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("side", choices=("joader", "turbo", "pil"))
    parser.add_argument("--source", default="demo")
    parser.add_argument("--address")
    parser.add_argument("--root")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--step-s", type=float, default=0.08)
    parser.add_argument("--augment", type=int, default=224)
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--start-file", type=Path, help="read once this file exists (all jobs ready)")
    parser.add_argument("--ready-file", type=Path, help="touched once the loader is built")
    parser.add_argument("--prefetch", type=int, help="joader: JoaderDataset(prefetch=N) (default: not given)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    imported_at, imported_cpu = time.time(), _cpu()

    transform = RandomCropFlip(args.augment)
    if args.side == "joader":
        from joader import JoaderDataset

        options = {} if args.prefetch is None else {"prefetch": args.prefetch}  # A/B only: the plain script sets none
        ds: Any = JoaderDataset(args.source, address=args.address, transform=transform, **options)
        loader = DataLoader(ds, batch_size=args.batch_size)
    else:
        torch.set_num_threads(1)  # what a careful user sets beside busy workers
        ds = Folder(args.root, args.side, args.image_size, transform)
        loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers,
                            persistent_workers=args.num_workers > 0)
    ready_at, ready_cpu = time.time(), _cpu()
    if args.ready_file:
        args.ready_file.touch()
    if args.start_file:
        while not args.start_file.exists():
            time.sleep(0.002)
    started_at, started_cpu = time.time(), _cpu()

    first_batch_at = first_batch_cpu = None
    wait_s = next_cpu_s = step_s = 0.0
    samples = steps = 0
    epochs = []
    waits: list[float] = []  # each batch's time in next()
    for _ in range(args.epochs):
        epoch_started = time.time()
        iterator = iter(loader)
        while True:
            t, c = time.perf_counter(), _cpu()
            try:
                images, _labels = next(iterator)
            except StopIteration:
                wait_s += time.perf_counter() - t
                next_cpu_s += _cpu() - c
                break
            waited = time.perf_counter() - t
            wait_s += waited
            next_cpu_s += _cpu() - c
            waits.append(round(waited, 4))
            if first_batch_at is None:
                first_batch_at, first_batch_cpu = time.time(), _cpu()
            samples += len(images)
            steps += 1
            t = time.perf_counter()
            time.sleep(args.step_s)  # the emulated GPU step
            step_s += time.perf_counter() - t
        epochs.append({"started_at": epoch_started, "ended_at": time.time()})
    ended_at, ended_cpu = time.time(), _cpu()
    helpers_cpu = tree_cpu_s(os.getpid()) - _own_tree_cpu()
    helpers_by_kind = _helpers_by_kind()
    report = {
        "side": args.side, "pid": os.getpid(), "samples": samples, "steps": steps, "epochs": epochs,
        "launched_at": LAUNCHED_AT or None, "imported_at": imported_at, "ready_at": ready_at,
        "started_at": started_at, "first_batch_at": first_batch_at, "ended_at": ended_at,
        "cpu": {"imported": imported_cpu, "ready": ready_cpu, "started": started_cpu,
                "first_batch": first_batch_cpu, "ended": ended_cpu, "helpers": helpers_cpu,
                "helpers_by_kind": helpers_by_kind},
        "wait_s": wait_s, "next_cpu_s": next_cpu_s, "step_s": step_s, "waits": waits,
    }
    args.out.write_text(json.dumps(report))
    if args.side == "joader":
        ds.close()
    return 0


def _helpers_by_kind() -> dict[str, float]:
    """The live descendants' CPU (and what they reaped) by kind: the lease keeper
    (`joader.client.keeper_process`), DataLoader workers (every other descendant), and what this
    process reaped itself (its cutime + cstime: exited helpers, e.g. non-persistent workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / tick, cmdline)
    out = {"lease keeper": 0.0, "DataLoader workers": 0.0, "reaped": 0.0}
    me = os.getpid()
    with open(f"/proc/{me}/stat", "rb") as f:
        stat = f.read().decode(errors="replace")
    out["reaped"] = sum(int(x) for x in stat[stat.rfind(")") + 2:].split()[13:15]) / tick
    frontier = [me]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cpu, cmdline) in table.items():
            if ppid == parent:
                out["lease keeper" if "joader.client.keeper_process" in cmdline else "DataLoader workers"] += cpu
                frontier.append(pid)
    return out


def _own_tree_cpu() -> float:
    """This process's own utime+stime as /proc counts it (the tree's root, to subtract)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        stat = f.read().decode(errors="replace")
    fields = stat[stat.rfind(")") + 2:].split()
    return sum(int(x) for x in fields[11:15]) / tick


if __name__ == "__main__":
    sys.exit(main())
