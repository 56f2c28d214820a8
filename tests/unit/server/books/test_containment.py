"""Containment (server/books/containment.py): a bookkeeping error in one job's part of joaderd ends
that job, loudly, and every other job goes on with correct books; it never stops the server.

Driven like test_registry.py (fake pool, fake clock), with the error injected where the field
met it: the scheduler thread dealing a round, a `Next`, a removal, a decode being filed."""

from __future__ import annotations

import pytest
from pyroaring import BitMap

from joader.errors import InvariantError, JobEndedError, UnknownJobError
from joader.server.scheduling.scheduler import Scheduler
from tests.support.registry_driver import attach, make_registry, nxt, pump, read_epoch

pytestmark = pytest.mark.timeout(60)


def _two_jobs():  # type: ignore[no-untyped-def]
    registry, pool, clock = make_registry(num_slots=40)
    a = attach(registry, "demo", BitMap(range(30)), "a", 4)
    b = attach(registry, "demo", BitMap(range(30)), "b", 4)
    return registry, pool, a, b


def test_a_round_that_breaks_for_one_job_ends_that_job_and_the_others_read_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    registry, pool, a, b = _two_jobs()
    enqueue, deal_drawn = Scheduler._enqueue, Scheduler._deal_drawn
    dealt = {"n": 0}

    def count(job, picks: int) -> None:  # type: ignore[no-untyped-def]
        if job.name == "b":
            before = dealt["n"]
            dealt["n"] += picks
            if before < 10 <= dealt["n"]:
                raise InvariantError("cache policy: refcount of 7 would drop to -1 (injected)")

    def broken(self, job, rank, share, item_id, *, consumed):  # type: ignore[no-untyped-def]
        count(job, 1)
        enqueue(self, job, rank, share, item_id, consumed=consumed)

    def broken_drawn(self, job, item_ids, left):  # type: ignore[no-untyped-def]
        count(job, len(item_ids))  # (a batch of drawn rounds deals a job's picks at once)
        deal_drawn(self, job, item_ids, left)

    monkeypatch.setattr(Scheduler, "_enqueue", broken)
    monkeypatch.setattr(Scheduler, "_deal_drawn", broken_drawn)
    assert nxt(registry, b.job_id, 1, 4, []).item_ids == []  # b starts reading
    orders = [read_epoch(registry, pool, a.job_id, token=t) for t in (1, 2)]
    assert [sorted(order) for order in orders] == [list(range(30))] * 2
    with pytest.raises(UnknownJobError, match="internal error in dealing a DSA round.*other jobs go on"):
        nxt(registry, b.job_id, 1, 4, [])
    status = registry.status()
    assert status["internal_errors"] == 1 and status["jobs_ended_by_errors"] == 1
    assert [job["name"] for job in status["jobs"]] == ["a"]


def test_a_next_that_breaks_ends_its_job_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    registry, pool, a, b = _two_jobs()
    pump(registry, pool)
    first = nxt(registry, b.job_id, 1, 4, [])
    pump(registry, pool)
    first = nxt(registry, b.job_id, 1, 4, first.item_ids)
    assert first.item_ids
    acknowledge = registry.passes.acknowledge

    def broken(job, *args, **kwargs):  # type: ignore[no-untyped-def]
        if job.name == "b":
            raise KeyError(12345)  # a missing key in its books, as a bug would
        acknowledge(job, *args, **kwargs)

    monkeypatch.setattr(registry.passes, "acknowledge", broken)
    with pytest.raises(JobEndedError, match="internal error in Next.*start the job again"):
        nxt(registry, b.job_id, 1, 4, first.item_ids)
    assert sorted(read_epoch(registry, pool, a.job_id, token=1)) == list(range(30))


def test_removing_a_job_whose_books_broke_recounts_the_cache_from_the_others() -> None:
    registry, pool, a, b = _two_jobs()
    pump(registry, pool)
    nxt(registry, b.job_id, 1, 4, [])
    pump(registry, pool)
    got = nxt(registry, b.job_id, 1, 4, [])
    assert got.item_ids
    # b's books lie: it believes it holds copies it was never handed (a release would underflow).
    pass_ = next(iter(b.ranks[0].passes.values()))
    for key in list(pass_.outstanding):
        pass_.outstanding[key] += 3
        pass_.held[0] += 3
        b.ranks[0].handed_out += 3
    assert registry.remove_job(b.job_id, "its lease ended")  # no exception reaches the caller
    registry.check_invariants()
    assert sorted(read_epoch(registry, pool, a.job_id, token=1)) == list(range(30))
    assert registry.status()["internal_errors"] == 1


def test_a_decode_that_cannot_be_filed_ends_the_jobs_waiting_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    registry, pool, a, b = _two_jobs()
    nxt(registry, a.job_id, 1, 4, [])
    nxt(registry, b.job_id, 1, 4, [])
    registry.schedule_once()
    assert pool.submitted
    task_id, _, item_id, _ = pool.submitted.pop(0)
    waiting = registry.waiting_for(task_id)
    assert waiting
    monkeypatch.setattr(registry.cache, "file_result",
                        lambda *args, **kwargs: (_ for _ in ()).throw(AssertionError("books disagree")))
    assert registry.file_result(task_id, True, None, 0.001) is None  # the results thread lives on
    monkeypatch.undo()
    assert not set(waiting) & set(registry.jobs.jobs)
    registry.check_invariants()
