"""The registry's logic, driven step by step with a fake decode pool and a fake clock.

No threads, no gRPC, no shared memory: `schedule_once` runs rounds and dispatches decodes, the
fake pool "decodes" instantly when told, and `next_items` never has to wait for anything that
the test did not already make ready.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from pyroaring import BitMap

from joader.errors import (
    InvalidArgumentError,
    PassSupersededError,
    TooManyJobsError,
    UnknownJobError,
    UnknownSourceError,
)
from joader.server.records import Batch, Job
from joader.server.registry import Registry, RegistryConfig, Source, max_indices_bytes
from joader.server.resumes import decide_restart
from joader.sources.imagefolder import SourceListing

pytestmark = pytest.mark.timeout(60)

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


def test_interleaved_jobs_get_each_item_once_per_epoch_and_release_every_pin() -> None:
    registry, pool, _ = make_registry()
    a = attach(registry, "demo", BitMap(range(0, 40)), "a", 4)
    b = attach(registry, "demo", BitMap(range(20, 60)), "b", 4)
    rng = random.Random(0)
    orders: dict[str, list[int]] = {a.job_id: [], b.job_id: []}
    acks: dict[str, list[int]] = {a.job_id: [], b.job_id: []}
    done = {a.job_id: False, b.job_id: False}
    while not all(done.values()):
        pump(registry, pool)
        job_id = rng.choice([j for j, d in done.items() if not d])  # uneven speeds
        result = nxt(registry, job_id, 1, rng.randint(1, 6), acks[job_id])
        acks[job_id] = result.item_ids
        orders[job_id] += result.item_ids
        done[job_id] = result.end_of_epoch
    for job_id in done:
        nxt(registry, job_id, 1, 0, acks[job_id])
    assert sorted(orders[a.job_id]) == list(range(0, 40))
    assert sorted(orders[b.job_id]) == list(range(20, 60))
    status = registry.status()
    assert status["items_decoded"] < 80  # some items served both jobs
    assert status["cache"]["used_bytes"] <= status["cache"]["capacity_bytes"]
    # Everything was acknowledged: only items in the queues (next epoch's lookahead) are pinned.
    queued = {entry.key for job in (a, b) for entry in job.ranks[0].queue}
    assert status["cache"]["pinned_items"] == len(queued)


def test_a_new_pass_abandons_an_unfinished_epoch_and_starts_a_whole_one() -> None:
    registry, pool, _ = make_registry()
    job = attach(registry, "demo", BitMap(range(30)), "a", 4)
    pump(registry, pool)
    assert not job.ranks[0].queue  # registered, not reading yet: no rounds, no decodes
    assert nxt(registry, job.job_id, 7, 4, []).item_ids == []  # nothing prepared yet
    pump(registry, pool)
    first = nxt(registry, job.job_id, 7, 4, [])
    assert first.epoch == 1 and len(first.item_ids) == 4
    order = read_epoch(registry, pool, job.job_id, token=8)  # a new pass: epoch 2, whole
    assert sorted(order) == list(range(30))
    with pytest.raises(PassSupersededError, match="newer iterator"):  # a straggler of pass 7
        nxt(registry, job.job_id, 7, 4, first.item_ids)
    late_ack = nxt(registry, job.job_id, 7, 0, first.item_ids)  # acknowledging still works
    assert not late_ack.item_ids
    registry.remove_job(job.job_id, "test")
    assert registry.status()["cache"]["pinned_items"] == 0


def test_a_silent_job_loses_its_lease_and_its_pins() -> None:
    registry, pool, clock = make_registry(lease_s=5.0)
    quiet = attach(registry, "demo", BitMap(range(40)), "quiet", 4)
    busy = attach(registry, "demo", BitMap(range(40)), "busy", 4)
    for job in (quiet, busy):
        nxt(registry, job.job_id, 1, 4, [])  # start reading
    pump(registry, pool)
    held = nxt(registry, quiet.job_id, 1, 4, [])  # handed out, never acknowledged
    assert held.item_ids
    clock.now += 3.0
    registry.touch(busy.job_id)
    clock.now += 3.0  # quiet: 6 s without a request; busy: 3 s
    registry.schedule_once()
    names = [j["name"] for j in registry.status()["jobs"]]
    assert names == ["busy"]
    with pytest.raises(UnknownJobError, match="lease"):
        nxt(registry, quiet.job_id, 1, 4, held.item_ids)
    assert sorted(read_epoch(registry, pool, busy.job_id, 1)) == list(range(40))
    registry.remove_job(busy.job_id, "test")
    assert registry.status()["cache"]["pinned_items"] == 0


def test_failed_items_are_skipped_reported_and_not_decoded_again_before_the_retry_time() -> None:
    registry, pool, _ = make_registry()
    job = attach(registry, "demo", BitMap(range(20)), "a", 4)
    bad = {3, 11}
    for epoch in range(2):
        order = read_epoch(registry, pool, job.job_id, token=epoch, fail=bad)
        assert sorted(order) == [i for i in range(20) if i not in bad]
    status = registry.status()
    assert status["items_failed"] == 2
    assert {f["path"] for f in status["failed"]} == {"b/003.jpg", "b/011.jpg"}
    assert status["decodes"]["requested"] - status["items_decoded"] == 2  # tried once each
    registry.remove_job(job.job_id, "test")


def test_bad_registrations_name_the_problem() -> None:
    registry, _, _ = make_registry()
    with pytest.raises(UnknownSourceError, match="demo"):
        registry.attach("imagenet", None, "a", 4)
    with pytest.raises(InvalidArgumentError, match=r"60\.\.69.*0\.\.59"):
        attach(registry, "demo", BitMap(range(55, 70)), "a", 4)
    with pytest.raises(InvalidArgumentError, match="empty"):
        attach(registry, "demo", BitMap(), "a", 4)
    with pytest.raises(UnknownJobError):
        nxt(registry, "nope", 1, 4, [])


def test_a_failed_item_is_decoded_again_at_its_next_use_after_the_retry_time() -> None:
    """The storage was down during epoch 1: every file failed. The lookahead queued epoch 2's
    first picks then, still failed. Once the retry time has passed (the storage is back), those
    copies are decoded again when epoch 2's pass starts, not reported failed from the old
    decision (epoch 2 delivered 8 of 10)."""
    registry, pool, clock = make_registry(num_slots=8, lease_s=1000.0)
    job = attach(registry, "demo", BitMap(range(10)), "a", 2)
    order = read_epoch(registry, pool, job.job_id, token=1, batch=2, fail=set(range(10)))
    assert order == [] and registry.status()["items_failed"] == 10
    stale = [e.item_id for e in job.ranks[0].queue if e.epoch == 2]
    assert stale  # queued while failed
    clock.now += registry.config.retry_failed_s + 1  # the files are back
    first = nxt(registry, job.job_id, 2, 2, [])  # epoch 2's pass starts: their decodes start at once
    registry.schedule_once()
    assert set(stale) <= {item_id for _, _, item_id, _ in pool.submitted}
    order = first.item_ids + read_epoch(registry, pool, job.job_id, token=2, batch=2)
    assert sorted(order) == list(range(10))
    status = registry.status()
    assert status["items_failed"] == 0 and status["decodes"]["retried"] == 10
    registry.remove_job(job.job_id, "test")
    assert registry.status()["cache"]["pinned_items"] == 0


def test_a_failed_copy_reached_by_a_next_after_the_retry_time_is_decoded_again() -> None:
    """The same when the retry time passes during epoch 2, before a Next reaches the copy: the
    first copy, handed out before the retry time, is skipped; the second is decoded again."""
    registry, pool, clock = make_registry(num_slots=12, lease_s=1000.0)
    job = attach(registry, "demo", BitMap(range(10)), "a", 1)
    read_epoch(registry, pool, job.job_id, token=1, batch=1, fail=set(range(10)))
    assert len([e for e in job.ranks[0].queue if e.epoch == 2]) >= 2
    first = nxt(registry, job.job_id, 2, 1, [])  # before the retry time: skipped
    assert first.item_ids == [] and len(first.failed) == 1
    clock.now += registry.config.retry_failed_s + 1
    order = read_epoch(registry, pool, job.job_id, token=2, batch=1)
    assert sorted(order) == sorted(set(range(10)) - {first.failed[0][0]})


def test_a_file_that_keeps_failing_is_retried_at_most_once_per_use_and_skipped() -> None:
    """--retry-failed-s 0: every use may retry, but a copy reached by a Next is retried once,
    then reported; an epoch never loops on a broken file."""
    registry, pool, clock = make_registry(num_slots=60, lease_s=1000.0, retry_failed_s=0.0)
    job = attach(registry, "demo", BitMap(range(10)), "a", 4)
    for token in (1, 2, 3):
        clock.now += 1.0
        order = read_epoch(registry, pool, job.job_id, token=token, fail={5})
        assert sorted(order) == [i for i in range(10) if i != 5]
    assert registry.status()["decodes"]["requested"] <= 10 + 3 * 2


def test_fresh_workers_with_a_repeated_token_start_a_new_whole_epoch() -> None:
    """torch.manual_seed before each epoch gives fresh DataLoader workers the same base seed."""
    registry, pool, _ = make_registry()
    job = attach(registry, "demo", BitMap(range(24)), "a", 4)
    seen: list[list[int]] = []
    for epoch, pids in enumerate([(101, 102), (201, 202), (301, 302)], start=1):
        order: list[int] = []
        acks = {0: [], 1: []}
        done = {0: False, 1: False}
        while not all(done.values()):
            pump(registry, pool)
            for worker in (0, 1):
                if done[worker]:
                    continue
                batch = nxt(registry, job.job_id, 77, 3, acks[worker], worker_id=worker, pid=pids[worker])
                assert batch.epoch == epoch
                acks[worker] = batch.item_ids
                order += batch.item_ids
                done[worker] = batch.end_of_epoch
        seen.append(order)
    assert [sorted(o) for o in seen] == [list(range(24))] * 3
    # A worker of an earlier pass that still asks gets a clear error, not an empty epoch.
    with pytest.raises(PassSupersededError):
        nxt(registry, job.job_id, 77, 3, [], worker_id=1, pid=202)


def test_a_job_is_reachable_only_with_its_secret() -> None:
    registry, pool, _ = make_registry()
    job = attach(registry, "demo", BitMap(range(20)), "a", 4)
    nxt(registry, job.job_id, 1, 4, [])
    with pytest.raises(UnknownJobError, match="secret"):
        registry.next_items(job.job_id, 99, 4, [], secret=b"guess")
    assert "secret" not in str(registry.status())
    assert sorted(read_epoch(registry, pool, job.job_id, token=1)) == list(range(20))
    registry.remove_job(job.job_id, "its lease keeper exited")
    with pytest.raises(UnknownJobError, match="lease keeper exited"):
        nxt(registry, job.job_id, 1, 4, [])


def test_jobs_beyond_max_jobs_are_refused_with_the_flag_named() -> None:
    registry, _, _ = make_registry(max_jobs=2)
    for name in ("a", "b"):
        attach(registry, "demo", BitMap(range(10)), name, 4)
    with pytest.raises(TooManyJobsError, match="--max-jobs"):
        attach(registry, "demo", BitMap(range(10)), "c", 4)


def test_job_names_cannot_forge_log_lines() -> None:
    registry, _, _ = make_registry()
    job = attach(registry, "demo", BitMap(range(10)), "evil\nERROR forged", 4)
    assert "\n" not in job.name and "\n" not in job.job_id
    assert job.name.startswith("evil\\n")


def test_indices_bound_admits_every_subset_of_the_source() -> None:
    for num_items in (1, 300, 65_536, 65_537, 1_281_167):
        dense = BitMap(range(num_items))
        sparse = BitMap(range(0, num_items, 2))
        for bitmap in (dense, sparse):
            assert len(bitmap.serialize()) <= max_indices_bytes(num_items)
    assert max_indices_bytes(300) < 16_384


# ----------------------------------------------------------------------------- real jobs


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


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_of_one_job_split_each_epoch_evenly(drop_last: bool) -> None:
    registry, pool, _ = make_registry(num_slots=30)
    dataset = BitMap(range(5, 26))  # 21 items, 2 ranks: 11 each (one padded) or 10 each
    job = attach(registry, "demo", dataset, "ddp", 4, rank=0, world_size=2, drop_last=drop_last)
    same = attach(registry, "demo", dataset, "ddp", 4, rank=1, world_size=2, drop_last=drop_last)
    assert same is job and registry.status()["jobs"][0]["ranks_attached"] == 2
    for epoch in range(3):
        orders = read_ranks(registry, pool, job, token=100 * epoch, rng=random.Random(epoch))
        per_rank = 10 if drop_last else 11
        assert [len(o) for o in orders] == [per_rank, per_rank]
        union = orders[0] + orders[1]
        if drop_last:
            assert len(set(union)) == 20 and set(union) <= set(dataset)
        else:
            assert set(union) == set(dataset)
            (duplicate,) = [i for i in set(union) if union.count(i) > 1]  # the one padding copy
            assert union.count(duplicate) == 2
    registry.remove_job(job.job_id, "test")
    assert registry.status()["cache"]["pins"] == 0


def test_a_rank_reads_nothing_until_every_rank_attached_and_one_lost_lease_ends_all() -> None:
    registry, pool, clock = make_registry(lease_s=5.0)
    job = attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=1, world_size=2)
    pump(registry, pool)
    assert nxt(registry, job.job_id, 1, 4, [], rank=1).item_ids == []  # rank 0 is missing
    with pytest.raises(InvalidArgumentError, match="already attached"):
        attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=1, world_size=2)
    attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=0, world_size=2)
    pump(registry, pool)
    assert len(nxt(registry, job.job_id, 1, 4, [], rank=1).item_ids) == 4
    clock.now += 3.0
    registry.touch(job.job_id, 1)
    clock.now += 3.0  # rank 0 never asked: its lease ends, and with it the job
    registry.schedule_once()
    with pytest.raises(UnknownJobError, match="rank 0"):
        nxt(registry, job.job_id, 1, 4, [], rank=1)
    assert registry.status()["cache"]["pins"] == 0


def test_replies_hold_whole_batches_until_the_last() -> None:
    registry, pool, _ = make_registry(num_slots=40)
    job = attach(registry, "demo", BitMap(range(23)), "a", 4)
    sizes, acks = [], []
    while True:
        pump(registry, pool)
        result = nxt(registry, job.job_id, 1, 4, acks)
        acks = result.item_ids
        if result.item_ids:
            sizes.append(len(result.item_ids))
        if result.end_of_epoch:
            break
    assert sizes == [4, 4, 4, 4, 4, 3]


def test_a_warm_queue_gives_several_whole_batches_per_reply_and_keeps_its_capacity() -> None:
    """max_batches: a reply adds further whole batches when they are ready; beside another job
    on the source, only while the queue keeps its capacity (else the job would join rounds
    alone while the other's queue is full: less sharing)."""
    registry, pool, _ = make_registry(num_slots=60, lookahead_batches=2)
    job = attach(registry, "demo", BitMap(range(60)), "a", 4)
    assert job.queue_capacity == 8
    assert nxt(registry, job.job_id, 1, 4, [], max_batches=4).item_ids == []  # starts the reading
    pump(registry, pool)
    assert len(nxt(registry, job.job_id, 1, 4, [], max_batches=4).item_ids) == 8  # alone: all ready

    registry, pool, _ = make_registry(num_slots=60, lookahead_batches=2)
    a = attach(registry, "demo", BitMap(range(60)), "a", 4)
    b = attach(registry, "demo", BitMap(range(60)), "b", 4)
    capacity = a.queue_capacity
    sizes, order, acks, b_acks = [], [], [], []
    for step in range(10_000):
        pump(registry, pool)
        if step % 3 == 0:  # b reads a batch for a's three: a's queue grows beyond its capacity
            b_acks = nxt(registry, b.job_id, 1, 4, b_acks).item_ids
            pump(registry, pool)
        queued = len(a.ranks[0].queue)
        result = nxt(registry, a.job_id, 1, 4, acks, max_batches=4)
        acks = result.item_ids
        order += result.item_ids
        if result.item_ids:
            sizes.append(len(result.item_ids))
            assert len(result.item_ids) % 4 == 0 or result.end_of_epoch
            assert len(result.item_ids) == 4 or queued - len(result.item_ids) >= capacity
        if result.end_of_epoch:
            break
    nxt(registry, a.job_id, 1, 0, acks)
    assert sorted(order) == list(range(60))
    # Refilled by shared rounds, a's queue never holds a whole batch beyond its capacity here.
    assert set(sizes) == {4}
    # Without max_batches, one batch per reply as before.
    registry, pool, _ = make_registry(num_slots=60, lookahead_batches=2)
    job = attach(registry, "demo", BitMap(range(60)), "a", 4)
    nxt(registry, job.job_id, 1, 4, [])
    pump(registry, pool)
    assert len(nxt(registry, job.job_id, 1, 4, []).item_ids) == 4


def test_jobs_starting_together_begin_in_step() -> None:
    """A job that starts reading waits `start_grace_s` for the source's other attached jobs:
    two identical jobs that ask a moment apart then share every round from the first."""
    registry, pool, clock = make_registry(num_slots=40, start_grace_s=0.2)
    a = attach(registry, "demo", BitMap(range(30)), "a", 4)
    b = attach(registry, "demo", BitMap(range(30)), "b", 4)
    assert nxt(registry, a.job_id, 1, 4, []).item_ids == []
    pump(registry, pool)
    assert len(a.ranks[0].queue) == 0  # a waits for b (its grace is not over)
    clock.now += 0.05
    nxt(registry, b.job_id, 1, 4, [])
    pump(registry, pool)
    assert [e.item_id for e in a.ranks[0].queue] == [e.item_id for e in b.ranks[0].queue] != []
    # A job alone on its source does not wait; nor one whose grace is over.
    registry, pool, clock = make_registry(num_slots=40, start_grace_s=0.2)
    c = attach(registry, "demo", BitMap(range(30)), "c", 4)
    nxt(registry, c.job_id, 1, 4, [])
    pump(registry, pool)
    assert len(c.ranks[0].queue) > 0
    d = attach(registry, "demo", BitMap(range(30)), "d", 4)
    e = attach(registry, "demo", BitMap(range(30)), "e", 4)
    nxt(registry, d.job_id, 1, 4, [])
    pump(registry, pool)
    assert len(d.ranks[0].queue) == 0  # e is attached and idle: d waits ...
    clock.now += 0.25
    pump(registry, pool)
    assert len(d.ranks[0].queue) > 0  # ... 0.2 s at most
    assert e.reading is False


def test_a_resumed_epoch_delivers_exactly_what_was_not_consumed_then_whole_epochs() -> None:
    registry, pool, _ = make_registry(num_slots=30)
    before = attach(registry, "demo", BitMap(range(30)), "a", 4)
    pump(registry, pool)
    nxt(registry, before.job_id, 1, 4, [])
    pump(registry, pool)
    consumed = nxt(registry, before.job_id, 1, 4, []).item_ids + nxt(registry, before.job_id, 1, 4, []).item_ids
    registry.remove_job(before.job_id, "the training process was killed")
    job = attach(registry, "demo", BitMap(range(30)), "a", 4)
    order, acks = [], []
    while True:
        pump(registry, pool)
        result = nxt(registry, job.job_id, 9, 4, acks, resume_epoch=3, resume_consumed=BitMap(consumed))
        assert result.epoch == 3  # the checkpoint's numbering goes on
        acks = result.item_ids
        order += result.item_ids
        if result.end_of_epoch:
            break
    assert sorted(order + consumed) == list(range(30))
    assert sorted(read_epoch(registry, pool, job.job_id, token=10)) == list(range(30))


def test_a_resume_waits_for_every_worker_in_any_order() -> None:
    """StatefulDataLoader restores each worker's own state; a worker that had yielded nothing
    has none, and may ask first."""
    registry, pool, _ = make_registry(num_slots=30)
    job = attach(registry, "demo", BitMap(range(24)), "a", 4)
    pump(registry, pool)
    first = nxt(registry, job.job_id, 5, 4, [], worker_id=0, pid=10)  # no state: a plain pass
    assert first.item_ids == []  # nothing prepared yet, so nothing handed out
    # worker 1 brings the checkpoint: the pass becomes epoch 4 resumed, both reports counted
    orders: dict[int, list[int]] = {0: [], 1: []}
    acks: dict[int, list[int]] = {0: [], 1: []}
    done = {0: False, 1: False}
    while not all(done.values()):
        pump(registry, pool)
        for worker in (1, 0):
            if done[worker]:
                continue
            extra = {"resume_epoch": 4, "resume_consumed": BitMap(range(6)), "resume_parts": 2} if worker else {}
            result = nxt(registry, job.job_id, 5, 4, acks[worker], worker_id=worker, pid=10 + worker, **extra)
            assert result.epoch == 4
            acks[worker] = result.item_ids
            orders[worker] += result.item_ids
            done[worker] = result.end_of_epoch
    assert sorted(orders[0] + orders[1]) == list(range(6, 24))


def test_a_solo_job_with_a_seed_gets_the_same_order_in_every_run() -> None:
    def run(seed: int) -> list[int]:
        registry, pool, _ = make_registry(num_slots=30)
        job = attach(registry, "demo", BitMap(range(40)), "a", 4, seed=seed)
        assert job.seed == seed
        return read_epoch(registry, pool, job.job_id, 1) + read_epoch(registry, pool, job.job_id, 2)

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_a_dataset_smaller_than_the_queue_is_prepared_one_epoch_ahead_at_most() -> None:
    registry, pool, _ = make_registry(num_slots=200)
    job = attach(registry, "demo", BitMap(range(6)), "tiny", 64)
    nxt(registry, job.job_id, 1, 64, [])  # starts reading: rounds run
    for _ in range(20):
        pump(registry, pool)
    assert len(job.ranks[0].queue) <= 2 * 6  # this epoch and the next, not dozens of epochs
    for token in (1, 2, 3):
        assert sorted(read_epoch(registry, pool, job.job_id, token, batch=64)) == list(range(6))


def test_a_pending_resume_gives_way_to_a_new_pass_that_resumes_nothing() -> None:
    """StatefulDataLoader drops the iterator of a finished epoch's checkpoint and starts a fresh
    one: a resume still waiting for its second worker must not hold the job forever."""
    registry, pool, _ = make_registry(num_slots=30)
    job = attach(registry, "demo", BitMap(range(20)), "a", 4)
    nxt(registry, job.job_id, 5, 4, [], worker_id=1, pid=11,
        resume_epoch=2, resume_consumed=BitMap(range(20)), resume_parts=2)
    assert job.resume is not None  # waiting for worker 0's report
    order = read_epoch(registry, pool, job.job_id, token=6)  # a new iterator, no checkpoint
    assert sorted(order) == list(range(20)) and job.resume is None


class VariablePool(FakePool):
    """Items of the second source vary in size (a `resize` stage): 200 + 7 * id bytes."""

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        self.submitted.append((task_id, source_index, item_id, offset))

    def finish(self, registry: Registry, fail: set[int] = frozenset()) -> None:
        while self.submitted:
            task_id, source_index, item_id, _offset = self.submitted.pop(0)
            nbytes = ITEM_BYTES if source_index == 0 else 200 + 7 * item_id
            shape = (3, 8, 8) if source_index == 0 else (1, 1, nbytes)
            registry.file_result(task_id, True, None, 0.001, shape=shape, dtype="uint8", nbytes=nbytes)


def test_two_sources_of_different_sizes_share_one_cache_of_bytes() -> None:
    listing = make_registry()[0].source("demo").listing
    variable = SimpleNamespace(name="resize:8", size=None,
                               spec=SimpleNamespace(shape=None, dtype="uint8", max_nbytes=700))
    pool, clock = VariablePool(), FakeClock()
    config = RegistryConfig(lease_s=5.0, next_wait_s=0.0, linger_s=0.0)
    sources = [Source("fixed", listing, STAGE, 0, seed=1), Source("varied", listing, variable, NUM_ITEMS, seed=2)]
    registry = Registry(sources, 24 * ITEM_BYTES, pool, config, clock)
    a = attach(registry, "fixed", BitMap(range(40)), "a", 4)
    b = attach(registry, "varied", BitMap(range(60)), "b", 4)
    for epoch in range(2):
        orders = {a.job_id: [], b.job_id: []}
        acks = {a.job_id: [], b.job_id: []}
        done = {a.job_id: False, b.job_id: False}
        while not all(done.values()):
            pump(registry, pool)
            for job_id in done:
                if not done[job_id]:
                    result = nxt(registry, job_id, 10 + epoch, 4, acks[job_id])
                    if job_id == b.job_id:
                        assert all(n == 200 + 7 * i for i, n in zip(result.item_ids, result.lengths, strict=True))
                    acks[job_id] = result.item_ids
                    orders[job_id] += result.item_ids
                    done[job_id] = result.end_of_epoch
            cache = registry.status()["cache"]
            assert cache["used_bytes"] <= cache["capacity_bytes"]
        for job_id in done:
            nxt(registry, job_id, 10 + epoch, 0, acks[job_id])
        assert sorted(orders[a.job_id]) == list(range(40)) and sorted(orders[b.job_id]) == list(range(60))
    for job in (a, b):
        registry.remove_job(job.job_id, "test")
    cache = registry.status()["cache"]
    assert cache["evictions"] > 0 and cache["pins"] == 0
    # what is held takes its own bytes, rounded to 64: within 10% of the items' bytes
    assert cache["items_bytes"] <= cache["used_bytes"] <= 1.1 * cache["items_bytes"] + 64 * cache["items"]


def test_images_smaller_than_the_stage_are_counted_and_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    registry, pool, _ = make_registry()
    job = attach(registry, "demo", BitMap(range(6)), "a", 4)
    nxt(registry, job.job_id, 1, 4, [])
    registry.schedule_once()
    with caplog.at_level("WARNING"):
        for task_id, _, item_id, _ in list(pool.submitted):
            shape = (3, 5, 7) if item_id % 2 else (3, 8, 8)  # odd items: smaller than S = 8
            registry.file_result(task_id, True, None, 0.001, shape=shape, dtype="uint8",
                                 nbytes=3 * shape[1] * shape[2])
        pool.submitted.clear()
    registry.check_invariants()
    small = registry.status()["sources"][0]["small_items"]
    assert small == sum(1 for i in range(6) if i % 2 and i in registry.source("demo").cached_ids)
    assert small > 0 and "smaller than 8 px" in caplog.text and "upscale = true" in caplog.text


def test_sharing_is_counted_per_pair_beside_its_bound() -> None:
    """Identical datasets share every round both take part in; disjoint ones never do."""
    registry, pool, _ = make_registry(num_slots=60)
    a = attach(registry, "demo", BitMap(range(20)), "a", 4)
    b = attach(registry, "demo", BitMap(range(20)), "b", 4)
    c = attach(registry, "demo", BitMap(range(30, 50)), "c", 4)
    jobs = (a, b, c)
    orders: dict[str, list[int]] = {job.job_id: [] for job in jobs}
    acks: dict[str, list[int]] = {job.job_id: [] for job in jobs}
    done = dict.fromkeys(orders, False)
    while not all(done.values()):  # in lockstep: every round has all three
        for job in jobs:
            if not done[job.job_id]:
                result = nxt(registry, job.job_id, 1, 4, acks[job.job_id])
                acks[job.job_id] = result.item_ids
                orders[job.job_id] += result.item_ids
                done[job.job_id] = result.end_of_epoch
        pump(registry, pool)
    assert all(sorted(orders[job.job_id]) == sorted(job.dataset) for job in jobs)
    pairs = {(p["a"], p["b"]): p for p in registry.status()["sharing_pairs"]}
    ab = pairs[tuple(sorted((a.job_id, b.job_id)))]
    assert ab["rounds"] > 0 and ab["shared"] == ab["rounds"] and ab["bound"] == 1.0
    ac = pairs[tuple(sorted((a.job_id, c.job_id)))]
    assert ac["rounds"] > 0 and ac["shared"] == 0 and ac["bound"] == 0.0
    registry.remove_job(b.job_id, "test")
    after = {(p["a"], p["b"]): p for p in registry.status()["sharing_pairs"]}
    kept = after[tuple(sorted((a.job_id, b.job_id)))]  # kept for status and benches, not live
    assert not kept["live"] and kept["shared"] == ab["shared"] and {kept["name_a"], kept["name_b"]} == {"a", "b"}


def test_status_splits_sharing_from_cross_epoch_reuse_and_counts_lookahead_apart() -> None:
    """Two identical jobs, two epochs each, a cache that holds everything: each decode serves
    both jobs once per epoch. Within-epoch sharing is 2 (at most the number of jobs), the second
    epoch is cross-epoch reuse, and every requested decode is accounted for."""
    registry, pool, _ = make_registry(num_slots=NUM_ITEMS + 10)
    jobs = [attach(registry, "demo", BitMap(range(20)), name, 4) for name in ("a", "b")]
    for epoch in (1, 2):
        acks: dict[str, list[int]] = {job.job_id: [] for job in jobs}
        done = {job.job_id: False for job in jobs}
        while not all(done.values()):
            pump(registry, pool)
            for job in jobs:  # in step: both read each round's picks
                if not done[job.job_id]:
                    result = nxt(registry, job.job_id, epoch, 4, acks[job.job_id])
                    acks[job.job_id], done[job.job_id] = result.item_ids, result.end_of_epoch
        for job in jobs:
            nxt(registry, job.job_id, epoch, 0, acks[job.job_id])
        status = registry.status()
        assert [(j["epoch"], j["epoch_delivered"], j["epoch_items"], j["epochs_completed"])
                for j in status["jobs"]] == [(epoch, 20, 20, epoch)] * 2
    assert status["items_decoded"] == 20 and status["items_delivered"] == 80
    assert status["sharing"] == {"within_epoch": 2.0, "cross_epoch_reuse": 2.0, "deliveries_per_decode": 4.0,
                                 "items_reused": 40}
    assert [j["items_reused"] for j in status["jobs"]] == [20, 20]
    cache, decodes = status["cache"], status["decodes"]
    assert decodes["requested"] == 20 + decodes["in_flight"] + decodes["cancelled"]
    assert cache["lookups"]["misses"] + cache["lookahead"]["misses"] == decodes["requested"]
    # every entry of both epochs was looked up once; entries queued for the next epoch while
    # the current one was read are lookahead
    assert sum(sum(c.values()) for c in (cache["lookups"], cache["lookahead"])) >= 80
    assert cache["lookahead"]["hits"] > 0


def test_stall_reports_are_summed_over_readers_per_epoch() -> None:
    registry, pool, _ = make_registry()
    job = attach(registry, "demo", BitMap(range(8)), "a", 4, world_size=2)
    for rank, (wait, step) in enumerate(((1.0, 3.0), (2.0, 2.0))):
        nxt(registry, job.job_id, 7, 0, [], rank=rank, stall=(1, wait, step, 4))
    nxt(registry, job.job_id, 7, 0, [], rank=0, stall=(1, 1.5, 4.5, 6))  # a later, cumulative report
    stall = next(j for j in registry.status()["jobs"])["stall"]
    assert stall == {"epoch": 1, "wait_s": 3.5, "step_s": 6.5, "items": 10, "fraction": 0.35}
    nxt(registry, job.job_id, 8, 0, [], rank=0, stall=(2, 1.0, 1.0, 2))
    status = registry.status()["jobs"][0]
    assert status["stall"]["epoch"] == 2 and status["stall"]["fraction"] == 0.5
    assert status["stall_total"] == {"wait_s": 4.5, "step_s": 7.5, "items": 12, "fraction": 0.375}


# ----------------------------------------------------------------------------- faults


def test_a_job_whose_only_attached_rank_closes_ends_and_the_next_run_gets_a_new_job() -> None:
    """Rank 0 of a 2-rank job attached and closed; rank 1 never came. The job ends at once
    (it stayed "0/2" for good, and the next run's rank 1 joined it and read its whole epoch
    alone while that run's rank 0 waited in a new job)."""
    registry, pool, _ = make_registry(num_slots=30)
    stale = attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=0, world_size=2)
    registry.close_rank(stale.job_id, 0)
    assert registry.status()["jobs"] == []
    with pytest.raises(UnknownJobError, match="rank 1 of 2 never attached"):
        nxt(registry, stale.job_id, 1, 4, [])
    second = attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=1, world_size=2)
    assert second.job_id != stale.job_id
    assert attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=0, world_size=2) is second
    orders = read_ranks(registry, pool, second, token=10)
    assert [len(o) for o in orders] == [10, 10] and sorted(orders[0] + orders[1]) == list(range(20))


