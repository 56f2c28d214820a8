"""`make demo`: three concurrent jobs share one joaderd on generated ImageNet-like data.

Generates the demo folder (once), starts joaderd with a cache of a quarter of the prepared
dataset, runs three emulated training jobs in their own processes (overlapping subsets, different
speeds, staggered starts) for two epochs each with progress bars, prints the status table while
they run and at the end, and stops the server cleanly.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from joader.client.cli import fetch_status, format_status
from joader.launch import JoaderdProcess, JoaderdStartError

IMAGE_SIZE = 256


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


def run_job(argv: list[str]) -> int:
    """One demo job: what a training script does, with a sleep for its step and a progress bar."""
    parser = argparse.ArgumentParser(prog="python -m joader.client.demo job")
    parser.add_argument("--address", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--indices", required=True, help="START:STOP")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.0, help="emulated training step per batch")
    parser.add_argument("--start-delay-s", type=float, default=0.0)
    parser.add_argument("--position", type=int, default=0, help="progress bar line")
    args = parser.parse_args(argv)
    time.sleep(args.start_delay_s)
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    from joader import JoaderDataset

    start, stop = map(int, args.indices.split(":"))
    with JoaderDataset("demo", indices=range(start, stop), address=args.address, name=args.name,
                       batch_size=32) as ds:
        loader = DataLoader(ds, batch_size=32)
        for epoch in range(args.epochs):
            with tqdm(total=len(ds), desc=f"{args.name} epoch {epoch + 1}/{args.epochs}", position=args.position,
                      unit="img", leave=True, dynamic_ncols=True) as bar:
                for images, _labels in loader:
                    bar.update(len(images))
                    time.sleep(args.step_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        return run_job(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m joader.client.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("demo-data"))
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)

    from joader.client.demo_data import make_demo_data

    print(f"demo: generating {args.items} ImageNet-like JPEGs in {args.data} (once)", flush=True)
    make_demo_data(args.data, args.items, progress=True)
    n = args.items
    cache_bytes = n * 3 * IMAGE_SIZE * IMAGE_SIZE // 4
    runtime = Path(tempfile.mkdtemp(prefix="joader-demo-"))
    listen = f"unix:{runtime / 'joaderd.sock'}"
    print(f"demo: starting joaderd at {listen} with a {cache_bytes / 2**20:.0f} MiB cache "
          "(a quarter of the prepared dataset)", flush=True)
    server = start_joaderd(args.data, listen, cache_bytes, ["--log-level", "WARNING"])
    address = server.address  # as joaderd reports it
    jobs = [
        # name, indices, emulated step per batch of 32, start delay
        ("tune-a", f"0:{2 * n // 3}", 0.02, 0.0),
        ("tune-b", f"{n // 3}:{n}", 0.04, 1.5),
        ("full-c", f"0:{n}", 0.03, 3.0),
    ]
    procs = []
    try:
        for position, (name, indices, step_s, delay_s) in enumerate(jobs):
            procs.append(subprocess.Popen([
                sys.executable, "-m", "joader.client.demo", "job", "--address", address, "--indices", indices,
                "--epochs", str(args.epochs), "--step-s", str(step_s), "--start-delay-s", str(delay_s),
                "--name", name, "--position", str(position),
            ]))
        shown = False
        while any(p.poll() is None for p in procs):
            if not shown and len(fetch_status(address)["jobs"]) == len(jobs):
                time.sleep(2.0)
                print("\n" * len(jobs) + format_status(fetch_status(address)) + "\n", flush=True)
                shown = True
            time.sleep(0.5)
        failed = [name for (name, *_), p in zip(jobs, procs, strict=True) if p.returncode != 0]
        print("\n" * len(jobs) + format_status(fetch_status(address)), flush=True)
        if failed:
            print(f"demo: jobs {', '.join(failed)} failed", file=sys.stderr)
            return 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        code = server.stop(timeout_s=30)
        print(f"demo: joaderd stopped (exit code {code})", flush=True)
        try:
            runtime.rmdir()
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
