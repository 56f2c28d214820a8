"""Jobs whose ranks span hosts (issue 20): one joaderd per host, torchrun across "nodes".

Each host is a joaderd of its own (own socket, own arena); each node is a torchrun agent with
`--nnodes 2 --rdzv-backend c10d` on 127.0.0.1, whose ranks are told their host's joaderd
(`--address`, as JOADER_ADDRESS would on a real node). The ranks run `framework_jobs stateful`:
JoaderDataLoader, gloo, an all_reduce every step (a rank with fewer batches would hang it).
Every sample's pixels and label are checked against a decode made here, and each epoch is
exactly once over the union of all ranks on all hosts.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from joader.testing.integrity import check_records, read_records
from tests.support.processes import NUM_DEMO_ITEMS, Client, Clients, free_port, wait_for

pytestmark = pytest.mark.slow
JOB = "tests.support.framework_jobs"




def _nodes(clients: Clients, name: str, servers: list[Any], local_ranks: list[int], *args: str) -> list[Client]:
    """One torchrun agent per host, rendezvous over c10d; node i's ranks use servers[i]."""
    endpoint = f"127.0.0.1:{free_port()}"
    return [clients.popen(f"{name}-node{i}", [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(servers)),
        "--nproc-per-node", str(local), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", name, "--max-restarts", "0", "-m", JOB, "stateful", "--address", server.address, *args])
        for i, (server, local) in enumerate(zip(servers, local_ranks, strict=True))]


def _check(out: Path, expected: Any, world: int, items: int, epochs: int, what: str) -> dict[int, list[int]]:
    records = [r for rank in range(world) for r in read_records(out / f"records-{rank}.jsonl")]
    findings = check_records(records, expected, set(range(items)), epochs, what)
    per_rank = {rank: [Counter(r["epoch"] for r in records if r["rank"] == rank).get(e, 0)
                       for e in range(1, epochs + 1)] for rank in range(world)}
    print(f"{what}: items per rank per epoch {per_rank}; {findings.summary()}")
    assert findings.ok, f"{what}: {findings.summary()}"
    return per_rank


@pytest.mark.parametrize("local_ranks", [[1, 1], [2, 1]], ids=["1+1", "2+1"])
def test_a_job_across_two_hosts_is_exact_with_equal_batches(
        demo_root: Path, start_joaderd: Any, clients: Clients, expected: Any, tmp_path: Path,
        local_ranks: list[int]) -> None:
    """Two hosts, 1+1 or 2+1 ranks: every epoch exactly once over all ranks, every rank the same
    batches (an all_reduce per step), and each host decodes its part only."""
    servers = [start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS) for _ in local_ranks]
    world = sum(local_ranks)
    items = NUM_DEMO_ITEMS // world * world  # no padding: exactly once is exact
    epochs = 2
    out = tmp_path / "run"
    runs = _nodes(clients, "multi", servers, local_ranks, "--out", str(out), "--epochs", str(epochs),
                  "--batch-size", "8", "--items", str(items))
    for run in runs:
        clients.wait(run, timeout_s=240)
    per_rank = _check(out, expected, world, items, epochs, f"{'+'.join(map(str, local_ranks))} ranks on 2 hosts")
    assert per_rank == {r: [items // world] * epochs for r in range(world)}
    done = [json.loads((out / f"done-{r}.json").read_text()) for r in range(world)]
    assert len({d["len_loader"] for d in done}) == 1 and all(d["batches"] == [d["len_loader"]] * epochs for d in done)
    first = 0
    for host, (server, local) in enumerate(zip(servers, local_ranks, strict=True)):
        status = server.status()
        part = local * items // world
        decoded = status["items_decoded"]
        print(f"host {host}: {local} ranks, part {part} items, {decoded} decodes over {epochs} epochs, "
              f"{status['items_delivered']} deliveries")
        assert status["items_delivered"] == part * epochs
        assert decoded <= part * epochs  # its part only (the cache holds it: once, mostly)
        assert [d["hosts"] for d in done[first:first + local]] == [
            {"world_size": world, "first_rank": first, "local_ranks": local}] * local
        first += local


def test_two_jobs_across_the_same_hosts_share_on_each_host(
        demo_root: Path, start_joaderd: Any, clients: Clients, expected: Any, tmp_path: Path) -> None:
    """Two 2-host jobs on the same items, at once: each host's part is the same for both (cut
    from the source's keyed order), so each host decodes its part, not the dataset, and serves
    both jobs from one decode."""
    servers = [start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS) for _ in range(2)]
    epochs = 2
    outs = [tmp_path / "a", tmp_path / "b"]
    runs = [run for name, out in zip(("a", "b"), outs, strict=True)
            for run in _nodes(clients, name, servers, [1, 1], "--out", str(out), "--epochs", str(epochs),
                              "--batch-size", "8", "--step-s", "0.02")]
    for run in runs:
        clients.wait(run, timeout_s=240)
    for out in outs:
        _check(out, expected, 2, NUM_DEMO_ITEMS, epochs, f"job {out.name}")
    part = NUM_DEMO_ITEMS // 2
    for host, server in enumerate(servers):
        status = server.status()
        decoded, delivered = status["items_decoded"], status["items_delivered"]
        print(f"host {host}: part {part}, {decoded} decodes, {delivered} deliveries to 2 jobs over {epochs} "
              f"epochs ({delivered / decoded:.2f} served per decode)")
        assert delivered == 2 * part * epochs
        assert decoded <= 1.1 * part, f"host {host} decoded {decoded} for a part of {part}: the jobs did not share"


def test_a_hosts_joaderd_killed_and_restarted_mid_epoch_its_ranks_resume_exactly(
        demo_root: Path, start_joaderd: Any, clients: Clients, expected: Any, tmp_path: Path) -> None:
    """kill -9 of host 1's joaderd mid-epoch, a new one on its socket 1 s later: host 1's two
    ranks reconnect and finish the epoch with what they had not read; host 0's never notices.
    Every epoch exactly once over all ranks, pixels and labels checked. With two ranks on the
    restarted host and an all_reduce every step, a rank that already had its next batch
    reports what it consumed only after the all_reduce, which waits for the other rank, whose
    resumed epoch waits for that report: the lease keepers report for their ranks when they
    attach again, and the epoch resumes on those reports alone (`decide_restart`). Epoch 2
    then starts as a new pass on both ranks: a rank that asked with its epoch number (2) was
    taken for a resume, and the job waited for the other rank's report for good (about 1 run
    in 5), or dealt epoch 2 twice (issue 27)."""
    servers = [start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS) for _ in range(2)]
    out = tmp_path / "run"
    epochs = 2
    runs = _nodes(clients, "restart", servers, [1, 2], "--out", str(out), "--epochs", str(epochs),
                  "--batch-size", "4", "--step-s", "0.05", "--items", "159")
    records = out / "records-1.jsonl"

    def read_some() -> bool:
        return records.exists() and sum(1 for _ in records.open()) >= 16

    wait_for(read_some, 120, "host 1's first rank to read 16 items")
    servers[1].expected_exit_code = -9
    servers[1].proc.kill()
    servers[1].proc.wait()
    at_kill = sum(1 for _ in records.open())
    assert at_kill < 53 * epochs, "host 1's rank had finished before its joaderd was killed"
    print(f"host 1's joaderd killed after its rank 1 read {at_kill} items")
    time.sleep(1.0)
    restarted = start_joaderd.restart(servers[1])
    for run in runs:
        clients.wait(run, timeout_s=240)
    per_rank = _check(out, expected, 3, 159, epochs, "host 1's joaderd killed and restarted")
    assert per_rank == {r: [53] * epochs for r in range(3)}
    assert restarted.status()["items_delivered"] > 0