def test_a_rank_of_a_new_run_does_not_join_the_old_run_while_it_finishes() -> None:
    """Rank 0 of run 1 closed while its rank 1 still reads: run 2's rank 0 starts a new job,
    and run 2's rank 1 joins that one, not run 1's."""
    registry, _, _ = make_registry(num_slots=30)
    old = attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=0, world_size=2)
    attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=1, world_size=2)
    registry.close_rank(old.job_id, 0)
    assert [j["job_id"] for j in registry.status()["jobs"]] == [old.job_id]  # rank 1 still reads
    new = attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=0, world_size=2)
    assert new is not old
    assert attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=1, world_size=2) is new
    registry.close_rank(old.job_id, 1)
    assert [j["job_id"] for j in registry.status()["jobs"]] == [new.job_id]


def test_a_job_whose_ranks_never_all_attach_ends_after_the_attach_timeout() -> None:
    registry, pool, clock = make_registry(lease_s=5.0, rank_attach_timeout_s=30.0)
    job = attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=0, world_size=3)
    attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=2, world_size=3)
    for _ in range(5):  # attached ranks keep their leases; the job waits for rank 1
        clock.now += 5.0
        assert nxt(registry, job.job_id, 1, 4, [], rank=0).item_ids == []
        nxt(registry, job.job_id, 2, 4, [], rank=2)
        pump(registry, pool)
    waiting = registry.status()["jobs"][0]["waiting"]
    assert waiting["for"] == "ranks" and waiting["ranks"] == [1] and waiting["since_s"] == 25.0
    assert "rank 1 of 3 not attached" in waiting["detail"]
    clock.now += 5.0
    registry.schedule_once()
    assert registry.status()["jobs"] == []
    with pytest.raises(UnknownJobError, match="rank 1 of 3 did not attach within 30 s.*--rank-attach-timeout-s"):
        nxt(registry, job.job_id, 1, 4, [], rank=0)
    assert registry.status()["cache"]["pins"] == 0
    # the missing rank arriving late starts a new job (which waits for the others in turn)
    late = attach(registry, "demo", BitMap(range(20)), "ddp", 4, rank=1, world_size=3)
    assert late.job_id != job.job_id


