"""Files that hang their decode worker (issue 36, item 5), with a real joaderd: a file that hung
twice is quarantined and not decoded again in the next epochs, even with --retry-failed-s 0,
every healthy item arrives each epoch with the right pixels, and once the file is fixed on disk
it is served again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from joader.client.tools.demo_data import make_demo_data
from joader.testing.hang_stage import HANG_MARK
from joader.testing.integrity import check_records, read_records, reference
from tests.support.processes import IMAGE_SIZE, finish, wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)

NUM_ITEMS = 24
HANGING = (5, 17)


def _run_job(server: Any, tmp_path: Path, name: str, epochs: int) -> list[dict[str, Any]]:
    records = tmp_path / f"{name}.jsonl"
    job = subprocess.Popen(
        [sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address, "--records",
         str(records), "--epochs", str(epochs), "--indices", f"0:{NUM_ITEMS}", "--timeout-s", "120"],
        cwd=ROOT, stderr=open(tmp_path / f"{name}.err", "wb"), start_new_session=True)
    assert finish(job, 200) == 0, (tmp_path / f"{name}.err").read_text()[-3000:]
    return read_records(records)


def test_a_file_that_hung_twice_is_not_decoded_again_until_it_is_fixed(tmp_path: Path, start_joaderd: Any) -> None:
    root = tmp_path / "images"
    listing = make_demo_data(root, NUM_ITEMS, num_classes=2, seed=7, progress=False)
    expected = reference(root, IMAGE_SIZE)
    targets = [root / listing.paths[i] for i in HANGING]
    good = [target.read_bytes() for target in targets]
    for target, data in zip(targets, good, strict=True):
        target.write_bytes(HANG_MARK + data)
    config = tmp_path / "joaderd.toml"
    config.write_text(f'[sources.demo]\npath = "{root}"\nstage = "joader.testing.hang_stage:factory"\n'
                      f"options = {{ size = {IMAGE_SIZE} }}\n")
    server = start_joaderd({}, cache_items=8, extra=[
        "--config", str(config), "--decode-timeout-s", "0.5", "--retry-failed-s", "0"], env={"PYTHONPATH": str(ROOT)})

    records = _run_job(server, tmp_path, "first", 3)  # a cache of 8: every epoch decodes again
    findings = check_records(records, expected, set(range(NUM_ITEMS)) - set(HANGING), 3, "first")
    assert findings.ok, findings.summary()
    workers = server.status()["workers"]
    assert workers["tasks_timed_out"] == 2 * len(HANGING), workers  # epochs 2 and 3 ran neither again
    assert workers["quarantined"] == len(HANGING)
    log = server.log()
    for i in HANGING:
        assert log.count(f"quarantined {listing.paths[i]}:") == 1  # named once each

    targets[0].write_bytes(good[0])  # fixed on disk; the other one still hangs
    os.utime(targets[0], ns=(time.time_ns(), time.time_ns() + 10**9))
    wait_for(lambda: server.status()["workers"]["quarantined"] == 1, 30, "the fixed file to leave quarantine")
    records = _run_job(server, tmp_path, "second", 1)
    findings = check_records(records, expected, set(range(NUM_ITEMS)) - {HANGING[1]}, 1, "second")
    assert findings.ok, findings.summary()
    assert server.status()["workers"]["tasks_timed_out"] == 2 * len(HANGING)
