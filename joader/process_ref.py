"""A process named by its pid AND its start time, so that a recorded pid is never someone else's.

PIDs wrap (on a busy host within the hour): a pid written in a ready file or kept by a driver may
belong to another process by the time it is used. `ProcessRef` keeps the process's start time
beside the pid, as the kernel counts it: clock ticks since boot (/proc/PID/stat's field 22), fixed
for the process's life and, unlike a wall-clock start time (psutil's `create_time`, computed from
the boot time, which moves when the clock is stepped), never off by a second. `send_signal` opens
a pidfd first and checks the start through it, so the signal reaches the process that was
recorded or nobody (a pidfd keeps naming its process even if the pid is reused after the check).

`pid_alive` is the plain check where only a pid is known (the pid in an arena's file name, whose
flock proves the rest: `joader.cache.arena.remove_stale_arenas`).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from dataclasses import dataclass

__all__ = ["ProcessRef", "pid_alive"]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start ticks) of process `pid`, or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except (OSError, ValueError):
        return None
    # after the command's closing parenthesis: field 3 (state) is [0], field 22 (starttime) [19]
    return fields[0].decode(), int(fields[19])


@dataclass(frozen=True)
class ProcessRef:
    """Process `pid`, started `start_ticks` clock ticks after boot."""

    pid: int
    start_ticks: int

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        """The process that has `pid` now, or None if there is none (or only its zombie)."""
        found = _stat(pid) if pid > 0 else None
        return cls(pid, found[1]) if found is not None and found[0] != "Z" else None

    @classmethod
    def current(cls) -> ProcessRef:
        ref = cls.of(os.getpid())
        assert ref is not None
        return ref

    @classmethod
    def parse(cls, text: str) -> ProcessRef:
        """From `str(ref)`: "PID:START_TICKS"."""
        pid, _, start = text.partition(":")
        try:
            return cls(int(pid), int(start))
        except ValueError:
            raise ValueError(f"{text!r} is not PID:START_TICKS") from None

    def __str__(self) -> str:
        return f"{self.pid}:{self.start_ticks}"

    def is_running(self) -> bool:
        """Whether this very process still runs (a zombie does not: it holds nothing)."""
        return self.of(self.pid) == self

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


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not: it holds nothing)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """A process that exited and was not reaped yet (its parent never waited): it holds nothing,
    and a server killed -9 by its starter's child stays one as long as the starter lives."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[:1] == [b"Z"]
    except OSError:
        return False