def test_a_job_that_stops_reading_holds_its_share_at_most_and_never_stalls_another() -> None:
    """A cache of three batches per job. `paused` reads a reply, has a second one in flight (a
    client's prefetch), and stops reading with its lease alive. Alone it may use the whole
    cache; once `other` attaches, its queue is unpinned down to its share (its copies count in
    it) and `other` reads its whole epoch. `paused` then goes on and gets its whole epoch too."""
    registry, pool, _ = make_registry(num_slots=24, lease_s=1000.0)
    paused = attach(registry, "demo", BitMap(range(60)), "paused", 8)
    nxt(registry, paused.job_id, 1, 8, [], max_batches=4)
    pump(registry, pool)
    held = nxt(registry, paused.job_id, 1, 8, [], max_batches=4).item_ids
    pump(registry, pool)
    held += nxt(registry, paused.job_id, 1, 8, [], max_batches=4).item_ids
    pump(registry, pool)
    assert len(held) == 16
    other = attach(registry, "demo", BitMap(range(60)), "other", 8)
    assert sorted(read_epoch(registry, pool, other.job_id, 1, batch=8)) == list(range(60))
    rank = paused.ranks[0]
    assert rank.handed_out == 16 and rank.pinned == 0  # over its share of 12: nothing pinned ahead
    status = {j["name"]: j for j in registry.status()["jobs"]}
    assert status["paused"]["handed_out"] == 16 and status["paused"]["cache_share"] == 12
    # It reads on, acknowledging its first reply: still over its share less its lookahead, so
    # its next reply says to copy at once; then its epoch is whole.
    order = list(held)
    assert nxt(registry, paused.job_id, 1, 8, held[:8], max_batches=4).item_ids == []  # decoding
    pump(registry, pool)
    first = nxt(registry, paused.job_id, 1, 8, [], max_batches=4)
    assert first.copy_now and 0 < len(first.item_ids) <= 8
    acks = held[8:] + first.item_ids
    order += first.item_ids
    while True:
        pump(registry, pool)
        result = nxt(registry, paused.job_id, 1, 8, acks, max_batches=4)
        acks = result.item_ids
        order += result.item_ids
        if result.end_of_epoch:
            break
    assert sorted(order) == list(range(60))


