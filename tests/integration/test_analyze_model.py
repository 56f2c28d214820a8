"""`joader analyze`'s model checked against a real run (issue 38): a real joaderd, real jobs.

The prediction for the setting that was measured is computed from the same window's figures, so
it is compared with that window's measured stall: it must agree within the stated error. The
what-ifs must go the right way: a data-bound run (one decode worker, jobs with no step) gains
from a second worker; a compute-bound one (jobs whose step sleeps) does not. No speed is
asserted: a loaded machine changes the figures, not their consistency or their direction.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from joader.analysis import STATED_ERROR
from tests.support.processes import NUM_DEMO_ITEMS, finish, wait_for

pytestmark = pytest.mark.timeout(180)


def _analyze_beside(server: Any, step_s: str) -> dict[str, Any]:
    """`joader analyze --json` over 3 s while two jobs read with `step_s` per batch of 8, once
    both have reported their stall (a window that straddles a start is not a steady one)."""
    names = ("first", "second")
    jobs = [server.job("--epochs", "10000", "--batch-size", "8", "--step-s", step_s, name=name) for name in names]
    try:
        def measured() -> bool:
            found = {j["name"]: j for j in server.status()["jobs"]}
            return all(n in found and (found[n].get("stall") or {}).get("fraction") is not None
                       and found[n]["items_delivered"] >= 48 for n in names)

        wait_for(measured, 120, "both jobs to report a stall", interval_s=0.5)
        result = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "analyze", "--json", "--interval", "3",
                                 "--address", server.address], capture_output=True, text=True, timeout=90, check=False)
    finally:
        for job in jobs:
            job.terminate()
            finish(job)
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    assert {job["name"] for job in report["jobs"]} == set(names), report
    return report


def _check_the_setting_measured(job: dict[str, Any]) -> None:
    check = job["model_check"]
    assert check is not None, job
    assert abs(check["predicted_stall"] - job["measured"]["stall"]) <= STATED_ERROR, job
    assert check["within_stated_error"], job
    now = next(w for w in job["workers"] if w["workers"] == 1)
    assert now["stall"] == check["predicted_stall"], job  # the what-if for 1 worker is the setting measured


def test_analyze_predicts_the_stall_it_measures_and_a_second_worker_only_when_data_bound(
        demo_root: Path, start_joaderd: Any) -> None:
    # Pillow decodes the whole 500x375 JPEG: the one worker is the limit for jobs that only read
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS // 4, workers=1,
                           extra=("--decoder", "pil"))
    data_bound = _analyze_beside(server, "0")
    assert data_bound["stated_error"] == STATED_ERROR and data_bound["host"]["decode_workers"] == 1
    for job in data_bound["jobs"]:
        assert job["bound"] == "prep", job
        _check_the_setting_measured(job)
        one, two = ({w["workers"]: w for w in job["workers"]}[k] for k in (1, 2))
        assert two["stall"] < one["stall"] and two["epoch_s"] < one["epoch_s"], job
        assert two["samples_per_s"] > one["samples_per_s"], job

    compute_bound = _analyze_beside(server, "0.25")  # 32 samples/s each: data keeps up
    for job in compute_bound["jobs"]:
        assert job["bound"] == "compute", job
        _check_the_setting_measured(job)
        stalls = [w["stall"] for w in job["workers"]]
        assert max(stalls) - min(stalls) <= STATED_ERROR, job  # flat: workers do not help
        assert job["recommendation"].startswith("compute-bound"), job
