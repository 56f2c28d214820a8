"""Test fault injection is a named hook (server/fault_hooks.py), armed once from the environment."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from joader.server import fault_hooks


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    yield
    fault_hooks.arm({})


def test_nothing_is_armed_without_the_variable() -> None:
    assert fault_hooks.arm({}) == ""
    for point in fault_hooks.POINTS:
        fault_hooks.reached(point)  # no raise


@pytest.mark.parametrize("point", fault_hooks.POINTS)
def test_only_the_armed_point_raises_and_names_the_variable(point: str) -> None:
    assert fault_hooks.arm({fault_hooks.FAULT_ENV: point}) == point
    for other in fault_hooks.POINTS:
        if other != point:
            fault_hooks.reached(other)
    with pytest.raises(RuntimeError, match=f"fault injected by JOADERD_INJECT_FAULT={point}"):
        fault_hooks.reached(point)


def test_an_unknown_point_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    assert fault_hooks.arm({fault_hooks.FAULT_ENV: "nowhere"}) == ""
    assert "'nowhere' is not a known fault; ignored" in caplog.text
    for point in fault_hooks.POINTS:
        fault_hooks.reached(point)
