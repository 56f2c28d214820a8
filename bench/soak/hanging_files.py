"""Issue 36, item 5 ("files that hang are retried every epoch"): with some files that hang
their decode worker every time, at joaderd's DEFAULT decode timeout and retry time, how much
slower is each epoch than a clean one, and does a job still get every healthy item of every
epoch, with the right pixels?

A real joaderd (2 workers, no --decode-timeout-s, no --retry-failed-s: the defaults) serves
`--items` (300) demo JPEGs through the user stage of `joader/testing/hang_stage.py`: joader's
center-crop, except that on the chosen files it sleeps for good, as a read from a hung mount or
a decoder stuck in a loop would. For each fraction of hanging files (0%, 5%, 10%; picked with a
fixed seed) one job (`joader/testing/integrity_job.py`, on_error="skip") reads `--epochs` (3)
epochs and records every sample's index, label and pixel crc32; each epoch is checked against
a decode made here, outside joaderd (`joader/testing/integrity.check_records`: every healthy
item exactly once, right pixels and label, no hanging one). Each epoch's wall time is when its
last sample was recorded (the records file is polled every 50 ms), from the job's start for
the first. Also reported: the pool's timed-out tasks and quarantined files (`joader status`),
the decode timeout joaderd logged, and how often joaderd's log names each hanging file as
quarantined (once each).

Before the fix, the issue measured 139/95/95 s at 10% with --decode-timeout-s 3 (about 1 s
clean); at the then-default 60 s, 5% would make the first epoch about 15 minutes.

Usage:
    python -m bench.soak.hanging_files [--items 300] [--fractions 0,0.05,0.1] [--epochs 3]
        [--cache quarter|full] [--workers 2] [--label after] [--extra "--decode-timeout-s 3"]

Results go to bench/results/hanging_files-<label>.json. The machine is a shared 2-core VM:
times vary from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    IMAGE_SIZE,
    RESULTS,
    bench_env,
    demo_data,
    full_cache_bytes,
    quarter_cache_bytes,
)
from joader.launch import JoaderdProcess
from joader.sources.base import open_source
from joader.testing.integrity import check_records, read_records, reference

ROOT = Path(__file__).resolve().parents[2]
LATER_EPOCH_FACTOR = 3.0  # the bar: each epoch after the first within 3x a clean one


def start_server(root: Path, hang_on: list[str], cache_bytes: int, workers: int, workdir: Path,
                 extra: list[str]) -> JoaderdProcess:
    """joaderd with source `demo` = `root` through the hanging stage, at its default timeouts."""
    config = workdir / "joaderd.toml"
    names = ", ".join(json.dumps(p) for p in hang_on)
    config.write_text(f"[sources.demo]\npath = {json.dumps(str(root))}\n"
                      f'stage = "joader.testing.hang_stage:factory"\n'
                      f"options = {{ size = {IMAGE_SIZE}, hang_on = [{names}] }}\n")
    args = ["--listen", f"unix:{workdir / 'joaderd.sock'}", "--config", str(config),
            "--cache-size", str(cache_bytes), "--workers", str(workers), "--log-level", "INFO", *extra]
    return JoaderdProcess.start(args, env=_env(), stdout=workdir / "joaderd.log", ready_timeout_s=120)


def _env() -> dict[str, str]:
    return {**bench_env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def read_status(address: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "status", "--json", "--address", address],
                         capture_output=True, text=True, timeout=60, check=True, env=bench_env())
    return json.loads(out.stdout)


def run_job(address: str, records: Path, num_items: int, epochs: int, timeout_s: float) -> tuple[list[float], str]:
    """Runs the recording job; returns each epoch's end (seconds from the job's start) and its
    error text ("" if it finished)."""
    started = time.monotonic()
    job = subprocess.Popen(
        [sys.executable, "-m", "joader.testing.integrity_job", "--address", address, "--records", str(records),
         "--epochs", str(epochs), "--indices", f"0:{num_items}", "--batch-size", "16", "--timeout-s", "600"],
        cwd=ROOT, env=_env(), stderr=subprocess.PIPE, start_new_session=True)
    ends: list[float] = []
    while job.poll() is None and time.monotonic() - started < timeout_s:
        time.sleep(0.05)
        done = _epochs_done(records)
        while len(ends) < done:
            ends.append(time.monotonic() - started)
    if job.poll() is None:
        job.kill()
    _, err = job.communicate()
    done = _epochs_done(records)
    while len(ends) < done:
        ends.append(time.monotonic() - started)
    error = "" if job.returncode == 0 else err.decode(errors="replace")[-600:]
    return ends, error


def _epochs_done(records: Path) -> int:
    try:
        return records.read_bytes().count(b'"kind": "epoch"')
    except OSError:
        return 0


def run_one(root: Path, paths: list[str], expected: dict[int, Any], fraction: float,
            args: argparse.Namespace) -> dict[str, Any]:
    hang_ids = sorted(random.Random(36).sample(range(len(paths)), round(fraction * len(paths))))
    hanging = [paths[i] for i in hang_ids]
    healthy = set(range(len(paths))) - set(hang_ids)
    cache_bytes = full_cache_bytes(len(paths)) if args.cache == "full" else quarter_cache_bytes(len(paths))
    workdir = Path(tempfile.mkdtemp(prefix="jhf-", dir="/tmp"))
    server = start_server(root, hanging, cache_bytes, args.workers, workdir, shlex.split(args.extra))
    try:
        ends, error = run_job(server.address, workdir / "job.jsonl", len(paths), args.epochs, args.job_timeout_s)
        status = read_status(server.address)
        records = read_records(workdir / "job.jsonl")
    finally:
        server.stop(timeout_s=30)
        log = (workdir / "joaderd.log").read_text(errors="replace")
        shutil.rmtree(workdir, ignore_errors=True)
    findings = check_records(records, expected, healthy, args.epochs, "job")
    walls = [round(end - start, 3) for start, end in zip([0.0, *ends], ends, strict=False)]
    workers = status.get("workers", {})
    timeouts = re.findall(r"decode timeout (?:now )?([0-9.]+ s \([^)]*\))", log)
    return {
        "fraction": fraction,
        "num_hanging": len(hanging),
        "healthy_expected": len(healthy),
        "epoch_wall_s": walls,
        "every_healthy_item_right": findings.ok and len(walls) == args.epochs and not error,
        "findings": {"checked": findings.checked, "wrong_pixels": findings.wrong_pixels,
                     "wrong_labels": findings.wrong_labels, "duplicated": findings.duplicated,
                     "missing": findings.missing, "problems": findings.problems},
        "job_error": error,
        "status": {
            "items_failed": status.get("items_failed"),
            "tasks_timed_out": workers.get("tasks_timed_out"),
            "quarantined": workers.get("quarantined"),
            "replaced": workers.get("replaced"),
            "crash_loop": workers.get("crash_loop"),
        },
        "decode_timeouts_logged": timeouts,
        "quarantine_lines_per_file": sorted({log.count(f"quarantined {p}:") for p in hanging}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=300)
    parser.add_argument("--fractions", default="0,0.05,0.1", help="of the files that hang the stage")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cache", choices=("quarter", "full"), default="quarter")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--job-timeout-s", type=float, default=1200.0)
    parser.add_argument("--extra", default="", help="more joaderd flags (default: none, the defaults)")
    parser.add_argument("--label", default="after", help="which code this measures (part of the file name)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    root = demo_data(args.items)
    paths = [str(p) for p in open_source(str(root)).paths]
    expected = reference(root, IMAGE_SIZE)
    results = {}
    for fraction in fractions:
        result = run_one(root, paths, expected, fraction, args)
        results[fraction] = result
        print(f"{fraction:.0%} hanging ({result['num_hanging']} files): epochs "
              + " ".join(f"{w:.1f}s" for w in result["epoch_wall_s"])
              + f"; every healthy item right: {result['every_healthy_item_right']}"
              + (f"; job failed: {result['job_error'][-200:]}" if result["job_error"] else ""), flush=True)
    clean = results.get(0.0, {}).get("epoch_wall_s")
    for result in results.values():
        walls = result["epoch_wall_s"]
        result["vs_clean"] = [round(w / c, 2) for w, c in zip(walls, clean, strict=False)] if clean else None
        result["later_epochs_ok"] = bool(result["vs_clean"]) and len(walls) == args.epochs and all(
            r <= LATER_EPOCH_FACTOR for r in result["vs_clean"][1:])
    out = args.out or RESULTS / f"hanging_files-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "question": "issue 36 item 5: files that hang the decoder, at the default timeouts",
        "label": args.label, "items": args.items, "epochs": args.epochs, "cache": args.cache,
        "workers": args.workers, "extra_flags": args.extra, "host_cpus": os.cpu_count(),
        "load_avg_at_end": os.getloadavg(), "results": {str(f): r for f, r in results.items()},
    }, indent=1))
    print(f"\n{args.items} items, {args.epochs} epochs, cache {args.cache}, {args.workers} workers, "
          f"joaderd flags: {args.extra or 'defaults'}")
    print(f"{'HANG':>5} {'FILES':>5} {'EPOCH S':>22} {'VS CLEAN':>18} {'EXACT':>6} {'TIMED OUT':>9} {'QUAR':>5}")
    for fraction, r in results.items():
        print(f"{fraction:>5.0%} {r['num_hanging']:>5} {' '.join(f'{w:6.1f}' for w in r['epoch_wall_s']):>22} "
              f"{' '.join(f'{v:5.2f}' for v in r['vs_clean'] or []):>18} "
              f"{'yes' if r['every_healthy_item_right'] else 'NO':>6} {r['status']['tasks_timed_out']:>9} "
              f"{r['status']['quarantined']:>5}")
    verdict = all(r["every_healthy_item_right"] and r["later_epochs_ok"] for r in results.values())
    print(f"\nevery healthy item right, epochs after the first <= {LATER_EPOCH_FACTOR:g}x clean: "
          f"{'met' if verdict else 'NOT met'}; results in {out}")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
