"""Status from counters (issue 37): `Registry.status` is O(jobs), never a walk of the cached
items under the lock (0.58 s with 128k cached, and the autoscaler asks every 2 s); its figures
equal a recomputation from scratch after random operations."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pyroaring import BitMap

from joader.server.books.records import ItemState
from joader.server.registry.registry import Registry
from tests.support.registry_driver import NUM_ITEMS, attach, make_registry, nxt, pump

pytestmark = pytest.mark.timeout(60)


class RefusingItems(dict):  # type: ignore[type-arg]
    """A cache's items that refuse to be walked (a lookup by key is fine)."""

    def _refuse(self, *args: object) -> Any:
        raise AssertionError("status walked the cache's items")

    __iter__ = values = items = keys = _refuse  # type: ignore[assignment]


def from_scratch(registry: Registry) -> dict[str, Any]:
    """The figures status gives, recomputed by walking every item and job."""
    items = list(dict.values(registry.cache.items))
    jobs = registry.jobs.jobs.values()
    return {
        "items": sum(1 for i in items if i.state is ItemState.READY),
        "items_bytes": sum(i.nbytes for i in items if i.state is ItemState.READY),
        "pinned_items": sum(1 for i in items if i.pins),
        "pins": sum(i.pins for i in items),
        "in_flight": sum(1 for i in items if not i.state.settled),
        "items_failed": sum(len(s.failed) for s in registry._sources.values()),
        "failed": sorted((s.name, i) for s in registry._sources.values() for i in s.failed)[:50],
        "queued": [sum(len(r.queue) for r in job.ranks) for job in jobs],
        "handed_out": [sum(r.handed_out for r in job.ranks) for job in jobs],
        "delivered": [job.items_delivered for job in jobs],
    }


def from_status(status: dict[str, Any]) -> dict[str, Any]:
    cache = status["cache"]
    return {
        "items": cache["items"], "items_bytes": cache["items_bytes"], "pinned_items": cache["pinned_items"],
        "pins": cache["pins"], "in_flight": status["decodes"]["in_flight"], "items_failed": status["items_failed"],
        "failed": [(f["source"], f["item_id"]) for f in status["failed"]],
        "queued": [j["queued"] for j in status["jobs"]], "handed_out": [j["handed_out"] for j in status["jobs"]],
        "delivered": [j["items_delivered"] for j in status["jobs"]],
    }


def status_without_walking(registry: Registry) -> dict[str, Any]:
    cache = registry.cache
    items = cache.items
    cache.items = RefusingItems(items)
    try:
        return registry.status()
    finally:
        cache.items = items


@pytest.mark.parametrize("seed", range(4))
def test_status_figures_equal_a_recount_after_random_operations_without_walking_the_items(seed: int) -> None:
    rng = random.Random(seed)
    registry, pool, clock = make_registry(num_slots=30, lease_s=1e9, rank_attach_timeout_s=1e9)
    bad = set(rng.sample(range(NUM_ITEMS), 4))
    jobs: dict[str, tuple[int, list[int]]] = {}  # job id -> (token, acks)
    for step in range(300):
        roll = rng.random()
        if (roll < 0.05 and len(jobs) < 4) or not jobs:
            ids = BitMap(rng.sample(range(NUM_ITEMS), rng.randrange(10, NUM_ITEMS)))
            job = attach(registry, "demo", ids, f"j{step}", rng.choice([2, 4]))
            jobs[job.job_id] = (1, [])
        elif roll < 0.08 and len(jobs) > 1:
            job_id = rng.choice(sorted(jobs))
            registry.remove_job(job_id, "done")
            del jobs[job_id]
        elif roll < 0.4:
            pool_fail = bad if rng.random() < 0.7 else set()
            pump(registry, pool, pool_fail)
        elif roll < 0.45:
            clock.now += rng.choice([1.0, 61.0])  # past retry_failed_s: failed files are tried again
        else:
            job_id = rng.choice(sorted(jobs))
            token, acks = jobs[job_id]
            result = nxt(registry, job_id, token, rng.choice([0, 2, 4]), acks if rng.random() < 0.8 else [])
            jobs[job_id] = (token + result.end_of_epoch, result.item_ids)
        assert from_status(status_without_walking(registry)) == from_scratch(registry), step