def test_a_checkpoint_mid_epoch_resumes_across_both_hosts(
        demo_root: Path, start_joaderd: Any, clients: Clients, expected: Any, tmp_path: Path) -> None:
    """A 2+1-rank job checkpoints every 5 steps (JoaderDataLoader gathers all 3 ranks' states),
    is killed (-9, every rank) mid-epoch 2, and resumes from its last checkpoint (the same
    joaderds; the killed run's jobs ended with their leases): each rank's records cut back to
    that checkpoint, every epoch exactly once. The same checkpoint on 1 + 2 ranks resumes too."""
    servers = [start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS) for _ in range(2)]
    out = tmp_path / "run"
    base = ("--out", str(out), "--epochs", "3", "--batch-size", "4", "--items", "159", "--every", "5")
    killed = _nodes(clients, "killed", servers, [2, 1], *base, "--kill-at", "1:7")
    for run in killed:
        clients.wait(run, timeout_s=240, expect=None)
    assert not (out / "done-0.json").exists(), "the run was to be killed mid-epoch"
    resumed = _nodes(clients, "resumed", servers, [2, 1], *base, "--resume", "yes")
    for run in resumed:
        clients.wait(run, timeout_s=240)
    per_rank = _check(out, expected, 3, 159, 3, "2+1 ranks killed mid-epoch 2 and resumed")
    assert per_rank == {r: [53] * 3 for r in range(3)}
    # The same checkpoint on another layout (1 + 2 ranks) resumes too, each host's part cut by
    # the new layout (issue 40; what it delivers: tests/integration/test_elastic_resume.py).
    moved = _nodes(clients, "moved", servers, [1, 2], *base, "--resume", "yes")
    for run in moved:
        clients.wait(run, timeout_s=240)
