"""Decode workers killed by files (a user stage that calls `os._exit` on some files, as a native
decoder's crash or an OOM kill would): those files fail as files, the pool stays at its target,
and a job's every epoch is exactly the other items, with the right pixels.

Two sizes: seven files (14 deaths, just past the ten a minute that would start the crash-loop
backoff if they counted), and 10% of 500 files (100 deaths, ten times that threshold). Before
issue 27's fix each death counted toward the backoff and the crashed file went back first in
line: the 10% job died of TimeoutError with the pool at 0 of 2 workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from joader.client.tools.demo_data import make_demo_data
from joader.sources.base import open_source
from joader.testing.integrity import check_records, read_records, reference
from tests.support.processes import IMAGE_SIZE, finish, wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _crash_config(tmp_path: Path, root: Path, crash_on: list[str]) -> Path:
    config = tmp_path / "joaderd.toml"
    names = ", ".join(f'"{p}"' for p in crash_on)
    config.write_text(f'[sources.demo]\npath = "{root}"\nstage = "joader.testing.crash_stage:factory"\n'
                      f"options = {{ size = {IMAGE_SIZE}, crash_on = [{names}] }}\n")
    return config


def _run_job(server: Any, tmp_path: Path, indices: str, epochs: int, deadline_s: float) -> list[dict[str, Any]]:
    records = tmp_path / "job.jsonl"
    job = subprocess.Popen(
        [sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address, "--records",
         str(records), "--epochs", str(epochs), "--indices", indices, "--timeout-s", "120"],
        cwd=ROOT, stderr=open(tmp_path / "job.err", "wb"), start_new_session=True)
    assert finish(job, deadline_s) == 0, (tmp_path / "job.err").read_text()[-3000:]
    return read_records(records)


def test_seven_crashing_files_fail_as_files_and_jobs_finish_exactly(demo_root: Path, start_joaderd: Any,
                                                                     tmp_path: Path) -> None:
    paths = [str(p) for p in open_source(str(demo_root)).paths]
    crash_on = paths[5:160:23]  # seven files across the classes
    assert len(crash_on) == 7
    config = _crash_config(tmp_path, demo_root, crash_on)
    server = start_joaderd({}, cache_items=64, extra=["--config", str(config)], env={"PYTHONPATH": str(ROOT)})
    records = _run_job(server, tmp_path, "0:160", 3, 200)
    bad = {paths.index(p) for p in crash_on}
    findings = check_records(records, reference(demo_root, IMAGE_SIZE), set(range(160)) - bad, 3, "job")
    assert findings.ok, findings.summary()
    log = server.log()
    assert "a crash loop" not in log, log[-3000:]  # the files explain every death
    workers = wait_for(lambda: (w := server.status()["workers"])["alive"] == w["configured"] and w, 60,
                       "the pool back at its target")
    assert workers["replaced"] >= 7 and workers["quarantined"] == 7
    for path in crash_on:
        assert f"quarantined {path}" in log  # each reported as that file's failure


@pytest.fixture(scope="module")
def root_500(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("crash500") / "images"
    make_demo_data(root, 500, num_classes=5, seed=3, progress=False)
    return root


def test_ten_percent_of_files_crashing_the_stage_are_skipped_and_every_healthy_item_arrives(
        root_500: Path, start_joaderd: Any, tmp_path: Path) -> None:
    """50 of 500 files kill their worker every time (100 deaths and more, ten times the backoff's
    threshold): every epoch of a job with on_error="skip" is exactly the 450 others, with the
    right pixels and labels; the 50 are in `joader status` as failed; the pool is at its target."""
    paths = [str(p) for p in open_source(str(root_500)).paths]
    bad = set(range(3, 500, 10))
    assert len(bad) == 50
    config = _crash_config(tmp_path, root_500, [paths[i] for i in sorted(bad)])
    server = start_joaderd({}, cache_items=64, extra=["--config", str(config)], env={"PYTHONPATH": str(ROOT)})
    records = _run_job(server, tmp_path, "0:500", 3, 270)  # a generous deadline: it fails a hang only
    findings = check_records(records, reference(root_500, IMAGE_SIZE), set(range(500)) - bad, 3, "job")
    assert findings.ok, findings.summary()
    status = server.status()
    assert status["items_failed"] == 50
    assert {f["path"] for f in status["failed"]} == {paths[i] for i in bad}
    assert all("crashes the decoder" in f["reason"] for f in status["failed"])
    workers = wait_for(lambda: (w := server.status()["workers"])["alive"] == w["configured"] and w, 60,
                       "the pool back at its target")
    assert workers["quarantined"] == 50 and workers["suspects"] == 0
