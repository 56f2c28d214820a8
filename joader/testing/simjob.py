"""An emulated training job: a DataLoader over joader (or a plain baseline) and a sleep per step.

The demo, the integration tests and the benchmarks all run jobs through this module, each job
in its own process as real training would be:

    python -m joader.testing.simjob --source demo --indices 0:600 --epochs 2 --step-s 0.05 \
        --batch-size 32 --num-workers 2 --out job.json

`--baseline ROOT` runs the same job without joader: an ImageFolder-style map dataset that does
the same shared stage (decode, resize, crop) in its own DataLoader workers, shuffled by PyTorch.
The emulated GPU step is a sleep, so it costs no CPU. The JSON report holds, per epoch, the wall
time, the time spent waiting for data, the item order (with `--record`), and the CPU seconds of
the process and its workers. Each epoch also carries its wall-clock start and end (`started_at`,
`ended_at`, `time.time()`) and its own `cpu_s`: this process plus every live descendant (read from
/proc, so persistent DataLoader workers and the lease keeper count) plus the children it reaped.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


def parse_indices(spec: str | None) -> Any:
    """`0:600` (a range), `0:100,200:300,7` (a list), or `@ids.json`; None or "" means all."""
    if not spec:
        return None
    if spec.startswith("@"):
        return json.loads(Path(spec[1:]).read_text())
    parts = spec.split(",")
    if len(parts) == 1 and ":" in spec:
        start, _, stop = spec.partition(":")
        return range(int(start), int(stop))
    ids: list[int] = []
    for part in parts:
        start, sep, stop = part.partition(":")
        ids.extend(range(int(start), int(stop)) if sep else [int(part)])
    return ids


class RandomCropFlip:
    """The emulated job stage (`--augment`): a random `size` x `size` crop and a random
    horizontal flip of a uint8 CHW tensor, as a training script's transform would do."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        height, width = image.shape[-2:]
        top = int(torch.randint(0, height - self.size + 1, ()))
        left = int(torch.randint(0, width - self.size + 1, ()))
        image = image[..., top:top + self.size, left:left + self.size]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image.contiguous()


