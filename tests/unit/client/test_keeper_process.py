"""The lease keeper process itself (`joader.client.keeper_process`): what it sends joaderd."""

from __future__ import annotations

import threading

from joader.client import keeper_process


def test_the_first_request_carries_the_order() -> None:
    """A lease keeper's first message, also when it attaches again after a restart: the
    job's order travels with it (joaderd refuses a rank whose order differs from its job's)."""
    base = {"source": "demo", "indices": "", "name": "j"}
    stop = threading.Event()
    first = next(keeper_process._requests(base | {"order": "independent"}, stop, [1.0]))
    assert first.order == "independent"
    assert next(keeper_process._requests(base, stop, [1.0])).order == "shared"
