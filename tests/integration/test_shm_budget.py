"""Issue 36: four auto-sized joaderds of different specs in a 1 GiB /dev/shm stay within one budget
(half of it), and a DataLoader with 2 workers passing 64 MiB batches still runs beside them.

Runs `bench/system/shm_budget.py` in a private mount namespace (root and `unshare -m`: a tmpfs of its own
at /dev/shm, so the host's is untouched). Before the budget, the same four took 960 of 1,024 MiB
and the DataLoader failed ("unable to allocate shared memory ... No space left on device").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT

MiB = 2**20


def _private_shm_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root: mounts a private 1 GiB /dev/shm in a mount namespace (unshare -m)"
    if shutil.which("unshare") is None:
        return "needs unshare(1) (util-linux) for a private /dev/shm"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        return f"unshare -m cannot mount a tmpfs here: {probe.stderr.strip()[:200]}"
    return None


@pytest.mark.timeout(120)
def test_four_auto_sized_servers_stay_within_the_budget_and_a_dataloader_still_runs(tmp_path: Path) -> None:
    reason = _private_shm_unavailable()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "shm_budget.json"
    done = subprocess.run([sys.executable, "-m", "joader.testing.shm_budget", "--shm-size", "1g", "--batches", "4",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)
    assert out.exists(), done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert done.returncode == 0, done.stdout + done.stderr
    assert result["budget_bytes"] == 512 * MiB  # half of the 1 GiB /dev/shm
    assert [s["arena_bytes"] // MiB for s in result["servers"]] == [256, 128, 64, 32]
    assert result["total_bytes"] <= result["budget_bytes"]
    assert "half of what the 3 other auto-started servers (448.0 MiB) left" in result["servers"][3]["sizing"]
    loader = result["dataloader"]
    assert (loader["ok"], loader["batches"], loader["wrong"]) == (True, 4, 0), loader
    assert (result["ledger_entries_while_serving"], result["ledger_entries_after_stop"]) == (4, 0)
