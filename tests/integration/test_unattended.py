"""A joaderd that runs unattended, as a client that starts it for itself will run it: it exits by
itself once it has had no job for `--idle-exit-s` (cleanly: exit code 0, socket, arena and ready
file gone), never while a job is attached, however long that job reads nothing; and
`--cache-size auto` sizes its arena from the data and serves from it (server/registry/idle_exit.py,
server/cache_sizing.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from joader.testing.integrity import check_records, read_records
from tests.support.processes import ITEM_NBYTES, NUM_DEMO_ITEMS, ROOT, Clients, wait_for

pytestmark = pytest.mark.timeout(180)

IDLE_EXIT_S = 2.0
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.MULTILINE)


def _logged_at(log: str, text: str) -> datetime:
    """When joaderd logged the first line containing `text`."""
    for line in log.splitlines():
        if text in line and (match := _LOG_TIME.match(line)):
            return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
    raise AssertionError(f"joaderd never logged {text!r}:\n{log[-4000:]}")


def _exited_cleanly(server: Any, within_s: float) -> None:
    """joaderd exits by itself within `within_s`, with 0, leaving nothing behind."""
    try:
        code = server.proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"joaderd did not exit by itself within {within_s:g} s:\n{server.log()[-4000:]}")
    assert code == 0, server.log()[-4000:]
    assert not Path(server.address.removeprefix("unix:")).exists(), "the socket was left behind"
    assert not os.path.exists(server.arena_path), "the arena was left behind"
    assert not server.process.ready_file.exists(), "the ready file was left behind"
    assert "joaderd stopped; removed" in server.log()


def test_no_job_ever_exits_after_the_setting(demo_root: Path, start_joaderd: Any) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=32, extra=["--idle-exit-s", str(IDLE_EXIT_S)])
    _exited_cleanly(server, within_s=30)
    said = re.search(r"joaderd: no job for (\d+\.\d) s \(--idle-exit-s\); exiting", server.log())
    assert said is not None and IDLE_EXIT_S <= float(said.group(1)) < IDLE_EXIT_S + 1.5, server.log()[-4000:]


def test_it_stays_while_a_job_is_attached_but_idle_and_exits_once_the_job_closed(
        demo_root: Path, start_joaderd: Any, clients: Clients) -> None:
    sock_dir = Path(tempfile.mkdtemp(prefix="jd-", dir="/tmp"))  # short: sun_path is 108 bytes
    try:
        sock = sock_dir / "joaderd.sock"
        # A real JoaderDataset, started first (torch takes seconds to import, longer than
        # --idle-exit-s), attaches the moment joaderd's socket appears; it reads one epoch, stays
        # attached reading nothing for longer than both --idle-exit-s and the lease (its keeper's
        # heartbeats hold the lease), then closes.
        job = clients.start("job", SimpleNamespace(address=f"unix:{sock}"), "one-epoch", "--name", "one-epoch",
                            "--epochs", "1", "--batch-size", "16", "--linger-s", "10", "--wait-for", str(sock))
        wait_for(lambda: any(e["event"] == "waiting" for e in job.events()), 90, "the job to import the client")
        server = start_joaderd({"demo": demo_root}, cache_items=64, lease_s=3.0, listen=f"unix:{sock}",
                               extra=["--idle-exit-s", str(IDLE_EXIT_S)])
        wait_for(lambda: any(e["event"] == "lingering" for e in job.events()), 90, "the job to read its epoch")
        time.sleep(IDLE_EXIT_S + 1.5)
        assert server.proc.poll() is None, f"joaderd exited while a job was attached:\n{server.log()[-4000:]}"
        status = server.status()
        assert (status["idle_exit_s"], status["idle_s"]) == (IDLE_EXIT_S, None)
        assert [j["name"] for j in status["jobs"]] == ["one-epoch"]
        assert status["jobs"][0]["epochs_completed"] == 1
        clients.wait(job, 60)
        _exited_cleanly(server, within_s=30)
        assert len(job.report()["epochs"][0]) == NUM_DEMO_ITEMS
        log = server.log()
        left = _logged_at(log, "removed (closed by its client)")
        exiting = _logged_at(log, "(--idle-exit-s); exiting")
        waited = (exiting - left).total_seconds()
        # checked every 0.2 s (idle_exit.check_period_s); the log's clock has milliseconds
        assert IDLE_EXIT_S - 0.01 <= waited <= IDLE_EXIT_S + 1.5, f"exited {waited:.3f} s after its job left"
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_cache_size_auto_holds_the_whole_dataset_and_serves_it(demo_root: Path, start_joaderd: Any,
                                                               expected: dict[int, Any], tmp_path: Path) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=1, extra=["--cache-size", "auto"])  # auto wins
    dataset = NUM_DEMO_ITEMS * ITEM_NBYTES  # center-crop: every item exactly its bytes
    status = server.status()
    assert status["cache_sizing"]["mode"] == "auto"
    assert status["cache_sizing"]["dataset_bytes"] == dataset
    assert status["cache_sizing"]["reason"].startswith("the whole prepared dataset")
    assert status["cache"]["capacity_bytes"] == dataset + dataset // 16
    assert os.path.getsize(server.arena_path) == status["cache"]["capacity_bytes"]
    assert re.search(r"--cache-size auto: cache \d+\.\d MiB = the whole prepared dataset", server.log())
    records = tmp_path / "auto.jsonl"
    with open(f"{records}.err", "wb") as err:
        job = subprocess.run([sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address,
                              "--records", str(records), "--epochs", "2", "--timeout-s", "120"],
                             cwd=ROOT, stderr=err, timeout=150, check=False)
    assert job.returncode == 0, Path(f"{records}.err").read_text()[-3000:]
    findings = check_records(read_records(records), expected, set(range(NUM_DEMO_ITEMS)), 2, "auto")
    assert findings.ok, findings.summary()
    status = server.status()
    assert (status["items_decoded"], status["cache"]["evictions"]) == (NUM_DEMO_ITEMS, 0)  # each decoded once
