"""The job registry: drives the sampler, the RefCnt cache and the decode pool for every job.

This is plain logic behind one lock; the gRPC servicer is a thin adapter over it. Three kinds of
callers come in:

- the scheduler thread (`run_scheduler`) runs a DSA round whenever some job's lookahead queue is
  below its capacity, with every job whose queue is below its limit (twice the capacity); a job
  at its limit sits the round out, so a slow job never holds back a fast one. It hands decodes to
  the pool in order of need (the round in which an item was first picked);
- the results thread files finished decodes into the cache (`file_result`);
- the servicer calls `attach`, `touch`, `remove_job`, `status` and, for `Next`, the three steps
  `begin_next` / `poll_next` / `end_next`. None of them blocks: a `Next` that must wait for a
  decode registers a *waker* (a callable the registry calls, under its lock, when the job's
  items may have become ready), so an asyncio servicer waits on an event without holding a
  thread. `next_items` is the blocking form of the same three steps, for tests and tools.

Pins: an item is pinned once for every queue entry and every handed-out, unacknowledged copy.
Pinned items are never evicted. An item's refcount is the number of jobs that still need it in
their current epoch (its presence in their remaining sets), maintained incrementally: -1 when a
round gives it to a job, +1 for every cached item of a job's dataset when that job starts an
epoch, and recomputed from the sampler when a decode lands.

Every item a round gives to a job is in that job's queue, tagged with the job's epoch; a `Next`
takes the ready prefix of the queue, so items reach the job in the sampler's order.

Who may read a job: whoever holds its secret, which `attach` returns to the lease holder only
(`status` lists job ids, never secrets). Within a job, a *pass* (one `iter()` of the dataset,
shared by the DataLoader workers of that iterator) reads one epoch. A new pass supersedes the
current one; the old pass's next request raises `PassSupersededError` instead of ending quietly.
Passes are named by a token the client derives from the workers' base seed; since that seed
repeats whenever a user re-seeds torch, a known token arriving from a *new process* in a worker
slot the pass already has is a new pass too (fresh workers), not a continuation.
"""

from __future__ import annotations

import heapq
import hmac
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pyroaring import BitMap

from joader.cache.arena import SlotAllocator
from joader.cache.policy import RefCntPolicy
from joader.errors import (
    InvalidArgumentError,
    PassSupersededError,
    ServerFailedError,
    TooManyJobsError,
    UnknownJobError,
    UnknownSourceError,
    superseded_message,
)
from joader.server.records import (
    Batch,
    Entry,
    Item,
    ItemState,
    Job,
    NextArgs,
    NextCall,
    Pass,
    Source,
)
from joader.sources.safe_open import display_path

logger = logging.getLogger(__name__)

_MAX_PASSES_PER_JOB = 8
_MAX_RETIRED_PER_JOB = 256
_MAX_REMOVED_REMEMBERED = 4096
_ROARING_CONTAINER_IDS = 1 << 16
_ROARING_CONTAINER_MAX_BYTES = 8192 + 16  # a bitmap container plus its key, count and offset


