"""Seeing the host: `joader top --once` and the Prometheus `/metrics` of a real joaderd."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import NUM_DEMO_ITEMS, finish, wait_for

pytestmark = pytest.mark.timeout(240)


def _stalls(server: Any) -> dict[str, float]:
    return {j["name"]: j["stall"]["fraction"] for j in server.status()["jobs"]
            if j.get("stall") and j["stall"]["fraction"] is not None}


def _run_beside_two_jobs(server: Any, command: list[str]) -> subprocess.CompletedProcess[str]:
    """Runs `joader COMMAND --address ...` while two jobs read: one whose loop does nothing but
    read (prep-bound: it waits for decodes) and one with a long step (compute-bound)."""
    jobs = [server.job("--epochs", "10000", "--batch-size", "8", "--step-s", step, name=name)
            for name, step in (("prepbound", "0"), ("computebound", "0.25"))]
    try:
        wait_for(lambda: len(_stalls(server)) == 2, 120, "both jobs to report a stall", interval_s=0.5)
        return subprocess.run([sys.executable, "-m", "joader.client.tools.cli", *command, "--address", server.address],
                              capture_output=True, text=True, timeout=90, check=False)
    finally:
        for job in jobs:
            job.terminate()
            finish(job)


def test_top_once_shows_each_job_with_its_stall(demo_root: Path, start_joaderd: Any) -> None:
    """`joader top --once` lists both jobs, with their stall."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS // 4)
    result = _run_beside_two_jobs(server, ["top", "--once", "--interval", "1"])
    assert result.returncode == 0, result.stderr
    frame = result.stdout
    assert "STALL" in frame and "decode workers" in frame and "cache" in frame, frame
    stall = {}
    for name in ("prepbound", "computebound"):
        row = next((line for line in frame.splitlines() if name in line), None)
        assert row is not None, frame
        # columns: JOB RANKS EPOCH PROGRESS SAMPLES/S STALL SHARED FROM-OTHERS DELIVERED
        percents = re.findall(r"(\d+)%", row)
        assert len(percents) == 3, row
        stall[name] = int(percents[0])
    assert stall["prepbound"] >= 50 and stall["computebound"] <= 20, (stall, frame)


_HOLD_SCRIPT = r"""
import sys
from torch.utils.data import DataLoader
from joader import JoaderDataset
address, epochs = sys.argv[1], int(sys.argv[2])
with JoaderDataset("demo", indices=range(40), address=address, batch_size=8, name="scraped") as ds:
    for _ in range(epochs):
        for images, labels in DataLoader(ds, batch_size=8):
            pass
    print("read", flush=True)
    sys.stdin.read()  # stays attached until the test closes stdin
"""