def test_copies_beyond_the_share_get_no_extra_batches_and_ask_for_copy_now() -> None:
    """Two readers of one pass (DataLoader workers handing batches on) hold their replies
    unacknowledged. A reply adds extra batches only while the rank's copies stay within its
    share less its lookahead (here 32 - 8 = 24 items); a reply beyond it says copy_now, and goes
    only to a reader holding no more copies than the other (the loop takes their batches in
    turn); acknowledging brings the rank back within it."""
    registry, pool, _ = make_registry(num_slots=32, lease_s=1000.0)
    job = attach(registry, "demo", BitMap(range(60)), "a", 4)
    assert (job.cache_share, job.queue_capacity) == (32, 8)
    nxt(registry, job.job_id, 1, 4, [], worker_id=0, pid=10, max_batches=4)
    held: dict[int, list[int]] = {0: [], 1: []}
    sizes, flags = [], []
    for worker in (0, 1, 0, 1, 0, 1):
        pump(registry, pool)
        reply = nxt(registry, job.job_id, 1, 4, [], worker_id=worker, pid=10 + worker, max_batches=4)
        held[worker] += reply.item_ids
        sizes.append(len(reply.item_ids))
        flags.append(reply.copy_now)
        assert job.ranks[0].handed_out == len(held[0]) + len(held[1])
    # two batches while within 24 copies, then one; worker 0, ahead of worker 1, waits for it
    assert sizes == [8, 8, 8, 4, 0, 4]
    assert flags == [False, False, False, True, False, True]
    assert nxt(registry, job.job_id, 1, 4, held[0], worker_id=0, pid=10, max_batches=4).item_ids == []
    pump(registry, pool)  # worker 0's 16 copies acknowledged: its queue is pinned and decoded again
    reply = nxt(registry, job.job_id, 1, 4, [], worker_id=0, pid=10, max_batches=4)
    assert not reply.copy_now and len(reply.item_ids) == 8  # 16 + 8 copies: within 24 again


