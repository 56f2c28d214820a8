"""Next fronts (NOTE [ Next fronts ] in server/fronts/__init__.py): jobs on every route a call
takes to a front read through `--fronts 2` and get the right samples (pixels and label against a decode made
here, every epoch exactly once); a front killed -9 under running jobs stops joaderd (exit 70,
its log naming the front), and the jobs resume exactly on a restarted one; nothing is left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from joader.process_ref import pid_alive
from tests.integration.test_restart_integrity import MODES, _check, _samples, _start, _subset
from tests.support.processes import wait_for

pytestmark = pytest.mark.timeout(240)


def _fronts(server: Any) -> list[dict[str, Any]]:
    return wait_for(lambda: (f := server.status()["fronts"]) and all(x["ready"] for x in f) and f, 30,
                    "the fronts to listen")


def _gone(fronts: list[dict[str, Any]]) -> bool:
    return not any(pid_alive(f["pid"]) for f in fronts) and not any(
        os.path.exists(f["address"].removeprefix("unix:")) for f in fronts)


# The client paths that reach a front differently: the training process's own calls (plain, and
# batched replies), DataLoader workers each with a channel of their own, and hand-off workers.
# (The other modes differ only in what the client does with a reply: test_restart_integrity.)
ROUTES = {name: MODES[name] for name in ("plain", "batched", "workers", "handoff")}


def test_every_route_reads_the_right_samples_through_fronts(demo_root: Path, start_joaderd: Any,
                                                            expected: dict[int, Any]) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=48, extra=["--fronts", "2"])
    fronts = _fronts(server)
    assert len(fronts) == 2
    jobs = {name: _start(server, name, indices, options, 2, 0.02) for name, (indices, options) in ROUTES.items()}
    findings = _check(server.dir, jobs, {n: _subset(i) for n, (i, _) in ROUTES.items()}, dict.fromkeys(jobs, 2), expected)
    print(findings.summary())
    calls = [f["calls"] for f in server.status()["fronts"]]
    assert all(c > 0 for c in calls), f"each front relays some job's calls: {calls}"
    assert server.stop() == 0
    wait_for(lambda: _gone(fronts), 10, "the fronts to exit and remove their sockets")


def test_a_front_killed_under_jobs_stops_joaderd_and_the_jobs_resume_exactly(
        demo_root: Path, start_joaderd: Any, expected: dict[int, Any]) -> None:
    """Its replies in flight may be lost after joaderd dealt their items; only a restart (the
    keepers attach again with what the readers consumed) deals them again."""
    server = start_joaderd({"demo": demo_root}, cache_items=48, extra=["--fronts", "2"])
    home = server.dir
    fronts = _fronts(server)
    chosen = {n: MODES[n] for n in ("plain", "handoff")}
    jobs = {name: _start(server, name, indices, options, 2, 0.05) for name, (indices, options) in chosen.items()}
    wait_for(lambda: all(_samples(home, name) >= 24 for name in jobs), 90, "every job's first batches")
    server.expected_exit_code = 70
    os.kill(fronts[0]["pid"], signal.SIGKILL)
    assert server.proc.wait(timeout=20) == 70
    assert f"Next front 0 (pid {fronts[0]['pid']}) exited" in server.log()
    wait_for(lambda: _gone(fronts), 10, "the other front to exit with joaderd")
    time.sleep(0.5)
    server = start_joaderd.restart(server)
    _check(home, jobs, {n: _subset(i) for n, (i, _) in chosen.items()}, dict.fromkeys(jobs, 2), expected)


def test_fronts_exit_with_a_joaderd_killed_9(demo_root: Path, start_joaderd: Any) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=48, extra=["--fronts", "2"])
    fronts = _fronts(server)
    server.expected_exit_code = -signal.SIGKILL
    server.proc.kill()
    server.proc.wait()
    wait_for(lambda: _gone(fronts), 10, "the fronts to see their links close, exit and remove their sockets")
    # A killed joaderd's arena is its successor's to remove (tested elsewhere); any joaderd of a
    # parallel test may have removed it already (stale arenas are swept at start and a few times after).
    Path(server.arena_path).unlink(missing_ok=True)
