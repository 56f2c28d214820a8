"""A source that changes under a running joaderd (issue 27, finding 4), with a real joaderd and
real jobs whose every sample is checked against a decode made here (`integrity.py`).

- The folder renamed away and back mid-run: before, each decode in the gap was reported as a
  bad file and skipped, and stayed skipped for `--retry-failed-s` (the jobs lost those items for
  epochs). Now the items wait for the folder and every epoch is complete.
- The folder replaced by other images of the same layout: before, the new pixels were delivered
  beside the old cached ones under the same indices, with no warning. Now the job stops with
  `SourceChangedError` naming the change and the fix, having received old pixels only, and a
  new job on the source is refused the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from joader.client.tools.demo_data import make_demo_data
from joader.testing.integrity import check_records, read_records, reference
from tests.support.processes import IMAGE_SIZE, finish, wait_for

pytestmark = pytest.mark.timeout(240)

NUM_ITEMS = 160
EPOCHS = 3


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The jobs a test started; killed afterwards if a failed assertion left them running."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _start(server: Any, name: str, epochs: int, sleep: float,
           started: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    records = server.dir / f"{name}.jsonl"
    command = [sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address,
               "--source", "photos", "--records", str(records), "--name", name, "--epochs", str(epochs),
               "--sleep", str(sleep), "--timeout-s", "60"]
    with open(server.dir / f"{name}.err", "wb") as err:
        proc = subprocess.Popen(command, stderr=err, start_new_session=True)
    started.append(proc)
    return proc


def _samples(server: Any, name: str) -> list[dict[str, Any]]:
    return [r for r in read_records(server.dir / f"{name}.jsonl") if r.get("kind") == "sample"]


def _health(server: Any) -> dict[str, Any]:
    source = next(s for s in server.status()["sources"] if s["name"] == "photos")
    return source.get("health", {"state": "ok"})


def _stderr(server: Any, name: str) -> str:
    return (server.dir / f"{name}.err").read_text(errors="replace")


def test_a_folder_renamed_away_and_back_loses_no_item(tmp_path: Path, start_joaderd: Any,
                                                      started: list[subprocess.Popen[bytes]]) -> None:
    """Renamed away while a job reads (a cache of 40 of 160 items: most are decoded each epoch),
    back once joaderd saw it gone: every epoch delivers every item, with the right pixels."""
    photos = tmp_path / "photos"
    make_demo_data(photos, NUM_ITEMS, num_classes=4, seed=1, progress=False)
    expected = reference(photos, IMAGE_SIZE)
    server = start_joaderd({"photos": photos}, cache_items=40)
    job = _start(server, "away", EPOCHS, 0.05, started)
    wait_for(lambda: len(_samples(server, "away")) >= 24, 90, "the job's first batches")
    away = tmp_path / "photos.away"
    photos.rename(away)
    try:
        # Gone until joaderd held a read for it (or, before the fix, the job skipped an item).
        wait_for(lambda: _health(server)["state"] == "away" and _health(server)["held_items"] > 0
                 or "skipping item" in _stderr(server, "away"), 60, "a read of the missing folder")
        health = _health(server)
    finally:
        away.rename(photos)
    code = finish(job, 150)
    assert code == 0, _stderr(server, "away")[-3000:]
    findings = check_records(_samples(server, "away"), expected, set(range(NUM_ITEMS)), EPOCHS, "away")
    assert findings.ok, findings.summary()
    assert "skipping item" not in _stderr(server, "away")
    assert health["state"] == "away" and "is gone" in health["message"], health
    wait_for(lambda: _health(server)["state"] == "ok", 30, "the source served again")
    log = server.log()
    assert "is gone" in log and "is back after" in log, log[-3000:]


def test_a_folder_replaced_by_other_images_is_refused_not_mixed(tmp_path: Path, start_joaderd: Any,
                                                                started: list[subprocess.Popen[bytes]]) -> None:
    """Another dataset of the same layout (same paths, other pixels) moved in under the folder's
    name mid-run: the job stops with SourceChangedError naming the problem and the fix, having
    received the old pixels only; a new job on the source is refused; joaderd stays up."""
    photos = tmp_path / "photos"
    make_demo_data(photos, NUM_ITEMS, num_classes=4, seed=1, progress=False)
    other = tmp_path / "other"
    make_demo_data(other, NUM_ITEMS, num_classes=4, seed=2, progress=False)
    old, new = reference(photos, IMAGE_SIZE), reference(other, IMAGE_SIZE)
    differ = {i for i in old if old[i].crc != new[i].crc}
    assert len(differ) > NUM_ITEMS // 2, "the two datasets must have other pixels"
    server = start_joaderd({"photos": photos}, cache_items=40)
    job = _start(server, "swapped", EPOCHS, 0.05, started)
    wait_for(lambda: len(_samples(server, "swapped")) >= 24, 90, "the job's first batches")
    photos.rename(tmp_path / "photos.old")
    other.rename(photos)
    code = finish(job, 150)
    samples = _samples(server, "swapped")
    mixed = [s for s in samples if s["crc"] != old[s["index"]].crc]
    assert not mixed, (f"{len(mixed)} of {len(samples)} samples have pixels other than the listed data's, "
                       f"e.g. {mixed[:3]}; the job exited with {code}")
    err = _stderr(server, "swapped")
    assert code != 0 and "SourceChangedError" in err and "changed under joaderd" in err, err[-3000:]
    assert "restart joaderd" in err.lower() and "another name" in err, err[-3000:]
    health = _health(server)
    assert health["state"] == "changed" and "changed under joaderd" in health["message"], health
    # A new job on the source: refused with the same error, before any item.
    late = _start(server, "late", 1, 0.0, started)
    assert finish(late, 90) != 0
    late_err = _stderr(server, "late")
    assert "SourceChangedError" in late_err and "changed under joaderd" in late_err, late_err[-3000:]
    assert not _samples(server, "late")
    assert not server.status()["jobs"]
    assert "dropped its" in server.log(), server.log()[-3000:]
