"""A decode pool in a crash loop recovers: a user stage kills its worker on seven files (14
deaths, past the ten a minute that start the backoff); those files fail as files, the pool is
back at its target within 60 s, and a job's every epoch is exactly the other items, with the
right pixels. Before the fix the pool stopped replacing workers for good and every epoch after
delivered only what was cached."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from joader.sources.base import open_source
from tests.integration.conftest import IMAGE_SIZE, finish, wait_for
from tests.integration.integrity import check_records, read_records, reference

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def test_the_pool_recovers_from_a_crash_loop_and_jobs_finish_exactly(demo_root: Path, start_joaderd: Any,
                                                                     tmp_path: Path) -> None:
    paths = [str(p) for p in open_source(str(demo_root)).paths]
    crash_on = paths[5:160:23]  # seven files across the classes
    assert len(crash_on) == 7
    config = tmp_path / "joaderd.toml"
    names = ", ".join(f'"{p}"' for p in crash_on)
    config.write_text(f'[sources.demo]\npath = "{demo_root}"\nstage = "tests.integration.crash_stage:factory"\n'
                      f"options = {{ size = {IMAGE_SIZE}, crash_on = [{names}] }}\n")
    server = start_joaderd({}, cache_items=64, extra=["--config", str(config)], env={"PYTHONPATH": str(ROOT)})
    records = tmp_path / "job.jsonl"
    job = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.integrity_job", "--address", server.address, "--records",
         str(records), "--epochs", "3", "--indices", "0:160", "--timeout-s", "120"],
        cwd=ROOT, stderr=open(tmp_path / "job.err", "wb"))
    assert finish(job, 200) == 0, (tmp_path / "job.err").read_text()[-3000:]
    bad = {paths.index(p) for p in crash_on}
    findings = check_records(read_records(records), reference(demo_root, IMAGE_SIZE), set(range(160)) - bad, 3, "job")
    assert findings.ok, findings.summary()
    log = server.log()
    assert "a crash loop" in log, log[-3000:]
    workers = wait_for(lambda: (w := server.status()["workers"])["alive"] == w["configured"] and w, 60,
                       "the pool back at its target")
    assert workers["replaced"] >= 10
    for path in crash_on:
        assert path in log  # each reported as that file's failure
