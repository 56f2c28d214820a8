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
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import IMAGE_SIZE, NUM_DEMO_ITEMS
from tests.integration.integrity import check_records, read_records, reference
from tests.integration.processes import Client, Clients, free_port

pytestmark = pytest.mark.slow
JOB = "tests.integration.framework_jobs"


@pytest.fixture(scope="module")
def expected(demo_root: Path) -> Any:
    return reference(demo_root, IMAGE_SIZE)


@pytest.fixture
def clients(tmp_path: Path) -> Any:
    runner = Clients(tmp_path)
    try:
        yield runner
    finally:
        runner.close()


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
