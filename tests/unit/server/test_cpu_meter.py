"""joaderd's CPU meter (server/cpu_meter.py): the host's busy verdict and the CPU-bound jobs,
from readings (pure), and from real processes (one that spins, one that sleeps)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from joader.server.cpu_meter import JOB_BUSY_CORES, CpuMeter, _cpu_seconds, _with_parents

pytestmark = pytest.mark.timeout(60)


def test_the_host_is_busy_below_a_quarter_core_idle_and_a_job_busy_from_half_a_core() -> None:
    meter = CpuMeter()
    pids = {"train": {10, 11}, "gpu": {20}, "gone": {30}}
    assert meter.measure(100.0, 50.0, pids, {10: 1.0, 11: 0.0, 20: 5.0, 30: 1.0}) is None  # first reading
    # 2 s later: 0.4 idle core-seconds (0.2 cores idle: busy); train used 0.9 + 0.3 of 2 s (0.6
    # cores), gpu 0.1 s, gone vanished (not counted), 40 appeared (no baseline: not counted).
    verdict = meter.measure(102.0, 50.4, pids | {"new": {40}}, {10: 1.9, 11: 0.3, 20: 5.1, 40: 9.0})
    assert verdict == (True, {"train"})
    verdict = meter.measure(104.0, 51.4, pids, {10: 2.1, 11: 0.3, 20: 5.2})  # 0.5 cores idle; train 0.1 cores
    assert verdict == (False, set())


def test_a_spinning_process_is_busy_and_a_sleeping_one_is_not() -> None:
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        meter = CpuMeter()
        pids = _with_parents({"spin": {spin.pid}, "sleep": {sleep.pid}})
        assert spin.pid in pids["spin"] and sleep.pid in pids["sleep"]
        everyone = set().union(*pids.values())
        start, before = time.monotonic(), _cpu_seconds(everyone)
        meter.measure(start, psutil.cpu_times().idle, pids, before)
        time.sleep(1.5)
        end, after = time.monotonic(), _cpu_seconds(everyone)
        verdict = meter.measure(end, psutil.cpu_times().idle, pids, after)
        assert verdict is not None and "sleep" not in verdict[1]
        spun = (after[spin.pid] - before[spin.pid]) / (end - start)
        assert spun > 0.05  # it ran, however loaded the machine (a loaded one gives it less than a core)
        used = sum(after[p] - before[p] for p in pids["spin"] if p in before and p in after) / (end - start)
        assert ("spin" in verdict[1]) == (used >= JOB_BUSY_CORES)
    finally:
        for proc in (spin, sleep):
            proc.kill()
            proc.wait()
