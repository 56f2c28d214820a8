"""Driving the registry step by step: a fake decode pool, a fake clock, and the calls a
client makes (attach, Next), for the server's unit tests.

No threads, no gRPC, no shared memory: `schedule_once` runs rounds and dispatches decodes, the
fake pool "decodes" instantly when told, and `next_items` never has to wait for anything that
the test did not already make ready.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from joader.server.books.records import Job
from joader.server.registry.next_call import Batch
from joader.server.registry.registry import Registry, RegistryConfig, Source
from joader.sources.imagefolder import SourceListing

NUM_ITEMS = 60
ITEM_BYTES = 3 * 8 * 8
# A stand-in for a built-in stage: only its name, size and item spec matter to the registry.
STAGE = SimpleNamespace(name="center-crop:8", size=8,
                        spec=SimpleNamespace(shape=(3, 8, 8), dtype="uint8", max_nbytes=ITEM_BYTES))


class FakePool:
    """Records submissions; `finish` files them back into the registry."""

    num_workers = 2

    def __init__(self) -> None:
        self.submitted: list[tuple[int, int, int, int]] = []

    @property
    def in_flight(self) -> int:
        return len(self.submitted)

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        assert capacity == ITEM_BYTES
        self.submitted.append((task_id, source_index, item_id, offset))

    def finish(self, registry: Registry, fail: set[int] = frozenset()) -> None:
        while self.submitted:
            task_id, _, item_id, _offset = self.submitted.pop(0)
            ok = item_id not in fail
            registry.file_result(task_id, ok, None if ok else "truncated", 0.001,
                                 shape=(3, 8, 8), dtype="uint8", nbytes=ITEM_BYTES)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_registry(num_slots: int = 20, lease_s: float = 5.0, **config: object) -> tuple[Registry, FakePool, FakeClock]:
    listing = SourceListing(
        root=Path("/nonexistent"),
        classes=("a", "b"),
        class_to_idx={"a": 0, "b": 1},
        paths=tuple(f"{'ab'[i % 2]}/{i:03d}.jpg" for i in range(NUM_ITEMS)),
        labels=np.array([i % 2 for i in range(NUM_ITEMS)], dtype=np.int32),
    )
    pool, clock = FakePool(), FakeClock()
    config.setdefault("start_grace_s", 0.0)  # the frozen clock would never end a grace
    settings = RegistryConfig(lease_s=lease_s, next_wait_s=0.0, linger_s=0.0, **config)  # type: ignore[arg-type]
    registry = Registry([Source("demo", listing, STAGE, 0, seed=3)], num_slots * ITEM_BYTES, pool, settings, clock)
    return registry, pool, clock


SECRETS: dict[str, bytes] = {}


def attach(registry: Registry, *args: object, **kwargs: object) -> Job:
    """`Registry.attach` with a fixed job seed unless given: the fake clock and pool make
    everything else deterministic, and a test must not depend on a random job seed."""
    kwargs.setdefault("seed", 11)
    job = registry.attach(*args, **kwargs)  # type: ignore[arg-type]
    SECRETS[job.job_id] = job.secret
    registry.check_invariants()
    return job


def nxt(registry: Registry, job_id: str, token: int, max_items: int, acks: list[int],
        worker_id: int = 0, pid: int = 0, **kwargs: object) -> Batch:
    """`Registry.next_items` with the job's secret, as the job's own client sends it; the
    cache's books are checked against the jobs' after every call."""
    try:
        return registry.next_items(job_id, token, max_items, acks, secret=SECRETS.get(job_id, b""),
                                   worker_id=worker_id, pid=pid, **kwargs)  # type: ignore[arg-type]
    finally:
        registry.check_invariants()


def pump(registry: Registry, pool: FakePool, fail: set[int] = frozenset()) -> None:
    for _ in range(50):
        progressed = registry.schedule_once()
        registry.check_invariants()
        if not progressed and not pool.submitted:
            return
        pool.finish(registry, fail)
        registry.check_invariants()


def read_epoch(registry: Registry, pool: FakePool, job_id: str, token: int, batch: int = 4,
               fail: set[int] = frozenset()) -> list[int]:
    order: list[int] = []
    acks: list[int] = []
    for _ in range(10_000):
        pump(registry, pool, fail)
        result = nxt(registry, job_id, token, batch, acks)
        acks = result.item_ids
        order += result.item_ids
        if result.end_of_epoch:
            nxt(registry, job_id, token, 0, acks)
            return order
    raise AssertionError("epoch did not end")


def read_ranks(registry: Registry, pool: FakePool, job: Job, token: int, batch: int = 3,
               rng: random.Random | None = None) -> list[list[int]]:
    """One epoch of every rank of `job`, the ranks taking turns at random speeds."""
    rng = rng or random.Random(0)
    orders: list[list[int]] = [[] for _ in range(job.world_size)]
    acks: list[list[int]] = [[] for _ in range(job.world_size)]
    done = [False] * job.world_size
    for _ in range(10_000):
        if all(done):
            for rank in range(job.world_size):
                nxt(registry, job.job_id, token + rank, 0, acks[rank], rank=rank)
            return orders
        pump(registry, pool)
        rank = rng.choice([r for r in range(job.world_size) if not done[r]])
        result = nxt(registry, job.job_id, token + rank, batch, acks[rank], rank=rank)
        acks[rank] = result.item_ids
        orders[rank] += result.item_ids
        done[rank] = result.end_of_epoch
    raise AssertionError("epoch did not end")
