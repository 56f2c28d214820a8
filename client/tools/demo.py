"""`make demo`: three training jobs share one joaderd on generated ImageNet-like data, then
the same three jobs run with plain DataLoaders, and the demo says what happened.

What it shows, and why the settings are what they are (a newcomer reads this at the start):

- a small sweep, as people run one: two tuning trials on overlapping two-thirds of the data at
  different speeds, and a full run that joins late. Jobs need not read the same items, start
  together or go at the same pace;
- a cache of a quarter of the prepared data, on purpose: smaller than what the jobs read, so
  the sharing comes from joaderd keeping the jobs' random orders correlated (DSA) and evicting
  by how many jobs still need an item (RefCnt), not from holding everything;
- each job checks its own epochs: every image of its subset once, none twice (a checksum of
  every image it received);
- then the same jobs with plain DataLoaders, each decoding its own images with the same decoder
  at the same size, so the difference in time is the sharing alone.

It ends with a summary: images read against images decoded, the two times, and the next step.
`python -m joader.client.tools.demo --help` lists the knobs; `make demo` runs the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from joader.client.tools.cli import fetch_status, format_status
from joader.launch import JoaderdProcess, JoaderdStartError

IMAGE_SIZE = 256
BATCH = 32
PLAIN_WORKERS = 2  # DataLoader workers per plain job: each job decodes its own images
# name, first and last fraction of the items, emulated training step per batch (s), start delay (s)
JOBS = (
    ("tune-a", 0.0, 2 / 3, 0.02, 0.0),
    ("tune-b", 1 / 3, 1.0, 0.04, 0.5),
    ("full-c", 0.0, 1.0, 0.03, 1.0),
)


@dataclass(frozen=True)
class JobReport:
    """What one job process saw, written as JSON to its `--report` file."""

    name: str
    items: int  # its subset's size (len of its dataset)
    epochs: list[dict[str, int]]  # per epoch: images received, distinct images among them
    wall_s: float

    @property
    def read(self) -> int:
        return sum(e["received"] for e in self.epochs)

    @property
    def exact(self) -> bool:
        return all(e["received"] == e["distinct"] == self.items for e in self.epochs)


def start_joaderd(data: Path, address: str, cache_bytes: int, extra: list[str] | None = None) -> JoaderdProcess:
    """Starts joaderd serving `data` as source `demo` and waits until it serves (its ready file).

    joaderd's output goes to this terminal, so its warnings stay visible during the demo.
    """
    args = ["--source", f"demo={data}", "--listen", address, "--cache-size", str(cache_bytes),
            "--image-size", str(IMAGE_SIZE), *(extra or [])]
    try:
        return JoaderdProcess.start(args, ready_timeout_s=60)
    except JoaderdStartError as error:
        raise SystemExit(f"demo: {error}") from None


class _PlainFolder:
    """A map-style dataset over the demo folder, as a user's ImageFolder would be: each item
    read and prepared in the DataLoader's workers, with joaderd's own listing and stage (its
    default decoder, center crop to `IMAGE_SIZE`), so both runs do the same work per decode."""

    def __init__(self, data: Path, indices: range) -> None:
        from joader.sources.imagefolder import list_image_folder
        from joader.stages import build_stage

        self.listing = list_image_folder(data)
        self.stage = build_stage("center-crop", size=IMAGE_SIZE)
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        import torch

        item_id = self.indices[index]
        array = self.stage.prepare(self.listing.read(item_id), str(self.listing.paths[item_id]))
        return torch.from_numpy(array), int(self.listing.labels[item_id])


def _loader(args: argparse.Namespace, indices: range) -> tuple[Any, Any, int]:
    """The job's DataLoader, the dataset to close afterwards (or None) and its length."""
    from torch.utils.data import DataLoader

    if args.plain:
        plain = _PlainFolder(Path(args.data), indices)
        # a map-style dataset by protocol (len, getitem), which DataLoader takes; not a Dataset
        # subclass, so that importing this module does not import torch
        loader: Any = DataLoader(plain, batch_size=BATCH, shuffle=True, num_workers=PLAIN_WORKERS)  # type: ignore[arg-type]
        return loader, None, len(plain)
    from joader import JoaderDataset

    ds = JoaderDataset("demo", indices=indices, address=args.address, name=args.name, batch_size=BATCH)
    return DataLoader(ds, batch_size=BATCH), ds, len(ds)


