"""Filing finished decodes in batches (`Registry.file_results`, server/registry/filing.py): a batch filed
under one acquisition of the lock leaves the same books as its items filed one by one, and one
result that cannot be filed loses none of the others."""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from typing import Any

import pytest
from pyroaring import BitMap

from joader.server.registry.registry import Registry
from tests.support.registry_driver import (
    ITEM_BYTES,
    NUM_ITEMS,
    FakePool,
    attach,
    make_registry,
    nxt,
)

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class Result:
    """A finished decode as the pool reports it (`DecodeResult`'s filed fields)."""

    task_id: int
    ok: bool
    error: str | None
    decode_s: float = 0.001
    shape: tuple[int, ...] = (3, 8, 8)
    dtype: str = "uint8"
    nbytes: int = ITEM_BYTES
    checksum: int = 7
    size_only: bool = False


class CountingLock:
    """The registry's lock, counting its acquisitions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.acquired = 0

    def acquire(self, *args: Any) -> bool:
        self.acquired += 1
        return self._lock.acquire(*args)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _books(registry: Registry) -> tuple[Any, ...]:
    """What filing changes, but where in the arena the ranges lie: a batch dispatches the
    decodes it freed after its last item, not after each, so a range a failed item freed is
    reused by then (the same bytes are used and free, in other places). Jobs by name (a job
    id has a random part)."""
    registry.check_invariants()
    cache = registry.cache
    items = {key: (item.state.name, item.pins, item.shape, item.dtype, item.nbytes, item.checksum,
                   sorted(job.name for job in cache.waiters.get(key, ())), cache.policy.refcount(key) if key in cache.policy else None)
             for key, item in cache.items.items()}
    text = json.dumps(registry.status(), sort_keys=True, default=str)
    for job in registry.jobs.jobs.values():
        text = text.replace(job.job_id, job.name)
    status = json.loads(text)
    for layout in ("largest_free_bytes", "fragmentation"):  # where the ranges lie, not how many bytes
        status["cache"].pop(layout)
    return items, status


def _run(seed: int) -> None:
    """Two registries driven alike, by one seeded random sequence of rounds, Next calls and
    finished decodes: `one` files each result with `file_result`, `batched` files the same
    results, taken in random batches, with `file_results`."""
    rng = random.Random(seed)
    one, one_pool, _ = make_registry(num_slots=NUM_ITEMS, lease_s=1000.0)
    batched, batched_pool, _ = make_registry(num_slots=NUM_ITEMS, lease_s=1000.0)
    jobs = [(attach(one, "demo", BitMap(range(NUM_ITEMS)), name, 4, seed=seed + i),
             attach(batched, "demo", BitMap(range(NUM_ITEMS)), name, 4, seed=seed + i))
            for i, name in enumerate(("a", "b"))]
    acks: list[list[int]] = [[] for _ in jobs]
    tokens = [1 for _ in jobs]
    bad = set(rng.sample(range(NUM_ITEMS), 6))
    for _ in range(400):
        action = rng.random()
        if action < 0.3:
            assert one.schedule_once() == batched.schedule_once()
        elif action < 0.7 and one_pool.submitted:
            _finish(rng, one, one_pool, batched, batched_pool, bad)
        else:
            index = rng.randrange(len(jobs))
            want = rng.randint(0, 6)
            replies = [nxt(registry, job.job_id, tokens[index], want, acks[index])
                       for registry, job in zip((one, batched), jobs[index], strict=True)]
            assert replies[0].item_ids == replies[1].item_ids and replies[0].failed == replies[1].failed
            assert replies[0].end_of_epoch == replies[1].end_of_epoch
            acks[index] = replies[0].item_ids
            if replies[0].end_of_epoch:
                tokens[index] += 1
        assert _books(one) == _books(batched)


def _finish(rng: random.Random, one: Registry, one_pool: FakePool, batched: Registry, batched_pool: FakePool,
            bad: set[int]) -> None:
    """Takes the first results of both pools (all taken before filing, as `get_results` does)."""
    assert [t[:3] for t in one_pool.submitted] == [t[:3] for t in batched_pool.submitted]
    count = rng.randint(1, len(one_pool.submitted))
    taken = one_pool.submitted[:count]
    del one_pool.submitted[:count], batched_pool.submitted[:count]
    results = [Result(task_id, item_id not in bad, None if item_id not in bad else "truncated")
               for task_id, _, item_id, _ in taken]
    for result in results:
        one.file_result(result.task_id, result.ok, result.error, result.decode_s, shape=result.shape,
                        dtype=result.dtype, nbytes=result.nbytes, checksum=result.checksum)
    batched.file_results(results)


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_filed_at_once_leaves_the_books_of_its_items_filed_one_by_one(seed: int) -> None:
    _run(seed)


def test_a_batch_is_filed_under_one_acquisition_of_the_lock() -> None:
    registry, pool, _ = make_registry(num_slots=NUM_ITEMS)
    job = attach(registry, "demo", BitMap(range(20)), "a", 4)
    nxt(registry, job.job_id, 1, 4, [])
    registry.schedule_once()
    results = [Result(task_id, True, None) for task_id, _, _, _ in pool.submitted]
    pool.submitted.clear()
    assert len(results) > 1
    lock = CountingLock()
    registry._lock = lock  # type: ignore[assignment]
    registry._cond = threading.Condition(lock)  # type: ignore[arg-type]
    registry.file_results(results)
    assert lock.acquired == 1
    assert all(registry.cache.items[r.task_id].state.name == "READY" for r in results)


def test_one_result_that_cannot_be_filed_ends_its_waiters_and_the_rest_of_the_batch_is_filed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Containment per item, as `@contained` gives `file_result`: the jobs waiting for the bad
    one end, the others' items are filed, and the books are recounted from the jobs left."""
    registry, pool, _ = make_registry(num_slots=NUM_ITEMS)
    a = attach(registry, "demo", BitMap(range(0, 20)), "a", 4)
    b = attach(registry, "demo", BitMap(range(30, 50)), "b", 4)
    nxt(registry, a.job_id, 1, 4, [])
    nxt(registry, b.job_id, 1, 4, [])
    registry.schedule_once()
    results = [Result(task_id, True, None) for task_id, _, _, _ in pool.submitted]
    pool.submitted.clear()
    bad = next(r for r in results if registry.waiting_for(r.task_id) == [a.job_id])
    original = registry.cache.file_result

    def file_result(key: int, *args: Any, **kwargs: Any) -> Any:
        if key == bad.task_id:
            raise AssertionError("books disagree")
        return original(key, *args, **kwargs)

    monkeypatch.setattr(registry.cache, "file_result", file_result)
    registry.file_results(results)
    monkeypatch.undo()
    assert a.job_id not in registry.jobs.jobs and b.job_id in registry.jobs.jobs
    others = [r for r in results if a.job_id not in registry.waiting_for(r.task_id) and r.task_id in registry.cache.items
              and r is not bad]
    b_keys = {r.task_id for r in results if r.task_id - registry.source("demo").key_base >= 30}
    assert b_keys and all(registry.cache.items[key].state.name == "READY" for key in b_keys)
    assert others
    registry.check_invariants()
    assert registry.status()["internal_errors"] == 1


def test_a_batch_wakes_each_waiting_job_once_not_once_per_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ One wake per job and batch ] (server/registry/filing.py)."""
    registry, pool, _ = make_registry(num_slots=NUM_ITEMS)
    jobs = [attach(registry, "demo", BitMap(range(20)), name, 4, seed=3) for name in ("a", "b")]
    for job in jobs:
        nxt(registry, job.job_id, 1, 4, [])
    registry.schedule_once()
    results = [Result(task_id, True, None) for task_id, _, _, _ in pool.submitted]
    pool.submitted.clear()
    waits = [job_id for r in results for job_id in registry.waiting_for(r.task_id)]
    waiting = set(waits)
    assert waiting == {job.job_id for job in jobs} and len(waits) > len(waiting)  # a job waits for several
    woken: list[str] = []
    original = registry.item_settled
    monkeypatch.setattr(registry, "item_settled", lambda job: (woken.append(job.job_id), original(job))[1])
    registry.file_results(results)
    assert sorted(woken) == sorted(waiting)  # each once, after the batch
    assert all(registry.cache.items[r.task_id].state.name == "READY" and not registry.waiting_for(r.task_id)
               for r in results)
