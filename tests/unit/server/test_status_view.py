"""joaderd's status: the registry's snapshot plus the daemon's own part (server/status_view.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from joader.server.cache_sizing import CacheSize
from joader.server.config import ServerConfig, SourceConfig
from joader.server.pool.records import PoolStats
from joader.server.status_view import StatusView

STATS = PoolStats(workers_configured=3, workers_alive=2, workers_busy=1, workers_replaced=4,
                  tasks_retried=5, tasks_timed_out=6, worker_pids=(11, 12), resizes=("workers 2 -> 3",),
                  suspects=7, quarantined=8, decode_timeout_s=9.5, quarantine_lifted=10)


class FakeRegistry:
    def __init__(self) -> None:
        self.extras: list[dict[str, Any]] = []

    def status(self, extra: dict[str, Any]) -> dict[str, Any]:
        self.extras.append(extra)
        return {"jobs": [], **extra}


def make_view(registry: FakeRegistry, **config: Any) -> StatusView:
    server_config = ServerConfig(sources=(SourceConfig("demo", Path("/data")),), **config)
    return StatusView(registry, SimpleNamespace(stats=lambda: STATS), server_config,  # type: ignore[arg-type]
                      "127.0.0.1:0", "/dev/shm/joader-x", CacheSize(1 << 20, 1 << 19, "the whole dataset"))


def test_the_daemons_part_names_its_workers_and_cache_sizing() -> None:
    extra = make_view(FakeRegistry(), cache_size_bytes=1 << 20, autoscale=False, max_workers=4).extra()
    assert extra["address"] == "127.0.0.1:0" and extra["arena_path"] == "/dev/shm/joader-x"
    assert extra["pid"] == os.getpid() and extra["num_workers"] == 3
    assert extra["workers"] == {
        "configured": 3, "alive": 2, "busy": 1, "replaced": 4, "tasks_retried": 5, "tasks_timed_out": 6,
        "pids": [11, 12], "mode": "fixed", "max": 4,
        "resizes": ["workers 2 -> 3"], "crash_loop": False, "restart_in_s": 0.0, "suspects": 7,
        "quarantined": 8, "quarantine_lifted": 10, "decode_timeout_s": 9.5,
    }
    assert extra["cache_sizing"] == {"mode": "fixed", "reason": "the whole dataset", "dataset_bytes": 1 << 19}


def test_the_full_status_is_the_registrys_with_the_daemons_part_and_the_port_once_known() -> None:
    registry = FakeRegistry()
    view = make_view(registry, cache_size_bytes=None, autoscale=True)
    view.address = "127.0.0.1:4321"  # joaderd sets it once the kernel chose the port
    full = view.full()
    assert [extra["address"] for extra in registry.extras] == ["127.0.0.1:4321"]
    assert full["address"] == "127.0.0.1:4321" and full["jobs"] == []
    assert full["cache_sizing"]["mode"] == "auto" and full["workers"]["mode"] == "auto"
