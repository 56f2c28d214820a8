"""Helpers of the fault tests: run the client programs of `trust_clients` and read their JSON."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def client(address: str, command: str, *args: str, stdin: bool = False) -> subprocess.Popen[str]:
    """Starts `python -m tests.support.trust_clients COMMAND` in its own process group."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.trust_clients", command, "--address", address, *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
    )


def run_client(address: str, command: str, *args: str, timeout_s: float = 120) -> tuple[dict[str, Any], str]:
    """Runs a client program to its end; returns its last JSON line and its stderr."""
    proc = client(address, command, *args)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"client {command} did not finish within {timeout_s:g} s:\n{err}")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"client {command} exited {proc.returncode}:\n{out}\n{err}"
    return json.loads(lines[-1]), err


def read_line(proc: subprocess.Popen[str], timeout_s: float = 60) -> dict[str, Any]:
    """The client's next JSON line (polling its stdout with a deadline)."""
    import select

    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                return json.loads(line)
    err = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
    pytest.fail(f"no JSON line from client {proc.args} within {timeout_s:g} s (exit {proc.poll()}):\n{err}")


def end(proc: subprocess.Popen[str], timeout_s: float = 60) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"client {proc.args} did not end within {timeout_s:g} s:\n{err}")


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident (or, with field="VmHWM", peak resident) memory, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


def joader_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"joader-{os.getuid()}-*")}
