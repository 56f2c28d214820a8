"""Trust, the job side: what ordinary scripts and hostile local processes do to a job's epochs.

Each test starts a real joaderd and real client processes (issue 7, items 1, 2, 3, 4, 7, 8, 9
and the client-side smaller items of 14).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from joader.client.tools.demo_data import make_demo_data
from tests.support.data import corrupt_jpeg
from tests.support.processes import NUM_DEMO_ITEMS, wait_for
from tests.support.trust import client, end, read_line, rss_bytes, run_client

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("generator", [False, True], ids=["manual_seed", "seeded_generator"])
def test_reseeding_before_every_epoch_still_delivers_whole_epochs(
    demo_root: Path, start_joaderd: Any, generator: bool
) -> None:
    """Item 1: fresh DataLoader workers with a repeated base seed are a new pass, not the old one."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS)
    result, _ = run_client(server.address, "reseed", "--epochs", "3", "--workers", "2",
                           *(["--generator"] if generator else []))
    assert [sorted(order) for order in result["epochs"]] == [list(range(NUM_DEMO_ITEMS))] * 3


def test_two_iterators_the_older_raises_a_clear_error(demo_root: Path, start_joaderd: Any) -> None:
    """Item 2: a second iter() takes the epoch; the first raises on its next next(), never just ends."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS)
    result, _ = run_client(server.address, "two-iterators", "--head", "32")
    assert len(result["head"]) == 32
    assert sorted(result["second"]) == list(range(NUM_DEMO_ITEMS))
    assert result["first_error"] is not None, "the superseded iterator ended quietly"
    assert result["first_error"]["type"] == "PassSupersededError"
    assert "newer iterator" in result["first_error"]["message"]


def test_another_process_cannot_reach_a_job_it_does_not_own(demo_root: Path, start_joaderd: Any) -> None:
    """Item 2: job ids are public (Status), the per-job secret is not; the owner is unaffected."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS)
    victim = client(server.address, "read", "--epochs", "2", "--pause", stdin=True)
    info = read_line(victim)
    first = read_line(victim)
    assert first["count"] == NUM_DEMO_ITEMS
    attack, _ = run_client(server.address, "hijack")
    assert attack["results"], "the attacker saw no job in Status"
    for outcome in attack["results"]:
        assert not outcome["ok"] and outcome["class"] == "UnknownJobError", outcome
    assert "secret" not in attack["status_text"].lower()
    assert victim.stdin is not None
    victim.stdin.write("go\n")
    victim.stdin.flush()
    second = read_line(victim)
    out, err = end(victim)
    assert second["count"] == NUM_DEMO_ITEMS, err
    assert info["job_id"]


def test_non_utf8_class_and_file_names(tmp_path: Path, start_joaderd: Any) -> None:
    """Item 3: Linux paths are bytes; a bad file and a class folder that are not UTF-8."""
    root = tmp_path / "images"
    listing = make_demo_data(root, 12, num_classes=2, seed=3, progress=False)
    odd_class = os.fsdecode(b"cl\xff")
    os.rename(root / listing.classes[1], root / odd_class)
    bad = root / listing.classes[0] / os.fsdecode(b"badzero\xfe.jpg")
    shutil.copy(root / listing.paths[0], bad)
    corrupt_jpeg(bad)
    server = start_joaderd({"odd": root}, cache_items=16)
    proc = client(server.address, "read", "--source", "odd", "--batch-size", "4")
    info = read_line(proc)
    assert odd_class in info["classes"]
    done = read_line(proc)
    out, err = end(proc)
    assert done["count"] == 12  # 13 files, the corrupt one skipped
    assert "badzero\\xfe.jpg" in err  # reported, readably
    status = server.status()
    assert status["items_failed"] == 1
    assert any("badzero\\xfe" in f["path"] for f in status["failed"])
    table = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "status", "--address", server.address],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "badzero\\xfe.jpg" in table.stdout, table.stderr


def test_a_file_fixed_on_disk_is_served_again_after_the_retry_time(tmp_path: Path, start_joaderd: Any) -> None:
    """Item 4: a file failure is retried at its next use after --retry-failed-s."""
    root = tmp_path / "images"
    listing = make_demo_data(root, 12, num_classes=2, seed=4, progress=False)
    target = root / listing.paths[5]
    good = target.read_bytes()
    corrupt_jpeg(target)
    server = start_joaderd({"demo": root}, cache_items=4, extra=["--retry-failed-s", "1"])
    first, _ = run_client(server.address, "read", "--batch-size", "4")
    assert sorted(first["epochs"][0]) == [i for i in range(12) if i != 5]
    target.write_bytes(good)
    time.sleep(1.1)  # the retry time is what is under test
    second, _ = run_client(server.address, "read", "--batch-size", "4")
    assert sorted(second["epochs"][0]) == list(range(12))
    status = server.status()
    assert status["items_failed"] == 0 and status["decodes"]["retried"] >= 1


