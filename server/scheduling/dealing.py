"""Dealing: how much of a rank's ready queue one reader gets, and whether it must wait first.

Pure: plain numbers and mappings in, decisions out; no lock, no thread, no gRPC, no clock. The
`Next` protocol (next_protocol.py) gathers the numbers from the registry's books under its
lock, asks here, and acts on the answer.

A *reader* is one process reading a pass: the training process, or one DataLoader worker
(`worker_id`). A reader asks in whole batches of `batch_items` (its DataLoader's batch size);
`served[w]` counts the items reader `w` was dealt in this pass, `held[w]` the copies it holds
unacknowledged. A rank's *copies budget* is what its handed-out, unacknowledged copies may take
of its share of the cache (`copies_budget`).

Three rules say whether a reader whose reply is ready must wait (`turn`,
`must_acknowledge_first`), and four steps size the reply (`want`, `ready_to_reply`,
`reply_bound`, `whole_batches`); `copy_now` says whether its reader must copy the items out at
once.

NOTE [ The loop's turn ]
~~~~~~~~~~~~~~~~~~~~~~~~
A DataLoader takes its workers' batches in turn: batch b of worker w is the loop's batch
b * W + w. A batch dealt before the loop's earlier ones sits unread in a suspended worker,
holding cache. Beside a job that stopped reading with 24 of 32 slots in copies, a two-worker
reader had one batch of cache left; worker 0, having copied its batch, asked again and was dealt
the loop's third batch before worker 1 its second, which then had nowhere to decode into while
the loop waited for it (1 CI run in 5 hung). So readers say how many they are (`num_workers`)
and a pass is dealt in the loop's order: a reader is served only when no other unfinished
reader's next batch comes earlier in it. A reader whose part of the epoch ended no longer
counts. The client always says `num_workers` (1 in the training process); a pass of one reader
has no turn to keep.

NOTE [ No turn after a restart ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pass a joaderd restart interrupted (`PassBook.continued`) is not dealt in the loop's turn:
counted from zero on the new server, a worker whose part ended on the dead server (it never asks
again) came first for good, and the worker holding the epoch's last batch waited for it
(`bench/soak/restart_storm.py --mode workers`). Its readers are dealt by copies held instead: a
reader holding more copies than another reader of the pass that waits now lets that one go
first, which keeps the workers' batches roughly in step with the loop's order.

NOTE [ Copies budget ]
~~~~~~~~~~~~~~~~~~~~~~
A rank's share of the cache (`Job.cache_share`) holds its pinned queue and its handed-out,
unacknowledged copies. Its copies may take the share less its lookahead (`copies_budget`): the
queue needs its lookahead to keep reading. A DataLoader worker whose prefetch slots are full is
suspended, so a reply reaching it sits unread until the loop takes one of its batches, and the
loop takes its workers' batches in turn: worker 0 of a fresh DataLoader was dealt four batches
before worker 1 first asked, and the loop then waited for worker 1, whose batch had no slot
left to decode into. So beyond the budget a reader holding more copies than another reader of
the rank waits for acknowledgements (`must_acknowledge_first`); fresh workers ask one by one,
so the workers of the rank's recent passes count too, holding nothing until they ask. A reply
that takes the rank beyond the budget says `copy_now`: its reader copies the items out and
acknowledges them in its next request, at once, instead of handing them on.

NOTE [ Room for a job that joins ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Copies handed out cannot be taken back: a job whose loop pauses (validation, a checkpoint, a
debugger) with its DataLoader workers alive holds them until it reads on. A rank alone had the
whole cache as its share, so its workers' prefetch could take copies of all of it, and a job
that joined then got no item for as long as the first one paused. So the budget is taken from
the share the rank would have with one more job (`Job.copies_share`: the cache over the ranks
plus one); beyond it, replies say `copy_now` and their items are unpinned at once.

NOTE [ A batch larger than the budget ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A hand-off worker keeps its batch in progress pinned until the batch is whole and the training
process copied it. A batch larger than the copies budget (batches of 300, a cache of 85 items)
could then never be completed, and the job hung until `timeout_s`, every time. So a
reader whose copies all belong to its unfinished batch never waits for acknowledgements; a
reply whose reader cannot finish its batch within the budget says `copy_now` (the batch then
crosses to the training process through the worker's memory); and after a short reply a reader
is given the rest of that batch before any of its next one, so its batches stay whole and the
loop's turn stays in step with them.

NOTE [ Extra batches ]
~~~~~~~~~~~~~~~~~~~~~~
A reply whose first batch is ready takes further whole batches (up to the request's
`max_batches`) that are ready now, never a wait for them. Beside other jobs on the source only
from what the rank's queue holds beyond its capacity: a queue drained below it makes the job
join the next rounds alone while the others' queues are full, and sharing drops (the
three-identical-jobs test caught exactly that). A job alone on its source takes what is ready.
Either way only while the rank's copies stay within its budget: extra batches dealt into a
cache its copies nearly fill left its other readers nothing to decode into, and the loop hung.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass


def copies_budget(cache_share: int, queue_capacity: int) -> int:
    """Handed-out, unacknowledged copies one rank may hold before its replies say `copy_now`:
    its share of the cache less its lookahead. See NOTE [ Copies budget ] and NOTE [ Room for
    a job that joins ] (the share passed is `Job.copies_share`)."""
    return max(1, cache_share - queue_capacity)


def in_batch(served: int, batch_items: int) -> int:
    """Items a reader has of its batch in progress, after `served` items in batches of
    `batch_items` (0: its batches are not known; none)."""
    return served % batch_items if batch_items > 0 else 0


def request_limits(max_items: int, max_batches: int, max_items_per_request: int) -> tuple[int, int]:
    """A request's batch size and batches per reply, within joaderd's per-request limit."""
    max_items = min(max_items, max_items_per_request)
    return max_items, max(1, min(max_batches, max_items_per_request // max(1, max_items)))


# ----------------------------------------------------------------------------- waiting rules


class Turn(enum.Enum):
    """Whether a reader whose reply is ready is served now (`turn`)."""

    GO = "go"
    WAIT = "wait"  # another reader's batch comes first in the loop's order
    DEFER = "defer"  # another waiting reader holds fewer copies: wake it, and wait


def loop_place(served: int, batch_items: int, num_workers: int, worker: int) -> int:
    """Where a reader's next batch comes in its DataLoader's order (NOTE [ The loop's turn ])."""
    return (served // max(1, batch_items)) * num_workers + worker


def turn(*, worker_id: int, batch_items: int, num_workers: int, continued: bool,
         served: Mapping[int, int], ended: Collection[int], held: Mapping[int, int],
         asking: Mapping[int, int]) -> Turn:
    """Whether reader `worker_id` of a pass is served now, or another reader of it first.

    `num_workers`: the readers of the pass, as its requests said; `continued`: a pass a
    restart interrupted; `ended`: readers whose part of the epoch ended; `asking`: reader ->
    its `Next` calls waiting now. See NOTE [ The loop's turn ] and
    NOTE [ No turn after a restart ].
    """
    if continued:
        mine = held.get(worker_id, 0)
        if mine and any(calls and worker != worker_id and held.get(worker, 0) < mine
                        for worker, calls in asking.items()):
            return Turn.DEFER
        return Turn.GO
    if num_workers <= 1:
        return Turn.GO  # one reader: no turn to keep
    mine = loop_place(served.get(worker_id, 0), batch_items, num_workers, worker_id)
    if any(loop_place(served.get(worker, 0), batch_items, num_workers, worker) < mine
           for worker in range(num_workers) if worker != worker_id and worker not in ended):
        return Turn.WAIT
    return Turn.GO


def must_acknowledge_first(*, worker_id: int, size: int, batch_items: int, held: Mapping[int, int],
                           served: Mapping[int, int], members: Collection[int], recent_readers: int,
                           handed_out: int, budget: int) -> bool:
    """Whether reader `worker_id` must wait for acknowledgements before a reply of `size` items
    that would take its rank (`handed_out` copies now) beyond its copies `budget`.

    It waits when it holds more copies than another reader of the rank: a reader of this pass
    (`members`), or one of the `recent_readers` workers of the rank's recent passes (the most
    any of its passes had), which hold nothing until they ask. Never for copies that all
    belong to its own unfinished batch. See NOTE [ Copies budget ] and
    NOTE [ A batch larger than the budget ].
    """
    mine = held.get(worker_id, 0)
    if not mine or handed_out + size <= budget:
        return False
    if mine <= in_batch(served.get(worker_id, 0), batch_items):
        return False
    readers = set(members).union(range(recent_readers))
    return any(held.get(worker, 0) < mine for worker in readers if worker != worker_id)


# ----------------------------------------------------------------------------- reply sizes


@dataclass(frozen=True)
class Want:
    """What a reader's reply waits for (`want`)."""

    wanted: int  # ready items at the queue's head that make a reply
    in_batch: int  # items the reader already has of its batch in progress
    rest: int  # items that finish that batch (a whole batch if none is in progress)
    partial_ok: bool  # the queue cannot hold `wanted`: a shorter reply may go after lingering


def want(*, batch_items: int, left: int | None, served: int, queue_capacity: int) -> Want:
    """How many ready items a reply of a reader waits for.

    Whole batches: a reply holds `batch_items` items (the rest of the epoch at its end, `left`;
    None while not known), so each DataLoader worker collates whole batches and an epoch has
    exactly len(loader) of them. Only a queue smaller than a batch (a cache too small for the
    jobs' batch sizes) forces partial replies, after lingering. A reader that got part of a
    batch is next given the rest of that batch (NOTE [ A batch larger than the budget ]).
    """
    wanted = min(batch_items, left if left is not None else batch_items)
    got = in_batch(served, batch_items)
    rest = batch_items - got
    wanted = min(wanted, rest)
    partial_ok = wanted > queue_capacity
    return Want(min(wanted, queue_capacity), got, rest, partial_ok)


def ready_to_reply(*, ready: int, wanted: int, lingered: bool, stopped: bool) -> bool:
    """Whether `ready` items at the queue's head make a reply: all it wants, or some once it
    lingered (or joaderd stops)."""
    return ready >= wanted or bool(ready and (lingered or stopped))


def reply_bound(*, batch_items: int, max_batches: int, queue_len: int, keep: int, ready: int,
                handed_out: int, budget: int, left: int | None) -> int | None:
    """The most items a reply whose first batch is ready may take: further whole batches up to
    `max_batches`, leaving `keep` items queued (the queue's capacity beside other jobs on the
    source, else 0) and the rank's copies within `budget`; capped at the epoch's rest (`left`).
    None when it takes no extra batch (the reply is one batch). `ready`: the ready items at the
    queue's head, counted up to one batch. See NOTE [ Extra batches ]."""
    size = batch_items
    spare = queue_len - size - keep
    extra = min(max_batches - 1, spare // size) if ready >= size else 0
    extra = min(extra, (budget - handed_out) // size - 1)
    if extra <= 0:
        return None
    most = size * (1 + extra)
    return most if left is None else min(most, left)


def whole_batches(*, batch_items: int, most: int, available: int) -> int:
    """The reply's size, given `available` ready items of the `most` it may take: all of them,
    else the whole batches among them (one batch at least: its first, which is ready)."""
    if available >= most:
        return most
    return max(batch_items, available - available % batch_items)


def copy_now(*, handed_out: int, budget: int, served: int, batch_items: int) -> bool:
    """Whether a reply's reader must copy its items out and acknowledge them at once, its rank
    now holding `handed_out` copies, the reader `served` items: the rank's copies went beyond
    its budget, or the reader cannot finish its batch in progress within it. See NOTE [ Copies
    budget ] and NOTE [ A batch larger than the budget ]."""
    if handed_out > budget:
        return True
    got = in_batch(served, batch_items)
    return bool(got) and handed_out + batch_items - got > budget
