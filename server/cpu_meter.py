"""joaderd's CPU meter: whether every core of the host is busy, and which jobs' training processes
keep a core busy. A round may wait for a job behind only then (NOTE [ A leader waits only where it
costs the sweep nothing ] in server/scheduling/in_step.py).

A job's processes are the readers of its passes (their pids come with every `Next`) and their
parents: with DataLoader workers the readers are the workers and the training loop is their
parent; with `num_workers=0` the reader is the training process. A job is CPU-bound when those
processes used at least `JOB_BUSY_CORES` of a core over the period (a model trained on the CPU,
which on a crowded host gets well under a core); a job that sleeps on a GPU step uses a few percent. The host is busy when fewer than
`HOST_IDLE_CORES` of its cores were idle over the period.

`CpuMeter.measure` is pure (readings in, verdicts out); `run` is the `joaderd-cpu` thread, which
reads /proc through psutil once a second.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import psutil

logger = logging.getLogger(__name__)

PERIOD_S = 1.0
HOST_IDLE_CORES = 0.25
JOB_BUSY_CORES = 0.25  # three CPU-bound jobs beside decoders on 2 cores get about half a core each


class CpuMeter:
    """Turns successive readings into (host busy, CPU-bound jobs)."""

    def __init__(self) -> None:
        self._last: tuple[float, float, dict[int, float]] | None = None

    def measure(self, now_s: float, idle_s: float, job_pids: dict[str, set[int]],
                cpu_s: dict[int, float]) -> tuple[bool, set[str]] | None:
        """`idle_s`: the host's idle CPU seconds so far; `job_pids`: each job's processes;
        `cpu_s`: CPU seconds so far of every process read now. None at the first reading."""
        last, self._last = self._last, (now_s, idle_s, dict(cpu_s))
        if last is None or now_s <= last[0]:
            return None
        then_s, then_idle, then_cpu = last
        span = now_s - then_s
        host_busy = (idle_s - then_idle) / span < HOST_IDLE_CORES
        busy: set[str] = set()
        for job_id, pids in job_pids.items():
            used = sum(cpu_s[pid] - then_cpu[pid] for pid in pids if pid in cpu_s and pid in then_cpu)
            if used / span >= JOB_BUSY_CORES:
                busy.add(job_id)
        return host_busy, busy


def _with_parents(job_pids: dict[str, set[int]]) -> dict[str, set[int]]:
    mine = os.getpid()
    out: dict[str, set[int]] = {}
    for job_id, pids in job_pids.items():
        found = set()
        for pid in pids:
            found.add(pid)
            try:
                parent = psutil.Process(pid).ppid()
            except (psutil.Error, OSError):
                continue
            if parent > 1:
                found.add(parent)
        out[job_id] = found - {mine}
    return out


def _cpu_seconds(pids: set[int]) -> dict[int, float]:
    cpu: dict[int, float] = {}
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.Error, OSError):
            continue
        cpu[pid] = times.user + times.system
    return cpu


def run(job_pids: Callable[[], dict[str, set[int]]], report: Callable[[bool, set[str]], None],
        stop: threading.Event, clock: Callable[[], float]) -> None:
    """The `joaderd-cpu` thread: every `PERIOD_S`, measure and `report(host_busy, busy_jobs)`."""
    meter = CpuMeter()
    while not stop.wait(PERIOD_S):
        pids = _with_parents(job_pids())
        everyone = set().union(*pids.values()) if pids else set()
        verdict = meter.measure(clock(), psutil.cpu_times().idle, pids, _cpu_seconds(everyone))
        if verdict is not None:
            report(*verdict)
