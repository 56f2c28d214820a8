"""The frameworks as their users write them (issue 18): Lightning, accelerate, torchrun with
torchdata's StatefulDataLoader, each run for real (gloo on the CPU) against a real joaderd.

Each run's ranks record every sample their training step received (`framework_jobs`), and the
test checks the union of the ranks: every epoch exactly once, every sample's pixels and label
against a decode made here (`integrity`), and the batches per epoch against `len(loader)`. The
fault tests kill the whole run (-9, every rank, its workers and lease keepers) mid-epoch and
resume it from its last checkpoint: what the killed run received after that checkpoint was
never trained on, so each rank's records are cut back to it first.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from joader.testing.integrity import check_records, read_records
from tests.support.processes import NUM_DEMO_ITEMS, Client, Clients, free_port

pytestmark = pytest.mark.slow
JOB = "tests.support.framework_jobs"
RANKS = 2




def _python(clients: Clients, name: str, *args: str) -> Client:
    return clients.popen(name, [sys.executable, "-m", JOB, *args])


def _torchrun(clients: Clients, name: str, *args: str) -> Client:
    return clients.popen(name, [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", JOB, *args])


def _records(out: Path) -> list[dict[str, Any]]:
    return [r for rank in range(RANKS) for r in read_records(out / f"records-{rank}.jsonl")]


def _check(out: Path, expected: Any, epochs: int, what: str) -> dict[int, list[int]]:
    """Exactly once per epoch over the union of the ranks, pixels and labels; prints and
    returns the items per rank per epoch."""
    records = _records(out)
    findings = check_records(records, expected, set(range(NUM_DEMO_ITEMS)), epochs, what)
    per_rank: dict[int, list[int]] = {}
    for rank in range(RANKS):
        counts = Counter(r["epoch"] for r in records if r.get("rank") == rank)
        per_rank[rank] = [counts.get(e, 0) for e in range(1, epochs + 1)]
    union = [len({r["index"] for r in records if r["epoch"] == e}) for e in range(1, epochs + 1)]
    print(f"{what}: items per rank per epoch {per_rank}, union per epoch {union} of {NUM_DEMO_ITEMS}; "
          f"{findings.summary()}")
    assert findings.ok, f"{what}: {findings.summary()}"
    return per_rank


def _latest_checkpoint(out: Path) -> Path:
    def step(path: Path) -> int:
        return int(path.stem.split("step=")[1])

    checkpoints = sorted(out.glob("*.ckpt"), key=step)
    assert checkpoints, f"no checkpoint in {out}"
    return checkpoints[-1]


@pytest.mark.parametrize("checkpoint", ["mid-epoch", "at an epoch's last batch"])
def test_lightning_ddp_dataset_built_before_fit_killed_and_resumed_is_exact(
        demo_root: Path, start_joaderd: Any, clients: Clients, expected: Any, tmp_path: Path,
        checkpoint: str) -> None:
    """Lightning's usual script: the dataset built at the top, then Trainer(accelerator="cpu",
    devices=2, strategy="ddp").fit. Killed -9 after a checkpoint, resumed with ckpt_path: every
    epoch exactly once over both ranks (JoaderDataLoader's state holds both ranks'; Lightning
    saves rank 0's). A checkpoint every 10 steps falls on each epoch's last batch, which
    Lightning resumes at the next epoch (with a plain StatefulDataLoader that epoch was empty)."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    out = tmp_path / "lightning"
    every, kill_at = ("4", "1:8") if checkpoint == "mid-epoch" else ("10", "2:5")
    base = ("lightning", "--address", server.address, "--out", str(out), "--epochs", "3",
            "--batch-size", "8", "--every", every)
    started = time.monotonic()
    run = _python(clients, "lightning", *base, "--kill-at", kill_at)
    code = clients.wait(run, timeout_s=240, expect=None)
    assert code != 0, f"the run was to be killed mid-epoch; it exited with {code}"
    checkpoint = _latest_checkpoint(out)
    resumed = _python(clients, "lightning-resumed", *base, "--resume", str(checkpoint))
    clients.wait(resumed, timeout_s=240)
    per_rank = _check(out, expected, 3, f"Lightning DDP, killed and resumed from {checkpoint.name}")
    assert per_rank == {r: [NUM_DEMO_ITEMS // RANKS] * 3 for r in range(RANKS)}
    done = json.loads((out / "done.json").read_text())
    assert done["len_loader"] == done["batches_per_epoch"] == math.ceil(NUM_DEMO_ITEMS / RANKS / 8)
    print(f"Lightning: {time.monotonic() - started:.1f} s; {done}")


def test_lightning_plain_dataloader_with_workers_has_len_batches(
        demo_root: Path, start_joaderd: Any, clients: Clients, expected: Any, tmp_path: Path) -> None:
    """A plain DataLoader with 2 workers and a batch size that does not divide a rank's share,
    no batch_size on the dataset: Lightning's len(loader) is the batches each epoch has."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    out = tmp_path / "plain"
    run = _python(clients, "lightning-plain", "lightning", "--address", server.address, "--out", str(out),
                  "--epochs", "2", "--batch-size", "12", "--workers", "2", "--loader", "plain")
    clients.wait(run, timeout_s=240)
    _check(out, expected, 2, "Lightning DDP, plain DataLoader, 2 workers")
    done = json.loads((out / "done.json").read_text())
    batches = math.ceil(NUM_DEMO_ITEMS / RANKS / 12)
    assert done == {"len_loader": batches, "global_step": 2 * batches, "batches_per_epoch": batches}, done


@pytest.mark.parametrize("how", ["prepare(model, optimizer, loader)", "loader left out of prepare",
                                 "prepare, 2 workers"])
def test_accelerate_two_processes_exact(demo_root: Path, start_joaderd: Any, clients: Clients,
                                         expected: Any, tmp_path: Path, how: str) -> None:
    """accelerate's default prepare() dispatches rank 0's batches (joader serves rank 0 the
    whole job); left out of prepare, each rank reads its own share. Both exact."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    out = tmp_path / "accelerate"
    extra = {"loader left out of prepare": ["--unprepared"], "prepare, 2 workers": ["--workers", "2"]}.get(how, [])
    run = _torchrun(clients, "accelerate", "accelerate", "--address", server.address, "--out", str(out),
                    "--epochs", "2", "--batch-size", "8", *extra)
    clients.wait(run, timeout_s=240)
    per_rank = _check(out, expected, 2, f"accelerate, {how}")
    assert per_rank == {r: [NUM_DEMO_ITEMS // RANKS] * 2 for r in range(RANKS)}
    for rank in range(RANKS):
        done = json.loads((out / f"done-{rank}.json").read_text())
        assert done["batches"] == [done["len_loader"]] * 2 == [NUM_DEMO_ITEMS // RANKS // 8] * 2, done


def test_accelerate_shard_is_refused_with_the_fix(demo_root: Path, start_joaderd: Any, clients: Clients,
                                                  tmp_path: Path) -> None:
    """dispatch_batches=False wraps the dataset in accelerate's IterableDatasetShard, which
    would keep half of each rank's share: refused at the first epoch, naming the fix."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    started = time.monotonic()
    run = _torchrun(clients, "shard", "accelerate", "--address", server.address, "--out",
                    str(tmp_path / "shard"), "--no-dispatch")
    assert clients.wait(run, timeout_s=120, expect=None) != 0
    elapsed = time.monotonic() - started
    stderr = run.stderr()
    assert "InvalidArgumentError" in stderr and "IterableDatasetShard" in stderr, stderr[-3000:]
    assert "Leave the DataLoader out of accelerator.prepare()" in stderr
    assert not _records(tmp_path / "shard"), "no sample may reach a training step"
    print(f"accelerate dispatch_batches=False refused in {elapsed:.1f} s")
    assert elapsed < 60


def test_torchrun_stateful_dataloader_killed_and_resumed_is_exact(
        demo_root: Path, start_joaderd: Any, clients: Clients, expected: Any, tmp_path: Path) -> None:
    """torchrun, 2 ranks with 2 DataLoader workers each, JoaderDataLoader, a checkpoint every 3
    steps written by rank 0 only; killed -9 mid-epoch 2, started again: exact."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    out = tmp_path / "stateful"
    base = ("stateful", "--address", server.address, "--out", str(out), "--epochs", "3",
            "--batch-size", "8", "--workers", "2", "--every", "3")
    run = _torchrun(clients, "stateful", *base, "--kill-at", "1:7")
    assert clients.wait(run, timeout_s=240, expect=None) != 0
    checkpoint_step = max(int(p.stem.split("-")[2]) for p in out.glob("mark-0-*.json"))
    resumed = _torchrun(clients, "stateful-resumed", *base, "--resume", "1")
    clients.wait(resumed, timeout_s=240)
    per_rank = _check(out, expected, 3, f"torchrun + JoaderDataLoader, killed, resumed at step {checkpoint_step}")
    assert per_rank == {r: [NUM_DEMO_ITEMS // RANKS] * 3 for r in range(RANKS)}


def test_len_loader_is_the_batches_received_in_every_mode(demo_root: Path, start_joaderd: Any,
                                                          clients: Clients, tmp_path: Path) -> None:
    """Items (0 and 2 workers, drop_last, a transform) and batched (0 workers, 2 with hand-off),
    a batch size (7) that divides neither the epoch nor joader's own default request (asked in
    64s, each worker's last batch came short: more batches than len(loader))."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    out = tmp_path / "lengths"
    out.mkdir()
    run = _python(clients, "lengths", "lengths", "--address", server.address, "--out", str(out),
                  "--batch-size", "7")
    clients.wait(run, timeout_s=180)
    results = json.loads((out / "lengths.json").read_text())
    for result in results:
        print(result)
    for result in results:
        drop = "drop_last" in result["mode"]
        batches = NUM_DEMO_ITEMS // 7 if drop else math.ceil(NUM_DEMO_ITEMS / 7)
        assert result["len_loader"] == result["batches"] == batches, result
        assert result["items"] == (batches * 7 if drop else NUM_DEMO_ITEMS), result


_UNSETTLED = r"""
import sys
from joader import JoaderDataset
from joader.errors import InvalidArgumentError
ds = JoaderDataset("demo", address=sys.argv[1])
print("len", len(ds), "classes", len(ds.classes), "targets", len(ds.targets), flush=True)
sys.stdin.readline()  # the test looks at joaderd's jobs meanwhile
try:
    next(iter(ds))
except InvalidArgumentError as error:
    print("refused:", error, flush=True)
"""


def test_a_rank_without_its_rank_knows_its_data_and_reads_only_once_placed(
        demo_root: Path, start_joaderd: Any, tmp_path: Path) -> None:
    """WORLD_SIZE=2 and LOCAL_RANK=1 but no RANK and no process group (a Lightning rank at the
    top of its script): classes, labels and len() at once, no job registered (never a guessed
    rank 0), and reading before its rank is known names the fix."""
    import os
    import subprocess

    server = start_joaderd({"demo": demo_root}, cache_items=64)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(WORLD_SIZE="2", LOCAL_RANK="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-c", _UNSETTLED, server.address], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = proc.stdout.readline()
        assert first.split() == ["len", str(NUM_DEMO_ITEMS // 2), "classes", "4", "targets", str(NUM_DEMO_ITEMS)], first
        assert server.status()["jobs"] == [], "a rank whose place is unknown registers nothing"
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "refused:" in out and "RANK is not set" in out and "pass rank= and world_size=" in out, out