def test_a_worker_ahead_of_one_that_has_not_asked_yet_waits_for_it() -> None:
    """Fresh DataLoader workers ask one by one. In a cache of three batches, worker 0 of the
    second pass asks three times before worker 1 first asks, acknowledging nothing (its batches
    wait in the DataLoader's queue until the loop took worker 1's). Beyond the copies budget it
    gets nothing more (the rank's previous pass had two workers); worker 1 gets the next batch,
    with copy_now. Dealt first come, worker 0 took the whole cache and the loop hung."""
    registry, pool, _ = make_registry(num_slots=24, lease_s=1000.0)
    job = attach(registry, "demo", BitMap(range(40)), "a", 8)
    assert (job.cache_share, job.queue_capacity) == (24, 8)  # copies budget: 24 - 8
    for worker in (0, 1):  # the first pass: two workers, read through
        nxt(registry, job.job_id, 1, 8, [], worker_id=worker, pid=10 + worker)
    acks: dict[int, list[int]] = {0: [], 1: []}
    done = {0: False, 1: False}
    while not all(done.values()):
        pump(registry, pool)
        for worker in (0, 1):
            if not done[worker]:
                result = nxt(registry, job.job_id, 1, 8, acks[worker], worker_id=worker, pid=10 + worker)
                acks[worker], done[worker] = result.item_ids, result.end_of_epoch
    for worker in (0, 1):
        nxt(registry, job.job_id, 1, 0, acks[worker], worker_id=worker, pid=10 + worker)
    sizes = []
    for _ in range(3):  # the second pass: worker 0 alone so far
        pump(registry, pool)
        sizes.append(len(nxt(registry, job.job_id, 2, 8, [], worker_id=0, pid=20).item_ids))
    assert sizes == [8, 8, 0] and job.ranks[0].handed_out == 16
    pump(registry, pool)
    first = nxt(registry, job.job_id, 2, 8, [], worker_id=1, pid=21)
    assert len(first.item_ids) == 8 and first.copy_now


