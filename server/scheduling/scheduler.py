"""The scheduler: DSA rounds that fill the ranks' queues, epoch by epoch.

A round runs, per source, whenever some job's next receiving rank has fewer queued items than
its capacity (or its fill, beyond it where the cache has room: NOTE [ Filling for replies of
several batches ] in registry.py); a turn runs such rounds in batches (NOTE [ Rounds in
batches ] in batches.py); every job whose receiving rank is below twice its capacity takes part, and, with
`--plan-horizon`, so does a job that lags the others by no more than the cache can bridge (NOTE
[ Planning a lagging job ahead ]), so jobs reading at about the same speed share nearly every round, and a slow job sits
rounds out (it loses sharing, not speed). A job takes part once all its ranks attached and one
of them asked for items, and not while a resumed epoch is still gathering its reports.

Who takes part, and when a round waits for a job behind: server/scheduling/in_step.py (NOTE [ Planning a
lagging job ahead ], NOTE [ A leader waits only where it costs the sweep nothing ]).

Each pick of a job is dealt to one of its ranks (`EpochShare.receiver`): round-robin for a fresh
epoch, so every rank gets `ceil(N / W)` items (padding with the epoch's first picks once the
sampler's epoch is over) or `floor(N / W)` under drop_last (the picks no rank needs are dropped
undecoded). A job of world size 1 has one rank that receives every pick.

Queued is not pinned: a rank pins the head of its queue (asking for those decodes) only within
its share of the cache, counting the copies it was handed and has not acknowledged
(`pin_ahead`); a rank that stops reading holds its share at most, never the others'.

Refcounts: an item's refcount is the number of jobs that still need it in their current epoch
plus its queue entries (planned reads). A round's pick leaves a remaining set and enters a queue
(no change), a queue entry that leaves its queue is -1, +1 for every cached item of a job's new
epoch; recomputed from the sampler and the queues when a decode lands (`Registry._needed`).

A job with order="independent" takes part in rounds by the same rule, but the sampler gives it a
draw of its own (NOTE [ Independent jobs share no round ]).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from itertools import repeat

from pyroaring import BitMap

from joader.errors import InvariantError
from joader.server.books.containment import is_bookkeeping_error
from joader.server.books.item_cache import ItemCache
from joader.server.books.pacing import UNKNOWN_RATE, due_time
from joader.server.books.records import (
    Entry,
    EpochShare,
    Item,
    ItemState,
    Job,
    Rank,
    RestShare,
    Source,
)
from joader.server.scheduling import in_step
from joader.server.scheduling.batches import (
    BatchBooks,
    alone,
    fill,
    goes_on,
    rounds_ahead,
    sharing_pairs,
)

logger = logging.getLogger(__name__)

_SHARES_KEPT = 4  # epochs of a job whose split is remembered (the oldest pass still reading)
PAIR_HISTORY = 256  # pairs of removed jobs whose counts status still shows
READING_WITHIN_S = 0.5  # a job that asked for items within this long is reading (a hold waits for it)


class Scheduler:
    """Drives each source's sampler for its jobs, and keeps their epochs' shares."""

    def __init__(self, cache: ItemCache, clock: Callable[[], float], *, deadlines: bool = True,
                 start_grace_s: float = 0.0, max_hold_s: float = 0.0) -> None:
        self._cache = cache
        self._clock = clock
        self._deadlines = deadlines  # False: every decode is due at once (round order)
        self._start_grace_s = start_grace_s
        self._max_hold_s = max_hold_s  # 0: a round never waits for a job behind
        # Every core of the host was busy lately (set by joaderd's CPU meter, server/cpu_meter.py).
        self.host_busy = False
        self._want_seq = 0  # counts wanted queue entries (the decode order's tie-break)
        # Set while a batch of rounds deals its picks: the ranks to pin ahead once it is over.
        self._deferred_pins: dict[int, tuple[Job, Rank]] | None = None
        self._now = 0.0  # the clock at the current round's start
        # The jobs the current round is working for (its participants): the ones to end when
        # the round breaks before its picks are dealt. `broken`: the jobs whose own pick could
        # not be dealt, and why (the registry ends them; the round went on for the others).
        self.acting: tuple[str, ...] = ()
        self.broken: list[tuple[str, Exception]] = []

    # ----------------------------------------------------------------------------- jobs

    def add(self, job: Job) -> None:
        """A new job: its first epoch, `job.sampler_epoch`, covers its whole dataset."""
        job.source.sampler.add_job(job.job_id, job.dataset, rng=job.rng, independent=alone(job))
        job.source.job_ids.append(job.job_id)
        self._cache.add_refcount(job.source, job.dataset, 1)
        self._open(job, job.sampler_epoch)

    def remove(self, job: Job, jobs: dict[str, Job]) -> None:
        """Forgets a job; its pairs' sharing counts move to the source's recent history."""
        source = job.source
        for pair in [p for p in source.pair_rounds if job.job_id in p]:
            rounds, shared = source.pair_rounds.pop(pair)
            a, b = (jobs.get(j, job) for j in pair)
            bound = a.dataset.intersection_cardinality(b.dataset) / max(len(a.dataset), len(b.dataset))
            source.pair_history[pair] = (a.name, b.name, rounds, shared, bound)
            while len(source.pair_history) > PAIR_HISTORY:
                del source.pair_history[next(iter(source.pair_history))]
        self._cache.add_refcount(source, source.sampler.remaining(job.job_id), -1)
        self._cache.forget_job(job.job_id)
        source.sampler.remove_job(job.job_id)
        source.job_ids.remove(job.job_id)

    def needed(self, source: Source, item_id: int) -> int:
        """How many jobs of `source` still need `item_id` in their current epoch."""
        sampler = source.sampler
        return sum(1 for job_id in source.job_ids if sampler.needs(job_id, item_id))

    def reuse_hazard(self, source: Source, item_id: int, jobs: dict[str, Job], now: float) -> float:
        """How soon some job reads `item_id` again, as a rate: the sum over the jobs that still
        need it of (the job's items/s) / (its items left in the epoch). Each such job picks it
        at random among what it has left, so its expected time to next use is the inverse."""
        sampler = source.sampler
        total = 0.0
        for job_id in source.job_ids:
            if sampler.needs(job_id, item_id):
                rate = jobs[job_id].rate.rate(now)
                total += (rate if rate else UNKNOWN_RATE) / max(1, sampler.num_remaining(job_id))
        return total

    def _open(self, job: Job, epoch: int, targets: list[int] | None = None) -> EpochShare:
        """Epoch `epoch`'s split: `targets[r]` items for rank r (default: a whole epoch's share)."""
        if targets is None:
            targets = [job.per_rank] * job.world_size
        share = EpochShare(epoch, targets, [0] * job.world_size)
        job.shares[epoch] = share
        # The oldest pass still reading (a superseded one, or a slower rank) needs its share.
        oldest = min(rank.claimed_epoch for rank in job.ranks) - _SHARES_KEPT
        for old in [e for e in job.shares if e < oldest]:
            del job.shares[old]
        return share

    # ----------------------------------------------------------------------------- epochs

    def abandon_if_done(self, job: Job, epoch: int) -> None:
        """The sampler gives `epoch` up once every rank finished or abandoned it early.

        A rank abandons an epoch when a newer pass of it starts first (its loop broke out). The
        ranks of a DDP job break out together; until the last one has, the others keep the
        items already queued for them.
        """
        if job.sampler_epoch != epoch or epoch in job.sampler_abandoned:
            return
        share = job.shares.get(epoch)
        for rank in job.ranks:
            finished = share is not None and rank.handed[epoch] >= share.target[rank.index]
            if not finished and epoch not in rank.abandoned:
                return
        logger.info("job %s: epoch %d abandoned before its end; the next one starts", job.job_id, epoch)
        job.sampler_abandoned.add(epoch)
        source = job.source
        sampler = source.sampler
        before = sampler.remaining(job.job_id)
        sampler.reset_epoch(job.job_id)
        job.sampler_epoch += 1
        self._cache.add_refcount(source, job.dataset - before, 1)
        self._open(job, job.sampler_epoch)

    def start_resumed(self, job: Job, epoch: int, consumed: list[BitMap],
                      rest: list[RestShare | None] | None = None) -> None:
        """Epoch `epoch` resumes without the items in `consumed` (per rank), whatever the job
        had queued: the resumed checkpoint is the truth now. Each rank gets its whole-epoch
        share less what it consumed, or, for a rank with a `rest` share (an elastic resume),
        that share less what it consumed beyond it."""
        for rank in job.ranks:
            self.drop_queue(rank, lambda entry: True)
        union = BitMap()
        for ids in consumed:
            union |= ids
        union &= job.dataset
        remaining = job.dataset - union
        source = job.source
        sampler = source.sampler
        self._cache.add_refcount(source, sampler.remaining(job.job_id), -1)
        sampler.remove_job(job.job_id)
        # A fresh stream for the resumed epoch: re-using the job's seed from its start would
        # replay the first draws of the interrupted epoch over a set that lacks their items.
        job.rng = random.Random(f"joader-resume:{job.seed}:{epoch}:{len(union)}")
        job.shares.clear()
        job.sampler_abandoned.clear()
        per = job.per_rank
        targets = []
        for index, ids in enumerate(consumed):
            count = len(ids & job.dataset)
            mine = rest[index] if rest is not None else None
            targets.append(mine.target(count) if mine is not None else max(0, per - count))
        if remaining:
            sampler.add_job(job.job_id, job.dataset, remaining=remaining, rng=job.rng,
                            independent=alone(job))
            self._cache.add_refcount(source, remaining, 1)
            job.sampler_epoch = epoch
            self._open(job, epoch, targets)
        else:  # the checkpoint came after the epoch's last item: only padding may be owed
            sampler.add_job(job.job_id, job.dataset, rng=job.rng, independent=alone(job))
            self._cache.add_refcount(source, job.dataset, 1)
            share = self._open(job, epoch, targets)
            self._now = self._clock()
            self._complete(job, share)
            job.sampler_epoch = epoch + 1
            self._open(job, epoch + 1)
        logger.info(
            "job %s: epoch %d resumed with %d of its %d items left", job.job_id, epoch,
            len(remaining), job.num_items,
        )

    def drop_queue(self, rank: Rank, drop: object) -> None:
        """Removes the queued entries of `rank` for which `drop(entry)` is true, releasing the
        pinned ones. The pinned entries left are still the head of the queue (order is kept)."""
        kept: deque[Entry] = deque()
        pinned = 0
        for position, entry in enumerate(rank.queue):
            held = position < rank.pinned
            if drop(entry):  # type: ignore[operator]
                if held:
                    self._cache.release(entry.key)
                self._cache.unplan(entry.key)
            else:
                kept.append(entry)
                pinned += held
        rank.queue = kept
        rank.pinned = pinned

    def pin_ahead(self, job: Job, rank: Rank, now: float | None = None) -> bool:
        """Pins the head of the rank's queue, in order, while the rank holds less than its share
        of the cache (`Job.cache_share`: pinned entries plus copies handed out and not yet
        acknowledged); unpins the newest pinned entries beyond it, when the share shrank (jobs
        arrived) or copies went out.

        A pinned entry asks for its item's decode and keeps the item's bytes in the arena. The
        bound is the share because a job that stops reading (its lease alive) would otherwise
        hold its copies and its whole queue, more than its share once other jobs arrived, and
        they would find no slot to decode into. Unpinned entries keep their place in the queue (the DSA picks stand);
        their items may be evicted, and are decoded again when acknowledgements bring them
        within the rank's share: such a job gets no more decodes ahead until it acknowledges.

        Returns whether an entry it pinned is settled already (ready to hand out: the caller
        wakes the job's waiting requests, unless a round does).
        """
        queue = rank.queue
        allowance = max(0, job.cache_share - rank.handed_out)
        cache = self._cache
        while rank.pinned > allowance:
            rank.pinned -= 1
            cache.release(queue[rank.pinned].key)
        if rank.pinned >= allowance or rank.pinned >= len(queue):
            return False
        if now is None:
            now = self._clock()
        deadlines = self._deadlines
        rate = job.rate.rate(now) if deadlines else None
        # Rank.pinned is a property (it keeps a low-water mark): read once, set after the loop
        # (cache.want never looks at the rank).
        pinned, end = rank.pinned, min(allowance, len(queue))
        claimed = rank.claimed_epoch
        source, want_seq, want = job.source, self._want_seq, cache.want
        get, ready = cache.items.get, ItemState.READY
        settled = False
        # A run of READY entries (cache hits) is pinned in bulk (`ItemCache.want_ready`), all
        # or nothing: `run_start` is where the run not yet pinned began.
        hits: list[Item] = []
        ahead = run_start = 0
        try:
            while pinned < end:
                entry = queue[pinned]
                item = entry.item = get(entry.key)
                if item is not None and item.state is ready:
                    if not hits:
                        run_start = pinned
                    hits.append(item)
                    ahead += entry.epoch > claimed
                    pinned += 1
                    continue
                if hits:
                    cache.want_ready(hits, ahead)
                    hits, ahead, settled = [], 0, True
                due_s = due_time(now, pinned, rate) if deadlines else 0.0
                # The sequence breaks ties among equal due times: decodes in the order wanted.
                want_seq += 1
                item = entry.item = want(source, entry.item_id, want_seq, consumed=False, due_s=due_s,
                                         ahead=entry.epoch > claimed)
                pinned += 1
                if item.state.settled:
                    settled = True
                else:
                    cache.add_waiter(item, job)  # woken when it settles
            if hits:
                cache.want_ready(hits, ahead)
                hits, settled = [], True
        finally:
            rank.pinned = run_start if hits else pinned  # a run that raised pinned nothing
            self._want_seq = want_seq
        return settled

    # ----------------------------------------------------------------------------- rounds

    def run_round(self, source: Source, jobs: dict[str, Job], max_rounds: int = 1) -> int:
        """DSA rounds over the jobs of `source`, if some job's receiving rank runs low: up to
        `max_rounds` of them with the same participants (NOTE [ Rounds in batches ] in batches.py).
        Returns how many ran (0: none was due)."""
        self.acting = ()
        now = self._now = self._clock()
        # Jobs of a sweep start reading a few milliseconds apart; the first one's rounds would
        # run alone and fill its queue before the others ask, leaving it a batch ahead for the
        # whole epoch (fewer shared rounds). So a job that just started reading waits briefly
        # for the source's other attached jobs to start too.
        others_idle = any(not jobs[j].reading for j in source.job_ids)
        sampler = source.sampler
        num_remaining = sampler.num_remaining
        queued = []
        empty: set[str] = set()  # jobs whose sampler epoch is over: a participant starts its next one
        for job_id in source.job_ids:
            job = jobs[job_id]
            if not (job.reading and job.all_attached and job.resume is None):
                continue
            if others_idle and now - job.reading_since_s < self._start_grace_s:
                continue
            if num_remaining(job_id) == 0:
                if job.sampler_epoch > job.claimed_epoch:
                    continue  # prepared a whole epoch ahead of its readers: enough lookahead
                empty.add(job_id)
            share = job.shares[job.sampler_epoch]
            receiver = share.receiver()
            # A job whose picks are dropped (every rank has its share) runs at no cost.
            length = len(job.ranks[receiver].queue) if receiver is not None else 0
            queued.append((job, length))
        # Beyond its capacity only while nothing is being decoded (NOTE [ Filling for replies of
        # several batches ] in registry.py): a decoding reply takes no extra batch anyway.
        warm = not self._cache.decodes_in_flight()
        if not any(length < fill(job, warm) for job, length in queued):
            return 0
        plan = self._plan(source, queued, now)
        if plan.hold:
            return 0
        participants = list(plan.participants)
        self.acting = tuple(participants)
        batch = max_rounds > 1 and plan.simple
        if batch:
            taking = [job for job, _ in queued if job.job_id in plan.participants]
            # A job sitting out below its capacity keeps single rounds going (its queue does
            # not change during the batch).
            others_short = any(length < fill(job, warm) for job, length in queued
                               if job.job_id not in plan.participants)
        self._deferred_pins = {} if batch else None
        books = BatchBooks(participants, sharing_pairs(source, participants, jobs))
        ahead = rounds_ahead(taking, others_short, warm, max_rounds, source.sampler) \
            if batch and not empty else None
        done = 0
        try:
            if ahead is not None:
                done = self._drawn_rounds(source, jobs, participants, ahead, books)
            while ahead is None:
                done += 1
                if self._one_round(source, jobs, participants, empty if done == 1 else (), books):
                    break  # an epoch ended, or a job's books broke: the next batch decides anew
                if not batch or done >= max_rounds or not goes_on(taking, others_short, warm):
                    break
        finally:
            books.flush()
            deferred, self._deferred_pins = self._deferred_pins, None
            for job, rank in (deferred or {}).values():
                self.pin_ahead(job, rank, now)
        self.acting = ()
        return done

    def _one_round(self, source: Source, jobs: dict[str, Job], participants: list[str],
                   empty: set[str] | tuple[()], books: BatchBooks) -> bool:
        """One round: sample, count, start the participants' new epochs, deal. Returns whether
        a batch of rounds must stop after it (a sampler epoch ended, or a job broke)."""
        sampler = source.sampler
        starting = [j for j in participants if j in empty] if empty else []
        picks = sampler.sample(participants)
        if picks.keys() != books.participants:
            # A pick for a job sitting out refills it silently: then a refcount below zero or
            # an item twice in an epoch. Loud and contained instead (a sampler bug did that).
            raise InvariantError(f"a round for {sorted(participants)} gave picks to {sorted(picks)}")
        books.count(picks)
        for job_id in starting:
            job = jobs[job_id]
            job.sampler_epoch += 1
            self._cache.add_refcount(source, job.dataset, 1)
            self._open(job, job.sampler_epoch)
        stop = False
        for job_id, item_id in picks.items():
            # Each pick is dealt on its own: a job whose books break here is reported
            # (`broken`) and the round goes on for the others, whose picks already left their
            # remaining sets (a round stopped half way loses them: an item short, a padding
            # copy twice). See NOTE [ One job's books, one job's loss ] in containment.py.
            try:
                stop |= self._deal(jobs[job_id], item_id, books.left)
            except Exception as error:
                if not is_bookkeeping_error(error):
                    raise
                self.broken.append((job_id, error))
                stop = True
        return stop

    def _drawn_rounds(self, source: Source, jobs: dict[str, Job], participants: list[str], rounds: int,
                      books: BatchBooks) -> int:
        """A batch whose length was known before its first round (`rounds_ahead`): its rounds
        drawn in one call (`DependentSampler.sample_rounds`), then each job's picks dealt in
        round order at once (`_deal_drawn`). A job whose books break is reported and dealt
        nothing; the others' picks are still dealt (left undealt, they would be lost to their
        epochs). Returns the rounds run."""
        sampler = source.sampler
        left = {job_id: sampler.num_remaining(job_id) for job_id in participants}  # before the draws
        drawn = sampler.sample_rounds(participants, rounds)
        for picks in drawn:
            if picks.keys() != books.participants:  # as in `_one_round`
                raise InvariantError(f"a round for {sorted(participants)} gave picks to {sorted(picks)}")
            books.count(picks)
        for job_id in participants:
            try:
                self._deal_drawn(jobs[job_id], [picks[job_id] for picks in drawn], left[job_id])
            except Exception as error:
                if not is_bookkeeping_error(error):
                    raise
                self.broken.append((job_id, error))
        return len(drawn)

    def _deal_drawn(self, job: Job, item_ids: list[int], left: int) -> None:
        """`_deal` for each of a drawn batch's picks of `job`, in round order, at once: what
        `rounds_ahead` made sure of (world size 1, the rank open, its share not dealt out,
        the epoch not over before the batch's last round) makes every pick an entry of the
        rank's queue and a planned read, and no pick a drop. `left`: the job's picks left in its
        sampler epoch before the batch."""
        share = job.shares[job.sampler_epoch]
        rank = job.ranks[0]
        count = len(item_ids)
        if job.world_size != 1 or rank.closed or share.target[0] - share.assigned[0] < count or left < count:
            raise InvariantError(
                f"job {job.job_id}: a drawn batch of {count} rounds for world size {job.world_size}, rank "
                f"{'closed' if rank.closed else 'open'}, {share.target[0] - share.assigned[0]} undealt, {left} left")
        share.assigned[0] += count
        if not share.head:
            share.head.append(item_ids[0])
        base = job.source.key_base
        keys = [base + item_id for item_id in item_ids] if base else item_ids  # (NOTE in `_enqueue`)
        rank.queue.extend(map(Entry, repeat(share.epoch, count), item_ids, keys))
        self._cache.plan_many(keys)  # each pick moved from the remaining set to the queue (`_enqueue`)
        self._pin_after(job, rank)
        if left == count:  # the batch's last round ended the job's sampler epoch
            self._complete(job, share)

    def _plan(self, source: Source, queued: list[tuple[Job, int]], now: float) -> in_step.Plan:
        """Who takes part in this round, or whether it waits (server/scheduling/in_step.py)."""
        if not self._max_hold_s and all(job.plan_horizon <= 2 * job.queue_capacity for job, _ in queued):
            # The defaults: the rule within two lookaheads alone, without measuring anything
            # (this runs once per round).
            return in_step.Plan(tuple(job.job_id for job, length in queued if length < 2 * job.queue_capacity),
                                simple=True)
        decode_rate = self._cache.decode_rate.rate(now)
        candidates = [
            in_step.Candidate(
                job.job_id, length, job.queue_capacity, job.plan_horizon,
                job.rate.rate(now) if decode_rate else None, cpu_bound=job.cpu_bound,
                reading=now - max(rank.last_read_s or 0.0 for rank in job.ranks) < READING_WITHIN_S,
                independent=job.order == "independent")
            for job, length in queued
        ]
        held_s = now - source.held_since_s if source.held_since_s is not None else 0.0
        plan = in_step.plan_round(candidates, decode_rate=decode_rate, host_busy=self.host_busy,
                                  held_s=held_s, max_hold_s=self._max_hold_s)
        if plan.hold:
            if source.held_since_s is None:
                source.held_since_s = now
                source.holds += 1
        elif source.held_since_s is not None:
            source.held_s += now - source.held_since_s
            source.held_since_s = None
        return plan

    def _deal(self, job: Job, item_id: int, left: dict[str, int]) -> bool:
        """Deals this round's pick of `job` to its receiving rank (or drops it: drop_last).
        Returns whether that ended the job's sampler epoch. `left`: the job's picks left in
        its sampler epoch after its previous pick of this batch (`BatchBooks.left`)."""
        source = job.source
        share = job.shares[job.sampler_epoch]
        receiver = share.receiver()
        if receiver is None:
            self._cache.consume_unqueued(source, item_id)  # drop_last: nobody's share
        else:
            self._enqueue(job, job.ranks[receiver], share, item_id, consumed=True)
            if len(share.head) < job.world_size:
                share.head.append(item_id)
        # Each pick of a round leaves its job's remaining set: one fewer than after the
        # previous one (the sampler is asked once per batch, after the job's first pick).
        job_id = job.job_id
        remaining = left.get(job_id)
        remaining = left[job_id] = source.sampler.num_remaining(job_id) if remaining is None else remaining - 1
        if remaining == 0:
            self._complete(job, share)
            return True
        return False

    def _complete(self, job: Job, share: EpochShare) -> None:
        """The sampler's epoch is over: ranks short of their share get padding copies."""
        share.complete = True
        head = share.head or list(job.dataset[: job.world_size])
        for rank in job.ranks:
            for i in range(share.target[rank.index] - share.assigned[rank.index]):
                self._enqueue(job, rank, share, head[i % len(head)], consumed=False)

    def _enqueue(self, job: Job, rank: Rank, share: EpochShare, item_id: int, *, consumed: bool) -> None:
        share.assigned[rank.index] += 1
        if rank.closed:  # the rank is done: its share is not prepared
            if consumed:  # the pick left the job's remaining set: a cached copy has one reference less
                self._cache.consume_unqueued(job.source, item_id)
            return
        base = job.source.key_base
        # NOTE: with base 0 (the first source) the key is the item id's own int object: an int
        # is 32 bytes, and a warm queue holds tens of thousands of entries.
        key = base + item_id if base else item_id
        rank.queue.append(Entry(share.epoch, item_id, key))
        # A pick that left the remaining set for the queue keeps its reference (NOTE [ Planned
        # reads ]); a padding copy adds one.
        self._cache.plan(key, moved=consumed)
        self._pin_after(job, rank)

    def _pin_after(self, job: Job, rank: Rank) -> None:
        """The rank received picks: it pins its head now, or once the batch of rounds is over."""
        deferred = self._deferred_pins
        if deferred is None:
            self.pin_ahead(job, rank, self._now)
        else:
            deferred[id(rank)] = (job, rank)
