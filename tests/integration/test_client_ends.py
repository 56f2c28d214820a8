"""How a client's processes end (issue 27, finding 5), against a real joaderd: the DataLoader
workers of a killed `batched=True` job, a dataset closed mid-epoch, a full /dev/shm.

Every client is its own process (the pytest process holds no gRPC channel): `integrity_job` for
a job whose samples are checked against a decode made here, or a short script.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from joader.testing.integrity import check_records, read_records, reference
from tests.support.processes import IMAGE_SIZE, finish, wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def _state(pid: int) -> str | None:
    """The process's state letter, None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def _workers(parent: int) -> list[int]:
    """The DataLoader workers of an `integrity_job` process: its children running the same
    program (its lease keeper runs `joader.client.keeper_process`)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and b"integrity_job" in cmdline and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return sorted(found)


def _integrity_job(server: Any, records: Path, *options: str, env: dict[str, str] | None = None
                   ) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address,
                             "--records", str(records), *options],
                            cwd=ROOT, stderr=open(f"{records}.err", "wb"), start_new_session=True,
                            env={**os.environ, **(env or {})})


@pytest.mark.parametrize("cache_items", [64, 16], ids=["offsets", "copied"])
def test_the_workers_of_a_killed_handoff_job_exit_promptly(demo_root: Path, start_joaderd: Any,
                                                           tmp_path: Path, cache_items: int) -> None:
    """A `batched=True` job with two DataLoader workers (batches handed over by arena offset) is
    killed while its loop sleeps after its first batch: every item of its epoch is handed out,
    and a worker waits for the receipt of its last batch, which only the dead training process
    could write. Its workers stayed up to `timeout_s` (here 120 s; 7 minutes were seen); they
    must notice their parent died and exit within seconds. In a cache of two batches, a worker
    copies its batches out (`copy_now`) and queues their bytes, which fill the result queue's
    pipe: such workers hung at exit for good, flushing to a pipe nobody reads."""
    server = start_joaderd({"demo": demo_root}, cache_items=cache_items)
    records = tmp_path / "killed.jsonl"
    job = _integrity_job(server, records, "--workers", "2", "--batched", "--indices", "0:32", "--epochs", "1",
                         "--sleep", "600", "--timeout-s", "120")
    workers: list[int] = []
    try:
        wait_for(lambda: read_records(records), 90, "the job's first batch")
        workers = wait_for(lambda: (found := _workers(job.pid)) and len(found) == 2 and found, 30,
                           "the job's two DataLoader workers")

        def delivered() -> bool:
            jobs = server.status()["jobs"]
            return bool(jobs) and jobs[0]["epoch_delivered"] == 32

        wait_for(delivered, 60, "the job's epoch to be handed out")
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        wait_for(lambda: not any(_alive(pid) for pid in workers), 20,
                 f"the killed job's DataLoader workers {workers} to exit")
        wait_for(lambda: not server.status()["jobs"], 30, "joaderd to drop the killed job")
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # its workers and keeper, if the test failed
        except ProcessLookupError:
            pass
        job.wait()
    findings = check_records(read_records(records), reference(demo_root, IMAGE_SIZE), set(range(32)), 0, "killed")
    assert findings.ok and findings.checked >= 8, findings.summary()


@pytest.mark.parametrize("options", [("--batched", "--transform"), ("--transform",)],
                         ids=["batched-transform", "items"])
def test_a_full_dev_shm_is_named_with_its_free_space_and_the_fix(demo_root: Path, start_joaderd: Any,
                                                                tmp_path: Path, options: tuple[str, ...]) -> None:
    """Issue 27, finding 5c: DataLoader workers make each batch in shared memory (batched: the
    dataset's batch tensor; items: torch's default collate); with /dev/shm full the job failed
    with torch's raw ENOSPC ("No space left on device (28)"), no hint. The error now says what
    is full, how much is free, and the fix. (torch's allocation is made to fail in the job's
    process: this machine's /dev/shm is shared and is never filled for real.)"""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    records = tmp_path / "shm.jsonl"
    job = _integrity_job(server, records, "--workers", "2", *options, "--epochs", "1", "--timeout-s", "60",
                         "--shm-full")
    assert finish(job, 120) != 0
    err = Path(f"{records}.err").read_text()
    assert "SharedMemoryFullError" in err, err[-3000:]
    assert "/dev/shm is full (" in err and " free of " in err, err[-3000:]
    assert "--shm-size" in err and "lower the batch size" in err, err[-3000:]
