"""Shared pieces of the joader benchmarks: demo data, a joaderd subprocess, emulated jobs, CPU.

Every job runs as its own process through `joader/testing/simjob.py`, as a training
script would, with one torch thread and OMP_NUM_THREADS=1 (on a busy two-core machine, OpenMP
spinning makes torch.stack in collate about 30x slower). The bench process itself never opens a
gRPC channel: the status is read by `joader status --json` in a subprocess.

CPU accounting, two ways:
- steady state (the figure we report): for joader, the CPU of the server's process tree (joaderd
  and its decode workers, read from /proc) between "ready" and "all jobs done", plus every job's
  per-epoch `cpu_s` (simjob: its own process and all descendants, so DataLoader workers and the
  lease keeper count); for the baseline, the jobs' per-epoch `cpu_s` alone. Start-up (importing
  torch, listing the folder) is excluded on both sides.
- total: `resource.getrusage(RUSAGE_CHILDREN)` of this process around the whole trial (every
  process it spawned and reaped, grandchildren included once their parents reaped them), minus
  the status subprocesses. This includes start-up and shutdown.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from joader.launch import JoaderdProcess
from joader.testing.simjob import tree_cpu_s

RESULTS = Path(__file__).resolve().parent / "results"
IMAGE_SIZE = 256
ITEM_NBYTES = 3 * IMAGE_SIZE * IMAGE_SIZE
DATA_DIR = Path(os.environ.get("JOADER_BENCH_DATA", "/tmp/joader-bench-data"))


def bench_env() -> dict[str, str]:
    """Environment of every subprocess: one OpenMP/MKL thread (DataLoader workers inherit it)."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def demo_data(num_items: int) -> Path:
    """A demo ImageFolder of exactly `num_items` 500x375 JPEGs (generated once, then reused)."""
    from joader.client.tools.demo_data import make_demo_data

    root = DATA_DIR / f"demo-{num_items}"
    marker = root / ".complete"
    if not marker.exists():
        print(f"generating {num_items} demo JPEGs in {root} ...", flush=True)
        make_demo_data(root, num_items, progress=False)
        marker.touch()
    warm_page_cache(root)
    return root


def warm_page_cache(root: Path) -> None:
    """Read every file once so that neither side pays for a cold disk."""
    for path in sorted(root.rglob("*.jp*g")):
        path.read_bytes()


def quarter_cache_bytes(num_items: int) -> int:
    return num_items * ITEM_NBYTES // 4


def full_cache_bytes(num_items: int) -> int:
    return num_items * ITEM_NBYTES + 64 * ITEM_NBYTES  # room for every item, plus slack


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Server:
    """One joaderd on a private Unix socket, serving `root` as source `demo`.

    Started by `joader.launch.JoaderdProcess`: ready when joaderd's ready file appears, which
    also gives the arena's path and joaderd's pid.
    """

    def __init__(self, root: Path, cache_bytes: int, *, workers: int | str = 2, extra: Sequence[str] = (),
                 source: str = "demo", settings: Sequence[str] | None = None) -> None:
        """`settings` replaces the demo's (image size, `workers`, log level): joaderd's own
        defaults for the rest, as a user's `joaderd --source NAME=ROOT` (bench/field/field.py)."""
        self.dir = Path(tempfile.mkdtemp(prefix="jb-", dir="/tmp"))  # short: sun_path is 108 bytes
        self.log_path = self.dir / "joaderd.log"
        self.status_cpu_s = 0.0
        if settings is None:
            settings = ["--image-size", str(IMAGE_SIZE), "--workers", str(workers), "--log-level", "INFO"]
        args = ["--listen", f"unix:{self.dir / 'joaderd.sock'}", "--source", f"{source}={root}",
                "--cache-size", str(cache_bytes), *settings, *extra]
        try:
            self.process = JoaderdProcess.start(args, env=bench_env(), stdout=self.log_path, ready_timeout_s=120)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.proc = self.process.proc
        self.address = self.process.address
        self.arena_path = self.process.arena_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def status(self) -> dict[str, Any]:
        before = children_cpu_s()
        out = subprocess.run(
            [sys.executable, "-m", "joader.client.tools.cli", "status", "--json", "--address", self.address],
            capture_output=True, text=True, timeout=60, check=True, env=bench_env(),
        )
        self.status_cpu_s += children_cpu_s() - before
        return json.loads(out.stdout)

    def stop(self) -> int:
        code = self.process.stop(timeout_s=30)
        shutil.rmtree(self.dir, ignore_errors=True)
        return code

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def simjob_command(name: str, *, address: str | None = None, baseline: Path | None = None,
                   indices: str | None = None, epochs: int = 1, batch_size: int = 32, step_s: float = 0.0,
                   num_workers: int = 0, start_at: float = 0.0, start_delay_s: float = 0.0,
                   record: bool = False, batched: bool = False, threads: int = 1,
                   decoder: str | None = None, augment: int = 0, step_cpu_s: float = 0.0) -> list[str]:
    command = [sys.executable, "-m", "joader.testing.simjob", "--name", name, "--epochs", str(epochs),
               "--batch-size", str(batch_size), "--step-s", str(step_s), "--num-workers", str(num_workers),
               "--image-size", str(IMAGE_SIZE), "--threads", str(threads)]
    if baseline is not None:
        command += ["--baseline", str(baseline)]
        if decoder:
            command += ["--decoder", decoder]
    else:
        command += ["--address", str(address), "--source", "demo"]
    if augment:
        command += ["--augment", str(augment)]
    if step_cpu_s:
        command += ["--step-cpu-s", str(step_cpu_s)]
    if indices:
        command += ["--indices", indices]
    if start_at:
        command += ["--start-at", repr(start_at)]
    if start_delay_s:
        command += ["--start-delay-s", repr(start_delay_s)]
    if record:
        command.append("--record")
    if batched:
        command.append("--batched")
    return command


