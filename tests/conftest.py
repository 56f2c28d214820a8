"""Fixtures for every test: nothing may be left behind in /dev/shm or as a child process."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

SHM_DIR = Path("/dev/shm")

# NOTE [ Rewritten test modules are cached ]
# pytest rewrites each test module's asserts and caches the result beside it as a .pyc, unless
# sys.dont_write_bytecode (PYTHONDONTWRITEBYTECODE, set on this machine): then every pytest
# process rewrote all of them again, about 3 CPU-s each (`make test` starts four). Only this
# process writes them; the processes the tests start keep the environment's setting.
sys.dont_write_bytecode = False


def joader_segments() -> set[str]:
    """This user's joader arenas in /dev/shm."""
    return {p.name for p in SHM_DIR.glob(f"joader-{os.getuid()}-*")}


def _live_parents() -> dict[int, int]:
    """pid -> parent pid of every live (non-zombie) process, read from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    return parents


def _state(pid: int) -> str | None:
    """A process's state letter ("Z": a zombie), None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


# NOTE [ Children from the children lists ]
# Every test asks for this process's children twice or more (before, after, while it waits for
# them to exit). Reading every process's /proc/PID/stat for that cost 3-7 ms a time with 100-200
# processes on the machine, some 40 CPU-seconds over `make test`; each of this process's threads'
# /proc/self/task/TID/children lists its children (a child outlives the thread that forked it:
# it then moves to another of the group's threads), so only those few files are read, and each
# child's state. The whole table (`_live_parents`) is read only when a new segment appeared.
def child_pids(parent: int) -> set[int]:
    """Live (non-zombie) children of `parent`, from its threads' children lists."""
    children: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{parent}/task").iterdir())
    except OSError:
        return set()
    for task in tasks:
        try:
            children.update(map(int, (task / "children").read_text().split()))
        except OSError:
            continue
    return {pid for pid in children if _state(pid) not in (None, "Z")}


def _creator(segment: str) -> int:
    return int(segment.split("-")[2])


def _descends(pid: int, parents: dict[int, int]) -> bool:
    while pid in parents:
        if pid == os.getpid():
            return True
        pid = parents[pid]
    return False


def _ours(segment: str, parents: dict[int, int], seen_ours: set[int] | None) -> bool:
    """Whether a segment is this test's: its creator is a descendant of this process, or dead.

    A live joaderd that is not ours (another checkout's, on a shared machine) is left alone.
    Under pytest-xdist (`seen_ours` given) a dead creator is ours only if it was seen alive as a
    descendant of this process during the test: see NOTE [ Leftovers under pytest-xdist ].
    """
    pid = _creator(segment)
    if _descends(pid, parents):
        return True
    if pid in parents:
        return False
    return seen_ours is None or pid in seen_ours


# NOTE [ Leftovers under pytest-xdist ]
# `make test` runs the suite in several pytest processes at once. A joaderd another worker's
# test killed on purpose leaves its segment until the next joaderd start removes it (stale
# arenas are removed at start-up), and by the rule "a dead creator's segment is ours" this test
# would be blamed for it. So while a test runs, a thread notes every joaderd segment whose
# creator is a descendant of this process; after it, a dead creator's segment counts only if it
# was noted. A joaderd that lived less than one polling period is missed: its leak is then left
# to the single-process run (`pytest tests`) to catch, never blamed on another test.
_POLL_S = 0.2


class _Watcher(threading.Thread):
    """Notes the creators of joader segments that descend from this process, until stopped."""

    def __init__(self) -> None:
        super().__init__(name="no-leftovers-watch", daemon=True)
        self.ours: set[int] = set()
        self._looked_at: set[int] = set()  # a live creator's ancestry does not change: once is enough
        self._stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stop_event.wait(_POLL_S):
            self.look()

    def look(self) -> None:
        creators = {_creator(s) for s in joader_segments()} - self._looked_at
        if creators:
            parents = _live_parents()
            self.ours |= {pid for pid in creators if _descends(pid, parents)}
            self._looked_at |= {pid for pid in creators if pid in parents}  # a dead one: not ours

    def stop(self) -> set[int]:
        self._stop_event.set()
        self.join()
        self.look()
        return self.ours


@pytest.fixture(autouse=True)
def no_leftovers() -> object:
    """Fails a test that leaves joader segments in /dev/shm or child processes running."""
    segments_before = joader_segments()
    children_before = child_pids(os.getpid())
    watcher = _Watcher() if os.environ.get("PYTEST_XDIST_WORKER") else None
    yield
    seen_ours = watcher.stop() if watcher else None
    deadline = time.monotonic() + 15
    while True:
        new_segments = joader_segments() - segments_before
        parents = _live_parents() if new_segments else {}  # NOTE [ Children from the children lists ]
        segments = {s for s in new_segments if _ours(s, parents, seen_ours)}
        children = child_pids(os.getpid()) - children_before
        if not segments and not children:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for name in segments:
        (SHM_DIR / name).unlink(missing_ok=True)
    pytest.fail(f"test left behind shared memory {sorted(segments)} and/or processes {sorted(children)}")
