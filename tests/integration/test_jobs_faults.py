"""Jobs that misbehave, against a real joaderd: a DDP job half attached, a file fixed between
epochs, a job that stops reading, a hand-off pipeline larger than a small cache, a forged resume.

Every client is a real process running `python -m tests.integration.test_jobs_faults CMD` (the
commands are at the end of this file), so the pytest process never opens a gRPC channel. Each
command writes what it read as JSON to `--out` and, with `--ready FILE`, creates FILE once it
reached the point the test waits for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import NUM_DEMO_ITEMS, finish, wait_for

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
# What a caller's environment (torchrun, a shell) could leak into a client that must not see it.
_SCRUBBED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "JOADER_ADDRESS")


class Clients:
    """Client processes in their own sessions; whatever is left at the test's end is killed."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, command: str, server: Any, name: str, *args: str) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(self.dir / f"{name}.err", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.test_jobs_faults", command,
                 "--address", server.address, "--out", str(self.out(name)), *args],
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.started.append(proc)
        return proc

    def out(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def report(self, name: str) -> Any:
        return json.loads(self.out(name).read_text())

    def stderr(self, name: str) -> str:
        return (self.dir / f"{name}.err").read_text(errors="replace")

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()

    def close(self) -> None:
        for proc in self.started:
            self.kill(proc)


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[Clients]:
    runner = Clients(tmp_path)
    try:
        yield runner
    finally:
        runner.close()


def _jobs(server: Any) -> dict[str, dict[str, Any]]:
    return {job["name"]: job for job in server.status()["jobs"]}


# ---------------------------------------------------------------------------------------------
# 1. A half-attached job


def test_a_job_whose_only_attached_rank_closed_ends_and_the_next_run_reads_whole(
        demo_root: Path, start_joaderd: Any, clients: Clients) -> None:
    """Rank 0 of a 2-rank job attaches and closes its dataset; rank 1 never comes. The job ends
    at once (it stayed "0/2" for good, and the next run was split: its rank 1 joined the stale
    job and read its whole epoch alone, its rank 0 timed out in a new job)."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    early = clients.start("close", server, "early", "--rank", "0", "--world-size", "2", "--name", "half")
    assert finish(early, 90) == 0, clients.stderr("early")
    wait_for(lambda: "half" not in _jobs(server), 10, "joaderd to end the job with no rank attached")
    assert "never attached" in server.log()
    ranks = [clients.start("read", server, f"rank{r}", "--rank", str(r), "--world-size", "2", "--name", "half",
                           "--indices", "0:100", "--batch-size", "8")
             for r in (1, 0)]
    for r, proc in zip((1, 0), ranks, strict=True):
        assert finish(proc, 120) == 0, clients.stderr(f"rank{r}")
    orders = [clients.report(f"rank{r}")["epochs"][0] for r in (0, 1)]
    assert [len(o) for o in orders] == [50, 50]
    assert sorted(orders[0] + orders[1]) == list(range(100))
    assert server.status()["jobs"] == []


def test_a_rank_that_never_attaches_ends_the_job_after_the_attach_timeout(
        demo_root: Path, start_joaderd: Any, clients: Clients) -> None:
    """Rank 0 reads and waits for rank 1, which never starts: after --rank-attach-timeout-s the
    job ends and rank 0's read fails naming the missing rank (not a TimeoutError minutes later)."""
    server = start_joaderd({"demo": demo_root}, cache_items=64, extra=["--rank-attach-timeout-s", "3"])
    alone = clients.start("read", server, "alone", "--rank", "0", "--world-size", "2", "--name", "lonely",
                          "--indices", "0:100", "--batch-size", "8", "--timeout-s", "100")
    wait_for(lambda: (_jobs(server).get("lonely") or {}).get("waiting"), 60, "the job to wait for rank 1")
    waiting = _jobs(server)["lonely"]["waiting"]
    assert waiting["for"] == "ranks" and waiting["ranks"] == [1]
    assert finish(alone, 60) != 0
    err = clients.stderr("alone")
    assert "UnknownJobError" in err and "rank 1 of 2 did not attach within 3 s" in err, err[-3000:]
    assert server.status()["jobs"] == []


# ---------------------------------------------------------------------------------------------
# 2. A file fixed before the next epoch


def test_a_rank_that_attached_but_never_reads_is_named_when_the_other_gives_up(
        demo_root: Path, start_joaderd: Any, clients: Any, tmp_path: Path) -> None:
    """Rank 1 attaches and holds its lease but never reads (accelerate's old dispatch did
    that): rank 0 fills its share, then waits for rank 1's. Its TimeoutError names rank 1 and
    says every rank must read, not the cache or the decoders."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    ready = tmp_path / "held"
    clients.start("hold", server, "idle", "--rank", "1", "--world-size", "2", "--name", "oneside",
                  "--ready", str(ready))
    wait_for(ready.exists, 60, "rank 1 to attach")
    started = time.monotonic()
    reader = clients.start("read", server, "reader", "--rank", "0", "--world-size", "2", "--name",
                           "oneside", "--timeout-s", "8")
    assert finish(reader, 120) != 0
    err = clients.stderr("reader")
    assert "TimeoutError" in err and "rank 1 of 2 has not asked for items" in err, err[-3000:]
    assert "every rank must iterate its own JoaderDataset" in err
    print(f"rank 0 gave up after {time.monotonic() - started:.1f} s: {err.strip().splitlines()[-1][:300]}")


def test_files_fixed_after_an_epoch_are_decoded_again_in_the_next(
        demo_root: Path, tmp_path: Path, start_joaderd: Any, clients: Clients) -> None:
    """joaderd --retry-failed-s 1. Every file of a 17-item source is broken in epoch 1 (its
    storage returned garbage) and fixed right after it; epoch 2 starts 4 s later. Epoch 2's
    first copies were queued during epoch 1 (lookahead), still failed: they are decoded again,
    and epoch 2 has all 17 items (the old decision skipped the queued ones)."""
    root = tmp_path / "src"
    good = tmp_path / "good"
    for path in sorted(demo_root.rglob("*.jpg"))[:17]:
        relative = path.relative_to(demo_root)
        for base in (root, good):
            (base / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, base / relative)
        (root / relative).write_bytes(path.read_bytes()[:200])  # truncated: fails to decode
    server = start_joaderd({"src": root}, cache_items=160,
                           extra=["--retry-failed-s", "1", "--lookahead-batches", "8"])
    job = clients.start("epochs", server, "fixed", "--source", "src", "--batch-size", "4",
                        "--epochs", "2", "--fix-from", str(good), "--fix-to", str(root), "--pause-s", "4")
    assert finish(job, 120) == 0, clients.stderr("fixed")
    first, second = clients.report("fixed")["epochs"]
    assert first == []
    assert sorted(second) == list(range(17)), f"epoch 2 delivered {len(second)} of 17"
    assert server.status()["items_failed"] == 0


# ---------------------------------------------------------------------------------------------
# 3. A job that stops reading; 4. a hand-off pipeline larger than the cache


def test_a_job_that_stops_reading_does_not_stall_another(
        demo_root: Path, start_joaderd: Any, clients: Clients) -> None:
    """A cache of two batches per job. `paused` reads one batch through DataLoader workers and
    stops with its loop's iterator alive (its lease alive; its workers prefetch on, each filling
    its slots and sending its next request); `other` starts once the paused job holds all the
    copies it will get, and must still read its two epochs, each exactly once. A rank alone
    could take copies of the whole cache, which it then held for good: `other` got no item."""
    server = start_joaderd({"demo": demo_root}, cache_items=32)
    ready = clients.dir / "paused.ready"
    paused = clients.start("pause", server, "paused", "--name", "paused", "--batch-size", "8",
                           "--ready", str(ready))
    wait_for(ready.exists, 90, "the paused job to read a batch")
    held: list[int] = []  # the paused job's copies, polled until they stop growing

    def settled() -> bool:
        held.append(_jobs(server)["paused"]["handed_out"])
        return len(held) >= 4 and held[-1] == held[-4]

    wait_for(settled, 60, "the paused job's workers to take every copy they will get", interval_s=0.5)
    other = server.job("--epochs", "2", "--batch-size", "8", name="other")
    assert finish(other, 120) == 0, server.job_stderr("other")
    for epoch in server.report("other")["epochs"]:
        assert sorted(epoch["order"]) == list(range(NUM_DEMO_ITEMS))
    assert _jobs(server)["paused"]["handed_out"] > 0  # it still holds copies, and its lease
    clients.kill(paused)
    wait_for(lambda: server.status()["jobs"] == [], 20, "joaderd to drop the paused job")
    assert server.status()["cache"]["pins"] == 0


@pytest.mark.parametrize("cache_batches", [2, 3])
def test_workers_handing_batches_over_fit_a_cache_of_a_few_batches(
        demo_root: Path, start_joaderd: Any, cache_batches: int) -> None:
    """num_workers=2, batched, no transform, a training step of 50 ms: workers hand batches to
    the training process as arena offsets, and the DataLoader's prefetch (two batches per
    worker, and each worker's next request in flight) holds more batches than the cache. A
    lone job hung until TimeoutError: served first come, worker 0 was dealt four batches while
    worker 1 waited for one, which the loop needed next and no slot was left to decode. Now
    each ready batch goes to the waiting worker holding fewest copies, no extra batches are
    dealt into a cache the copies nearly fill, and replies beyond the job's share say
    `copy_now` (the workers copy them and acknowledge at once)."""
    server = start_joaderd({"demo": demo_root}, cache_items=8 * cache_batches)
    job = server.job("--epochs", "2", "--batch-size", "8", "--num-workers", "2", "--batched",
                     "--step-s", "0.05", name="handoff")
    assert finish(job, 150) == 0, server.job_stderr("handoff")
    for epoch in server.report("handoff")["epochs"]:
        assert sorted(epoch["order"]) == list(range(NUM_DEMO_ITEMS))
    status = server.status()
    assert status["jobs"] == [] and status["cache"]["pins"] == 0


# ---------------------------------------------------------------------------------------------
# 5. A forged resume


def test_a_resume_waiting_for_more_readers_than_exist_is_shown_in_status(
        demo_root: Path, start_joaderd: Any, clients: Clients) -> None:
    """A state that says five readers report a part of the resumed epoch, loaded by a process
    that reads alone: the job waits (as it must: it cannot tell a slow reader from a missing
    one), and status says what for: rank 0 has 1 of 5 reports."""
    server = start_joaderd({"demo": demo_root}, cache_items=32)
    ready = clients.dir / "forged.ready"
    forged = clients.start("forged", server, "forged", "--name", "forged", "--batch-size", "8",
                           "--parts", "5", "--ready", str(ready))
    wait_for(ready.exists, 90, "the forged job to ask")

    def waiting() -> Any:
        job = _jobs(server).get("forged") or {}
        return job.get("waiting") if (job.get("waiting") or {}).get("for") == "resume_reports" else None

    found = wait_for(waiting, 30, "status to show the resume waiting")
    assert found["epoch"] == 1 and found["ranks"] == [{"rank": 0, "reports": 1, "parts": 5}]
    assert "rank 0: 1 of 5" in found["detail"]
    clients.kill(forged)


# ---------------------------------------------------------------------------------------------
# The client commands (run in their own processes)


def _dataset(args: argparse.Namespace, **extra: Any) -> Any:
    from joader.client.dataset import JoaderDataset

    indices = range(*map(int, args.indices.split(":"))) if args.indices else None
    return JoaderDataset(args.source, indices=indices, address=args.address, name=args.name,
                         batch_size=args.batch_size, return_index=True, rank=args.rank,
                         world_size=args.world_size, timeout_s=args.timeout_s, **extra)


def _write(path: str, data: Any) -> None:
    Path(f"{path}.tmp").write_text(json.dumps(data))
    os.replace(f"{path}.tmp", path)


def _touch(path: str | None) -> None:
    if path:
        Path(path).touch()


def close_command(args: argparse.Namespace) -> None:
    """Attaches one rank and closes it without reading (its lease stream ends with `closing`)."""
    ds = _dataset(args)
    ds.close()
    _write(args.out, {"closed": True})


def read_command(args: argparse.Namespace) -> None:
    """Reads `--epochs` epochs; reports the indices of each."""
    ds = _dataset(args)
    epochs = []
    for _ in range(args.epochs):
        epochs.append([int(index) for index, _image, _label in ds])
    ds.close()
    _write(args.out, {"epochs": epochs})


def epochs_command(args: argparse.Namespace) -> None:
    """Reads `--epochs` epochs; after the first, copies `--fix-from` over `--fix-to` (the files
    are fixed) and waits `--pause-s`."""
    ds = _dataset(args)
    epochs = []
    for epoch in range(args.epochs):
        epochs.append([int(index) for index, _image, _label in ds])
        if epoch == 0 and args.fix_from:
            shutil.copytree(args.fix_from, args.fix_to, dirs_exist_ok=True)
            time.sleep(args.pause_s)
    ds.close()
    _write(args.out, {"epochs": epochs})


def pause_command(args: argparse.Namespace) -> None:
    """Reads one batch through DataLoader workers that hand batches over (their prefetch goes
    on: each worker fills its two slots and has its next request in flight), then stops reading
    with its lease alive until killed."""
    from torch.utils.data import DataLoader

    ds = _dataset(args, batched=True)
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    batches = iter(loader)  # held: dropping the iterator would shut its workers down
    indices, _images, _labels = next(batches)
    _write(args.out, {"first": [int(i) for i in indices]})
    _touch(args.ready)
    while True:
        time.sleep(1)


def hold_command(args: argparse.Namespace) -> None:
    """Attaches one rank and holds its lease without ever reading (a script that reads on
    another rank only), until killed."""
    ds = _dataset(args)  # held: a dataset no one holds ends its lease when it is collected
    _touch(args.ready)
    while ds is not None:
        time.sleep(1)


def forged_command(args: argparse.Namespace) -> None:
    """Loads a state that says `--parts` readers report a part of epoch 1, reads alone."""
    import threading

    from pyroaring import BitMap

    from joader.client.checkpoint import ResumePoint

    ds = _dataset(args)
    # A forged request (load_state_dict refuses a state whose parts exceed its readers): what a
    # client of its own, or readers that died before reporting, can still leave joaderd with.
    ds._resume = ResumePoint(1, BitMap([0, 1, 2]), args.parts)
    threading.Thread(target=lambda: next(iter(ds)), daemon=True).start()
    time.sleep(0.5)
    _touch(args.ready)
    while True:
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = {"close": close_command, "read": read_command, "epochs": epochs_command,
                "pause": pause_command, "forged": forged_command, "hold": hold_command}
    parser.add_argument("command", choices=sorted(commands))
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--source", default="demo")
    parser.add_argument("--indices", help="start:stop of the source's ids (default: all)")
    parser.add_argument("--name")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--ready", help="created once the command reached its waiting point")
    parser.add_argument("--fix-from")
    parser.add_argument("--fix-to")
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--parts", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    commands[args.command](args)


if __name__ == "__main__":
    main()
