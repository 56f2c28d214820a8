"""The sweep that crashed joaderd (issue 27, finding 0), run many times, every sample checked.

    python -m bench.soak.sweep_whole_cache [--runs 20] [--epochs 5] [--stagger-s 0.5] [--items 1200]

Question: does an ordinary sweep survive when the cache holds the whole dataset? A Ray Tune
sweep of 4 trials over 1,200 photos with `joaderd --image-size 64` and the default 1 GiB cache
(the prepared data is 14 MiB: every item is reused across epochs) lost its joaderd in 3 of 6
runs ("refcount of 1021 would drop to -1" in the scheduler), and one finished sweep had an
epoch with an item twice. Four plain processes reproduce it: `DataLoader(JoaderDataset(
"photos", return_index=True), batch_size=32)`, 0.01 s per step, started 0.5 s apart, each
building its model (0 to 2 x `--setup-s`) between attaching and its first read: a job attached and not
reading yet while a late joiner's first round aligned is what the sampler mis-dealt to.

Each run here starts a fresh joaderd with the README's defaults but `--image-size 64` (the
default cache, `--workers auto`, `--epoch-align first`), then 4 such jobs (`tests/integration/
integrity_job.py`, a real torch DataLoader over JoaderDataset) `--stagger-s` apart, each for
`--epochs` epochs. After each run: every job exited 0, every sample's pixels and label match a
decode made here outside joaderd, every epoch of every job is exactly once, joaderd is still
up, its status counts no contained internal error, and it stops cleanly. Prints one line per run
and a summary; writes bench/results/sweep_whole_cache-*.json; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from joader.client.tools.demo_data import make_demo_data
from joader.launch import JoaderdProcess
from joader.testing.integrity import Findings, check_records, read_records, reference

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
JOBS = 4
BATCH = 32


@dataclass
class RunResult:
    number: int
    seconds: float = 0.0
    samples: int = 0
    wrong: int = 0
    duplicated: int = 0
    missing: int = 0
    jobs_failed: int = 0
    server_crashed: bool = False
    internal_errors: int = 0
    sharing: float = 0.0  # deliveries per decode, from joaderd's status
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.wrong or self.duplicated or self.missing or self.jobs_failed or self.server_crashed
                    or self.internal_errors)

    def line(self) -> str:
        return (f"run {self.number:2d}: {self.seconds:5.1f} s, {self.samples} samples checked, wrong {self.wrong}, "
                f"duplicated {self.duplicated}, missing {self.missing}, jobs failed {self.jobs_failed}, "
                f"joaderd crashed {self.server_crashed}, internal errors {self.internal_errors}, "
                f"deliveries per decode {self.sharing:.2f}: {'ok' if self.ok else 'FAILED'}")


def _status(address: str, env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "status", "--json", "--address", address],
                         capture_output=True, text=True, timeout=60, env=env).stdout
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        return {}


def one_run(number: int, args: argparse.Namespace, data: Path, expected: dict, work: Path) -> RunResult:
    result = RunResult(number)
    home = work / f"run-{number}"
    home.mkdir()
    env = {**os.environ, "JOADER_VERIFY": "1", "PYTHONWARNINGS": "ignore"}
    address = f"unix:{home / 'joaderd.sock'}"
    server = JoaderdProcess.start(["--listen", address, "--image-size", "64", "--source", f"photos={data}"],
                                  stdout=home / "joaderd.log", ready_timeout_s=120, env=env)
    started = time.monotonic()
    rng = random.Random(number)  # each job's set-up time, the same in every sweep
    jobs = []
    try:
        for k in range(JOBS):
            if k:
                time.sleep(args.stagger_s)
            records = home / f"trial{k}.jsonl"
            command = [sys.executable, "-m", "joader.testing.integrity_job", "--address", address,
                       "--source", "photos", "--records", str(records), "--name", f"trial{k}",
                       "--epochs", str(args.epochs), "--batch-size", str(BATCH), "--follow-loader",
                       "--sleep", "0.01", "--timeout-s", "120", "--setup-s", f"{rng.uniform(0, 2 * args.setup_s):.2f}"]
            jobs.append((records, subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                                   stderr=open(f"{records}.err", "wb"))))
        for records, proc in jobs:
            try:
                code = proc.wait(timeout=args.job_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            if code != 0:
                result.jobs_failed += 1
                result.problems.append(f"{records.stem} exited {code}: "
                                       f"{Path(f'{records}.err').read_text(errors='replace')[-800:]}")
            findings = check_records(read_records(records), expected, set(range(args.items)), args.epochs,
                                     records.stem, Findings())
            result.samples += findings.checked
            result.wrong += findings.wrong_pixels + findings.wrong_labels
            result.duplicated += findings.duplicated
            result.missing += findings.missing
            result.problems += findings.problems[:3]
        result.seconds = time.monotonic() - started
        if server.proc.poll() is not None:
            result.server_crashed = True
            result.problems.append(f"joaderd exited with {server.proc.returncode}: "
                                   f"{(home / 'joaderd.log').read_text(errors='replace')[-1500:]}")
        else:
            status = _status(address, env)
            result.internal_errors = int(status.get("internal_errors", 0) or 0)  # type: ignore[call-overload]
            sharing = status.get("sharing") or {}
            result.sharing = float(sharing.get("deliveries_per_decode", 0.0) or 0.0)  # type: ignore[union-attr]
    finally:
        for _, proc in jobs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        code = server.stop(timeout_s=20)
        if code not in (0, None) and not result.server_crashed:
            result.server_crashed = True
            result.problems.append(f"joaderd exited with {code} when stopped")
    if result.ok:
        shutil.rmtree(home, ignore_errors=True)
    else:
        result.problems.insert(0, f"its files are kept in {home}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--items", type=int, default=1200, help="demo photos (500x375 JPEGs) in the source")
    parser.add_argument("--stagger-s", type=float, default=0.5, help="between the jobs' starts")
    parser.add_argument("--setup-s", type=float, default=1.5,
                        help="each job's model building, from attaching to its first read: uniform in "
                             "[0, 2 x this], seeded by the run's number")
    parser.add_argument("--job-timeout-s", type=float, default=600.0)
    parser.add_argument("--data", type=Path, default=None, help="an ImageFolder to use instead of demo photos")
    parser.add_argument("--quick", action="store_true", help="3 runs of 3 epochs")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.epochs = 3, 3
    work = Path(tempfile.mkdtemp(prefix="sweep-whole-cache-"))
    data = args.data
    if data is None:
        data = work / "photos"
        print(f"sweep: writing {args.items} demo photos ...", flush=True)
        make_demo_data(data, args.items, num_classes=10, seed=0, progress=False)
    print("sweep: decoding the reference outside joaderd ...", flush=True)
    expected = reference(data, 64)
    args.items = len(expected)
    results = []
    for number in range(1, args.runs + 1):
        result = one_run(number, args, data, expected, work)
        results.append(result)
        print(result.line(), flush=True)
        for problem in result.problems[:6]:
            print(f"    {problem}", flush=True)
    failed = [r for r in results if not r.ok]
    total = sum(r.samples for r in results)
    print(f"sweep: {len(results)} runs of {JOBS} jobs x {args.epochs} epochs x {args.items} items, "
          f"{args.stagger_s:g} s apart, {args.setup_s:g} s set-up, cache holding the whole dataset: "
          f"{total} samples checked, "
          f"{len(failed)} runs failed (joaderd crashes {sum(r.server_crashed for r in results)}, "
          f"internal errors {sum(r.internal_errors for r in results)}, wrong {sum(r.wrong for r in results)}, "
          f"duplicated {sum(r.duplicated for r in results)}, missing {sum(r.missing for r in results)})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"sweep_whole_cache-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                               "runs": [asdict(r) | {"ok": r.ok} for r in results], "failed": len(failed)}, indent=2))
    print(f"sweep: wrote {out}")
    if not failed:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
