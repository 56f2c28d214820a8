"""A process named by pid and start time (`joader.process_ref`): a recorded pid whose process
is gone, or was reused, is never signalled."""

from __future__ import annotations

import signal
import subprocess
import sys

from joader.process_ref import ProcessRef


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_it_round_trips_through_text() -> None:
    ref = ProcessRef.current()
    assert ProcessRef.parse(str(ref)) == ref and ref.is_running()


def test_another_process_under_the_same_pid_is_not_signalled() -> None:
    child = _sleeper()
    try:
        real = ProcessRef.of(child.pid)
        assert real is not None
        reused = ProcessRef(child.pid, real.start_ticks - 500)  # what a stale record of that pid looks like
        assert not reused.is_running()
        assert reused.send_signal(signal.SIGTERM) is False
        assert reused.stop(timeout_s=1) is True  # nothing to stop: the recorded process is gone
        assert child.poll() is None  # the process that has the pid now was left alone
        assert real.stop(timeout_s=10) is True
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


def test_an_ended_process_is_not_running_even_as_a_zombie() -> None:
    child = _sleeper()
    ref = ProcessRef.of(child.pid)
    assert ref is not None
    child.kill()
    assert ref.wait_gone(10)  # a zombie until reaped: it holds nothing
    child.wait()
    assert not ref.is_running() and ref.send_signal(signal.SIGTERM) is False