def test_an_impossible_resume_parts_is_refused_and_a_waiting_resume_is_shown() -> None:
    registry, _, _ = make_registry(num_slots=30)
    job = attach(registry, "demo", BitMap(range(20)), "a", 4)
    with pytest.raises(InvalidArgumentError, match=r"resume_parts 5000 .*1\.\.1024.*num_workers"):
        nxt(registry, job.job_id, 5, 4, [], resume_epoch=2, resume_consumed=BitMap(range(3)), resume_parts=5000)
    assert job.resume is None
    for worker in (0, 1):  # a state that says five readers report; two do
        nxt(registry, job.job_id, 5, 4, [], worker_id=worker, pid=10 + worker,
            resume_epoch=2, resume_consumed=BitMap([worker]), resume_parts=5)
    waiting = registry.status()["jobs"][0]["waiting"]
    assert waiting["for"] == "resume_reports" and waiting["epoch"] == 2
    assert waiting["ranks"] == [{"rank": 0, "reports": 2, "parts": 5}]
    assert "rank 0: 2 of 5" in waiting["detail"]


def test_lease_keepers_reports_resume_a_restarted_ddp_epoch_before_any_reader_asks() -> None:
    """After a restart each rank's lease keeper attaches again with what the rank received of
    its epoch (its client board). The epoch resumes on those reports: rank 0's reader is served
    while rank 1's has not asked (a DDP rank blocked in an all_reduce that waits for rank 0),
    and rank 1's own report, when it comes, joins without a second resume. Exactly once."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(24))
    consumed = {0: BitMap([0, 5, 7]), 1: BitMap([2, 3])}
    jobs = [attach(registry, "demo", items, "ddp", 4, rank=r, world_size=2,
                   restart_report=(2, consumed[r])) for r in (0, 1)]
    job = jobs[0]
    assert jobs[1] is job and job.resume is None and job.resumed_epoch == 2
    got: dict[int, list[int]] = {0: [], 1: []}
    acks: dict[int, list[int]] = {0: [], 1: []}
    done = {0: False, 1: False}

    def ask(rank: int) -> None:
        result = nxt(registry, job.job_id, 7 + rank, 4, acks[rank], rank=rank, resume_epoch=2,
                     resume_consumed=consumed[rank])
        assert result.epoch == 2
        acks[rank] = result.item_ids
        got[rank] += result.item_ids
        done[rank] = result.end_of_epoch

    for _ in range(20):  # rank 0 alone: its next batch comes while rank 1 has not asked
        pump(registry, pool)
        ask(0)
        if got[0]:
            break
    assert len(got[0]) == 4, "rank 0 was not served before rank 1's reader asked"
    for _ in range(200):
        pump(registry, pool)
        for rank in (1, 0):
            if not done[rank]:
                ask(rank)
        if all(done.values()):
            break
    delivered = got[0] + got[1] + list(consumed[0]) + list(consumed[1])
    assert sorted(set(delivered)) == list(range(24)) and len(delivered) - len(set(delivered)) <= 1  # padding


def test_a_passs_workers_are_dealt_in_the_loops_turn_beside_a_job_holding_the_cache() -> None:
    """A DataLoader takes worker 0's batch, worker 1's, worker 0's next, ... Beside a job that
    stopped reading with 24 of 32 slots in copies, a two-worker reader has one batch of cache.
    Worker 0, having copied its batch, asks again (acknowledging it) before worker 1 was dealt
    its first: dealt first come, worker 0's second batch would sit unread in a suspended worker
    while the loop waits for worker 1's, which has nowhere to decode into (the job got no item
    for good). In turn, worker 0 waits; worker 1 is dealt next; the pass reads its epoch through,
    exactly once, and a worker whose part ended does not hold up the other."""
    registry, pool, _ = make_registry(num_slots=32, lease_s=1000.0)
    paused = attach(registry, "demo", BitMap(range(60)), "paused", 8)
    held: list[int] = []
    while len(held) < 24:  # its DataLoader workers' prefetch: replies it never acknowledges
        pump(registry, pool)
        held += nxt(registry, paused.job_id, 1, 8, [], pid=10).item_ids
    assert len(held) == 24
    reader = attach(registry, "demo", BitMap(range(40)), "reader", 8)
    assert reader.cache_share == 16
    nxt(registry, reader.job_id, 2, 8, [], worker_id=0, pid=20, num_workers=2)  # starts its rounds
    pump(registry, pool)
    first = nxt(registry, reader.job_id, 2, 8, [], worker_id=0, pid=20, num_workers=2)
    assert len(first.item_ids) == 8
    pump(registry, pool)
    # worker 0 copied its batch out and asks for its next: the loop's third batch, not its second
    assert nxt(registry, reader.job_id, 2, 8, first.item_ids, worker_id=0, pid=20, num_workers=2).item_ids == []
    order = list(first.item_ids)
    acks: dict[int, list[int]] = {0: [], 1: []}
    done = {0: False, 1: False}
    turns = []
    for _ in range(40):
        pump(registry, pool)
        for worker in (1, 0):  # worker 1 asks first from here on: the turn, not the order of asking, decides
            if done[worker]:
                continue
            reply = nxt(registry, reader.job_id, 2, 8, acks[worker], worker_id=worker, pid=20 + worker, num_workers=2)
            acks[worker], done[worker] = reply.item_ids, reply.end_of_epoch
            if reply.item_ids:
                turns.append(worker)
            order += reply.item_ids
        if all(done.values()):
            break
    assert sorted(order) == list(range(40))
    assert turns == [1, 0, 1, 0]  # batches 2..5 of the epoch, each to the worker the loop reads next


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_lone_reader_has_no_turn_to_keep(num_workers: int) -> None:
    """The training process says num_workers 1 (a request that says nothing counts the same):
    its reader takes its second batch at once, with no other reader to wait for."""
    registry, pool, _ = make_registry(num_slots=40, lease_s=1000.0)
    job = attach(registry, "demo", BitMap(range(40)), "a", 4)
    pump(registry, pool)
    first = nxt(registry, job.job_id, 1, 4, [], worker_id=0, pid=10, num_workers=num_workers)
    pump(registry, pool)
    assert len(nxt(registry, job.job_id, 1, 4, first.item_ids, worker_id=0, pid=10,
                   num_workers=num_workers).item_ids) == 4


@pytest.mark.parametrize("seed", range(6))
def test_late_joiners_with_a_cache_that_holds_the_dataset_keep_refcounts_and_epochs(seed: int) -> None:
    """Issue 27, finding 0: four jobs of a sweep start a little apart over one source whose
    whole prepared data fits the cache (the default 1 GiB for a small dataset), so items are
    reused across epochs, and late joiners align onto a running job's rest (--epoch-align
    first). A round that aligned one joiner gave a pick to another that had attached and not
    read yet; the scheduler died of "refcount would drop to -1", or an epoch repeated an item.
    Every step is checked against the jobs' books (refcounts and pins), every epoch exactly once."""
    registry, pool, _ = make_registry(num_slots=3 * NUM_ITEMS)
    rng = random.Random(seed)
    epochs_wanted = 3
    orders: dict[str, list[list[int]]] = {}
    acks: dict[str, list[int]] = {}
    jobs: list[str] = []
    for step in range(20_000):
        if len(jobs) < 4 and step >= 5 * len(jobs):  # each joins a few batches after the last
            job = attach(registry, "demo", BitMap(range(24)), f"trial{len(jobs)}", 4, seed=rng.randrange(1 << 30))
            jobs.append(job.job_id)
            orders[job.job_id], acks[job.job_id] = [[]], []
        pump(registry, pool)
        # A script attaches when it builds its dataset and reads once its model is built.
        reading = [j for k, j in enumerate(jobs) if len(orders[j]) <= epochs_wanted and step >= 5 * k + 12]
        if not reading:
            if len(jobs) == 4 and all(len(orders[j]) > epochs_wanted for j in jobs):
                break
            continue
        job_id = rng.choices(reading, weights=[1 + jobs.index(j) for j in reading])[0]  # uneven speeds
        token = len(orders[job_id])  # one pass (iter()) per epoch
        result = nxt(registry, job_id, token, 4, acks[job_id])
        acks[job_id] = result.item_ids
        orders[job_id][-1] += result.item_ids
        if result.end_of_epoch:
            orders[job_id].append([])
            acks[job_id] = nxt(registry, job_id, token, 0, acks[job_id]).item_ids
    else:
        raise AssertionError("the jobs did not finish their epochs")
    for job_id in jobs:
        for epoch in orders[job_id][:epochs_wanted]:
            assert sorted(epoch) == list(range(24)), f"{job_id}: an epoch not exactly once: {[len(e) for e in orders[job_id]]}"


