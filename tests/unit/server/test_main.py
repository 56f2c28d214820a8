"""joaderd's glue (server/main.py) that needs no server: the idle thread stops serving once the
registry says so. A real joaderd runs in tests/integration/test_unattended.py."""

from __future__ import annotations

import logging
import threading

import pytest

from joader.server import main as main_module

pytestmark = pytest.mark.timeout(30)


class _Registry:
    """Says "idle for 2.0 s" at its third question."""

    def __init__(self) -> None:
        self.asked = 0

    def exit_if_idle(self) -> float | None:
        self.asked += 1
        return 2.04 if self.asked == 3 else None


def test_the_idle_thread_stops_serving_once_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    registry, stopping, stops = _Registry(), threading.Event(), []
    with caplog.at_level(logging.INFO, logger="joader.server"):
        main_module._exit_when_idle(registry, 0.5, stopping, lambda: stops.append(1))  # type: ignore[arg-type]
    assert (registry.asked, stops) == (3, [1])
    assert "joaderd: no job for 2.0 s (--idle-exit-s); exiting" in caplog.text


def test_the_idle_thread_ends_with_joaderd() -> None:
    registry, stopping = _Registry(), threading.Event()
    stopping.set()
    main_module._exit_when_idle(registry, 600.0, stopping, lambda: pytest.fail("stopped"))  # type: ignore[arg-type]
    assert registry.asked == 0
