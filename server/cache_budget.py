"""The ledger of a user's auto-sized joaderds: who holds how much of their one budget.

`joaderd --cache-budget-dir DIR` (what auto-started servers get: DIR is the user's private
auto-start directory) sizes `--cache-size auto` against the live others (server/cache_sizing.py,
NOTE [ One budget for all of a user's auto-started servers ]). In DIR:

- `budget.lock`: an exclusive `flock` held while one server reads the ledger, sizes its arena,
  allocates it and records it, so that two servers starting at once never both count the same
  free bytes (the kernel drops the lock when its holder dies; the descriptor is close-on-exec
  and closed before the decode pool forks);
- `budget.json`: one entry per server: its pid, its process start time, its arena's bytes and
  path, what it serves. Written whole to a temp file and moved in place (`os.replace`), so a
  reader never sees half of it.

An entry counts only while its process lives: the pid AND its start time (psutil's
`create_time`) must match, since pids wrap and a pid recorded yesterday may be someone else's
now. A server that exits cleanly removes its entry (`CacheBudget.release`); one killed -9 leaves
it, and the next reader drops it.

DIR must be the user's own (`joader.private_dir`: created 0700 if missing, refused if it is a
symlink or someone else can write in it); its files are opened with O_NOFOLLOW and must be ours.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from joader.errors import CacheSpaceError, JoaderError
from joader.private_dir import flocked, open_private, private_dir, write_private

__all__ = ["BudgetClaim", "CacheBudget", "Holder", "LEDGER_NAME", "LOCK_NAME", "live_holders"]

logger = logging.getLogger(__name__)

LEDGER_NAME = "budget.json"
LOCK_NAME = "budget.lock"
LOCK_TIMEOUT_S = 120.0  # another server allocating a large arena holds the lock for seconds
_START_TIME_SLACK_S = 0.05  # create_time is in clock ticks (10 ms); the same process reads the same
ACCESS_DENIED = -1.0  # process_start_time of a process that runs but may not be looked at


@dataclass(frozen=True)
class Holder:
    """One server's entry: its process (pid and start time) and what it holds."""

    pid: int
    started: float  # psutil.Process(pid).create_time()
    arena_bytes: int
    arena: str
    what: str  # what it serves, for the refusal message: "photos (resize:512) at unix:/..."

    def describe(self) -> str:
        return f"pid {self.pid}: {self.what}"


def process_start_time(pid: int) -> float | None:
    """`pid`'s start time, or None if no such process runs (a zombie does not). A process we may
    not look at (another pid namespace's) counts as the recorded one: better to count a server
    twice than to let the budget go over."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.AccessDenied:
        return ACCESS_DENIED
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def live_holders(holders: list[Holder],
                 start_time: Callable[[int], float | None] = process_start_time) -> list[Holder]:
    """The entries whose process still runs: the same pid, started at the same time."""
    live = []
    for holder in holders:
        started = start_time(holder.pid)
        if started == ACCESS_DENIED or started is not None and abs(started - holder.started) <= _START_TIME_SLACK_S:
            live.append(holder)
    return live


class BudgetClaim:
    """What one start sees under the lock (`others`), and its own entry once recorded."""

    def __init__(self, others: list[Holder]) -> None:
        self.others = others
        self.mine: Holder | None = None

    def record(self, arena_bytes: int, arena: str, what: str) -> None:
        """This server's arena, written to the ledger when the claim ends."""
        pid = os.getpid()
        self.mine = Holder(pid, psutil.Process(pid).create_time(), arena_bytes, arena, what)


class CacheBudget:
    """The ledger in `directory` (the module docstring)."""

    def __init__(self, directory: Path, *, lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        self.directory = Path(directory)
        self.lock_timeout_s = lock_timeout_s
        self._recorded = False

    @contextlib.contextmanager
    def claim(self) -> Iterator[BudgetClaim]:
        """Holds the lock; yields the live others; writes the ledger (others + this server's entry,
        if recorded) as it lets go. Nothing is written if the body raises."""
        with self._locked():
            claim = BudgetClaim(live_holders(self._read()))
            yield claim
            entries = claim.others + ([claim.mine] if claim.mine is not None else [])
            self._write(entries)
            self._recorded = claim.mine is not None

    def release(self) -> None:
        """Removes this server's entry (at a clean exit); never raises."""
        if not self._recorded:
            return
        try:
            with self._locked():
                pid = os.getpid()
                self._write([h for h in live_holders(self._read()) if h.pid != pid])
            self._recorded = False
        except (OSError, JoaderError) as error:
            logger.warning("could not remove this server from the cache budget in %s: %s (the next "
                           "server drops the entry once this process is gone)", self.directory, error)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        private_dir(self.directory)  # NOTE [ Check the directory before anything is written in it ]
        path = self.directory / LOCK_NAME

        def timed_out(_fd: int) -> BaseException:
            return CacheSpaceError(
                f"another joaderd has held the cache budget's lock {path} for over {self.lock_timeout_s:g} s; "
                "see `joader servers`, or give --cache-size a size")

        with flocked(path, self.lock_timeout_s, timed_out):
            yield

    def _read(self) -> list[Holder]:
        path = self.directory / LEDGER_NAME
        try:
            fd = open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        with os.fdopen(fd, "rb") as file:
            raw = file.read()
        try:
            return [Holder(**entry) for entry in json.loads(raw)["servers"]]
        except (ValueError, TypeError, KeyError) as error:
            logger.warning("cache budget ledger %s is unreadable (%s); starting it afresh", path, error)
            return []

    def _write(self, holders: list[Holder]) -> None:
        data = json.dumps({"version": 1, "servers": [asdict(h) for h in holders]}, indent=1).encode()
        write_private(self.directory / LEDGER_NAME, data)