def _read_ddp_epoch(registry: Registry, pool: FakePool, job: Job, asks: dict[int, dict[str, object]],
                    first: int = 0, rounds: int = 300) -> tuple[dict[int, list[int]], set[int]]:
    """Reads one pass per rank to its end (rank `first` is served a batch before the other
    asks, when it can be). `asks[rank]`: the extra fields of that rank's requests (its token
    and any resume fields). Returns each rank's items and the epoch numbers its replies named."""
    got: dict[int, list[int]] = {rank: [] for rank in asks}
    acks: dict[int, list[int]] = {rank: [] for rank in asks}
    done = dict.fromkeys(asks, False)
    epochs: set[int] = set()
    order = [first] + [rank for rank in asks if rank != first]
    for _ in range(rounds):
        pump(registry, pool)
        for rank in order:
            if done[rank]:
                continue
            fields = dict(asks[rank])
            token = int(fields.pop("token"))  # type: ignore[call-overload]
            result = nxt(registry, job.job_id, token, 4, acks[rank], rank=rank, pid=100 + rank, **fields)
            if result.item_ids or result.end_of_epoch:
                epochs.add(result.epoch)
            acks[rank], done[rank] = result.item_ids, result.end_of_epoch
            got[rank] += result.item_ids
            if rank == first and not got[first] and not done[first]:
                break  # the other rank asks once this one had a batch: it sits in an all_reduce
        if all(done.values()):
            return got, epochs
    raise AssertionError(f"the epoch did not end: ranks done {done}, items {[len(g) for g in got.values()]}, "
                         f"waiting {registry.status()['jobs'][0].get('waiting')}")


@pytest.mark.parametrize("stale", [(0,), (0, 1)], ids=["one-rank-stale", "both-ranks-stale"])
def test_after_a_restart_the_next_epoch_is_a_new_pass_whichever_rank_asks_first(stale: tuple[int, ...]) -> None:
    """Issue 27, finding 2. joaderd restarted mid-epoch 1 of a 2-rank job: the lease keepers
    re-attach with what their ranks received (the client board), the interrupted passes finish
    epoch 1. Then epoch 2 starts plainly on both ranks, but a rank whose training process had
    not adopted the restart yet asks with the epoch number it expects (2) and nothing consumed.
    That is a new pass, not a resume: with one rank "resuming" and the other plain, the job sat
    out for the resume report the plain rank never sends (the hang of the 2-host test); with both
    "resuming", rank 0 was handed its queued epoch-2 items while the resume gathered, and the
    resume then dealt the whole epoch again (34 items twice, 34 never). Exactly once, no wait."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(24))
    consumed = {0: BitMap([0, 5, 7, 9]), 1: BitMap([2, 3, 11, 12])}
    job = attach(registry, "demo", items, "ddp", 4, rank=0, world_size=2, restart_report=(1, consumed[0]))
    assert attach(registry, "demo", items, "ddp", 4, rank=1, world_size=2, restart_report=(1, consumed[1])) is job
    interrupted = {rank: {"token": 7 + rank, "resume_epoch": 1, "resume_consumed": consumed[rank]} for rank in (0, 1)}
    got, epochs = _read_ddp_epoch(registry, pool, job, interrupted)
    first = got[0] + got[1] + list(consumed[0]) + list(consumed[1])
    assert epochs == {1} and sorted(first) == list(range(24))
    new = {rank: {"token": 20 + rank} for rank in (0, 1)}
    for rank in stale:
        new[rank].update(resume_epoch=2, resume_consumed=BitMap())
    got, epochs = _read_ddp_epoch(registry, pool, job, new)
    assert epochs == {2}
    assert sorted(got[0] + got[1]) == list(range(24)), (
        f"duplicated {len(got[0]) + len(got[1]) - len(set(got[0] + got[1]))}, "
        f"missing {len(set(range(24)) - set(got[0] + got[1]))}")


def test_a_restarts_resume_is_decided_from_the_keepers_reports_alone() -> None:
    """`decide_restart`: the newest reported epoch resumes without what its ranks received; a
    rank that reported an older epoch is past it (its next pass reads the resumed one), and a
    rank that reported nothing received nothing."""
    assert decide_restart({}, 2) is None
    decision = decide_restart({0: (2, BitMap([1, 2])), 1: (1, BitMap(range(12))), 3: (2, BitMap([5]))}, 4)
    assert decision is not None and decision.epoch == 2
    assert decision.consumed == [BitMap([1, 2]), BitMap(), BitMap(), BitMap([5])]
    assert decision.claimed == [2, 1, 1, 2] and decision.behind == [1]


def test_after_a_restart_passes_continue_or_start_as_the_client_says_and_the_numbering_goes_on() -> None:
    """The client's own messages after a restart: rank 0's keeper reports epoch 2 (it read 6
    items of it), rank 1's epoch 1 (all its 12; it had not started epoch 2). Rank 0's
    interrupted pass continues epoch 2; rank 1's interrupted pass of epoch 1 ends at once, and
    its new pass reads epoch 2. Then both ranks' next passes are epoch 3, whole: the numbering
    is the client's, whoever adopted the restart first (an acknowledgement once did, and the
    next pass was dealt epoch 1 again)."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(24))
    read = BitMap([0, 4, 8, 12, 16, 20])
    job = attach(registry, "demo", items, "ddp", 4, rank=0, world_size=2, restart_report=(2, read))
    assert job.resumed_epoch == 0  # rank 1 has not attached: nothing decided yet
    nxt(registry, job.job_id, 7, 4, [], rank=0, pid=100, continue_epoch=2)  # before rank 1 attached
    assert attach(registry, "demo", items, "ddp", 4, rank=1, world_size=2,
                  restart_report=(1, BitMap(range(1, 24, 2)))) is job
    assert job.resumed_epoch == 2 and job.resume is None
    ended = nxt(registry, job.job_id, 8, 4, [], rank=1, pid=101, continue_epoch=1)
    assert ended.epoch == 1 and ended.end_of_epoch and not ended.item_ids
    got, epochs = _read_ddp_epoch(registry, pool, job, {0: {"token": 7, "continue_epoch": 2}, 1: {"token": 9}},
                                  first=1)  # the rank furthest from its share is dealt first
    assert epochs == {2} and sorted(got[0] + got[1] + list(read)) == list(range(24))
    assert len(got[0]) == 12 - len(read) and len(got[1]) == 12
    got, epochs = _read_ddp_epoch(registry, pool, job, {0: {"token": 10}, 1: {"token": 11}})
    assert epochs == {3} and sorted(got[0] + got[1]) == list(range(24))