@pytest.mark.parametrize("thread", ["scheduler", "results"])
def test_a_dead_internal_thread_stops_joaderd_loudly(demo_root: Path, start_joaderd: Any, thread: str) -> None:
    """Item 7: an exception in a background thread ends joaderd (exit 70), and jobs hear of it."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS,
                           env={"JOADERD_INJECT_FAULT": thread})
    server.expected_exit_code = 70
    proc = client(server.address, "read", "--timeout-s", "30")
    read_line(proc)
    outcome = read_line(proc, timeout_s=90)
    end(proc)
    assert outcome.get("error"), outcome
    assert outcome["error"]["type"] in ("ServerFailedError", "ConnectionError"), outcome
    wait_for(lambda: server.proc.poll() is not None, 30, "joaderd to exit")
    assert server.proc.returncode == 70
    log = server.log()
    assert "Traceback" in log and f"joaderd-{thread}" in log


def test_256_jobs_at_once_each_read_a_batch(demo_root: Path, start_joaderd: Any) -> None:
    """Item 8: 256 concurrent jobs (one client process) and no thread each; the limit is named."""
    server = start_joaderd({"demo": demo_root}, cache_items=4096, lease_s=30.0, extra=["--max-jobs", "256"])
    rss_before = rss_bytes(server.proc.pid)
    result, _ = run_client(server.address, "many-jobs", "--jobs", "256", "--batch-size", "4", timeout_s=200)
    outcomes = result["results"]
    assert all(o["attached"] and o["items"] >= 1 for o in outcomes), [o for o in outcomes if not o.get("items")][:3]
    assert result["jobs_in_status"] == 256
    rss_after = rss_bytes(server.proc.pid)
    print(f"joaderd RSS with 256 jobs: {rss_before / 2**20:.0f} MiB before, {rss_after / 2**20:.0f} MiB after")
    # One more than the limit is refused with the limit and the flag named.
    over, _ = run_client(server.address, "many-jobs", "--jobs", "257", "--batch-size", "4", timeout_s=200)
    refused = [o for o in over["results"] if not o["attached"]]
    assert refused and all(o["class"] == "TooManyJobsError" and "--max-jobs" in o["details"] for o in refused)


def test_an_expired_lease_frees_its_job_slot(demo_root: Path, start_joaderd: Any) -> None:
    """Item 8: a job whose client hangs loses its lease, and its slot under --max-jobs."""
    server = start_joaderd({"demo": demo_root}, cache_items=64, lease_s=2.0, extra=["--max-jobs", "1"])
    hung = client(server.address, "read", "--epochs", "2", "--pause", stdin=True)
    read_line(hung)
    read_line(hung)  # one epoch read; now it waits on stdin
    os.killpg(hung.pid, signal.SIGSTOP)  # the whole client hangs, keeper included
    try:
        wait_for(lambda: not server.status()["jobs"], 30, "the hung job's lease to expire")
        result, _ = run_client(server.address, "read")
        assert sorted(result["epochs"][0]) == list(range(NUM_DEMO_ITEMS))
    finally:
        os.killpg(hung.pid, signal.SIGKILL)
        hung.communicate()


def test_a_huge_indices_message_is_refused_unread(demo_root: Path, start_joaderd: Any) -> None:
    """Item 9: 242 MB of indices for a 160-item source; joaderd's memory stays where it was."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    rss_before = rss_bytes(server.proc.pid)
    result, _ = run_client(server.address, "big-indices", "--mb", "242", timeout_s=200)
    assert not result["ok"]
    assert result["code"] == "RESOURCE_EXHAUSTED", result
    rss_after = rss_bytes(server.proc.pid)
    print(f"joaderd RSS around a 242 MB indices message: {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
    assert rss_after < rss_before + 64 * 2**20
    ok, _ = run_client(server.address, "read")  # and it still serves
    assert sorted(ok["epochs"][0]) == list(range(NUM_DEMO_ITEMS))


def test_a_dead_lease_keeper_is_named_as_the_cause(demo_root: Path, start_joaderd: Any) -> None:
    """Item 14: a killed keeper is reported as such, not as an expired lease."""
    server = start_joaderd({"demo": demo_root}, cache_items=64, lease_s=30.0)
    proc = client(server.address, "read", "--epochs", "2", "--pause", stdin=True)
    info = read_line(proc)
    read_line(proc)
    os.kill(info["keeper_pid"], signal.SIGKILL)
    wait_for(lambda: not server.status()["jobs"], 30, "the job to go with its keeper")
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    outcome = read_line(proc)
    end(proc)
    assert outcome["error"]["type"] == "UnknownJobError"
    message = outcome["error"]["message"]
    assert "lease keeper" in message and "expired" not in message


def test_raising_on_a_bad_file_leaves_nothing_pinned(tmp_path: Path, start_joaderd: Any) -> None:
    """Item 14: on_error='raise' acknowledges the batch it raised in."""
    root = tmp_path / "images"
    listing = make_demo_data(root, 24, num_classes=2, seed=5, progress=False)
    for i in (2, 9):
        corrupt_jpeg(root / listing.paths[i])
    server = start_joaderd({"demo": root}, cache_items=64)
    proc = client(server.address, "raise-then-hold", "--batch-size", "4", stdin=True)
    outcome = read_line(proc)
    assert outcome["error"] and "could not be decoded" in outcome["error"]

    def settled() -> dict[str, Any] | None:
        status = server.status()
        jobs = status["jobs"]
        queued = sum(j["queued"] for j in jobs)
        return status if jobs and status["cache"]["pins"] == queued else None

    wait_for(settled, 20, "pins to equal the job's queued entries (no handed-out batch pinned)")
    end(proc)  # closes its stdin: the client closes the dataset and exits


def test_exiting_with_an_open_iterator_prints_no_traceback(demo_root: Path, start_joaderd: Any) -> None:
    """Item 14: `next(iter(ds))` and exit."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    result, err = run_client(server.address, "next-then-exit")
    assert "first" in result
    assert "Traceback" not in err and "TypeError" not in err, err


def test_repeated_indices_are_refused_with_the_fix() -> None:
    """Item 14: indices=[3, 3, 3] used to become one item silently."""
    from joader.client.dataset import to_bitmap
    from joader.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"3 \(3 times\).*unique"):
        to_bitmap([3, 3, 3, 4])
    assert list(to_bitmap([5, 3, 4])) == [3, 4, 5]
