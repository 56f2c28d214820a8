"""Adaptive decode workers (`joaderd --workers auto`, the default): A-Dloader's knob for a shared pool.

A fixed pool of decode workers is wrong both ways on a shared host. Too few, and jobs stall on
data while cores sit idle; too many (every CPU), and while the jobs are
compute-bound, the decode bursts take cores from the training processes they serve. So joaderd
measures every `period_s` and moves the pool one worker at a time:

- **grow** when some job is prep-bound (its training loop waited for data for `grow_stall` or
  more of the period; for a job read through DataLoader workers, which cannot measure its loop,
  when its requests waited in joaderd for `grow_stall` of the period), the workers are the
  bottleneck (busy for `busy_to_grow` of their time: otherwise more of them would not help), and
  the host has at least `idle_cores_to_grow` idle cores for the new one, unless the job waits
  `grow_now_stall` (a third) of its time or more: it then computes little, and the new worker's
  CPU comes from other work on the host, not from the jobs (NOTE [ Growing on a busy host ]);
- **shrink** when no job is prep-bound, and the work of the period would still fit one worker
  fewer at `busy_to_shrink` of their time (so decoding keeps up, with headroom for bursts);
  an idle joaderd (no jobs reading) shrinks to `min_workers`.

Hysteresis: a condition must hold for `patience` periods in a row, and after a change nothing
moves for `cooldown_s` (the jobs need time to show its effect). One exception: a job that waits
`grow_now_stall` (a third) of its time or more on workers that are all busy grows the pool at
the first period that shows it. That is the start of every run (an empty cache, every job
wanting its first batches): with patience, four jobs on 2 cores got their second worker 2 s
later, a quarter into an 8 s run (`bench/system/four_jobs.py --server-workers auto --no-barrier`),
while a worker too many costs one process until the cooldown lets it go. Bounds: `min_workers` ..
`max_workers` (default 1 .. the CPUs joaderd may use). Every change is logged with its reason
and shown by `joader status` / `joader top` (the pool's resize log).

Pure logic: `Autoscaler.decide` takes one period's measurements and the time; joaderd's
`joaderd-autoscale` thread does the measuring (status snapshots, host CPU from psutil) and
calls `DecodePool.resize`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AutoscaleConfig:
    min_workers: int = 1
    max_workers: int = 2
    period_s: float = 2.0
    grow_stall: float = 0.10
    busy_to_grow: float = 0.80
    grow_now_stall: float = 0.33  # a stall this long (and the rest of the grow rule) needs no patience
    idle_cores_to_grow: float = 0.3
    busy_to_shrink: float = 0.60
    patience: int = 2
    cooldown_s: float = 6.0


@dataclass(frozen=True)
class Period:
    """What one period measured."""

    duration_s: float
    workers: int  # the pool's size during the period
    busy_s: float  # decode workers' busy seconds in the period (all workers together)
    idle_cores: float  # the host's idle CPU, in cores, averaged over the period
    jobs_reading: int  # jobs that received items in the period
    stalls: tuple[float, ...] = ()  # per job with a measured stall: wait / (wait + step) in the period
    server_waits: tuple[float, ...] = ()  # per job without one: share of the period its requests waited


@dataclass
class Autoscaler:
    config: AutoscaleConfig
    workers: int
    _streak: tuple[str, int] = ("", 0)  # the direction that held, and for how many periods
    _last_change_s: float = field(default=-1e18)

    def decide(self, now_s: float, period: Period) -> tuple[int, str] | None:
        """The new pool size and why, or None to keep it."""
        config = self.config
        self.workers = period.workers
        busy = period.busy_s / (period.duration_s * max(1, period.workers)) if period.duration_s > 0 else 0.0
        waiting = max((*period.stalls, *period.server_waits), default=0.0)
        direction, reason = "", ""
        if period.jobs_reading == 0:
            if self.workers > config.min_workers:
                direction, reason = "shrink", "no job is reading"
        elif waiting >= config.grow_stall:
            # A job that waits a third of its time for data computes little meanwhile: the CPU a
            # new worker takes then comes from whatever else runs on the host (at the kernel's fair
            # share), not from the jobs it serves, so idle cores are not asked for (NOTE [ Growing
            # on a busy host ]).
            if (self.workers < config.max_workers and busy >= config.busy_to_grow
                    and (period.idle_cores >= config.idle_cores_to_grow or waiting >= config.grow_now_stall)):
                direction = "grow"
                reason = (f"a job waits {waiting:.0%} of its time for data, workers busy {busy:.0%}, "
                          f"{period.idle_cores:.1f} cores idle")
        elif self.workers > config.min_workers:
            needed = busy * self.workers / (self.workers - 1)
            if needed <= config.busy_to_shrink:
                direction = "shrink"
                reason = (f"jobs are compute-bound (stall at most {waiting:.0%}); {self.workers - 1} "
                          f"worker(s) would be {needed:.0%} busy")
        streak = self._streak[1] + 1 if direction and direction == self._streak[0] else (1 if direction else 0)
        self._streak = (direction, streak)
        patience = 1 if direction == "grow" and waiting >= config.grow_now_stall else config.patience
        if not direction or streak < patience or now_s - self._last_change_s < config.cooldown_s:
            return None
        self._streak = ("", 0)
        self._last_change_s = now_s
        self.workers += 1 if direction == "grow" else -1
        return self.workers, reason


# NOTE [ Growing on a busy host ]
# The grow rule once asked for idle cores in every case, so that a worker would never take a core
# from compute-bound jobs. On a host that other work keeps busy (another tenant, a build) the host
# never shows an idle core, and four jobs that waited 55-70% of their time for data stayed at one
# worker for the whole run (issue 29: bench/system/four_jobs.py at a 0.04 s step, 0 resizes, 38% of the
# ideal, where a fixed pool of 2 gave 68-74%; a second worker that came only when the other work
# paused). A job waiting a third of its time or more is not compute-bound: a new worker's CPU then
# comes from the other work at the kernel's fair share, as a fixed pool's would. Below a third,
# where the jobs compute most of the time, growth still needs idle cores.


_NEW_JOB: dict[str, Any] = {"items_delivered": 0, "stall_total": {"wait_s": 0.0, "step_s": 0.0}, "server_wait_s": 0.0}


class PeriodMeter:
    """Turns successive status snapshots (and the host's idle CPU seconds) into `Period`s."""

    def __init__(self) -> None:
        self._last: tuple[float, float, dict[str, Any]] | None = None

    def measure(self, now_s: float, idle_cpu_s: float, status: dict[str, Any]) -> Period | None:
        """The period since the previous call (None on the first)."""
        last, self._last = self._last, (now_s, idle_cpu_s, status)
        if last is None:
            return None
        then_s, then_idle, before = last
        duration = now_s - then_s
        if duration <= 0:
            return None
        old = {job["job_id"]: job for job in before["jobs"]}
        stalls, waits, reading = [], [], 0
        for job in status["jobs"]:
            # A job that came during the period counts from its start: its first batches are
            # when it waits most, and skipping them delayed a needed worker by a period.
            prior = old.get(job["job_id"]) or _NEW_JOB
            if job["items_delivered"] == prior["items_delivered"]:
                continue
            reading += 1
            wait = job["stall_total"]["wait_s"] - prior["stall_total"]["wait_s"]
            step = job["stall_total"]["step_s"] - prior["stall_total"]["step_s"]
            if wait + step > 0:
                stalls.append(wait / (wait + step))
            else:  # read through DataLoader workers: how long its requests waited in joaderd
                waits.append(min(1.0, (job["server_wait_s"] - prior["server_wait_s"]) / duration))
        return Period(
            duration_s=duration,
            workers=int(status["workers"]["configured"]),
            busy_s=status["decodes"]["decode_s"] - before["decodes"]["decode_s"],
            idle_cores=(idle_cpu_s - then_idle) / duration,
            jobs_reading=reading,
            stalls=tuple(stalls),
            server_waits=tuple(waits),
        )
