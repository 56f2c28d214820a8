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


def child_pids(parent: int) -> set[int]:
    """Live (non-zombie) children of `parent`, read from /proc."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            children.add(int(stat.parent.name))
    return children


@pytest.fixture(autouse=True)
def no_leftovers() -> object:
    """Fails a test that leaves joader segments in /dev/shm or child processes running."""
    segments_before = joader_segments()
    children_before = child_pids(os.getpid())
    yield
    deadline = time.monotonic() + 15
    while True:
        segments = joader_segments() - segments_before
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
