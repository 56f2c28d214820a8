"""`JoaderDataset(order=...)` on a real joaderd: two shared jobs and one independent job read
the demo source together, in step (they start on one signal, at the same pace). Each job gets
every epoch exactly once with the right pixels and labels (`integrity.check_records`); the two
shared jobs have the same item at the same position far more often than chance, and the
independent job, beside them, about as often as chance (1/N of positions).

Thresholds, from the sample size (E = 2 epochs of N = 160 items per job): if two epochs are
independent uniform permutations, their same-position matches are the fixed points of a uniform
permutation, about Poisson(1) per epoch; over E epochs Poisson(E), mean 2: P(Poisson(2) >= 12)
= 1.4e-6, so the independent job must match each shared job fewer than 12 times (7.5% of
positions; chance is 0.6%), and the shared pair must match at least 12 times. Loose on purpose:
two shared jobs in step agree on 10% to 100% of positions (a loaded machine makes them drift:
`serial`), and the test is about the modes, not the machine's timing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from joader.sampling.checks import same_position_matches
from joader.testing.integrity import check_records, read_records
from tests.support.processes import NUM_DEMO_ITEMS, finish, wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)

EPOCHS = 2
MATCH_LIMIT = 12  # P(Poisson(EPOCHS) >= 12) = 1.4e-6: see the module docstring


def _orders(records: list[dict[str, Any]]) -> list[list[int]]:
    """The job's epochs, each in the order its loop received the items."""
    epochs: dict[int, list[int]] = {}
    for record in records:
        if record.get("kind") == "sample":
            epochs.setdefault(record["epoch"], []).append(record["index"])
    return [epochs[e] for e in sorted(epochs)]


@pytest.mark.serial  # the shared jobs agree as much as they run in step
def test_an_independent_job_beside_two_shared_ones(
        demo_root: Path, start_joaderd: Any, expected: dict[int, Any], tmp_path: Path) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    go = tmp_path / "go"
    orders = {"shared1": "shared", "shared2": "shared", "alone": "independent"}
    jobs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address,
             "--records", str(tmp_path / f"{name}.jsonl"), "--epochs", str(EPOCHS), "--timeout-s", "120",
             "--name", name, "--order", order, "--start-file", str(go), "--sleep", "0.01"],
            cwd=ROOT, stderr=open(tmp_path / f"{name}.err", "wb"))
        for name, order in orders.items()
    }
    wait_for(lambda: len(server.status()["jobs"]) == 3, 120, "three jobs to attach")
    status = server.status()
    assert sorted(j["order"] for j in status["jobs"]) == ["independent", "shared", "shared"]
    go.touch()
    received = {}
    for name, job in jobs.items():
        assert finish(job, 180) == 0, (tmp_path / f"{name}.err").read_text()[-3000:]
        records = read_records(tmp_path / f"{name}.jsonl")
        findings = check_records(records, expected, set(range(NUM_DEMO_ITEMS)), EPOCHS, name)
        assert findings.ok and findings.checked == EPOCHS * NUM_DEMO_ITEMS, findings.summary()
        received[name] = _orders(records)
    shared = same_position_matches(received["shared1"], received["shared2"])
    alone = [same_position_matches(received["alone"], received[s]) for s in ("shared1", "shared2")]
    positions = EPOCHS * NUM_DEMO_ITEMS
    print(f"same item at the same position: shared pair {shared / positions:.3f}, independent job "
          f"{alone[0] / positions:.3f} and {alone[1] / positions:.3f} (chance {1 / NUM_DEMO_ITEMS:.4f})")
    assert shared >= MATCH_LIMIT, (shared, alone)
    assert max(alone) < MATCH_LIMIT, (shared, alone)
    pairs = server.status()["sharing_pairs"]
    assert all("alone" not in (p["name_a"], p["name_b"]) for p in pairs), pairs