def run_job(argv: list[str]) -> int:
    """One demo job: what a training script does, with a sleep for its step and a progress bar.
    It checksums every image it receives, so each epoch is checked: all its items, none twice."""
    parser = argparse.ArgumentParser(prog="python -m joader.client.tools.demo job")
    parser.add_argument("--address", help="joaderd's address (a joader job)")
    parser.add_argument("--plain", action="store_true", help="a plain DataLoader over --data instead")
    parser.add_argument("--data", help="the demo folder (a plain job)")
    parser.add_argument("--name", required=True)
    parser.add_argument("--indices", required=True, help="START:STOP")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.0, help="emulated training step per batch")
    parser.add_argument("--start-delay-s", type=float, default=0.0)
    parser.add_argument("--position", type=int, default=0, help="progress bar line")
    parser.add_argument("--report", required=True, help="where to write what the job saw (JSON)")
    args = parser.parse_args(argv)
    time.sleep(args.start_delay_s)
    from tqdm import tqdm

    start, stop = map(int, args.indices.split(":"))
    began = time.monotonic()
    loader, ds, items = _loader(args, range(start, stop))
    epochs = []
    try:
        for epoch in range(args.epochs):
            seen: set[int] = set()
            received = 0
            with tqdm(total=items, desc=f"{args.name} epoch {epoch + 1}/{args.epochs}", position=args.position,
                      unit="img", leave=False, dynamic_ncols=True) as bar:
                for images, _labels in loader:
                    for image in images:
                        seen.add(zlib.crc32(image.numpy().tobytes()))
                    received += len(images)
                    bar.update(len(images))
                    time.sleep(args.step_s)
            epochs.append({"received": received, "distinct": len(seen)})
    finally:
        if ds is not None:
            ds.close()
    report = JobReport(args.name, items, epochs, time.monotonic() - began)
    Path(args.report).write_text(json.dumps(report.__dict__))
    return 0


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _spans(n: int) -> list[tuple[str, str, float, float]]:
    """Each job's name, `START:STOP` of the items, step and start delay, for `n` items."""
    return [(name, f"{round(first * n)}:{round(last * n)}", step_s, delay_s)
            for name, first, last, step_s, delay_s in JOBS]


def explain(n: int, cache_items: int, epochs: int) -> str:
    """What the demo is about to run, and why these settings."""
    lines = [f"demo: {len(JOBS)} training jobs, {_plural(epochs, 'epoch')} each, as a small sweep would run them:"]
    for name, span, step_s, delay_s in _spans(n):
        start, stop = map(int, span.split(":"))
        lines.append(f"  {name}: images {start}-{stop - 1} ({stop - start}), a {step_s * 1000:.0f} ms step per "
                     f"batch of {BATCH}, starts after {delay_s:g} s")
    lines += [
        f"  joaderd's cache holds {cache_items} of the {n} prepared images (a quarter), on purpose: jobs that",
        "  overlap only in part, go at their own speeds and start late still share most decodes, because",
        "  joaderd keeps their random orders correlated and evicts what fewer jobs still need.",
        "  Then the same jobs with plain DataLoaders, each decoding its own images (same decoder, same size).",
    ]
    return "\n".join(lines)


def run_jobs(runtime: Path, n: int, epochs: int, *, address: str | None = None,
             data: Path | None = None) -> tuple[float, list[JobReport]]:
    """Runs the jobs as processes (joader jobs at `address`, else plain ones over `data`), all
    at once as a sweep would; their wall time and reports. While joader jobs run, the status
    table is printed once all have attached."""
    procs = []
    began = time.monotonic()
    for position, (name, span, step_s, delay_s) in enumerate(_spans(n)):
        where = ["--address", address] if address else ["--plain", "--data", str(data)]
        procs.append(subprocess.Popen([
            sys.executable, "-m", "joader.client.tools.demo", "job", *where, "--indices", span, "--name", name,
            "--epochs", str(epochs), "--step-s", str(step_s), "--start-delay-s", str(delay_s),
            "--position", str(position), "--report", str(runtime / f"{name}.json"),
        ]))
    try:
        shown = address is None
        while any(p.poll() is None for p in procs):
            if not shown and len(fetch_status(address)["jobs"]) == len(JOBS):
                time.sleep(1.0)
                print("\n" * len(JOBS) + "demo: joaderd while all three jobs run (`joader top` shows this live):\n"
                      + format_status(fetch_status(address)) + "\n", flush=True)
                shown = True
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall_s = time.monotonic() - began
    failed = [name for (name, *_), p in zip(JOBS, procs, strict=True) if p.returncode != 0]
    if failed:
        raise SystemExit(f"demo: jobs {', '.join(failed)} failed (their errors are above)")
    reports = [JobReport(**json.loads((runtime / f"{name}.json").read_text())) for name, *_ in JOBS]
    return wall_s, reports


