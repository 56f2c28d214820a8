"""A cache of a few batches, checked by content: a lone job whose DataLoader workers hand
batches over by arena offset (it hung in a cache of three batches), and a job reading beside one
that stopped (it never got an item). Every sample's pixels and label against a decode made
here, every epoch exactly once (`integrity.py`); `test_jobs_faults.py` has their counts and
status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from joader.testing.integrity import check_records, read_records, reference
from tests.support.processes import IMAGE_SIZE, NUM_DEMO_ITEMS, finish, wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def _job(server: Any, records: Path, *options: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address,
                             "--records", str(records), "--epochs", "2", "--timeout-s", "120", *options],
                            cwd=ROOT, stderr=open(f"{records}.err", "wb"))


@pytest.mark.parametrize("cache_batches", [2, 3])
def test_a_lone_handoff_job_in_a_cache_of_a_few_batches_gets_the_right_samples(
        demo_root: Path, start_joaderd: Any, tmp_path: Path, cache_batches: int) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=8 * cache_batches)
    records = tmp_path / "handoff.jsonl"
    job = _job(server, records, "--workers", "2", "--batched", "--sleep", "0.05")
    assert finish(job, 180) == 0, Path(f"{records}.err").read_text()[-3000:]
    findings = check_records(read_records(records), reference(demo_root, IMAGE_SIZE), set(range(NUM_DEMO_ITEMS)),
                             2, "handoff")
    assert findings.ok, findings.summary()


def test_a_job_beside_a_paused_one_gets_the_right_samples(demo_root: Path, start_joaderd: Any,
                                                          tmp_path: Path) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=32)
    ready = tmp_path / "paused.ready"
    paused = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.test_jobs_faults", "pause", "--address", server.address,
         "--out", str(tmp_path / "paused.json"), "--name", "paused", "--batch-size", "8", "--ready", str(ready)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(ready.exists, 90, "the paused job to read a batch")
        records = tmp_path / "reader.jsonl"
        job = _job(server, records, "--workers", "2", "--transform")
        assert finish(job, 180) == 0, Path(f"{records}.err").read_text()[-3000:]
        findings = check_records(read_records(records), reference(demo_root, IMAGE_SIZE),
                                 set(range(NUM_DEMO_ITEMS)), 2, "reader")
        assert findings.ok, findings.summary()
    finally:
        os.killpg(paused.pid, signal.SIGKILL)
        paused.wait()


def test_a_handoff_job_whose_batch_is_larger_than_the_cache_gets_the_right_samples(
        demo_root: Path, start_joaderd: Any, tmp_path: Path) -> None:
    """Issue 27, finding 3: batches of 40 from a cache of 24 items, through two DataLoader
    workers that hand batches over by arena offset. A worker keeps its batch in progress pinned
    until it is whole, which this cache never allows: the job hung until timeout_s in 8 runs of
    8. joaderd now has such a worker copy its items out at once (`copy_now`)."""
    server = start_joaderd({"demo": demo_root}, cache_items=24)
    records = tmp_path / "bigbatch.jsonl"
    job = _job(server, records, "--workers", "2", "--batched", "--batch-size", "40", "--timeout-s", "30")
    assert finish(job, 180) == 0, Path(f"{records}.err").read_text()[-3000:]
    findings = check_records(read_records(records), reference(demo_root, IMAGE_SIZE), set(range(NUM_DEMO_ITEMS)),
                             2, "bigbatch")
    assert findings.ok, findings.summary()
