"""Concurrent jobs against a real joaderd: exactly once, sharing, and a job killed mid-epoch."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import NUM_DEMO_ITEMS, finish, wait_for

pytestmark = pytest.mark.timeout(240)


def assert_exactly_once(report: dict[str, Any], dataset: range, epochs: int) -> None:
    assert len(report["epochs"]) == epochs
    for number, epoch in enumerate(report["epochs"], 1):
        order = epoch["order"]
        assert len(order) == len(dataset), f"{report['name']} epoch {number}: {len(order)} items"
        assert sorted(order) == list(dataset), f"{report['name']} epoch {number} is not a permutation"


@pytest.mark.parametrize(("num_workers", "batched"), [(0, False), (2, False), (2, True)])
def test_concurrent_jobs_get_every_item_once_per_epoch_and_share(
    demo_root: Path, start_joaderd: Any, num_workers: int, batched: bool
) -> None:
    """Two overlapping jobs, one of them spread over DataLoader workers, two epochs each.

    The cache holds a quarter of the source, so sharing comes from DSA's correlated order, not
    from caching everything.
    """
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS // 4)
    a_items, b_items = range(120), range(40, NUM_DEMO_ITEMS)
    a = server.job("--indices", "0:120", "--epochs", "2", "--batch-size", "8",
                   "--num-workers", str(num_workers), *(["--batched"] if batched else []), name="a")
    b = server.job("--indices", f"40:{NUM_DEMO_ITEMS}", "--epochs", "2", "--batch-size", "8", name="b")
    assert finish(a) == 0, server.job_stderr("a")
    assert finish(b) == 0, server.job_stderr("b")
    assert_exactly_once(server.report("a"), a_items, 2)
    assert_exactly_once(server.report("b"), b_items, 2)
    status = server.status()
    assert status["items_delivered"] == 2 * (len(a_items) + len(b_items))
    assert status["items_failed"] == 0
    # what the old "sharing factor" checked (the jobs start unsynchronized and run at different
    # speeds here, so within-epoch sharing alone is small and varies with the machine's load)
    assert status["sharing"]["deliveries_per_decode"] > 1.0, status
    assert status["jobs"] == []  # both leases ended with their processes
    assert status["cache"]["pinned_items"] == 0


@pytest.mark.serial  # the jobs share as much as they run in step: a loaded machine makes them drift
def test_identical_jobs_share_almost_every_decode(demo_root: Path, start_joaderd: Any) -> None:
    """Three identical jobs at the same speed: each decode serves nearly three deliveries.

    The jobs line up their start (as a hyper-parameter sweep does) so that this measures DSA and
    the RefCnt cache rather than how long Python takes to import torch in each process.
    """
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    # Start together once all three are attached: a fixed "now + 4 s" was sometimes too soon on
    # a busy two-core machine, and a job half a second late shares nothing (sharing 1.7).
    go = server.dir / "go"
    jobs = [server.job("--epochs", "1", "--batch-size", "8", "--step-s", "0.02",
                       "--start-file", str(go), name=f"j{i}") for i in range(3)]
    wait_for(lambda: len(server.status()["jobs"]) == 3, 120, "three jobs to attach")
    go.touch()
    for i, job in enumerate(jobs):
        assert finish(job) == 0, server.job_stderr(f"j{i}")
        assert_exactly_once(server.report(f"j{i}"), range(NUM_DEMO_ITEMS), 1)
    status = server.status()
    # Ideal 3. What is lost is mostly the first few dozen rounds: lease keepers register ~0.1 s
    # apart, so the first job fills its lookahead queue alone. On 160 items that is up to ~15%;
    # bench/ measures the 1,200-item demo setting (target 2.7). Independent shuffles give ~1.3.
    assert status["sharing"]["within_epoch"] >= 2.4, status


def test_killed_client_releases_its_pins_while_the_other_job_finishes(
    demo_root: Path, start_joaderd: Any
) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS // 4, lease_s=3.0)
    victim = server.job("--epochs", "50", "--batch-size", "8", "--step-s", "0.05",
                        "--num-workers", "2", name="victim")
    survivor = server.job("--epochs", "2", "--batch-size", "8", "--step-s", "0.02", name="survivor")

    def victim_reading() -> bool:
        jobs = {j["name"]: j for j in server.status()["jobs"]}
        return "victim" in jobs and jobs["victim"]["items_delivered"] > 16

    wait_for(victim_reading, 60, "the victim job to read some items")
    os.killpg(victim.pid, signal.SIGKILL)  # the training process, its workers and its lease keeper
    victim.wait()
    wait_for(lambda: "victim" not in {j["name"] for j in server.status()["jobs"]}, 15,
             "joaderd to drop the killed job")
    assert finish(survivor) == 0, server.job_stderr("survivor")
    assert_exactly_once(server.report("survivor"), range(NUM_DEMO_ITEMS), 2)
    status = server.status()
    assert status["jobs"] == []
    assert status["cache"]["pinned_items"] == 0, status["cache"]
    assert "victim" in server.log() and "removed" in server.log()


def test_server_exit_removes_its_arena(demo_root: Path, start_joaderd: Any) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=16)
    arena = Path(server.status()["arena_path"])
    assert arena.exists()
    assert server.stop() == 0
    assert not arena.exists()
    assert not (server.dir / "joaderd.sock").exists()


def test_a_hung_client_loses_its_lease(demo_root: Path, start_joaderd: Any) -> None:
    """A job whose processes stop answering (SIGSTOP: alive, connected, silent) is dropped
    after its lease, and the server goes on serving a new job."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS // 4, lease_s=2.0)
    hung = server.job("--epochs", "50", "--batch-size", "8", "--step-s", "0.05", name="hung")
    wait_for(lambda: any(j["name"] == "hung" and j["items_delivered"] > 0 for j in server.status()["jobs"]),
             60, "the job to start reading")
    os.killpg(hung.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: server.status()["jobs"] == [], 20, "joaderd to drop the silent job")
        assert "no request for 2 s" in server.log()
        other = server.job("--epochs", "1", "--batch-size", "8", name="other")
        assert finish(other) == 0, server.job_stderr("other")
        assert_exactly_once(server.report("other"), range(NUM_DEMO_ITEMS), 1)
    finally:
        os.killpg(hung.pid, signal.SIGKILL)
        hung.wait()
    assert server.status()["cache"]["pinned_items"] == 0