def summarize(reports: list[JobReport], decoded: int, cache_items: int, joader_s: float,
              plain_s: float | None, data: Path) -> str:
    """The newcomer's summary: what ran, images read against decoded, the times, the next step."""
    read = sum(r.read for r in reports)
    lines = ["", "demo: what happened"]
    for r in reports:
        verdict = "every image once" if r.exact else "NOT exactly once (a bug: please report it)"
        lines.append(f"  {r.name}: {_plural(len(r.epochs), 'epoch')} of {r.items} images, {verdict} per epoch, "
                     f"{r.wall_s:.1f} s")
    lines.append(f"  this run: the jobs read {read} images; joaderd decoded {decoded} "
                 f"({read / max(decoded, 1):.2f} images read per decode) with a cache of {cache_items} images")
    if plain_s is not None:
        lines.append(f"  time for all three: {joader_s:.1f} s with joaderd, {plain_s:.1f} s with plain DataLoaders "
                     f"({PLAIN_WORKERS} workers each): {plain_s / joader_s:.2f}x")
        lines.append(f"  (on this machine's {os.cpu_count()} cores; bench/README.md has sweeps of real training "
                     "scripts measured the same way)")
    lines += [
        "",
        "next: in your training script, in place of your ImageFolder:",
        "    from joader import JoaderDataset",
        f"    ds = JoaderDataset(\"photos\", root=\"{data.resolve()}\", image_size=224)  # starts or joins joaderd",
        "    loader = torch.utils.data.DataLoader(ds, batch_size=64)",
        "  run several such scripts at once (a sweep), and `joader top` to watch them share;",
        "  examples/ has a real training script (real_job.py), Ray Tune and Optuna sweeps; the README covers",
        "  bash loops, Lightning, torchrun and what every number above means.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        return run_job(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m joader.client.tools.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("demo-data"))
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--no-plain", action="store_true", help="skip the run with plain DataLoaders")
    args = parser.parse_args(argv)

    from joader.client.tools.demo_data import make_demo_data

    n = args.items
    cache_items = max(1, n // 4)
    print(explain(n, cache_items, args.epochs) + "\n", flush=True)
    print(f"demo: generating {n} ImageNet-like JPEGs in {args.data} (once)", flush=True)
    make_demo_data(args.data, n, progress=True)
    cache_bytes = cache_items * 3 * IMAGE_SIZE * IMAGE_SIZE
    runtime = Path(tempfile.mkdtemp(prefix="joader-demo-"))
    listen = f"unix:{runtime / 'joaderd.sock'}"
    print(f"demo: starting joaderd at {listen} with a {cache_bytes / 2**20:.0f} MiB cache", flush=True)
    server = start_joaderd(args.data, listen, cache_bytes, ["--log-level", "WARNING"])
    try:
        joader_s, reports = run_jobs(runtime, n, args.epochs, address=server.address)
        decoded = int(fetch_status(server.address)["items_decoded"])
    finally:
        code = server.stop(timeout_s=30)
        print(f"demo: joaderd stopped (exit code {code})", flush=True)
    plain_s = None
    if not args.no_plain:
        print("demo: now the same jobs with plain DataLoaders", flush=True)
        plain_s, _ = run_jobs(runtime, n, args.epochs, data=args.data)
    for path in runtime.iterdir():
        path.unlink(missing_ok=True)
    runtime.rmdir()
    print(summarize(reports, decoded, cache_items, joader_s, plain_s, args.data), flush=True)
    return 0 if all(r.exact for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
