"""Seeing the host: `joader top --once` and the Prometheus `/metrics` of a real joaderd."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import NUM_DEMO_ITEMS, finish, wait_for

pytestmark = pytest.mark.timeout(240)


def _stalls(server: Any) -> dict[str, float]:
    return {j["name"]: j["stall"]["fraction"] for j in server.status()["jobs"]
            if j.get("stall") and j["stall"]["fraction"] is not None}


def test_top_once_shows_each_job_with_its_stall(demo_root: Path, start_joaderd: Any) -> None:
    """Two jobs: one whose loop does nothing but read (prep-bound, it waits for decodes) and one
    with a long step (compute-bound). `joader top --once` lists both, with their stall."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS // 4)
    jobs = [server.job("--epochs", "10000", "--batch-size", "8", "--step-s", step, name=name)
            for name, step in (("prepbound", "0"), ("computebound", "0.25"))]
    try:
        wait_for(lambda: len(_stalls(server)) == 2, 120, "both jobs to report a stall")
        result = subprocess.run(
            [sys.executable, "-m", "joader.client.cli", "top", "--once", "--interval", "1",
             "--address", server.address], capture_output=True, text=True, timeout=60, check=False)
    finally:
        for job in jobs:
            job.terminate()
            finish(job)
    assert result.returncode == 0, result.stderr
    frame = result.stdout
    assert "STALL" in frame and "decode workers" in frame and "cache" in frame, frame
    stall = {}
    for name in ("prepbound", "computebound"):
        row = next((line for line in frame.splitlines() if name in line), None)
        assert row is not None, frame
        # columns: JOB RANKS EPOCH PROGRESS SAMPLES/S STALL SHARED DELIVERED
        percents = re.findall(r"(\d+)%", row)
        assert len(percents) == 2, row
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