def test_metrics_scrape_after_a_known_workload(demo_root: Path, start_joaderd: Any) -> None:
    """One job reads 40 items twice from a cache that holds them all: 40 decodes, 80 deliveries,
    one job attached. `/metrics`, parsed with prometheus_client's own parser, says so."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS,
                           extra=("--metrics-listen", "127.0.0.1:0"))
    port = server.info["metrics_port"]
    assert isinstance(port, int) and port > 0, server.info
    job = subprocess.Popen([sys.executable, "-c", _HOLD_SCRIPT, server.address, "2"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "read", job.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200
            text = response.read().decode()
    finally:
        job.communicate(timeout=60)
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def value(name: str, **labels: str) -> float:
        matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
        assert len(matches) == 1, (name, labels, matches)
        return matches[0]

    assert value("joader_items_decoded_total") == 40
    assert value("joader_items_delivered_total") == 80
    assert value("joader_cache_misses_total") == 40  # one decode requested per item
    assert value("joader_cache_hits_total") >= 40  # the second epoch's entries (and lookahead)
    assert value("joader_decode_failures_total") == 0
    assert 40 * 3 * 64 * 64 <= value("joader_cache_bytes_used") <= value("joader_cache_bytes_capacity")
    assert value("joader_jobs") == 1
    assert value("joader_decode_workers_alive") == 2
    assert value("joader_job_items_total", job="scraped") == 80
    assert value("joader_job_epoch", job="scraped") == 2
    wait = value("joader_job_wait_seconds_total", job="scraped")
    step = value("joader_job_step_seconds_total", job="scraped")
    assert wait > 0 and step > 0 and wait + step < 60, (wait, step)  # its first items waited for decodes


def test_analyze_classifies_a_prep_bound_and_a_compute_bound_job(demo_root: Path, start_joaderd: Any) -> None:
    """`joader analyze --json`: per job, the measured stall, the bound, what-ifs for decode
    workers and cache sizes, and a recommendation; the two jobs classified right."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS // 4)
    result = _run_beside_two_jobs(server, ["analyze", "--json", "--interval", "3"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    jobs = {job["name"]: job for job in report["jobs"]}
    assert set(jobs) == {"prepbound", "computebound"}, report
    assert jobs["prepbound"]["bound"] == "prep" and jobs["computebound"]["bound"] == "compute", report
    assert jobs["prepbound"]["measured"]["stall"] > jobs["computebound"]["measured"]["stall"]
    for job in jobs.values():
        assert [w["workers"] for w in job["workers"]] == [1, 2, 3, 4]  # 2 now: one fewer, two more
        assert [c["cache"] for c in job["cache"]] == ["1/2x", "2x", "whole dataset"]
        for what_if in job["workers"] + job["cache"]:
            assert 0.0 <= what_if["stall"] <= 1.0 and what_if["epoch_s"] > 0, what_if
        assert job["measured"]["samples_per_s"] > 0 and job["recommendation"]
    assert jobs["prepbound"]["recommendation"].startswith("prep-bound")
    assert jobs["computebound"]["recommendation"].startswith("compute-bound")
    # the compute-bound job is predicted to stay so with more workers
    assert all(w["stall"] < 0.1 for w in jobs["computebound"]["workers"] if w["workers"] >= 2)
    host = report["host"]
    assert host["decode_workers"] == 2 and host["decode_cpu_ms_per_item"] > 0 and host["cores"] >= 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--workers auto needs two CPUs to grow")
@pytest.mark.serial  # the autoscaler grows the pool only onto an idle core
def test_workers_auto_grows_for_a_stalling_job_and_shrinks_when_it_is_gone(demo_root: Path, start_joaderd: Any) -> None:
    """`--workers auto` on two CPUs starts with one decode worker. A job with a short step waits
    for every decode while that worker is busy and a core is idle: the pool grows to two; once
    the job has gone, an idle pool shrinks back to one. Each change is logged with its reason,
    and `joader top` shows it."""
    # Pillow decodes the full 500x375 JPEG (turbo's DCT scaling makes 64 px items nearly free,
    # and then the worker is not the bottleneck, and rightly not grown)
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS // 4, workers="auto",
                           extra=("--decoder", "pil"))
    assert server.status()["workers"]["configured"] == 1
    # a short step that sleeps: the job leaves the CPU idle while it waits for the one worker
    # (a loop that only reads would itself take the idle core, and then growing would not help)
    job = server.job("--epochs", "10000", "--batch-size", "8", "--step-s", "0.005", name="greedy")
    try:
        # Poll slowly: each `joader status` is a Python process, and polling it ten times a
        # second would itself take the idle core the autoscaler looks for.
        grown = wait_for(lambda: (s := server.status())["workers"]["configured"] == 2 and s, 120,
                         "the pool to grow to two workers", interval_s=2.0)
        wait_for(lambda: server.status()["workers"]["alive"] == 2, 30, "the second worker to start", interval_s=1.0)
        assert any("waits" in line and "1 -> 2" in line for line in grown["workers"]["resizes"]), grown["workers"]
        frame = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "top", "--once", "--address",
                                server.address], capture_output=True, text=True, timeout=60, check=False).stdout
        assert "decode pool changes" in frame and "1 -> 2" in frame, frame
    finally:
        job.terminate()
        finish(job)
    shrunk = wait_for(lambda: (s := server.status())["workers"]["configured"] == 1 and s, 60,
                      "the idle pool to shrink to one worker", interval_s=1.0)
    assert "no job is reading" in shrunk["workers"]["resizes"][-1], shrunk["workers"]
    wait_for(lambda: server.status()["workers"]["alive"] == 1, 30, "the retired worker to exit", interval_s=1.0)