def run_jobs(commands: Sequence[list[str]], timeout_s: float = 900,
             env_extra: dict[str, str] | None = None, thread_env: bool = True) -> list[dict[str, Any]]:
    """Runs every job command at once (each its own process) and returns their JSON reports.

    `thread_env=False`: the jobs get the caller's environment as it is (no OMP_NUM_THREADS=1),
    as a user's plain script would."""
    env = {**(bench_env() if thread_env else dict(os.environ)), **(env_extra or {})}
    workdir = Path(tempfile.mkdtemp(prefix="jbjobs-", dir="/tmp"))
    procs = []
    try:
        for i, command in enumerate(commands):
            out = workdir / f"job{i}.json"
            err = open(workdir / f"job{i}.err", "wb")
            procs.append((subprocess.Popen([*command, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=err,
                                           env=env), out, err, workdir / f"job{i}.err"))
        deadline = time.monotonic() + timeout_s
        for proc, _, err, _ in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            err.close()
        reports = []
        for (proc, out, _, err_path), command in zip(procs, commands, strict=True):
            if proc.returncode != 0:
                raise RuntimeError(f"job failed ({proc.returncode}): {' '.join(command)}\n"
                                   f"{err_path.read_text(errors='replace')[-3000:]}")
            reports.append(json.loads(out.read_text()))
        return reports
    finally:
        for proc, *_ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def start_margin_s(num_jobs: int) -> float:
    """Time for `num_jobs` processes to import torch and register, so --start-at lines them up."""
    return 2.0 + 1.0 * num_jobs


def summarize_jobs(reports: Sequence[dict[str, Any]], epoch: int = 0) -> dict[str, Any]:
    """Per-job epoch times, aggregate samples/s over the span of all jobs, their epoch CPU."""
    epochs = [r["epochs"][epoch] for r in reports]
    started = min(e["started_at"] for e in epochs)
    ended = max(e["ended_at"] for e in epochs)
    samples = sum(e["num_samples"] for e in epochs)
    return {
        "epoch_s": [round(e["wall_s"], 3) for e in epochs],
        "wait_s": [round(e["wait_s"], 3) for e in epochs],
        "span_s": round(ended - started, 3),
        "start_skew_s": round(max(e["started_at"] for e in epochs) - started, 3),
        "samples": samples,
        "aggregate_samples_per_s": round(samples / (ended - started), 1),
        "jobs_cpu_s": round(sum(e["cpu_s"] for e in epochs), 3),
    }


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        import PIL
        import torch

        info["torch"] = torch.__version__
        info["pillow"] = PIL.__version__
    except ImportError:
        pass
    info["loadavg_at_start"] = list(os.getloadavg())
    return info


def measure_decode_capacity(root: Path, processes: int = 2, num_images: int = 400,
                            decoder: str | None = None) -> dict[str, Any]:
    """Images/s of the shared stage (read, decode, resize, crop) with `processes` processes
    (`decoder`: the stage's decoder, default joaderd's)."""
    import multiprocessing as mp

    from joader.sources.imagefolder import list_image_folder

    listing = list_image_folder(root)
    paths = [str(listing.root / p) for p in listing.paths[:num_images]]
    chunks = [paths[i::processes] for i in range(processes)]
    ctx = mp.get_context("fork")
    with ctx.Pool(processes) as pool:
        pool.map(_prepare_all, [([c[0]], decoder) for c in chunks])  # warm up the workers
        started = time.perf_counter()
        pool.map(_prepare_all, [(c, decoder) for c in chunks])
        elapsed = time.perf_counter() - started
    return {"processes": processes, "images": len(paths), "seconds": round(elapsed, 3),
            "images_per_s": round(len(paths) / elapsed, 1)}


def _prepare_all(work: tuple[list[str], str | None]) -> int:
    from joader.stages import build_stage

    paths, decoder = work
    options = {"decoder": decoder} if decoder else {}  # default: joaderd's default decoder
    stage = build_stage("center-crop", size=IMAGE_SIZE, **options)
    for path in paths:
        with open(path, "rb") as f:
            stage.prepare(f.read(), path)
    return len(paths)


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def save_figure(fig: Any, name: str) -> Path:
    """Lays out `fig` and writes it as bench/results/NAME.png."""
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


def start_processes(commands: Sequence[list[str]]) -> list[subprocess.Popen[bytes]]:
    """Starts long-running simjobs (quietly, in the bench environment); `stop_processes` ends them."""
    return [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=bench_env())
            for command in commands]


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    """SIGTERM each (long-running simjobs), then wait; SIGKILL what is still there after `timeout_s`."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