class PlainImageFolder(Dataset):
    """The baseline: what a training script does without joader (same shared stage)."""

    def __init__(self, root: str, image_size: int, indices: Any = None, decoder: str | None = None,
                 transform: Any = None) -> None:
        from joader.sources.imagefolder import list_image_folder

        self.listing = list_image_folder(root)
        self.image_size = image_size
        self._stage: Any = None  # joaderd's default stage and decoder: a like-for-like baseline
        self.decoder = decoder
        self.transform = transform
        self.ids = list(indices) if indices is not None else list(range(len(self.listing.paths)))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, int]:
        from joader.stages import build_stage

        if self._stage is None:  # built lazily, in the DataLoader worker
            options: dict[str, Any] = {"decoder": self.decoder} if self.decoder else {}
            self._stage = build_stage("center-crop", size=self.image_size, **options)
        item = self.ids[i]
        image = torch.from_numpy(self._stage.prepare(self.listing.read(item), self.listing.paths[item]))
        if self.transform is not None:
            image = self.transform(image)
        return item, image, int(self.listing.labels[item])


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pid_cpu_s(pid: int) -> float:
    """utime + stime of `pid` and its reaped children (/proc), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return 0.0
    fields = stat[stat.rfind(")") + 2:].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root_pid: int) -> float:
    """utime+stime (and reaped children's) of `root_pid` and all its live descendants (/proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        # after the name: state ppid ... utime(12) stime(13) cutime(14) cstime(15), 0-based here
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = sum(int(x) for x in fields[11:15]) / tick
    total = times.get(root_pid, 0.0)
    frontier = [root_pid]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid:
                total += times[child]
                frontier.append(child)
    return total


def _tree_cpu_s() -> float:
    """CPU seconds of this process, its reaped children and every live descendant."""
    return tree_cpu_s(os.getpid())


def _progress(desc: str, total: int, position: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, position=position, unit="img", leave=True, dynamic_ncols=True)


def run_job(args: argparse.Namespace) -> dict[str, Any]:
    indices = parse_indices(args.indices)
    dataset: Any
    transform = RandomCropFlip(args.augment) if args.augment else None
    size = args.augment or args.image_size
    if args.baseline:
        dataset = PlainImageFolder(args.baseline, args.image_size, indices, args.decoder, transform)
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers,
                            persistent_workers=args.num_workers > 0)
    else:
        from joader.client.dataset import JoaderDataset

        dataset = JoaderDataset(args.source, indices=indices, transform=transform, return_index=True,
                                address=args.address,
                                name=args.name, batch_size=args.batch_size, on_error=args.on_error,
                                batched=args.batched, threads=args.threads if args.threads > 0 else "auto")
        loader = DataLoader(dataset, batch_size=None if args.batched else args.batch_size,
                            num_workers=args.num_workers)
    if args.start_at:  # registered already: the jobs of a sweep start reading together
        time.sleep(max(0.0, args.start_at - time.time()))
    if args.start_file:  # registered already: start when the file appears (all jobs attached)
        deadline = time.monotonic() + 120
        while not args.start_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    report: dict[str, Any] = {"name": args.name, "num_items": len(dataset), "epochs": []}
    started = time.perf_counter()
    cpu_started = _cpu_s()
    for epoch in range(args.epochs):
        bar = _progress(f"{args.name} epoch {epoch + 1}/{args.epochs}", len(dataset), args.position, args.progress)
        order: list[int] = []
        wait_s = 0.0
        epoch_cpu = _tree_cpu_s()
        epoch_wall = time.time()
        epoch_started = time.perf_counter()
        waited_from = epoch_started
        num_samples = 0
        for ids, images, _labels in loader:
            wait_s += time.perf_counter() - waited_from
            if images.dtype != torch.uint8 or images.shape[1:] != (3, size, size):
                raise RuntimeError(f"unexpected batch {images.dtype} {tuple(images.shape)}")
            num_samples += len(ids)
            if args.record:
                order.extend(int(i) for i in ids)
            if bar is not None:
                bar.update(len(ids))
            if args.step_s:
                time.sleep(args.step_s)
            if args.step_cpu_s:
                _burn_cpu(args.step_cpu_s)
            waited_from = time.perf_counter()
        if bar is not None:
            bar.close()
        entry: dict[str, Any] = {
            "wall_s": time.perf_counter() - epoch_started,
            "wait_s": wait_s,
            "num_samples": num_samples,
            "started_at": epoch_wall,
            "ended_at": time.time(),
            "cpu_s": _tree_cpu_s() - epoch_cpu,
        }
        if args.record:
            entry["order"] = order
        report["epochs"].append(entry)
    report["wall_s"] = time.perf_counter() - started
    report["cpu_s"] = _cpu_s() - cpu_started
    if not args.baseline:
        report["job_id"] = dataset.job_id
        dataset.close()
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m joader.testing.simjob", description=__doc__.split("\n")[0])
    parser.add_argument("--source", default="demo")
    parser.add_argument("--address")
    parser.add_argument("--indices", help="e.g. 0:600 or 0:100,200:300 or @ids.json")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--step-s", type=float, default=0.0, help="emulated GPU time per batch")
    parser.add_argument("--step-cpu-s", type=float, default=0.0,
                        help="CPU time per batch on top of --step-s: a training step that needs a core "
                             "(a CPU model, or a busy input pipeline), e.g. for the adaptive-workers bench")
    parser.add_argument("--start-delay-s", type=float, default=0.0)
    parser.add_argument("--start-file", type=Path,
                        help="start reading once this file exists (after registering)")
    parser.add_argument("--start-at", type=float, default=0.0,
                        help="wall-clock time (time.time()) to start at, to line up several jobs")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--name", default=f"simjob-{os.getpid()}")
    parser.add_argument("--baseline", metavar="ROOT", help="run without joader on this ImageFolder")
    parser.add_argument("--augment", type=int, default=0, metavar="S",
                        help="job stage: a random S x S crop and flip per image (both sides; 0: none)")
    parser.add_argument("--decoder", help="the baseline's decoder (default: joaderd's default, like for like)")
    parser.add_argument("--record", action="store_true", help="record the item order of every epoch")
    parser.add_argument("--progress", action="store_true", help="show a progress bar")
    parser.add_argument("--position", type=int, default=0, help="progress bar row")
    parser.add_argument("--out", type=Path, help="write the JSON report here (default: stdout)")
    parser.add_argument("--on-error", choices=("skip", "raise"), default="skip")
    parser.add_argument("--batched", action="store_true",
                        help="JoaderDataset(batched=True) with DataLoader(batch_size=None)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; 0: set none, as a plain script (JoaderDataset's default)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not args.baseline:
        import joader.client.dataset  # noqa: F401  (import before --start-at, not after)
    if args.start_delay_s:
        time.sleep(args.start_delay_s)
    report = run_job(args)
    text = json.dumps(report)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


def _burn_cpu(seconds: float) -> None:
    """Busy for `seconds` of this thread's CPU time (not wall time: a contended core stretches it)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(2000))


if __name__ == "__main__":
    np.seterr(all="raise")
    sys.exit(main())
