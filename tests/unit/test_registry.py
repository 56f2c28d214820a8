"""The registry's logic, driven step by step with a fake decode pool and a fake clock.

No threads, no gRPC, no shared memory: `schedule_once` runs rounds and dispatches decodes, the
fake pool "decodes" instantly when told, and `next_items` never has to wait for anything that
the test did not already make ready.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from pyroaring import BitMap

from joader.errors import InvalidArgumentError, UnknownJobError, UnknownSourceError
from joader.server.registry import Registry, RegistryConfig, Source
from joader.sources.imagefolder import SourceListing

pytestmark = pytest.mark.timeout(60)

NUM_ITEMS = 60


class FakePool:
    """Records submissions; `finish` files them back into the registry."""

    num_workers = 2

    def __init__(self) -> None:
        self.submitted: list[tuple[int, int, int, int]] = []
        self.slots_in_use: dict[int, int] = {}

    @property
    def in_flight(self) -> int:
        return len(self.submitted)

    def submit(self, task_id: int, source_index: int, item_id: int, slot: int) -> None:
        assert slot not in self.slots_in_use.values(), "a slot was handed out twice"
        self.submitted.append((task_id, source_index, item_id, slot))

    def finish(self, registry: Registry, fail: set[int] = frozenset()) -> None:
        while self.submitted:
            task_id, _, item_id, _slot = self.submitted.pop(0)
            ok = item_id not in fail
            registry.file_result(task_id, ok, None if ok else "truncated", 0.001)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_registry(num_slots: int = 20, lease_s: float = 5.0) -> tuple[Registry, FakePool, FakeClock]:
    listing = SourceListing(
        root=Path("/nonexistent"),
        classes=("a", "b"),
        class_to_idx={"a": 0, "b": 1},
        paths=tuple(f"{'ab'[i % 2]}/{i:03d}.jpg" for i in range(NUM_ITEMS)),
        labels=np.array([i % 2 for i in range(NUM_ITEMS)], dtype=np.int32),
    )
    pool, clock = FakePool(), FakeClock()
    config = RegistryConfig(lease_s=lease_s, next_wait_s=0.0, linger_s=0.0)
    registry = Registry([Source("demo", listing, 8, 0, seed=3)], num_slots, 3 * 8 * 8, pool, config, clock)
    return registry, pool, clock


def pump(registry: Registry, pool: FakePool, fail: set[int] = frozenset()) -> None:
    for _ in range(50):
        progressed = registry.schedule_once()
        if not progressed and not pool.submitted:
            return
        pool.finish(registry, fail)


def read_epoch(registry: Registry, pool: FakePool, job_id: str, token: int, batch: int = 4,
               fail: set[int] = frozenset()) -> list[int]:
    order: list[int] = []
    acks: list[int] = []
    for _ in range(10_000):
        pump(registry, pool, fail)
        result = registry.next_items(job_id, token, batch, acks)
        acks = result.item_ids
        order += result.item_ids
        if result.end_of_epoch:
            registry.next_items(job_id, token, 0, acks)
            return order
    raise AssertionError("epoch did not end")


def test_interleaved_jobs_get_each_item_once_per_epoch_and_release_every_pin() -> None:
    registry, pool, _ = make_registry()
    a = registry.attach("demo", BitMap(range(0, 40)), "a", 4)
    b = registry.attach("demo", BitMap(range(20, 60)), "b", 4)
    rng = random.Random(0)
    orders: dict[str, list[int]] = {a.job_id: [], b.job_id: []}
    acks: dict[str, list[int]] = {a.job_id: [], b.job_id: []}
    done = {a.job_id: False, b.job_id: False}
    while not all(done.values()):
        pump(registry, pool)
        job_id = rng.choice([j for j, d in done.items() if not d])  # uneven speeds
        result = registry.next_items(job_id, 1, rng.randint(1, 6), acks[job_id])
        acks[job_id] = result.item_ids
        orders[job_id] += result.item_ids
        done[job_id] = result.end_of_epoch
    for job_id in done:
        registry.next_items(job_id, 1, 0, acks[job_id])
    assert sorted(orders[a.job_id]) == list(range(0, 40))
    assert sorted(orders[b.job_id]) == list(range(20, 60))
    status = registry.status()
    assert status["items_decoded"] < 80  # some items served both jobs
    assert status["cache"]["used_bytes"] <= status["cache"]["capacity_bytes"]
    # Everything was acknowledged: only items in the queues (next epoch's lookahead) are pinned.
    queued = {entry.key for job in (a, b) for entry in job.queue}
    assert status["cache"]["pinned"] == len(queued)


def test_a_new_pass_abandons_an_unfinished_epoch_and_starts_a_whole_one() -> None:
    registry, pool, _ = make_registry()
    job = registry.attach("demo", BitMap(range(30)), "a", 4)
    pump(registry, pool)
    assert not job.queue  # registered, not reading yet: no rounds, no decodes
    assert registry.next_items(job.job_id, 7, 4, []).item_ids == []  # nothing prepared yet
    pump(registry, pool)
    first = registry.next_items(job.job_id, 7, 4, [])
    assert first.epoch == 1 and len(first.item_ids) == 4
    order = read_epoch(registry, pool, job.job_id, token=8)  # a new pass: epoch 2, whole
    assert sorted(order) == list(range(30))
    late = registry.next_items(job.job_id, 7, 4, first.item_ids)  # a straggler of pass 7
    assert late.end_of_epoch and not late.item_ids
    registry.remove_job(job.job_id, "test")
    assert registry.status()["cache"]["pinned"] == 0


def test_a_silent_job_loses_its_lease_and_its_pins() -> None:
    registry, pool, clock = make_registry(lease_s=5.0)
    quiet = registry.attach("demo", BitMap(range(40)), "quiet", 4)
    busy = registry.attach("demo", BitMap(range(40)), "busy", 4)
    for job in (quiet, busy):
        registry.next_items(job.job_id, 1, 4, [])  # start reading
    pump(registry, pool)
    held = registry.next_items(quiet.job_id, 1, 4, [])  # handed out, never acknowledged
    assert held.item_ids
    clock.now += 3.0
    registry.touch(busy.job_id)
    clock.now += 3.0  # quiet: 6 s without a request; busy: 3 s
    registry.schedule_once()
    names = [j["name"] for j in registry.status()["jobs"]]
    assert names == ["busy"]
    with pytest.raises(UnknownJobError, match="lease"):
        registry.next_items(quiet.job_id, 1, 4, held.item_ids)
    assert sorted(read_epoch(registry, pool, busy.job_id, 1)) == list(range(40))
    registry.remove_job(busy.job_id, "test")
    assert registry.status()["cache"]["pinned"] == 0


def test_failed_items_are_skipped_reported_and_not_decoded_again() -> None:
    registry, pool, _ = make_registry()
    job = registry.attach("demo", BitMap(range(20)), "a", 4)
    bad = {3, 11}
    for epoch in range(2):
        order = read_epoch(registry, pool, job.job_id, token=epoch, fail=bad)
        assert sorted(order) == [i for i in range(20) if i not in bad]
    status = registry.status()
    assert status["items_failed"] == 2
    assert {f["path"] for f in status["failed"]} == {"b/003.jpg", "b/011.jpg"}
    assert status["cache"]["misses"] - status["items_decoded"] == 2  # tried once each
    registry.remove_job(job.job_id, "test")


def test_bad_registrations_name_the_problem() -> None:
    registry, _, _ = make_registry()
    with pytest.raises(UnknownSourceError, match="demo"):
        registry.attach("imagenet", None, "a", 4)
    with pytest.raises(InvalidArgumentError, match=r"60\.\.69.*0\.\.59"):
        registry.attach("demo", BitMap(range(55, 70)), "a", 4)
    with pytest.raises(InvalidArgumentError, match="empty"):
        registry.attach("demo", BitMap(), "a", 4)
    with pytest.raises(UnknownJobError):
        registry.next_items("nope", 1, 4, [])