def max_indices_bytes(num_items: int) -> int:
    """The largest serialized BitMap of ids in `0..num_items-1`, with slack.

    A portable roaring bitmap holds one container per 65,536 ids, none larger than a plain 8 KiB
    bitmap (array and run containers are used only when smaller), plus a small header. A
    message above this cannot be a subset of the source; refusing it unread keeps a hostile or
    buggy client from making joaderd parse hundreds of megabytes.
    """
    containers = -(-max(num_items, 1) // _ROARING_CONTAINER_IDS)
    return 1024 + containers * _ROARING_CONTAINER_MAX_BYTES


@dataclass(frozen=True)
class RegistryConfig:
    """Tunables of the registry; the defaults suit a training job of a few hundred samples/s."""

    lookahead_batches: int = 4
    lease_s: float = 10.0
    next_wait_s: float = 1.0
    # Once some items are ready, wait this long for a full batch: fewer, fuller replies leave
    # more CPU to the decoders when decoding is the bottleneck.
    linger_s: float = 0.05
    rounds_per_lock: int = 64
    decodes_in_flight_per_worker: int = 2
    retry_failed_s: float = 60.0  # a failed file is decoded again at its next use after this
    max_jobs: int = 1024
    max_items_per_request: int = 4096


class DecodeSubmitter(Protocol):
    """What the registry needs of the decode pool (the real one is `DecodePool`)."""

    num_workers: int

    @property
    def in_flight(self) -> int: ...

    def submit(self, task_id: int, source_index: int, item_id: int, slot: int) -> None: ...


class Registry:
    """All jobs, sources and the cache of one joaderd."""

    def __init__(
        self,
        sources: Sequence[Source],
        num_slots: int,
        slot_bytes: int,
        pool: DecodeSubmitter,
        config: RegistryConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or RegistryConfig()
        self._clock = clock
        # One lock. `_cond` wakes the scheduler (queue room, freed pins, jobs coming and going);
        # each job's wakers wake only that job's waiting `Next`s, so a decode landing does not
        # wake every waiting request of every job.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._sources = {s.name: s for s in sources}
        self._source_index = {s.name: i for i, s in enumerate(sources)}
        self._jobs: dict[str, Job] = {}
        self._removed: OrderedDict[str, str] = OrderedDict()  # job id -> why it was removed
        self._policy: RefCntPolicy = RefCntPolicy()
        self._slots = SlotAllocator(num_slots)
        self._num_slots = num_slots
        self._slot_bytes = slot_bytes
        self._pool = pool
        self._items: dict[int, Item] = {}
        self._demand: list[tuple[int, int]] = []  # (round seq, key): decode in order of need
        self._round_seq = 0
        self._stopped = False
        self._failure: str | None = None
        self._started_s = clock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.items_decoded = 0
        self.items_delivered = 0
        self.items_retried = 0
        self.decode_s = 0.0

    # ----------------------------------------------------------------------------- jobs

    def source(self, name: str) -> Source:
        source = self._sources.get(name)
        if source is None:
            known = ", ".join(sorted(self._sources)) or "(none)"
            raise UnknownSourceError(
                f"unknown source {name!r}; this joaderd serves: {known}. "
                "Start joaderd with --source NAME=PATH to add one."
            )
        return source

    def attach(self, source_name: str, indices: BitMap | None, name: str, batch_size: int) -> Job:
        """Registers a job on `source_name` over `indices` (None: the whole source)."""
        with self._cond:
            self._check_alive()
            source = self.source(source_name)
            name = printable_name(name)
            if len(self._jobs) >= self.config.max_jobs:
                raise TooManyJobsError(
                    f"job {name!r}: joaderd already serves {len(self._jobs)} jobs, its limit; "
                    f"finish some jobs, or restart joaderd with a higher --max-jobs "
                    f"(now {self.config.max_jobs})"
                )
            dataset = BitMap(range(source.num_items)) if indices is None else BitMap(indices)
            if not dataset:
                raise InvalidArgumentError(
                    f"job {name!r}: the dataset is empty; pass at least one index of {source_name!r}"
                )
            if dataset.max() >= source.num_items:
                bad = dataset - BitMap(range(source.num_items))
                raise InvalidArgumentError(
                    f"job {name!r}: indices {_describe_ids(bad)} are outside source "
                    f"{source_name!r}, which has items 0..{source.num_items - 1}"
                )
            if batch_size < 1:
                raise InvalidArgumentError(f"job {name!r}: batch_size must be >= 1, got {batch_size}")
            now = self._clock()
            job_id = f"{_id_prefix(name)}-{secrets.token_hex(4)}"
            job = Job(job_id, name or job_id, secrets.token_bytes(16), source, dataset, batch_size, now, now)
            source.sampler.add_job(job_id, dataset)
            source.job_ids.append(job_id)
            self._jobs[job_id] = job
            self._count_new_epoch(source, dataset)
            self._resize_queues()
            logger.info(
                "job %s: attached to source %s with %d items (queue %d)",
                job_id, source.name, len(dataset), job.queue_capacity,
            )
            self._cond.notify_all()
            return job

    def touch(self, job_id: str) -> None:
        """Renews a job's lease (its lease stream sent a heartbeat)."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None:
                raise UnknownJobError(self._gone_message(job_id))
            job.last_seen_s = self._clock()

    def on_removed(self, job_id: str, callback: Callable[[str], None]) -> None:
        """Calls `callback(reason)` (under the lock; it must not block) when the job goes."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None:
                callback(self._removed.get(job_id, "removed"))
            else:
                job.on_removed.append(callback)

    def remove_job(self, job_id: str, reason: str) -> bool:
        """Removes a job and releases everything it held. False if it was already gone."""
        with self._cond:
            job = self._jobs.pop(job_id, None)
            if job is None:
                return False
            self._removed[job_id] = reason
            while len(self._removed) > _MAX_REMOVED_REMEMBERED:
                self._removed.popitem(last=False)
            source = job.source
            for entry in job.queue:
                self._release(entry.key)
            job.queue.clear()
            for pass_ in job.passes.values():
                self._release_outstanding(pass_)
            for item_id in source.cached_ids & source.sampler.remaining(job_id):
                self._policy.add_refcount(source.key_base + item_id, -1)
            source.sampler.remove_job(job_id)
            source.job_ids.remove(job_id)
            self._resize_queues()
            logger.info("job %s: removed (%s) after %d items delivered", job_id, reason, job.items_delivered)
            self._cond.notify_all()
            job.wake()  # its waiting Nexts find it gone
            for callback in job.on_removed:
                callback(reason)
            return True

    def _job(self, job_id: str, secret: bytes) -> Job:
        job = self._jobs.get(job_id)
        # One message for "no such job" and "wrong secret": the reply must not tell a stranger
        # which job ids are live.
        if job is None or not hmac.compare_digest(job.secret, secret):
            raise UnknownJobError(self._gone_message(job_id))
        return job

    def _gone_message(self, job_id: str) -> str:
        reason = self._removed.get(job_id)
        if reason is not None:
            return (
                f"job {job_id!r} was removed by joaderd: {reason}. Its epoch cannot go on; "
                "create a new JoaderDataset (and see the training process's log for why its "
                "lease ended)."
            )
        return (
            f"job {job_id!r} is not registered with this joaderd (or the request lacks the job's "
            "secret, which only the JoaderDataset that attached it holds); create a new "
            "JoaderDataset"
        )

    def _resize_queues(self) -> None:
        # Queued items are pinned. A queue's capacity is its share of half the cache (so that,
        # at their limit of twice the capacity, all queues together fit in it), but at least one
        # batch while the whole cache can still hold every queue at its limit: a job that reads
        # a batch at a time and finds less than a batch queued sits out rounds it should share.
        num_jobs = max(1, len(self._jobs))
        share = self._num_slots // (4 * num_jobs)
        for job in self._jobs.values():
            floor = min(job.batch_size, self._num_slots // (2 * num_jobs))
            wanted = self.config.lookahead_batches * job.batch_size
            job.queue_capacity = max(1, min(wanted, max(share, floor)))

    # ----------------------------------------------------------------------------- Next

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
            job = self._job(args.job_id, args.secret)
            now = self._clock()
            job.last_seen_s = now
            known = job.passes.get(args.token)
            if known is not None and args.acks:
                self._acknowledge(job, known, args.acks)
            if args.max_items == 0:  # acknowledge only: also for a pass that was superseded
                return Batch(known.epoch if known else 0, False, [], [], [], [])
            pass_ = self._claim(job, args.token, args.worker_id, args.pid)
            if not job.reading:
                job.reading = True
                self._cond.notify_all()
            job.wakers.add(waker)
            max_items = min(args.max_items, self.config.max_items_per_request)
            return NextCall(job, pass_, max_items, now, now + self.config.next_wait_s, waker)

    def poll_next(self, call: NextCall) -> Batch | float:
        """A batch of ready items of the call's epoch (or its end), or seconds to wait first.

        An empty, not-ended batch once `next_wait_s` passed without a ready item: the client
        asks again. Raises `PassSupersededError` once a newer pass of the job started.
        """
        with self._cond:
            self._check_alive()
            job = call.job
            if self._jobs.get(job.job_id) is not job:
                raise UnknownJobError(self._gone_message(job.job_id))
            pass_ = call.pass_
            if pass_.superseded:
                raise PassSupersededError(_superseded(job, pass_))
            epoch = pass_.epoch
            if job.handed[epoch] >= job.num_items:
                return Batch(epoch, True, [], [], [], [])
            wanted = min(call.max_items, job.num_items - job.handed[epoch], job.queue_capacity)
            ready = self._count_ready(job, epoch, wanted)
            now = self._clock()
            if ready and call.linger_until_s is None:
                call.linger_until_s = now + self.config.linger_s
            linger = call.linger_until_s
            if ready >= wanted or (ready and (linger is not None and now >= linger or self._stopped)):
                batch = self._take_ready(job, pass_, call.max_items)
                assert batch is not None
                return batch
            if now >= call.deadline_s or self._stopped:
                return Batch(epoch, False, [], [], [], [])
            return max(0.0, min(call.deadline_s, linger if linger is not None else call.deadline_s) - now)

    def end_next(self, call: NextCall) -> None:
        with self._cond:
            call.job.wakers.discard(call.waker)
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
    ) -> Batch:
        """`begin_next`, `poll_next` and `end_next`, blocking this thread while it waits."""
        event = threading.Event()
        call = self.begin_next(NextArgs(job_id, secret, token, max_items, tuple(acks), worker_id, pid), event.set)
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

    def _acknowledge(self, job: Job, pass_: Pass, acks: Iterable[int]) -> None:
        base = job.source.key_base
        outstanding = pass_.outstanding
        for item_id in acks:
            key = base + item_id
            if outstanding[key] <= 0:
                logger.debug("job %s: ignoring ack of item %d it does not hold", job.job_id, item_id)
                continue
            outstanding[key] -= 1
            if not outstanding[key]:
                del outstanding[key]
            self._release(key)
        self._cond.notify_all()

    def _claim(self, job: Job, token: int, worker_id: int, pid: int) -> Pass:
        """The pass a request belongs to; a new token, or fresh workers, start a new one."""
        if (token, pid) in job.retired:
            pass_ = job.passes.get(token)
            raise PassSupersededError(_superseded(job, pass_))
        pass_ = job.passes.get(token)
        if pass_ is not None and not pass_.superseded:
            member = pass_.members.get(worker_id)
            if member is None or member == pid:
                pass_.members[worker_id] = pid
                return pass_
            # The same token from a new process in a worker slot the pass already has: fresh
            # DataLoader workers whose base seed repeated (the user re-seeded torch). A new pass.
            logger.info(
                "job %s: worker %d of pass %x is a new process (pid %d, was %d): a new pass",
                job.job_id, worker_id, token, pid, member,
            )
        return self._start_pass(job, token, worker_id, pid)

    def _start_pass(self, job: Job, token: int, worker_id: int, pid: int) -> Pass:
        current = job.current
        if current is not None and not current.superseded:
            self._supersede(job, current)
        epoch = job.claimed_epoch + 1
        job.claimed_epoch = epoch
        pass_ = Pass(token, epoch, {worker_id: pid})
        old = job.passes.pop(token, None)
        if old is not None:
            self._release_outstanding(old)
        job.passes[token] = pass_
        job.current = pass_
        while len(job.passes) > _MAX_PASSES_PER_JOB:
            oldest = next(iter(job.passes))
            self._release_outstanding(job.passes.pop(oldest))
        return pass_

    def _supersede(self, job: Job, pass_: Pass) -> None:
        """A newer pass took over: `pass_` may read no more; its unread epoch is dropped."""
        pass_.superseded = True
        for pid in pass_.members.values():
            job.retired[(pass_.token, pid)] = None
        while len(job.retired) > _MAX_RETIRED_PER_JOB:
            del job.retired[next(iter(job.retired))]
        # Its clients may still be copying their last batch out of the arena: their copies stay
        # pinned until acknowledged, or for one lease at most (a killed DataLoader worker never
        # acknowledges).
        pass_.release_at_s = self._clock() + self.config.lease_s
        epoch = pass_.epoch
        if job.handed[epoch] < job.num_items and epoch not in job.abandoned:
            self._abandon(job, epoch)
        job.wake()

    def _release_outstanding(self, pass_: Pass) -> None:
        for key, count in pass_.outstanding.items():
            for _ in range(count):
                self._release(key)
        pass_.outstanding.clear()
        pass_.release_at_s = None

    def _abandon(self, job: Job, epoch: int) -> None:
        """A new pass began before `epoch` was read to its end (the loop broke out early)."""
        logger.info(
            "job %s: a new pass began before epoch %d ended; dropping its %d unread items",
            job.job_id, epoch, job.num_items - job.handed[epoch],
        )
        job.abandoned.add(epoch)
        kept: deque[Entry] = deque()
        for entry in job.queue:
            if entry.epoch == epoch:
                self._release(entry.key)
            else:
                kept.append(entry)
        job.queue = kept
        if job.sampler_epoch == epoch:
            sampler = job.source.sampler
            before = sampler.remaining(job.job_id)
            sampler.reset_epoch(job.job_id)
            job.sampler_epoch += 1
            self._count_new_epoch(job.source, job.dataset - before)

    def _count_ready(self, job: Job, epoch: int, limit: int) -> int:
        """How many items at the head of the queue (of `epoch`, up to `limit`) can be taken."""
        items = self._items
        count = 0
        for entry in job.queue:
            if count >= limit:
                break
            if entry.epoch < epoch:
                continue  # leftovers of an abandoned epoch, dropped when taking
            if entry.epoch != epoch or not items[entry.key].state.settled:
                break
            count += 1
        return count

    def _take_ready(self, job: Job, pass_: Pass, max_items: int) -> Batch | None:
        queue = job.queue
        epoch = pass_.epoch
        while queue and queue[0].epoch < epoch:  # leftovers of an abandoned epoch
            self._release(queue.popleft().key)
        item_ids: list[int] = []
        labels: list[int] = []
        offsets: list[int] = []
        failed: list[tuple[int, str, str]] = []
        source = job.source
        source_labels = source.listing.labels
        slot_bytes = self._slot_bytes
        items = self._items
        while queue and len(item_ids) + len(failed) < max_items:
            entry = queue[0]
            if entry.epoch != epoch:
                break
            item = items[entry.key]
            if item.state is ItemState.READY:
                item_ids.append(entry.item_id)
                labels.append(int(source_labels[entry.item_id]))
                offsets.append(item.slot * slot_bytes)
                pass_.outstanding[entry.key] += 1  # the queue's pin now covers the handed-out copy
            elif item.state is ItemState.FAILED:
                failed.append((entry.item_id, source.listing.paths[entry.item_id], source.failed[entry.item_id]))
                self._release(entry.key)
            else:
                break
            queue.popleft()
        if not item_ids and not failed:
            return None
        count = len(item_ids) + len(failed)
        job.handed[epoch] += count
        job.items_delivered += len(item_ids)
        job.items_skipped += len(failed)
        self.items_delivered += len(item_ids)
        self._cond.notify_all()  # the queue has room again
        end = job.handed[epoch] >= job.num_items
        return Batch(epoch, end, item_ids, labels, offsets, failed)

    # ----------------------------------------------------------------------------- scheduling

    def run_scheduler(self) -> None:
        """The scheduler thread: `schedule_once` until `stop`, sleeping when there is no work."""
        while True:
            with self._cond:
                if self._stopped:
                    return
                if not self.schedule_once():
                    self._cond.wait(0.25)

    def schedule_once(self) -> bool:
        """Runs a bounded number of rounds, dispatches decodes, expires leases.

        Returns whether any round ran (the caller loops at once if so).
        """
        with self._cond:
            progressed = False
            for source in self._sources.values():
                for _ in range(self.config.rounds_per_lock):
                    if not self._run_round(source):
                        break
                    progressed = True
            self._dispatch()
            self._expire_leases()
            if progressed:
                for job in self._jobs.values():  # cached picks are ready at once
                    job.wake()
            return progressed

    def _run_round(self, source: Source) -> bool:
        """One DSA round, if some job's queue is below its capacity.

        Every job below its *limit* (twice its capacity) takes part, not only the one that ran
        low: jobs reading at about the same speed then share nearly every round, although they
        never ask at the same moment. A job whose queue reached its limit (it reads more slowly)
        sits the round out and loses sharing, not speed.
        """
        jobs = self._jobs
        # A job joins rounds from its first request for items, not from its registration, so
        # jobs launched together share from their first round even if they registered apart.
        queued = [
            (job_id, len(jobs[job_id].queue), jobs[job_id].queue_capacity)
            for job_id in source.job_ids
            if jobs[job_id].reading
        ]
        if not any(length < capacity for _, length, capacity in queued):
            return False
        participants = [job_id for job_id, length, capacity in queued if length < 2 * capacity]
        sampler = source.sampler
        starting = [j for j in participants if sampler.num_remaining(j) == 0]
        picks = sampler.sample(participants)
        for job_id in starting:
            job = jobs[job_id]
            job.sampler_epoch += 1
            self._count_new_epoch(source, job.dataset)
        self._round_seq += 1
        base = source.key_base
        items = self._items
        policy = self._policy
        now = self._clock()
        for job_id, item_id in picks.items():
            key = base + item_id
            item = items.get(key)
            if item is None:
                item = items[key] = Item(source, item_id)
                item.pins = 1
                heapq.heappush(self._demand, (self._round_seq, key))
                self.misses += 1
            elif item.state is ItemState.READY:
                policy.add_refcount(key, -1)
                policy.pin(key)
                self.hits += 1
            else:
                item.pins += 1
                if item.state is ItemState.FAILED and now - item.failed_s >= self.config.retry_failed_s:
                    # Failures are not forever: the file may have been fixed (or its storage
                    # come back) since. Jobs that queued it meanwhile wait for this decode.
                    item.move(ItemState.WAITING)
                    heapq.heappush(self._demand, (self._round_seq, key))
                    self.items_retried += 1
                    self.misses += 1
                elif item.state is not ItemState.FAILED:
                    self.hits += 1
            job = jobs[job_id]
            job.queue.append(Entry(job.sampler_epoch, item_id, key))
            if not item.state.settled:
                item.waiters.append(job)
        return True

    def _count_new_epoch(self, source: Source, needed: BitMap) -> None:
        """A job now needs `needed` again: every cached item in it gains a reference."""
        base = source.key_base
        for item_id in source.cached_ids & needed:
            self._policy.add_refcount(base + item_id, 1)

    def _dispatch(self) -> None:
        limit = self._pool.num_workers * self.config.decodes_in_flight_per_worker
        demand = self._demand
        while demand and self._pool.in_flight < limit:
            key = demand[0][1]
            item = self._items.get(key)
            if item is None or item.state is not ItemState.WAITING:
                heapq.heappop(demand)
                continue
            if item.pins == 0:  # every job that wanted it left before it was decoded
                heapq.heappop(demand)
                del self._items[key]
                continue
            slot = self._slots.allocate()
            if slot is None:
                victim = self._policy.victim()
                if victim is None:
                    return  # everything cached is pinned: decoding waits for acknowledgements
                self._evict(victim)
                slot = self._slots.allocate()
            heapq.heappop(demand)
            item.move(ItemState.DECODING)
            item.slot = slot
            self._pool.submit(key, self._source_index[item.source.name], item.item_id, slot)

    def _evict(self, key: int) -> None:
        self._policy.remove(key)
        item = self._items.pop(key)
        item.source.cached_ids.discard(item.item_id)
        self._slots.release(item.slot)
        self.evictions += 1

    def _release(self, key: int) -> None:
        """Drops one pin of `key` (a queue entry or a handed-out copy)."""
        item = self._items.get(key)
        if item is None:
            return
        if item.state is ItemState.READY:
            self._policy.unpin(key)
        else:
            item.pins -= 1

    def _expire_leases(self) -> None:
        now = self._clock()
        deadline = now - self.config.lease_s
        for job in [j for j in self._jobs.values() if j.last_seen_s < deadline]:
            self.remove_job(job.job_id, f"no request for {self.config.lease_s:g} s, nor a heartbeat (lease expired)")
        for job in self._jobs.values():
            for pass_ in job.passes.values():
                if pass_.release_at_s is not None and pass_.release_at_s <= now:
                    self._release_outstanding(pass_)

    # ----------------------------------------------------------------------------- results

    def file_result(self, key: int, ok: bool, error: str | None, decode_s: float) -> None:
        """Files one finished decode (called by the results thread)."""
        with self._cond:
            item = self._items.get(key)
            if item is None or item.state is not ItemState.DECODING:
                logger.warning("decode result for unknown item key %d ignored", key)
                return
            source = item.source
            self.decode_s += decode_s
            if ok:
                item.move(ItemState.READY)
                sampler = source.sampler
                refcount = sum(1 for j in source.job_ids if sampler.needs(j, item.item_id))
                self._policy.insert(key, refcount, pinned=item.pins)
                item.pins = 0
                source.cached_ids.add(item.item_id)
                if source.failed.pop(item.item_id, None) is not None:
                    logger.info("source %s: item %d decodes again", source.name, item.item_id)
                self.items_decoded += 1
            else:
                item.move(ItemState.FAILED)
                item.failed_s = self._clock()
                self._slots.release(item.slot)
                item.slot = -1
                source.failed[item.item_id] = error or "unknown error"
                logger.warning(
                    "source %s: item %d could not be prepared and is skipped (retried after %g s): %s",
                    source.name, item.item_id, self.config.retry_failed_s, error,
                )
            for job in item.waiters:
                job.wake()
            item.waiters = []
            self._dispatch()

    # ----------------------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            for job in self._jobs.values():
                job.wake()

    def fail(self, reason: str) -> None:
        """An internal part of joaderd broke: every request from now on gets `ServerFailedError`."""
        with self._cond:
            if self._failure is None:
                self._failure = reason
            self._stopped = True
            self._cond.notify_all()
            for job in self._jobs.values():
                job.wake()

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise ServerFailedError(
                f"joaderd is stopping after an internal error ({self._failure}); its log has the "
                "traceback. Restart joaderd, then the job."
            )

    def status(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """A JSON-ready snapshot (the schema `joader status --json` documents)."""
        with self._cond:
            now = self._clock()
            policy_stats = self._policy.statistics()
            waiting_pinned = sum(
                1 for i in self._items.values()
                if i.pins and i.state in (ItemState.WAITING, ItemState.DECODING)
            )
            used_slots = self._num_slots - self._slots.num_free
            failed = [
                {"source": s.name, "item_id": i, "path": display_path(s.listing.paths[i]), "reason": display_path(r)}
                for s in self._sources.values()
                for i, r in sorted(s.failed.items())
            ]
            status = {
                "uptime_s": round(now - self._started_s, 3),
                "sources": [
                    {
                        "name": s.name,
                        "root": display_path(str(s.listing.root)),
                        "num_items": s.num_items,
                        "num_classes": len(s.listing.classes),
                        "image_size": s.image_size,
                        "num_jobs": len(s.job_ids),
                    }
                    for s in self._sources.values()
                ],
                "jobs": [
                    {
                        "job_id": j.job_id,
                        "name": j.name,
                        "source": j.source.name,
                        "num_items": j.num_items,
                        "epoch": j.claimed_epoch,
                        "items_delivered": j.items_delivered,
                        "items_skipped": j.items_skipped,
                        "wait_s": round(j.wait_s, 3),
                        "queued": len(j.queue),
                        "queue_capacity": j.queue_capacity,
                        "age_s": round(now - j.created_s, 3),
                    }
                    for j in self._jobs.values()
                ],
                "max_jobs": self.config.max_jobs,
                "cache": {
                    "capacity_bytes": self._num_slots * self._slot_bytes,
                    "slot_bytes": self._slot_bytes,
                    "num_slots": self._num_slots,
                    "used_bytes": used_slots * self._slot_bytes,
                    "items": policy_stats.num_items,
                    "pinned": policy_stats.num_pinned + waiting_pinned,  # items, not pins
                    "hits": self.hits,
                    "misses": self.misses,
                    "evictions": self.evictions,
                },
                "items_decoded": self.items_decoded,
                "items_delivered": self.items_delivered,
                "items_failed": len(failed),
                "items_retried": self.items_retried,
                "failed": failed[:50],
                "decode_s": round(self.decode_s, 3),
                "sharing_factor": (
                    round(self.items_delivered / self.items_decoded, 4) if self.items_decoded else None
                ),
            }
            if extra:
                status.update(extra)
            return status


def printable_name(name: str, limit: int = 80) -> str:
    """`name` with control and other unprintable characters escaped, so logs cannot be forged."""
    cleaned = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)
    return cleaned[:limit]


def _id_prefix(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:40] or "job"


def _superseded(job: Job, pass_: Pass | None) -> str:
    return superseded_message(job.job_id, pass_.epoch if pass_ is not None else None)


def _describe_ids(ids: BitMap) -> str:
    """`5..9 and 12` style, short, for error messages."""
    if len(ids) <= 3:
        return ", ".join(str(i) for i in ids)
    return f"{ids.min()}..{ids.max()} ({len(ids)} ids)"
