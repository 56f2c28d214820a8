"""The scheduler thread's loop: `after_work` runs after each turn that ran rounds, only then."""

from __future__ import annotations

import threading

import pytest

from joader.server.registry.scheduler_thread import SchedulerThread


class Turns(SchedulerThread):
    """A scheduler thread whose turns are scripted: True (ran rounds) or False (no work)."""

    def __init__(self, turns: list[bool]) -> None:
        self._cond = threading.Condition()
        self._stopped = False
        self.turns = turns
        self.calls: list[str] = []

    def _schedule(self) -> bool:
        if not self.turns:
            self._stopped = True
            return False
        worked = self.turns.pop(0)
        self.calls.append("worked" if worked else "idle")
        return worked


def test_after_work_follows_each_working_turn_under_the_lock() -> None:
    thread = Turns([True, False, True, True])
    seen: list[bool] = []

    def after_work() -> None:
        seen.append(thread._cond._is_owned())  # type: ignore[attr-defined]
        thread.calls.append("after")

    thread._cond.wait = lambda timeout=None: True  # type: ignore[method-assign]  # no 0.25 s idle wait
    thread.run_scheduler(after_work)
    assert thread.calls == ["worked", "after", "idle", "worked", "after", "worked", "after"]
    assert seen == [True, True, True]


def test_a_raising_after_work_ends_the_thread_with_the_error() -> None:
    thread = Turns([False, True, True])
    thread._cond.wait = lambda timeout=None: True  # type: ignore[method-assign]

    def fault() -> None:
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        thread.run_scheduler(fault)
    assert thread.turns == [True]  # it raised after the first working turn