def test_a_continuation_never_supersedes_a_newer_pass() -> None:
    """A straggling request of a pass the restart interrupted (epoch 1) after the rank's new
    pass (epoch 2) started on the restarted joaderd: it is the superseded one."""
    registry, pool, _ = make_registry(num_slots=40)
    job = attach(registry, "demo", BitMap(range(20)), "a", 4, restart_report=(1, BitMap(range(20))))
    pump(registry, pool)
    assert nxt(registry, job.job_id, 5, 4, [], continue_epoch=0).epoch == 2
    with pytest.raises(PassSupersededError):
        nxt(registry, job.job_id, 4, 4, [], continue_epoch=1)
    assert sorted(read_epoch(registry, pool, job.job_id, 5)) == list(range(20))


def test_a_pending_resume_hands_out_nothing_of_its_epoch_while_it_gathers() -> None:
    """A checkpoint's resume of epoch 2 waits for rank 1's report; rank 0's queue already holds
    epoch-2 lookahead. Handed out now, those items would be dealt again when the resume starts."""
    registry, pool, _ = make_registry(num_slots=40)
    items = BitMap(range(16))
    job = attach(registry, "demo", items, "ddp", 4, rank=0, world_size=2)
    attach(registry, "demo", items, "ddp", 4, rank=1, world_size=2)
    first, _ = _read_ddp_epoch(registry, pool, job, {0: {"token": 1}, 1: {"token": 2}})
    pump(registry, pool)
    assert any(entry.epoch == 2 for entry in job.ranks[0].queue)  # the next epoch, prepared ahead
    parts = {0: {"token": 3, "resume_epoch": 2, "resume_consumed": BitMap([1])},
             1: {"token": 4, "resume_epoch": 2, "resume_consumed": BitMap([2])}}
    assert nxt(registry, job.job_id, 3, 4, [], rank=0, pid=100, resume_epoch=2,
               resume_consumed=BitMap([1])).item_ids == []
    got, epochs = _read_ddp_epoch(registry, pool, job, parts, first=1)
    assert epochs == {2} and sorted(got[0] + got[1] + [1, 2]) == list(range(16))


def test_a_continued_pass_serves_a_worker_whose_partner_ended_before_the_restart() -> None:
    """Two DataLoader workers read epoch 2; worker 0 had received its part's end when joaderd
    restarted, worker 1 still needed the epoch's last batch. Worker 0 never asks the restarted
    joaderd. The loop's turn (`dealing.turn`) counted on the new server from zero, so worker 0's
    "next batch" came first and worker 1 waited for it for good (`bench/restart_storm.py
    --mode workers`: the job sat with its last batch queued for ten minutes). A pass a restart
    interrupted is dealt without the turn: what each worker was served is on the dead server."""
    registry, pool, _ = make_registry(num_slots=40)
    job = attach(registry, "demo", BitMap(range(24)), "a", 4, restart_report=(2, BitMap(range(20))))
    order: list[int] = []
    acks: list[int] = []
    for _ in range(50):
        pump(registry, pool)
        reply = nxt(registry, job.job_id, 9, 4, acks, worker_id=1, pid=11, num_workers=2, continue_epoch=2)
        assert reply.epoch == 2
        acks = reply.item_ids
        order += reply.item_ids
        if reply.end_of_epoch:
            break
    assert sorted(order) == [20, 21, 22, 23]


def test_a_handoff_batch_larger_than_the_copies_budget_is_dealt_with_copy_now() -> None:
    """Issue 27, finding 3: two hand-off workers (each keeps its batch in progress pinned, as
    arena offsets, until the batch is whole and the training loop copied it) read batches of 20
    from a cache of 24 items, whose copies budget is 12. Worker 0's first reply (12 items, all
    its queue holds) left its batch unfinished; it then had to acknowledge first, which it never
    could, and worker 1 had to wait for worker 0's turn: the job got no item for good. Now a
    reply whose batch cannot be finished within the budget says copy_now (the worker copies and
    acknowledges at once), a reader's own unfinished batch never makes it wait, and the epoch is
    read through, exactly once, in the loop's turn."""
    registry, pool, _ = make_registry(num_slots=24, lease_s=1000.0)
    size = 20
    job = attach(registry, "demo", BitMap(range(NUM_ITEMS)), "big", size)
    for worker in (0, 1):  # both workers of the DataLoader ask at its start
        nxt(registry, job.job_id, 1, size, [], worker_id=worker, pid=10 + worker, num_workers=2)
    assert (job.cache_share, job.queue_capacity) == (24, 12)
    order: list[int] = []
    pinned_batch: dict[int, list[int]] = {0: [], 1: []}  # offsets held until the batch is whole
    batch: dict[int, list[int]] = {0: [], 1: []}
    acks: dict[int, list[int]] = {0: [], 1: []}
    done = {0: False, 1: False}
    batches: list[tuple[int, list[int]]] = []
    for _ in range(200):
        pump(registry, pool)
        for worker in (0, 1):
            if done[worker]:
                continue
            reply = nxt(registry, job.job_id, 1, size, acks[worker], worker_id=worker, pid=10 + worker,
                        num_workers=2)
            acks[worker] = []
            done[worker] = reply.end_of_epoch
            if reply.copy_now:
                acks[worker] += reply.item_ids  # copied out by the worker: acknowledged at once
            else:
                pinned_batch[worker] += reply.item_ids
            assert job.ranks[0].handed_out <= job.cache_share
            for item_id in reply.item_ids:
                batch[worker].append(item_id)
                if len(batch[worker]) == size:  # whole: the loop takes it and copies it out
                    batches.append((worker, batch[worker]))
                    acks[worker] += [i for i in pinned_batch[worker] if i in batch[worker]]
                    pinned_batch[worker] = [i for i in pinned_batch[worker] if i not in batch[worker]]
                    batch[worker] = []
            order += reply.item_ids
        if all(done.values()):
            break
    assert all(done.values()), f"the epoch hung after {len(order)} items"
    assert sorted(order) == list(range(NUM_ITEMS))
    assert [worker for worker, _ in batches] == [0, 1, 0]  # the loop's turn
