"""The Next protocol: whole batches per reply, the copies budget and copy_now, the DataLoader's
turn (server/registry/next_protocol.py, with the rules of server/scheduling/dealing.py), through the registry."""

from __future__ import annotations

import dataclasses

import pytest
from pyroaring import BitMap

from joader.server.registry.next_call import Batch
from tests.support.registry_driver import (
    ITEM_BYTES,
    NUM_ITEMS,
    attach,
    make_registry,
    nxt,
    pump,
    read_epoch,
)

pytestmark = pytest.mark.timeout(60)


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
    # Alone: all ready, and the cache has room, so its queue was filled beyond its capacity for
    # replies of several batches, up to twice its capacity less a batch (NOTE [ Filling for
    # replies of several batches ] in registry.py).
    assert job.queue_fill == 12
    assert len(nxt(registry, job.job_id, 1, 4, [], max_batches=4).item_ids) == 12

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
    assert a.reply_batches == 4 and a.queue_fill == 0  # two jobs: no room to fill beyond the capacity
    # Refilled by shared rounds, a's queue never holds a whole batch beyond its capacity here.
    assert set(sizes) == {4}
    # Without max_batches, one batch per reply as before.
    registry, pool, _ = make_registry(num_slots=60, lookahead_batches=2)
    job = attach(registry, "demo", BitMap(range(60)), "a", 4)
    nxt(registry, job.job_id, 1, 4, [])
    pump(registry, pool)
    assert len(nxt(registry, job.job_id, 1, 4, []).item_ids) == 4


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
    # Its queued items are planned reads, kept in the cache while `other` read (NOTE [ Planned
    # reads ] in item_cache.py): they come at once, or after their decode.
    order = list(held)
    first = nxt(registry, paused.job_id, 1, 8, held[:8], max_batches=4)
    if not first.item_ids:
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
    budget: the share it would have with one more job less its lookahead (here 32 // 2 - 8 = 8
    items; NOTE [ Room for a job that joins ]). A reply beyond it says copy_now, and goes only
    to a reader holding no more copies than the other (the loop takes their batches in turn);
    acknowledging brings the rank back within it."""
    registry, pool, _ = make_registry(num_slots=32, lease_s=1000.0)
    job = attach(registry, "demo", BitMap(range(60)), "a", 4)
    assert (job.cache_share, job.copies_share, job.queue_capacity) == (32, 16, 8)
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
    # two batches while within 8 copies, then one with copy_now; worker 0, ahead of worker 1,
    # waits for it once
    assert sizes == [8, 4, 0, 4, 4, 4]
    assert flags == [False, True, False, True, True, True]
    for worker in (0, 1):  # both acknowledge everything they hold
        assert nxt(registry, job.job_id, 1, 0, held[worker], worker_id=worker, pid=10 + worker).item_ids == []
    assert job.ranks[0].handed_out == 0
    pump(registry, pool)
    reply = nxt(registry, job.job_id, 1, 4, [], worker_id=0, pid=10, max_batches=4)
    assert not reply.copy_now and len(reply.item_ids) == 8  # within the budget again


def test_a_worker_ahead_of_one_that_has_not_asked_yet_waits_for_it() -> None:
    """Fresh DataLoader workers ask one by one. In a cache of three batches, worker 0 of the
    second pass asks three times before worker 1 first asks, acknowledging nothing (its batches
    wait in the DataLoader's queue until the loop took worker 1's). Beyond the copies budget it
    gets nothing more (the rank's previous pass had two workers); worker 1 gets the next batch,
    with copy_now. Dealt first come, worker 0 took the whole cache and the loop hung."""
    registry, pool, _ = make_registry(num_slots=24, lease_s=1000.0)
    job = attach(registry, "demo", BitMap(range(40)), "a", 8)
    assert (job.cache_share, job.copies_share, job.queue_capacity) == (24, 12, 8)  # copies budget: 12 - 8
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
    assert sizes == [8, 0, 0] and job.ranks[0].handed_out == 8  # a whole batch, then nothing more
    pump(registry, pool)
    first = nxt(registry, job.job_id, 2, 8, [], worker_id=1, pid=21)
    assert len(first.item_ids) == 8 and first.copy_now


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


def test_a_settling_item_wakes_a_waiting_next_only_when_its_batch_may_be_ready() -> None:
    """Issue 37: a waiting Next was woken, and polled, each time one of its items settled (a
    batch of 8 decodes: 8 polls). `Registry.item_settled` wakes it at its first ready item
    (its linger starts) and when its batch is ready; the batch is then the first 8 items
    dealt, in order."""
    from joader.server.books.records import Job
    from joader.server.registry.next_call import NextArgs
    from tests.support.registry_driver import SECRETS

    registry, pool, _ = make_registry(num_slots=40)
    job = attach(registry, "demo", BitMap(range(32)), "a", 8)
    assert nxt(registry, job.job_id, 1, 8, []).item_ids == []  # starts the reading
    registry.config = dataclasses.replace(registry.config, next_wait_s=1.0, linger_s=10.0)
    registry.schedule_once()
    wakes: list[int] = []
    call = registry.begin_next(NextArgs(job.job_id, SECRETS[job.job_id], 1, 8), lambda: wakes.append(1))
    assert not isinstance(call, Batch)
    assert isinstance(registry.poll_next(call), float)  # nothing ready: it waits
    dealt = [entry.item_id for entry in job.ranks[0].queue][:8]
    original_wake = Job.wake
    Job.wake = lambda self: None  # the results thread's wake, replaced by the hook below
    try:
        woken_after = []
        for settled in range(1, 9):
            task_id, _, item_id, _ = pool.submitted.pop(0)
            registry.file_result(task_id, True, None, 0.001, shape=(3, 8, 8), dtype="uint8", nbytes=ITEM_BYTES)
            before = len(wakes)
            with registry._cond:
                registry.item_settled(job)
            if len(wakes) > before:
                woken_after.append(settled)
                result = registry.poll_next(call)
        registry.check_invariants()
    finally:
        Job.wake = original_wake  # type: ignore[method-assign]
        registry.end_next(call)
    assert woken_after == [1, 8]
    assert isinstance(result, Batch) and result.item_ids == dealt


def test_a_scheduler_turn_wakes_a_waiting_next_only_when_its_batch_may_be_ready() -> None:
    """Issue 37: after every turn that ran a round, the scheduler woke every job's waiting
    Nexts (cached picks are ready at once): with a warm cache, a poll through the event loop
    per turn and job. Now a turn wakes a call as a settling item does (`item_settled`): at its
    first ready item and when its batch is ready; the batch is then the first 8 items dealt."""
    from joader.server.registry.next_call import NextArgs
    from tests.support.registry_driver import SECRETS

    registry, pool, _ = make_registry(num_slots=40)
    warm = attach(registry, "demo", BitMap(range(32)), "warm", 8)
    assert sorted(read_epoch(registry, pool, warm.job_id, 1, 8)) == list(range(32))  # all cached now
    job = attach(registry, "demo", BitMap(range(32)), "a", 8)
    assert nxt(registry, job.job_id, 1, 8, []).item_ids == []  # starts the reading
    registry.config = dataclasses.replace(registry.config, next_wait_s=1.0, linger_s=10.0, rounds_per_lock=1)
    wakes: list[int] = []
    call = registry.begin_next(NextArgs(job.job_id, SECRETS[job.job_id], 1, 8), lambda: wakes.append(1))
    assert not isinstance(call, Batch)
    try:
        assert isinstance(registry.poll_next(call), float)  # nothing queued: it waits
        woken_after, result, dealt = [], None, []
        for turn in range(1, 9):
            before = len(wakes)
            assert registry.schedule_once()  # one round: one cached item dealt to `job`
            assert not pool.submitted, "the items are cached: nothing to decode"
            if len(wakes) > before:
                woken_after.append(turn)
                dealt = [entry.item_id for entry in job.ranks[0].queue][:8]
                result = registry.poll_next(call)
        registry.check_invariants()
    finally:
        registry.end_next(call)
    assert woken_after == [1, 8]
    assert isinstance(result, Batch) and result.item_ids == dealt


def test_each_delivered_item_carries_its_own_label() -> None:
    """Issue 37: a reply's labels are gathered from the source's label array after the
    per-item loop; each must still be its item's (the driver's items are labelled i % 2)."""
    registry, pool, _ = make_registry(num_slots=40)
    job = attach(registry, "demo", BitMap(range(0, 60, 3)) | BitMap([1, 7]), "a", 4)
    acks: list[int] = []
    seen = []
    while True:
        pump(registry, pool)
        result = nxt(registry, job.job_id, 1, 4, acks)
        acks = result.item_ids
        assert result.labels == [item_id % 2 for item_id in result.item_ids]
        assert all(type(label) is int for label in result.labels)
        seen += result.item_ids
        if result.end_of_epoch:
            break
    assert sorted(seen) == sorted(BitMap(range(0, 60, 3)) | BitMap([1, 7]))


def test_queues_fill_beyond_their_capacity_only_while_nothing_decodes() -> None:
    """NOTE [ Filling for replies of several batches ]: while decodes wait or run, rounds fill a
    queue to its capacity only (a reply could take no extra batch, and a deeper queue cost main
    CPU per decode); once they settled, to its fill again, and a reply takes the extra batches."""
    registry, pool, _ = make_registry(num_slots=60, lookahead_batches=2)
    job = attach(registry, "demo", BitMap(range(60)), "a", 4)
    assert nxt(registry, job.job_id, 1, 4, [], max_batches=4).item_ids == []  # starts the reading
    assert job.queue_capacity == 8 and job.queue_fill == 12
    rank, scheduler = job.ranks[0], registry._scheduler
    registry.schedule_once()
    assert len(rank.queue) == 12 and pool.submitted  # nothing was decoding yet: to its fill
    head = {id(entry) for entry in list(rank.queue)[:8]}
    scheduler.drop_queue(rank, lambda entry: id(entry) in head)  # its first 8 read
    while registry.schedule_once():
        pass
    assert len(rank.queue) == 8  # its 4 left still decoding: to its capacity only
    pool.finish(registry)
    registry.schedule_once()
    assert len(rank.queue) == 12  # every decode landed: to its fill
    pump(registry, pool)
    assert len(nxt(registry, job.job_id, 1, 4, [], max_batches=4).item_ids) == 12
