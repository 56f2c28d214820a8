"""The `Next` protocol: which of a rank's ready items a reader is dealt, and when.

A `Next` is three steps, none of which blocks (`begin_next`, `poll_next` until a batch, then
`end_next`): a request that must wait registers a *waker*, which the registry calls under its
lock when the job's items may have become ready, so the asyncio servicer waits on an event
without holding a thread. `next_items` is the blocking form of the same three steps, for tests
and tools.

Every item a round gives to a rank is in that rank's queue, tagged with the job's epoch; a
`Next` takes the ready prefix of the queue, so items reach the rank in the sampler's order.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable

import numpy as np
from pyroaring import BitMap

from joader.errors import InvalidArgumentError, UnknownJobError
from joader.server.books.containment import contained
from joader.server.books.records import Item, ItemState, Job, PassBook, Rank, RestShare
from joader.server.books.source_watch import stopped_error
from joader.server.registry.next_call import Batch, NextArgs, NextCall
from joader.server.registry.queue_heads import heads
from joader.server.registry.state import RegistryState
from joader.server.scheduling import dealing
from joader.server.scheduling.dealing import Turn

logger = logging.getLogger(__name__)


class NextProtocol(RegistryState):
    """The `Registry`'s `Next` calls (a part of it: the registry's one lock guards them)."""

    @contained("Next", lambda registry, args, *_, **__: [args.job_id])
    def begin_next(self, args: NextArgs, waker: Callable[[], None]) -> NextCall | Batch:
        """Acknowledges `args.acks` and finds the request's pass (starting one if it is new).

        Returns a finished `Batch` for an acknowledge-only request (`max_items == 0`), else a
        `NextCall` to `poll_next` and finally `end_next`. `waker` is called when the job's items
        may have become ready.
        """
        if args.max_items < 0:
            raise InvalidArgumentError(f"job {args.job_id!r}: max_items must be >= 0, got {args.max_items}")
        with self._cond:
            self._check_alive()
            if args.job_id not in self.jobs.jobs and (error := stopped_error(self._sources.values(), args.job_id)):
                raise error
            job = self.jobs.lookup(args.job_id, args.secret)
            rank = self.passes.rank_of(job, args)
            now = self._clock()
            rank.last_seen_s = now
            rank.requested = True
            known = rank.passes.get(args.token)
            if args.stall is not None:
                job.stall.report(args.stall[0], (rank.index, args.token), *args.stall[1:])
            if known is not None and args.acks:
                self.passes.acknowledge(job, rank, known, args.acks, args.worker_id)
                if self._scheduler.pin_ahead(job, rank, now):
                    job.wake()  # another reader of the rank may be waiting for these
                self._cond.notify_all()
            if args.max_items == 0:  # acknowledge only: also for a pass that was superseded
                return Batch(known.epoch if known else 0, False, [], [], [], [])
            pass_ = self.passes.claim(job, rank, args)
            if pass_ is not known:
                self._recheck_failures(job, rank, pass_.epoch, len(rank.queue))
                if job.source.watch is not None:
                    job.source.watch.poke()  # an epoch starts: is its source still the listed one?
            rank.last_read_s = now
            if not job.reading:
                job.reading = True
                job.reading_since_s = now
            self._cond.notify_all()
            job.wakers.add(waker)
            pass_.asking[args.worker_id] += 1
            max_items, max_batches = dealing.request_limits(args.max_items, args.max_batches,
                                                            self.config.max_items_per_request)
            if max_items > job.batch_size or max_batches > job.reply_batches:
                # A reader asks in its DataLoader's batch size, which the dataset learns only
                # when the loader first fetches: the lookahead follows, in whole batches.
                job.batch_size = max(job.batch_size, max_items)
                job.reply_batches = max(job.reply_batches, max_batches)
                self._resize_queues()
            return NextCall(job, rank, pass_, max_items, now, now + self.config.next_wait_s, waker,
                            max_batches=max_batches, worker_id=args.worker_id)

    @contained("Next", lambda registry, call, *_, **__: [call.job.job_id])
    def poll_next(self, call: NextCall) -> Batch | float:
        """A batch of ready items of the call's epoch (or its end), or seconds to wait first.

        An empty, not-ended batch once `next_wait_s` passed without a ready item: the client
        asks again. Raises `PassSupersededError` once a newer pass of the rank started.
        """
        with self._cond:
            self._check_alive()
            job, rank, pass_ = call.job, call.rank, call.pass_
            job.nexts_waiting.pop(call.waker, None)
            if self.jobs.jobs.get(job.job_id) is not job:
                raise stopped_error([job.source], job.job_id) or UnknownJobError(self.jobs.gone_message(job.job_id))
            if pass_.superseded:
                raise self.passes.superseded_error(job, pass_)
            epoch = pass_.epoch
            now = self._clock()
            if self._scheduler.pin_ahead(job, rank, now):
                job.wake()  # the rank's other readers too
            left = self._left(job, rank, epoch)
            if left == 0:
                if call.worker_id not in pass_.ended:
                    pass_.ended.add(call.worker_id)
                    job.wake()  # a reader waiting for this one's turn
                return Batch(epoch, True, [], [], [], [])
            want = dealing.want(batch_items=call.max_items, left=left,
                                served=pass_.served[call.worker_id], queue_capacity=job.queue_capacity)
            self._recheck_failures(job, rank, epoch, call.max_items * call.max_batches)
            ready = self._count_ready(rank, epoch, want.wanted)
            if job.resume is not None and epoch >= job.resume.epoch:
                # NOTE: a resumed epoch still gathering its reports drops every queue and deals
                # its rest anew when it starts (`start_resumed`): an item of it (or of a later
                # epoch) handed out now would be dealt again. Queued lookahead waits.
                ready = 0
            if ready and call.linger_until_s is None:
                call.linger_until_s = now + self.config.linger_s
            linger = call.linger_until_s
            lingered = want.partial_ok and linger is not None and now >= linger
            if (dealing.ready_to_reply(ready=ready, wanted=want.wanted, lingered=lingered, stopped=self._stopped)
                    and self._turn(call) is Turn.GO and not self._must_acknowledge_first(call, want.wanted)):
                size = want.rest if want.in_batch else self._reply_size(call, rank, epoch, left, ready)
                batch = self._take_ready(job, rank, pass_, size, call.worker_id, call.max_items)
                assert batch is not None
                return batch
            if now >= call.deadline_s or self._stopped:
                return self._empty(job, rank, epoch, now)
            wake_s = linger if want.partial_ok and linger is not None else call.deadline_s
            job.nexts_waiting[call.waker] = (call, _need(ready, want.wanted, resumed=job.resume is not None))
            return max(0.0, min(call.deadline_s, wake_s) - now)

    def item_settled(self, job: Job) -> None:
        """An item `job` queued settled (ready or failed): wakes the job's waiting `Next`s
        whose answer it may change, not every one of them for every item.

        NOTE [ Waking a Next when its batch is ready ]
        A waiting `Next` was woken, and polled through the event loop, each time one of its
        items settled: 64 polls for a batch of 64 decodes, per job (the wake, the loop's
        round and the poll cost more than the decode's books). Its answer changes with the
        ready items at its rank's head only when they reach what it waits for: the first one
        (its linger starts) or its whole want (`dealing.ready_to_reply`); a partial reply
        after lingering comes from its timer, and a call held for another reason (its turn,
        acknowledgements, a resume) waits for other wakes, which still reach it
        (`Job.wake`). So a settle wakes a call only once its rank's ready count
        (`HeadBook.ready`, O(1) per item) reaches the need its last poll recorded
        (`_need`); a call not yet polled, or held for another reason (need 0), is woken as
        before. Called under the lock by the results thread (filing a decode)."""
        waiting = job.nexts_waiting
        if len(waiting) != len(job.wakers):
            job.wake()  # a call between its begin and its first wait: as before
            return
        for waker, (call, need) in list(waiting.items()):
            if need <= 0 or self._count_ready(call.rank, call.pass_.epoch, need) >= need:
                waker()

    def _empty(self, job: Job, rank: Rank, epoch: int, now: float) -> Batch:
        """An empty reply, saying what holds the job up when it is another rank: one not
        attached yet, or one that has not asked for items while this one's queue is empty
        (a job's epoch is dealt to its ranks in turn, so one rank's unread share stops the
        rounds). Without the reason, a script that reads on one rank only waits out its whole
        timeout, then blames the cache or the decoders."""
        waiting, never, waiting_s = self._held_up_by(job, rank, now)
        if not waiting and job.source.watch is not None:
            waiting = job.source.watch.waiting_reason(now)  # its folder is away
        return Batch(epoch, False, [], [], [], [], waiting=waiting, rank_never_read=never, waiting_s=waiting_s)

    def _held_up_by(self, job: Job, rank: Rank, now: float) -> tuple[str, bool, float]:
        if job.world_size == 1:
            return "", False, 0.0
        waiting = self.jobs.waiting(job, now)
        if waiting is not None:
            return str(waiting["detail"]), False, 0.0
        for other in job.ranks:
            if other is rank or other.closed:
                continue
            if other.last_read_s is None:
                since = now - job.created_s
                return (f"rank {other.index} of {job.world_size} has not asked for items in the "
                        f"{since:.0f} s since the job started, and each epoch is dealt to the ranks "
                        "in turn: every rank must iterate its own JoaderDataset"), True, since
            idle = now - other.last_read_s
            if idle > self.config.next_wait_s * 5 and len(other.queue) >= job.queue_capacity:
                return (f"rank {other.index} of {job.world_size} has not asked for items for "
                        f"{idle:.0f} s and its share is ready; this rank waits for it"), False, idle
        return "", False, 0.0

    def _turn(self, call: NextCall) -> Turn:
        """Whether the call's reader is served now (`dealing.turn`); a reader it defers to is
        woken to take its turn."""
        pass_ = call.pass_
        verdict = dealing.turn(worker_id=call.worker_id, batch_items=call.max_items,
                               num_workers=pass_.num_workers, continued=pass_.continued,
                               served=pass_.served, ended=pass_.ended, held=pass_.held,
                               asking=pass_.asking)
        if verdict is Turn.DEFER:
            for waker in list(call.job.wakers):
                if waker is not call.waker:  # waking this call too would spin it
                    waker()
        return verdict

    def _must_acknowledge_first(self, call: NextCall, size: int) -> bool:
        """`dealing.must_acknowledge_first` for the call's reader and rank."""
        job, rank, pass_ = call.job, call.rank, call.pass_
        return dealing.must_acknowledge_first(
            worker_id=call.worker_id, size=size, batch_items=call.max_items, held=pass_.held,
            served=pass_.served, members=pass_.members,
            recent_readers=max(len(p.members) for p in rank.passes.values()),
            handed_out=rank.handed_out, budget=_copies_budget(job))

    def _reply_size(self, call: NextCall, rank: Rank, epoch: int, left: int | None, ready: int) -> int:
        """How many items the reply takes once its first batch is ready (`dealing.reply_bound`,
        then `dealing.whole_batches` of what is ready of that)."""
        job = call.job
        size = call.max_items
        most = dealing.reply_bound(
            batch_items=size, max_batches=call.max_batches, queue_len=len(rank.queue),
            keep=job.queue_capacity if len(job.source.job_ids) > 1 else 0, ready=ready,
            handed_out=rank.handed_out, budget=_copies_budget(job),
            left=left)
        if most is None:
            return size
        return dealing.whole_batches(batch_items=size, most=most, available=self._count_ready(rank, epoch, most))

    def _left(self, job: Job, rank: Rank, epoch: int) -> int | None:
        """Items of `epoch` the rank has yet to receive; None while that is not known yet."""
        if job.resume is not None:
            return None  # a resumed epoch is still gathering its reports
        share = job.shares.get(epoch)
        if share is None:
            return 0 if epoch < job.sampler_epoch else None  # stale, or not begun yet
        left = max(0, share.target[rank.index] - rank.handed[epoch])
        if left and epoch in job.sampler_abandoned and not any(e.epoch == epoch for e in rank.queue):
            return 0  # the job's ranks broke out of this epoch: what was queued is all it gets
        return left

    @contained("Next", lambda registry, call, *_, **__: [call.job.job_id])
    def end_next(self, call: NextCall) -> None:
        with self._cond:
            call.job.wakers.discard(call.waker)
            call.job.nexts_waiting.pop(call.waker, None)
            asking = call.pass_.asking
            asking[call.worker_id] -= 1
            if asking[call.worker_id] <= 0:
                del asking[call.worker_id]
            call.job.wait_s += self._clock() - call.started_s

    def next_items(
        self,
        job_id: str,
        token: int,
        max_items: int,
        acks: Iterable[int] = (),
        *,
        secret: bytes,
        worker_id: int = 0,
        pid: int = 0,
        rank: int = 0,
        resume_epoch: int = 0,
        resume_consumed: BitMap | None = None,
        resume_parts: int = 1,
        max_batches: int = 1,
        stall: tuple[int, float, float, int] | None = None,
        num_workers: int = 0,
        continue_epoch: int = 0,
        resume_rest: RestShare | None = None,
    ) -> Batch:
        """`begin_next`, `poll_next` and `end_next`, blocking this thread while it waits."""
        event = threading.Event()
        args = NextArgs(job_id, secret, token, max_items, tuple(acks), worker_id, pid, rank,
                        resume_epoch, resume_consumed, resume_parts, max_batches, stall, num_workers,
                        continue_epoch, resume_rest)
        call = self.begin_next(args, event.set)
        if isinstance(call, Batch):
            return call
        try:
            while True:
                event.clear()
                result = self.poll_next(call)
                if isinstance(result, Batch):
                    return result
                event.wait(result)
        finally:
            self.end_next(call)

    def _recheck_failures(self, job: Job, rank: Rank, epoch: int, limit: int) -> None:
        """Failed copies among the next `limit` pinned entries of `epoch`, queued while their
        file had failed, are decoded again if `retry_failed_s` has passed by now (once per
        entry): queued as lookahead, maybe an epoch before, they carry an old decision, and a
        file fixed meanwhile was skipped in the epoch after its fix. Runs when a pass starts
        (the decodes start early) and when a `Next` is about to hand them out. Looks only at
        the rank's failed entries (`HeadBook.retry_candidates`), not the whole queue."""
        cache = self.cache
        candidates = heads(rank).retry_candidates(rank, cache.items, cache.decode_failures, cache.num_failed > 0)
        if not candidates:
            return
        now = self._clock()
        for position, entry in candidates:
            item = cache.items[entry.key]
            if entry.epoch != epoch or item.state is not ItemState.FAILED:
                continue
            failed_s = cache.failed_at[entry.key]
            if (now - failed_s < cache.retry_failed_s or cache.quarantined(item)
                    or not _within(rank, epoch, position, limit)):
                continue  # (not due: `retry_due` would refuse it, so the walk is spared)
            if cache.retry_due(item, now):
                entry.rechecked = True
                cache.add_waiter(item, job)
                logger.info("source %s: item %d failed %.1f s ago; decoding it again for job %s",
                            job.source.name, entry.item_id, now - failed_s, job.job_id)

    def _count_ready(self, rank: Rank, epoch: int, limit: int) -> int:
        """How many items at the head of the queue (of `epoch`, up to `limit`) can be taken:
        settled and pinned (entries beyond the rank's share are not decoded yet). From the
        rank's `HeadBook`: each entry is looked at about once while it waits."""
        return heads(rank).ready(rank, self.cache.items, epoch, limit, self.cache.items_retried)

    def _take_ready(self, job: Job, rank: Rank, pass_: PassBook, max_items: int, worker_id: int = 0,
                    batch_items: int = 0) -> Batch | None:
        """Hands out the ready head of the rank's queue, up to `max_items`, to reader
        `worker_id`, which collates batches of `batch_items` (0: unknown)."""
        queue = rank.queue
        epoch = pass_.epoch
        book = heads(rank)
        book.check(rank)
        while queue and queue[0].epoch < epoch:  # leftovers of an abandoned epoch
            entry = queue.popleft()
            book.popped_head(entry)
            self.cache.unplan(entry.key)
            if rank.pinned:
                rank.pinned -= 1
                self.cache.release(entry.key)
        batch = Batch(epoch, False, [], [], [], [])
        source = job.source
        source_labels = source.listing.labels
        # The per-item loop, with its lookups hoisted (issue 37: it runs once per delivery).
        cache = self.cache
        unplan = cache.unplan
        delivered: list[int] = []  # the READY keys handed out: delivered and unplanned together
        ready, failed_state = ItemState.READY, ItemState.FAILED
        job_id, outstanding = job.job_id, pass_.outstanding
        item_ids, labels, offsets = batch.item_ids, batch.labels, batch.offsets
        forms, checksums = batch.forms, batch.checksums
        taken = 0  # items and failures in the batch
        pinned = rank.pinned  # a property (it keeps a low-water mark): set once, after the loop
        try:
            while queue and pinned and taken < max_items:
                entry = queue[0]
                if entry.epoch != epoch:
                    break
                key = entry.key
                item: Item = entry.item  # type: ignore[assignment]  # pinned: the cache's items[key] (`Entry.item`)
                state = item.state
                if state is ready:
                    delivered.append(key)
                    item_ids.append(entry.item_id)
                    forms.append(item.form)
                elif state is failed_state:
                    batch.failed.append((entry.item_id, source.listing.paths[entry.item_id], source.failed[entry.item_id]))
                    cache.release(key)
                    unplan(key)
                else:
                    break
                taken += 1
                queue.popleft()
                pinned -= 1
        finally:
            rank.pinned = pinned
            rank.handed_out += len(delivered)
            book.popped_many(taken, epoch)
            outstanding.update(delivered)  # the queue's pins now cover the handed-out copies (a C loop)
            reused, shared = cache.deliver_ready(job_id, delivered)  # shared: another job's decode
        if isinstance(source_labels, np.ndarray):  # one gather, not an indexing and int() per item
            labels.extend(source_labels[item_ids].tolist())
        else:
            labels.extend(int(source_labels[item_id]) for item_id in item_ids)
        if item_ids:  # READY items: their offsets and checksums were filed (`Source.offsets`, `.checksums`)
            offsets.extend(source.offsets[item_ids].tolist())  # type: ignore[index]
            checksums.extend(source.checksums[item_ids].tolist())  # type: ignore[index]
        book.after_pops(rank)
        item_ids, failed = batch.item_ids, batch.failed
        if not item_ids and not failed:
            return None
        if failed and self._scheduler.pin_ahead(job, rank):  # a skipped item freed its part of the share
            job.wake()
        rank.handed[epoch] += len(item_ids) + len(failed)
        pass_.held[worker_id] += len(item_ids)
        pass_.served[worker_id] += len(item_ids) + len(failed)
        if len(pass_.asking) > 1:
            job.wake()  # a reader of the pass that deferred to this one may take what is left
        job.rate.add(self._clock(), len(item_ids) + len(failed))
        job.items_delivered += len(item_ids)
        job.items_skipped += len(failed)
        self.items_delivered += len(item_ids)
        job.items_reused += reused
        job.items_shared += shared
        self.items_reused += reused
        self._cond.notify_all()  # the queue has room again
        copy_now = dealing.copy_now(handed_out=rank.handed_out,
                                    budget=_copies_budget(job),
                                    served=pass_.served[worker_id], batch_items=batch_items)
        return dataclasses.replace(batch, end_of_epoch=self._left(job, rank, epoch) == 0, copy_now=copy_now)


def _need(ready: int, wanted: int, *, resumed: bool) -> int:
    """The ready items at which a waiting call's answer may change (NOTE [ Waking a Next when
    its batch is ready ]): the first (its linger starts), else its whole want; 0 (any settle
    wakes it) when it waits for something else: ready enough already, or a resume."""
    if resumed:
        return 0
    if ready == 0:
        return 1
    return wanted if ready < wanted else 0


def _within(rank: Rank, epoch: int, position: int, limit: int) -> bool:
    """Whether the entry at `position` is among the first `limit` entries of `epoch` (older
    entries before it passed over, a newer one before it ends the span): the span
    `_recheck_failures` looks at. Walks the head; asked only for a failed entry due a retry."""
    if limit <= 0:
        return False
    queue = rank.queue
    seen = 0
    for index in range(position):
        entry_epoch = queue[index].epoch
        if entry_epoch > epoch:
            return False
        seen += entry_epoch == epoch
        if seen >= limit:
            return False
    return True


def _copies_budget(job: Job) -> int:
    """The rank's copies budget (`dealing.copies_budget`) from the shares `Registry._resize_queues` set."""
    return dealing.copies_budget(job.copies_share, job.queue_capacity)
