"""The 2-host restart soak: DDP jobs across two joaderds, either one killed -9 at random points.

    python -m bench.soak.chaos_hosts [--duration-s 1200] [--seed 0] [--quick]

Issue 27, finding 2: a job across two hosts (layout 1+2, two DataLoader workers per rank, gloo, an
all_reduce per step) whose host with two ranks had its joaderd killed and restarted in epoch 1
got 34 items twice and 34 never in epoch 2 (3 runs of about 18), or hung. This soak runs that
configuration over and over and proves content, not counts.

Two simulated hosts on this machine: two joaderds, each with its own socket and arena (as
tests/integration/test_multi_host.py and bench/system/multi_host.py do). Each job is a DDP job of
three ranks, laid out 1+2 or 2+1 over the hosts (seeded), each rank a process with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, GROUP_RANK) and
its host's joaderd address; it builds `JoaderDataset` before `init_process_group` (the usual
way), reads through a torch DataLoader with two workers, plain (items) or `batched=True`
(workers hand batches over by arena offset), does an all_reduce per step (a rank with another
number of batches hangs it) and records every sample (epoch, index, label, crc32 of the pixels).
`--slots` jobs run at once; each slot starts a new job when one ends. Meanwhile, at random times
from a seeded RNG, one host's joaderd (chosen at random) is killed -9 and started again on its
socket after 0.1-1.5 s: mid-epoch, or exactly when a rank of that host reads the last batch of
an epoch (the next epoch's plain start is then the first thing the restarted joaderd sees).

Checked for every job: every sample's pixels and label against a decode made here, outside
joaderd (`joader/testing/integrity.py`), and each epoch exactly once over the union of its
ranks (no duplicates, none missing). `JOADER_VERIFY=1` is set for the ranks. A job that exits
non-zero or does not finish within `--job-timeout-s` is failed. It prints and writes
(bench/results/chaos-hosts-*.json): samples checked, wrong pixels and labels, duplicated,
missing, jobs run and failed, restarts (per host, and at an epoch's end); exits 1 if anything is
wrong. `--quick` is about two minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from joader.client.tools.demo_data import make_demo_data
from joader.launch import JoaderdProcess
from joader.testing.chaos import Summary
from joader.testing.integrity import Findings, check_records, read_records, reference
from joader.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
WORLD = 3  # ranks per job: 1 + 2 (or 2 + 1) over the two hosts
MODES = ("items", "batched")  # DataLoader(num_workers=2) over JoaderDataset, plain or batched


# ------------------------------------------------------------------------------ one rank

def rank_main(args: argparse.Namespace) -> int:
    """One rank of a DDP job (the environment is torchrun's): a DataLoader with two workers,
    an all_reduce per step, every sample recorded."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from joader.client.dataset import JoaderDataset

    batched = args.mode == "batched"
    dataset = JoaderDataset("demo", indices=range(args.items), address=args.address, name=args.name,
                            batch_size=args.batch_size if batched else None, batched=batched,
                            return_index=True, timeout_s=args.timeout_s)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(dataset, batch_size=None if batched else args.batch_size, num_workers=args.workers)
    out = Path(args.out, f"records-{rank}.jsonl").open("a")
    batches = []
    for epoch in range(1, args.epochs + 1):
        count = 0
        for indices, images, labels in loader:
            out.write("".join(
                json.dumps({"kind": "sample", "epoch": epoch, "index": int(i), "label": int(label),
                            "crc": zlib.crc32(image.contiguous().numpy().tobytes()), "rank": rank}) + "\n"
                for i, image, label in zip(indices, images, labels, strict=True)))
            out.flush()
            time.sleep(args.step_s)  # an emulated GPU step
            dist.all_reduce(torch.ones(1))  # what DDP's gradient all-reduce does
            count += 1
        batches.append(count)
    out.close()
    Path(args.out, f"done-{rank}.json").write_text(json.dumps({"batches": batches}))
    dist.barrier()
    dist.destroy_process_group()
    dataset.close()
    return 0


# ------------------------------------------------------------------------------ the soak

@dataclass
class HostsSummary(Summary):
    """chaos.py's figures, and the restarts per host."""

    restarts_per_host: list[int] = field(default_factory=lambda: [0, 0])
    jobs_by_mode: dict[str, int] = field(default_factory=dict)


@dataclass
class Job:
    """One DDP job: its ranks' processes, its layout over the hosts, its records."""

    number: int
    mode: str
    layout: tuple[int, int]  # ranks on host 0, on host 1
    out: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    started_s: float = 0.0
    failed: str = ""

    def host_of(self, rank: int) -> int:
        return 0 if rank < self.layout[0] else 1


class Soak:
    """Two joaderds, the job slots, the kills and the checks."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.rng = random.Random(args.seed)
        self.summary = HostsSummary(seed=args.seed)
        self.data = work / "images"
        make_demo_data(self.data, args.items, num_classes=5, seed=args.seed, progress=False)
        print(f"chaos-hosts: decoding the reference of {args.items} items outside joaderd ...", flush=True)
        self.expected = reference(self.data, args.image_size)
        self.env = {**os.environ, "JOADER_VERIFY": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self.servers: list[JoaderdProcess | None] = [None, None]
        self.addresses = []
        for host in range(2):
            (work / f"host{host}").mkdir(mode=0o700)
            self.addresses.append(f"unix:{work / f'host{host}' / 'joaderd.sock'}")
        self.jobs: list[Job] = []
        self.stopping = False

    # ----------------------------------------------------------------------------- processes

    def start_server(self, host: int) -> None:
        log = self.work / f"joaderd-{host}-{self.summary.restarts_per_host[host]}.log"
        item_nbytes = 3 * self.args.image_size ** 2
        cache_bytes = self.args.cache_items * item_nbytes
        args = ["--listen", self.addresses[host], "--cache-size", str(cache_bytes), "--image-size",
                str(self.args.image_size), "--workers", "1", "--lease-s", "5", "--source", f"demo={self.data}"]
        self.servers[host] = JoaderdProcess.start(args, stdout=log, ready_timeout_s=120, env=self.env)

    def restart_server(self, host: int, at_epoch_end: bool = False) -> None:
        server = self.servers[host]
        assert server is not None
        server.proc.kill()  # SIGKILL, as a crash
        server.proc.wait()
        server.kill()  # releases the launcher's files
        time.sleep(self.rng.uniform(0.1, 1.5))
        self.summary.restarts_per_host[host] += 1
        self.summary.joaderd_restarts += 1
        self.summary.restarts_at_epoch_end += at_epoch_end
        self.start_server(host)

    def start_job(self) -> Job:
        number = self.summary.jobs_run
        self.summary.jobs_run += 1
        mode = self.rng.choice(MODES)
        layout = self.rng.choice([(1, 2), (2, 1)])
        self.summary.jobs_by_mode[f"{mode} {layout[0]}+{layout[1]}"] = \
            self.summary.jobs_by_mode.get(f"{mode} {layout[0]}+{layout[1]}", 0) + 1
        out = self.work / f"job-{number}"
        out.mkdir()
        job = Job(number, mode, layout, out, started_s=time.monotonic())
        port = free_port()
        for rank in range(WORLD):
            host = job.host_of(rank)
            first = 0 if host == 0 else layout[0]
            env = {**self.env, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank - first),
                   "LOCAL_WORLD_SIZE": str(layout[host]), "GROUP_RANK": str(host), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"chaos-hosts-{number}"}
            command = [sys.executable, "-m", "bench.soak.chaos_hosts", "rank", "--address", self.addresses[host],
                       "--out", str(out), "--name", f"ddp-{number}", "--mode", mode, "--items",
                       str(self.args.items), "--epochs", str(self.args.epochs), "--batch-size",
                       str(self.args.batch_size), "--step-s", str(self.args.step_s), "--timeout-s",
                       str(self.args.client_timeout_s)]
            with open(out / f"rank-{rank}.err", "ab") as err:
                job.procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                                  stderr=err, start_new_session=True))
        return job

    @staticmethod
    def kill_job(job: Job) -> None:
        for proc in job.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()

    # ----------------------------------------------------------------------------- checks

    def reap(self) -> None:
        """Checks jobs that ended (or ran out of time); starts the next one of the slot."""
        now = time.monotonic()
        for job in list(self.jobs):
            codes = [proc.poll() for proc in job.procs]
            if any(code not in (None, 0) for code in codes):
                # One rank failed: the others would wait in a collective for good.
                self.kill_job(job)
                bad = next(r for r, code in enumerate(codes) if code not in (None, 0))
                job.failed = (f"job {job.number} ({job.mode}, {job.layout[0]}+{job.layout[1]}): rank {bad} exited "
                              f"with {codes[bad]}: {_tail(job.out / f'rank-{bad}.err')}")
            elif any(code is None for code in codes):
                if now - job.started_s < self.args.job_timeout_s:
                    continue
                self.kill_job(job)
                job.failed = (f"job {job.number} ({job.mode}, {job.layout[0]}+{job.layout[1]}) did not finish "
                              f"within {self.args.job_timeout_s:g} s: {_tail(job.out / 'rank-0.err')}")
            self.check(job)
            self.jobs.remove(job)
            if not self.stopping:
                self.jobs.append(self.start_job())

    def check(self, job: Job) -> None:
        records = [r for rank in range(WORLD) for r in read_records(job.out / f"records-{rank}.jsonl")]
        epochs = self.args.epochs if not job.failed else 0  # a failed job's epochs are not whole
        findings = check_records(records, self.expected, set(range(self.args.items)), epochs,
                                 f"job {job.number} ({job.mode}, {job.layout[0]}+{job.layout[1]})", Findings())
        summary = self.summary
        summary.samples_checked += findings.checked
        summary.wrong_pixels += findings.wrong_pixels
        summary.wrong_labels += findings.wrong_labels
        summary.duplicated += findings.duplicated
        summary.missing += findings.missing
        summary.problems.extend(findings.problems[:3])
        if job.failed:
            summary.jobs_failed += 1
            summary.problems.append(job.failed)

    # ----------------------------------------------------------------------------- faults

    def restart_at_epoch_end(self) -> bool:
        """Kills the joaderd of a rank's host when that rank reads the last batch of an epoch
        (within 20 s): the next epoch then starts on the restarted joaderd."""
        if not self.jobs:
            return False
        job = self.rng.choice(self.jobs)
        rank = self.rng.randrange(WORLD)
        share = self.args.items // WORLD
        records = job.out / f"records-{rank}.jsonl"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and all(proc.poll() is None for proc in job.procs):
            counts: dict[int, int] = {}
            for record in read_records(records):
                counts[record["epoch"]] = counts.get(record["epoch"], 0) + 1
            if counts and max(counts) < self.args.epochs and share - self.args.batch_size <= counts[max(counts)] < share:
                self.restart_server(job.host_of(rank), at_epoch_end=True)
                return True
            time.sleep(0.01)
        return False

    def run(self) -> HostsSummary:
        started = time.monotonic()
        for host in range(2):
            self.start_server(host)
        next_fault = started + self.rng.expovariate(1 / self.args.fault_every_s)
        next_progress = started + 30
        try:
            for _ in range(self.args.slots):
                self.jobs.append(self.start_job())
            while time.monotonic() - started < self.args.duration_s:
                self.reap()
                now = time.monotonic()
                if now >= next_fault:
                    if self.rng.random() < 0.35:
                        if not self.restart_at_epoch_end():
                            self.restart_server(self.rng.randrange(2))
                    else:
                        self.restart_server(self.rng.randrange(2))
                    next_fault = time.monotonic() + self.rng.expovariate(1 / self.args.fault_every_s)
                if now >= next_progress:
                    print(f"chaos-hosts: {now - started:5.0f} s  {self.line()}", flush=True)
                    next_progress = now + 30
                time.sleep(0.05)
            self.stopping = True
            deadline = time.monotonic() + self.args.job_timeout_s + 10
            while self.jobs and time.monotonic() < deadline:
                self.reap()
                time.sleep(0.1)
        finally:
            for job in self.jobs:
                self.kill_job(job)
            for server in self.servers:
                if server is not None:
                    server.stop(timeout_s=20)
        self.summary.duration_s = round(time.monotonic() - started, 1)
        return self.summary

    def line(self) -> str:
        s = self.summary
        return (f"samples checked {s.samples_checked}, wrong pixels {s.wrong_pixels}, wrong labels "
                f"{s.wrong_labels}, duplicated {s.duplicated}, missing {s.missing}; jobs {s.jobs_run} "
                f"(failed {s.jobs_failed}, running {len(self.jobs)}); joaderd restarts {s.joaderd_restarts} "
                f"(host 0: {s.restarts_per_host[0]}, host 1: {s.restarts_per_host[1]}; "
                f"{s.restarts_at_epoch_end} at an epoch's end)")


def _tail(path: Path, limit: int = 1200) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-limit:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    rank = sub.add_parser("rank", help="one rank of a job (what the soak runs)")
    rank.add_argument("--address", required=True)
    rank.add_argument("--out", required=True)
    rank.add_argument("--name", required=True)
    rank.add_argument("--mode", choices=MODES, required=True)
    rank.add_argument("--items", type=int, required=True)
    rank.add_argument("--epochs", type=int, required=True)
    rank.add_argument("--batch-size", type=int, required=True)
    rank.add_argument("--workers", type=int, default=2)
    rank.add_argument("--step-s", type=float, default=0.02)
    rank.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--duration-s", type=float, default=1200.0, help="fault injection time (default 20 min)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--items", type=int, default=159, help="demo JPEGs (a multiple of 3: no padding)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per job")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.03, help="sleep per step (an emulated GPU step)")
    parser.add_argument("--slots", type=int, default=1, help="jobs at once")
    parser.add_argument("--fault-every-s", type=float, default=12.0, help="mean time between restarts")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--cache-items", type=int, default=120, help="each joaderd's cache, in items")
    parser.add_argument("--client-timeout-s", type=float, default=120.0, help="JoaderDataset(timeout_s=)")
    parser.add_argument("--job-timeout-s", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true", help="about two minutes")
    args = parser.parse_args()
    if args.command == "rank":
        return rank_main(args)
    if args.items % WORLD:
        parser.error(f"--items must be a multiple of {WORLD} (no padding: exactly once is exact)")
    if args.quick:
        args.duration_s = 120.0
    work = Path(tempfile.mkdtemp(prefix="chaos-hosts-"))
    summary = Soak(args, work).run()
    ok = summary.ok
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        summary.problems.insert(0, f"the soak's files (logs, records) are kept in {work}")
    print(f"chaos-hosts: samples checked {summary.samples_checked}, wrong pixels {summary.wrong_pixels}, "
          f"wrong labels {summary.wrong_labels}, duplicated {summary.duplicated}, missing {summary.missing}, "
          f"jobs {summary.jobs_run} (failed {summary.jobs_failed}), restarts {summary.joaderd_restarts} "
          f"(per host {summary.restarts_per_host}, {summary.restarts_at_epoch_end} at an epoch's end)")
    for problem in summary.problems[:20]:
        print(f"  {problem}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"chaos-hosts-{time.strftime('%Y%m%d-%H%M%S')}.json"
    record: dict[str, Any] = {**asdict(summary), "ok": ok, "args": vars(args)}
    out.write_text(json.dumps(record, indent=2))
    print(f"chaos-hosts: {'OK' if ok else 'FAILED'}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
