"""A process named by its pid AND its start time, so that a recorded pid is never someone else's.

PIDs wrap (on a busy host within the hour): a pid written in a ready file or kept by a driver may
belong to another process by the time it is used. `ProcessRef` keeps the start time the kernel
reports (`psutil.Process.create_time`, from /proc/PID/stat's start ticks: fixed for a process's
life) beside the pid, and `send_signal` opens a pidfd first and checks the start time through it,
so the signal reaches the process that was recorded or nobody (a pidfd keeps naming its process
even if the pid is reused after the check).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from dataclasses import dataclass

import psutil

__all__ = ["ProcessRef"]

_SAME_START_S = 0.01  # create_time is computed from clock ticks: equal for one process


@dataclass(frozen=True)
class ProcessRef:
    """Process `pid`, started at `start_time` (seconds since the epoch, as psutil gives it)."""

    pid: int
    start_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        """The process that has `pid` now, or None if there is none."""
        try:
            return cls(pid, psutil.Process(pid).create_time())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, ValueError):
            return None

    @classmethod
    def current(cls) -> ProcessRef:
        ref = cls.of(os.getpid())
        assert ref is not None
        return ref

    @classmethod
    def parse(cls, text: str) -> ProcessRef:
        """From `str(ref)`: "PID:START_TIME"."""
        pid, _, start = text.partition(":")
        try:
            return cls(int(pid), float(start))
        except ValueError:
            raise ValueError(f"{text!r} is not PID:START_TIME") from None

    def __str__(self) -> str:
        return f"{self.pid}:{self.start_time!r}"

    def is_running(self) -> bool:
        """Whether this very process still runs (a zombie does not: it holds nothing)."""
        try:
            process = psutil.Process(self.pid)
            same = abs(process.create_time() - self.start_time) < _SAME_START_S
            return same and process.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        except psutil.AccessDenied:
            return True

    def send_signal(self, sig: int) -> bool:
        """Sends `sig` to this process if it still runs; False if it does not (nothing sent)."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return False
        try:
            if not self.is_running():  # checked after the pidfd pins the process
                return False
            signal.pidfd_send_signal(pidfd, sig)
            return True
        except ProcessLookupError:
            return False
        finally:
            os.close(pidfd)

    def wait_gone(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Waits up to `timeout_s` for this process to end; whether it did."""
        deadline = time.monotonic() + timeout_s
        pidfd = None
        with contextlib.suppress(ProcessLookupError):
            pidfd = os.pidfd_open(self.pid)
        try:
            while self.is_running():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if pidfd is not None:
                    select.select([pidfd], [], [], min(left, poll_s))  # readable once it exits
                else:
                    time.sleep(min(left, poll_s))
            return True
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def stop(self, timeout_s: float = 30.0) -> bool:
        """SIGTERM, then SIGKILL after `timeout_s`; whether this process is gone (True also when
        it had already ended: then nothing was sent)."""
        if not self.send_signal(signal.SIGTERM):
            return True
        if self.wait_gone(timeout_s):
            return True
        self.send_signal(signal.SIGKILL)
        return self.wait_gone(5.0)
