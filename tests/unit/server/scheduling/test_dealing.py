"""Dealing (server/scheduling/dealing.py): its rules and reply sizes, against obviously-correct models.

The models say each rule the long way round: the loop's turn by walking the DataLoader's order
batch by batch, a reply's size by trying every number of whole batches, `copy_now` by copying
the rest of a batch item by item. Seeded random cases compare the two.
"""

from __future__ import annotations

import random

import pytest

from joader.server.scheduling import dealing
from joader.server.scheduling.dealing import Turn

pytestmark = pytest.mark.timeout(60)

CASES = 3000


# ----------------------------------------------------------------------------- models


def model_next_reader(served: dict[int, int], batch_items: int, num_workers: int, ended: set[int],
                      caller: int) -> int:
    """The reader the DataLoader's loop needs a batch from next: walk its order (worker 0's
    batch 0, worker 1's batch 0, ..., worker 0's batch 1, ...) to the first batch not dealt
    yet, skipping readers whose part ended (the caller is asking, so it counts)."""
    dealt = {w: served.get(w, 0) // batch_items for w in range(num_workers)}
    position = 0
    while True:
        worker, batch = position % num_workers, position // num_workers
        if (worker == caller or worker not in ended) and batch >= dealt[worker]:
            return worker
        position += 1


def model_reply_size(*, size: int, max_batches: int, queue_len: int, keep: int, handed_out: int,
                     budget: int, left: int | None, ready_head: int) -> int:
    """Try every number of whole batches: the most whose each constraint holds (no more than
    asked, `keep` left queued, copies within the budget), then the largest size of those
    batches (or the epoch's rest) that is all ready; one batch whatever happens."""
    def allowed(k: int) -> bool:
        return k <= max_batches and queue_len - k * size >= keep and handed_out + k * size <= budget

    k = 1
    if min(ready_head, size) >= size:
        while allowed(k + 1):
            k += 1
    if k == 1:
        return size
    most = k * size if left is None else min(k * size, left)
    candidates = [most] + [j * size for j in range(1, k + 1) if j * size < most]
    return max((c for c in candidates if c <= ready_head), default=size)


def model_copy_now(*, handed_out: int, budget: int, served: int, batch_items: int) -> bool:
    """Copy the rest of the reader's batch in progress item by item: the rank must not go
    over its budget on the way (nor be over it already)."""
    copies = handed_out
    if copies > budget:
        return True
    if batch_items <= 0 or served % batch_items == 0:
        return False  # no batch in progress
    for _ in range(batch_items - served % batch_items):
        copies += 1
        if copies > budget:
            return True
    return False


# ----------------------------------------------------------------------------- the loop's turn


@pytest.mark.parametrize("seed", range(3))
def test_the_loops_turn_matches_walking_the_loops_order(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(CASES):
        workers = rng.randint(2, 6)
        size = rng.randint(1, 6)
        served = {w: rng.randint(0, 5 * size) for w in range(workers) if rng.random() < 0.9}
        ended = {w for w in range(workers) if rng.random() < 0.25}
        caller = rng.randrange(workers)
        got = dealing.turn(worker_id=caller, batch_items=size, num_workers=workers, continued=False,
                           served=served, ended=ended, held={}, asking={})
        expected = Turn.GO if model_next_reader(served, size, workers, ended, caller) == caller else Turn.WAIT
        assert got is expected, (workers, size, served, ended, caller)


@pytest.mark.parametrize("seed", range(20))
def test_workers_asking_in_any_order_are_dealt_in_the_loops_order(seed: int) -> None:
    """W readers ask in random order; each is dealt a whole batch when `turn` says so, and its
    part ends when the epoch has no batch left. Batch k of the epoch goes to worker k mod W,
    exactly as the DataLoader reads them, and nobody waits for good."""
    rng = random.Random(seed)
    workers, size, batches = rng.randint(2, 5), rng.randint(1, 8), rng.randint(0, 30)
    served: dict[int, int] = {w: 0 for w in range(workers)}
    ended: set[int] = set()
    order: list[int] = []
    for _ in range(100 * (batches + workers)):
        if len(ended) == workers:
            break
        worker = rng.choice([w for w in range(workers) if w not in ended])
        if len(order) == batches:
            ended.add(worker)  # the epoch's end: this reader's part is over
            continue
        if dealing.turn(worker_id=worker, batch_items=size, num_workers=workers, continued=False,
                        served=served, ended=ended, held={}, asking={}) is Turn.GO:
            served[worker] += size
            order.append(worker)
    assert len(ended) == workers
    assert order == [k % workers for k in range(batches)]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_pass_of_one_reader_is_never_held_back(num_workers: int) -> None:
    """The client always says num_workers (1 in the training process): a pass of one reader
    has no turn to keep, whatever copies it holds."""
    assert dealing.turn(worker_id=0, batch_items=4, num_workers=num_workers, continued=False,
                        served={0: 12}, ended=set(), held={0: 12, 1: 0}, asking={0: 1, 1: 1}) is Turn.GO


@pytest.mark.parametrize("seed", range(3))
def test_a_continued_pass_defers_to_a_waiting_reader_holding_fewer_copies(seed: int) -> None:
    """NOTE [ No turn after a restart ]: the reader holding fewest copies among those waiting
    goes first; the loop's order, counted on the new server from zero, plays no part."""
    rng = random.Random(seed)
    for _ in range(CASES):
        workers = rng.randint(1, 5)
        held = {w: rng.randint(0, 12) for w in range(workers)}
        asking = {w: rng.randint(0, 2) for w in range(workers)}
        caller = rng.randrange(workers)
        waiting = [w for w in range(workers) if w == caller or asking[w]]
        fewest = min(held[w] for w in waiting)
        expected = Turn.DEFER if held[caller] > fewest else Turn.GO
        got = dealing.turn(worker_id=caller, batch_items=4, num_workers=workers, continued=True,
                           served={w: 100 * w for w in range(workers)}, ended=set(), held=held,
                           asking=asking)
        assert got is expected, (held, asking, caller)


# ----------------------------------------------------------------------------- acknowledgements


def test_a_reader_ahead_beyond_the_budget_waits_for_acknowledgements() -> None:
    """NOTE [ Copies budget ]: worker 0 holds 16 copies, worker 1 12, budget 24: worker 0's
    next batch would go over, and worker 1 holds fewer, so worker 0 waits; worker 1 does not."""
    common = dict(size=4, batch_items=4, served={0: 16, 1: 12}, members={0: 10, 1: 11},
                  recent_readers=2, handed_out=28, budget=24)
    assert dealing.must_acknowledge_first(worker_id=0, held={0: 16, 1: 12}, **common)
    assert not dealing.must_acknowledge_first(worker_id=1, held={0: 16, 1: 12}, **common)
    # within the budget nobody waits
    assert not dealing.must_acknowledge_first(worker_id=0, held={0: 16, 1: 4},
                                              **{**common, "handed_out": 20})


def test_a_fresh_worker_that_has_not_asked_yet_counts_as_holding_nothing() -> None:
    """Fresh DataLoader workers ask one by one: the rank's previous pass had two readers, so
    worker 0 of the new pass, alone so far and holding 16, waits for worker 1."""
    args = dict(worker_id=0, size=8, batch_items=8, held={0: 16}, served={0: 16},
                members={0: 20}, handed_out=16, budget=16)
    assert dealing.must_acknowledge_first(recent_readers=2, **args)
    assert not dealing.must_acknowledge_first(recent_readers=1, **args)


def test_copies_of_the_readers_own_unfinished_batch_never_make_it_wait() -> None:
    """NOTE [ A batch larger than the budget ]: a batch of 20 and a budget of 12; worker 0 holds
    the 12 items of its unfinished batch: waiting for their acknowledgement would be for good."""
    assert not dealing.must_acknowledge_first(
        worker_id=0, size=8, batch_items=20, held={0: 12, 1: 0}, served={0: 12}, members={0: 1, 1: 2},
        recent_readers=2, handed_out=12, budget=12)


# ----------------------------------------------------------------------------- reply sizes


@pytest.mark.parametrize("seed", range(3))
def test_reply_sizes_match_trying_every_number_of_batches(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(CASES):
        size = rng.randint(1, 8)
        args = dict(max_batches=rng.randint(1, 5), queue_len=rng.randint(0, 10 * size),
                    keep=rng.choice([0, rng.randint(0, 4 * size)]), handed_out=rng.randint(0, 8 * size),
                    budget=rng.randint(1, 10 * size),
                    left=rng.choice([None, rng.randint(size, 8 * size)]))
        ready_head = rng.randint(0, args["queue_len"])
        most = dealing.reply_bound(batch_items=size, ready=min(ready_head, size), **args)
        got = size if most is None else dealing.whole_batches(batch_items=size, most=most,
                                                              available=min(ready_head, most))
        assert got == model_reply_size(size=size, ready_head=ready_head, **args), (size, args, ready_head)


def test_extra_batches_leave_the_queue_its_capacity_beside_other_jobs() -> None:
    """NOTE [ Extra batches ]: 5 batches of 4 queued and ready, 4 asked: alone on its source a
    job takes all 4; beside others it leaves its capacity (8 items) queued and takes 3."""
    args = dict(batch_items=4, max_batches=4, queue_len=20, ready=4, handed_out=0, budget=100, left=None)
    assert dealing.reply_bound(keep=0, **args) == 16
    assert dealing.reply_bound(keep=8, **args) == 12
    assert dealing.reply_bound(keep=16, **args) is None  # one batch
    assert dealing.reply_bound(keep=0, **{**args, "budget": 10}) == 8  # copies within the budget
    assert dealing.whole_batches(batch_items=4, most=16, available=11) == 8  # whole batches of what is ready


def test_a_reply_wants_whole_batches_and_the_rest_of_one_in_progress() -> None:
    whole = dealing.want(batch_items=8, left=None, served=16, queue_capacity=32)
    assert (whole.wanted, whole.in_batch, whole.rest, whole.partial_ok) == (8, 0, 8, False)
    rest = dealing.want(batch_items=8, left=None, served=19, queue_capacity=32)
    assert (rest.wanted, rest.in_batch, rest.rest) == (5, 3, 5)
    end = dealing.want(batch_items=8, left=3, served=16, queue_capacity=32)
    assert end.wanted == 3  # the epoch's rest
    small = dealing.want(batch_items=8, left=None, served=0, queue_capacity=5)
    assert (small.wanted, small.partial_ok) == (5, True)  # a queue smaller than a batch
    assert dealing.ready_to_reply(ready=5, wanted=5, lingered=False, stopped=False)
    assert not dealing.ready_to_reply(ready=4, wanted=5, lingered=False, stopped=False)
    assert dealing.ready_to_reply(ready=4, wanted=5, lingered=True, stopped=False)
    assert not dealing.ready_to_reply(ready=0, wanted=5, lingered=True, stopped=True)


@pytest.mark.parametrize("seed", range(3))
def test_copy_now_matches_copying_the_rest_of_the_batch(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(CASES):
        args = dict(handed_out=rng.randint(0, 40), budget=rng.randint(1, 40), served=rng.randint(0, 60),
                    batch_items=rng.randint(0, 25))
        assert dealing.copy_now(**args) == model_copy_now(**args), args


def test_budgets_and_request_limits() -> None:
    assert dealing.copies_budget(32, 8) == 24
    assert dealing.copies_budget(8, 8) == 1  # never zero: one copy may always go out
    assert dealing.in_batch(19, 8) == 3 and dealing.in_batch(19, 0) == 0
    assert dealing.request_limits(64, 4, 4096) == (64, 4)
    assert dealing.request_limits(5000, 4, 4096) == (4096, 1)
    assert dealing.request_limits(1000, 8, 4096) == (1000, 4)
    assert dealing.request_limits(0, 0, 4096) == (0, 1)
