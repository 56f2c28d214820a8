"""A cache, a scheduler and a job table over one small source, without a registry: what the
tests of server/registry/jobs.py and server/scheduling/scheduler.py drive directly."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from joader.server.books.item_cache import ItemCache
from joader.server.books.records import Source
from joader.server.registry.jobs import JobTable
from joader.server.scheduling.scheduler import Scheduler

ITEM_BYTES = 192
STAGE = SimpleNamespace(name="center-crop:8", size=8,
                        spec=SimpleNamespace(shape=(3, 8, 8), dtype="uint8", max_nbytes=ITEM_BYTES))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def books(num_items: int = 40, slots: int = 200, lease_s: float = 5.0, max_jobs: int = 8,
          rank_attach_timeout_s: float = 60.0) -> tuple[JobTable, Scheduler, Source, Clock]:
    listing = SimpleNamespace(paths=tuple(f"{i}.jpg" for i in range(num_items)),
                              labels=np.zeros(num_items, dtype=np.int32))
    source = Source("demo", listing, STAGE, 0, seed=1)
    clock = Clock()
    cache = ItemCache(slots * ITEM_BYTES, retry_failed_s=60.0, clock=clock)
    scheduler = Scheduler(cache, clock)
    table = JobTable(cache, scheduler, lease_s=lease_s, max_jobs=max_jobs, clock=clock,
                     rank_attach_timeout_s=rank_attach_timeout_s)
    return table, scheduler, source, clock
