"""Fixtures for every test: nothing may be left behind in /dev/shm or as a child process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

SHM_DIR = Path("/dev/shm")


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


def child_pids(parent: int) -> set[int]:
    """Live (non-zombie) children of `parent`."""
    return {pid for pid, ppid in _live_parents().items() if ppid == parent}


def _ours(segment: str, parents: dict[int, int]) -> bool:
    """Whether a segment is this test's: its creator is dead, or a descendant of this process.

    A live joaderd that is not ours (another checkout's, on a shared machine) is left alone.
    """
    pid = int(segment.split("-")[2])
    while pid in parents:
        if pid == os.getpid():
            return True
        pid = parents[pid]
    return int(segment.split("-")[2]) not in parents


@pytest.fixture(autouse=True)
def no_leftovers() -> object:
    """Fails a test that leaves joader segments in /dev/shm or child processes running."""
    segments_before = joader_segments()
    children_before = child_pids(os.getpid())
    yield
    deadline = time.monotonic() + 15
    while True:
        parents = _live_parents()
        segments = {s for s in joader_segments() - segments_before if _ours(s, parents)}
        children = {pid for pid, ppid in parents.items() if ppid == os.getpid()} - children_before
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
