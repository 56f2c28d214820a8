"""joaderd's status as `joader status` shows it: the registry's snapshot plus the daemon's own part.

The registry composes what it keeps (server/registry/status.py); this adds what only the
daemon knows: its address and arena, the decode pool's workers, how the cache was sized, its
pid. The servicer's `Status` call reads `extra` (and hands it to the registry itself); the
autoscaler and /metrics read `full`. The schema is documented in docs/status.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from joader.server.cache_sizing import CacheSize
    from joader.server.config import ServerConfig
    from joader.server.fronts.fronts import Fronts
    from joader.server.pool.decode_pool import DecodePool
    from joader.server.registry.registry import Registry


@dataclass
class StatusView:
    """What joaderd's status is made of; `address` is set again once the port is known."""

    registry: Registry
    pool: DecodePool
    config: ServerConfig
    address: str
    arena_path: str
    cache_size: CacheSize
    fronts: Fronts | None = None  # set once serving (NOTE [ Next fronts ])

    def extra(self) -> dict[str, Any]:
        """The daemon's own part of the status."""
        stats = self.pool.stats()
        config = self.config
        return {
            "address": self.address,
            "arena_path": self.arena_path,
            "num_workers": stats.workers_configured,
            "fronts": self.fronts.status() if self.fronts is not None else [],
            "workers": {
                "configured": stats.workers_configured,
                "alive": stats.workers_alive,
                "busy": stats.workers_busy,
                "replaced": stats.workers_replaced,
                "tasks_retried": stats.tasks_retried,
                "tasks_timed_out": stats.tasks_timed_out,
                "pids": list(stats.worker_pids),
                "mode": "auto" if config.autoscale else "fixed",
                "max": config.max_workers,
                "resizes": list(stats.resizes),
                "crash_loop": stats.crash_loop,
                "restart_in_s": stats.restart_in_s,
                "suspects": stats.suspects,
                "quarantined": stats.quarantined,
                "quarantine_lifted": stats.quarantine_lifted,
                "decode_timeout_s": stats.decode_timeout_s,  # in force (auto: from measured decodes)
            },
            "cache_sizing": {
                "mode": "fixed" if config.cache_size_bytes is not None else "auto",
                "reason": self.cache_size.reason,
                "dataset_bytes": self.cache_size.dataset_bytes,
            },
            "pid": os.getpid(),
        }

    def full(self) -> dict[str, Any]:
        """What `joader status` shows: the registry's snapshot with `extra` in it."""
        return self.registry.status(self.extra())
