"""The job registry: drives the sampler, the RefCnt cache and the decode pool for every job.

This is plain logic behind one lock (a `threading.Condition`); the gRPC servicer is a thin adapter
over it. Three kinds of threads call in:

- the scheduler thread (`run_scheduler`) runs a DSA round whenever some job's lookahead queue is
  below its capacity, with every job whose queue is below its limit (twice the capacity); a job
  at its limit sits the round out, so a slow job never holds back a fast one. It hands decodes to
  the pool in order of need (the round in which an item was first picked);
- the results thread (`run_results`) files finished decodes into the cache;
- gRPC threads call `attach`, `next_items`, `touch`, `remove_job` and `status`.

Pins: an item is pinned once for every queue entry and every handed-out, unacknowledged copy.
Pinned items are never evicted. An item's refcount is the number of jobs that still need it in
their current epoch (its presence in their remaining sets), maintained incrementally: -1 when a
round gives it to a job, +1 for every cached item of a job's dataset when that job starts an
epoch, and recomputed from the sampler when a decode lands.

Every item a round gives to a job is in that job's queue, tagged with the job's epoch; a `Next`
takes the ready prefix of the queue, so items reach the job in the sampler's order.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pyroaring import BitMap

from joader.cache.arena import SlotAllocator
from joader.cache.policy import RefCntPolicy
from joader.errors import InvalidArgumentError, UnknownJobError, UnknownSourceError
from joader.server.records import (
    _DECODING,
    _FAILED,
    _MAX_TOKENS_PER_JOB,
    _READY,
    _WAITING,
    Batch,
    Entry,
    Item,
    Job,
    Source,
)

logger = logging.getLogger(__name__)

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


class DecodeSubmitter:
    """What the registry needs of the decode pool (the real one is `DecodePool`)."""

    num_workers: int
    in_flight: int

    def submit(self, task_id: int, source_index: int, item_id: int, slot: int) -> None: ...


class Registry:
    """All jobs, sources and the cache of one joaderd."""

    def __init__(
        self,
        sources: Sequence[Source],
        num_slots: int,
        slot_bytes: int,
        pool: DecodeSubmitter,
        config: RegistryConfig = RegistryConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock
        # One lock. `_cond` wakes the scheduler (queue room, freed pins, jobs coming and going);
        # each job's own condition on the same lock wakes only that job's waiting `Next`s, so a
        # decode landing does not wake every waiting request of every job.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._sources = {s.name: s for s in sources}
        self._source_index = {s.name: i for i, s in enumerate(sources)}
        self._jobs: dict[str, Job] = {}
        self._policy: RefCntPolicy = RefCntPolicy()
        self._slots = SlotAllocator(num_slots)
        self._num_slots = num_slots
        self._slot_bytes = slot_bytes
        self._pool = pool
        self._items: dict[int, Item] = {}
        self._demand: list[tuple[int, int]] = []  # (round seq, key): decode in order of need
        self._round_seq = 0
        self._stopped = False
        self._started_s = clock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.items_decoded = 0
        self.items_delivered = 0
        self.decode_s = 0.0

    # ----------------------------------------------------------------------------- jobs

    def attach(self, source_name: str, indices: BitMap | None, name: str, batch_size: int) -> Job:
        """Registers a job on `source_name` over `indices` (None: the whole source)."""
        with self._cond:
            source = self._sources.get(source_name)
            if source is None:
                known = ", ".join(sorted(self._sources)) or "(none)"
                raise UnknownSourceError(
                    f"unknown source {source_name!r}; this joaderd serves: {known}. "
                    "Start joaderd with --source NAME=PATH to add one."
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
            job_id = f"{name or 'job'}-{uuid.uuid4().hex[:8]}"
            job = Job(job_id, name or job_id, source, dataset, batch_size, now, now)
            job.ready = threading.Condition(self._lock)
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
        """Renews a job's lease."""
        with self._cond:
            self._job(job_id).last_seen_s = self._clock()

    def remove_job(self, job_id: str, reason: str) -> bool:
        """Removes a job and releases everything it held. False if it was already gone."""
        with self._cond:
            job = self._jobs.pop(job_id, None)
            if job is None:
                return False
            source = job.source
            for entry in job.queue:
                self._release(entry.key)
            for key, count in job.outstanding.items():
                for _ in range(count):
                    self._release(key)
            for item_id in source.cached_ids & source.sampler.remaining(job_id):
                self._policy.add_refcount(source.key_base + item_id, -1)
            source.sampler.remove_job(job_id)
            source.job_ids.remove(job_id)
            self._resize_queues()
            logger.info(
                "job %s: removed (%s) after %d items delivered",
                job_id, reason, job.items_delivered,
            )
            self._cond.notify_all()
            job.ready.notify_all()  # its waiting Nexts find it gone
            return True

    def _job(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJobError(
                f"job {job_id!r} is not registered: it was removed, or its lease of "
                f"{self.config.lease_s:g} s ran out without a request. Create a new JoaderDataset."
            )
        return job

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

    def next_items(self, job_id: str, token: int, max_items: int, acks: Iterable[int]) -> Batch:
        """Acknowledges `acks`, then takes up to `max_items` ready items of the token's epoch.

        Waits up to `next_wait_s` for the first ready item; returns an empty, not-ended batch if
        none arrives (the client asks again). `max_items == 0` only acknowledges.
        """
        if max_items < 0:
            raise InvalidArgumentError(f"job {job_id!r}: max_items must be >= 0, got {max_items}")
        with self._cond:
            job = self._job(job_id)
            job.last_seen_s = self._clock()
            self._acknowledge(job, acks)
            if max_items == 0:  # acknowledge only
                return Batch(job.tokens.get(token, 0), False, [], [], [], [])
            if not job.reading:
                job.reading = True
                self._cond.notify_all()
            epoch = self._claim(job, token)
            started = self._clock()
            deadline = started + self.config.next_wait_s
            linger_until: float | None = None
            try:
                while True:
                    if job.handed[epoch] >= job.num_items or epoch in job.abandoned:
                        return Batch(epoch, True, [], [], [], [])
                    wanted = min(max_items, job.num_items - job.handed[epoch], job.queue_capacity)
                    ready = self._count_ready(job, epoch, wanted)
                    now = self._clock()
                    if ready and linger_until is None:
                        linger_until = now + self.config.linger_s
                    if ready >= wanted or (ready and (now >= linger_until or self._stopped)):
                        batch = self._take_ready(job, epoch, max_items)
                        assert batch is not None
                        return batch
                    if now >= deadline or self._stopped:
                        return Batch(epoch, False, [], [], [], [])
                    job.ready.wait(min(deadline, linger_until or deadline) - now)
                    job = self._job(job_id)  # the lease may have ended while we waited
            finally:
                job.wait_s += self._clock() - started

    def _acknowledge(self, job: Job, acks: Iterable[int]) -> None:
        base = job.source.key_base
        for item_id in acks:
            key = base + item_id
            if job.outstanding[key] <= 0:
                logger.debug("job %s: ignoring ack of item %d it does not hold", job.job_id, item_id)
                continue
            job.outstanding[key] -= 1
            if not job.outstanding[key]:
                del job.outstanding[key]
            self._release(key)
        self._cond.notify_all()

    def _claim(self, job: Job, token: int) -> int:
        """The epoch a pass (token) reads; a new token starts the next epoch."""
        epoch = job.tokens.get(token)
        if epoch is not None:
            return epoch
        current = job.claimed_epoch
        if current and job.handed[current] < job.num_items and current not in job.abandoned:
            self._abandon(job, current)
        epoch = current + 1
        job.claimed_epoch = epoch
        job.tokens[token] = epoch
        while len(job.tokens) > _MAX_TOKENS_PER_JOB:
            del job.tokens[next(iter(job.tokens))]
        return epoch

    def _abandon(self, job: Job, epoch: int) -> None:
        """A new pass began before `epoch` was read to its end (the loop broke out early)."""
        logger.info(
            "job %s: a new pass began before epoch %d ended; dropping its %d unread items",
            job.job_id, epoch, job.num_items - job.handed[epoch],
        )
        job.abandoned.add(epoch)
        # The pass that read this epoch is over, so copies it never acknowledged are not in use.
        for key, count in job.outstanding.items():
            for _ in range(count):
                self._release(key)
        job.outstanding.clear()
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
        queue = job.queue
        items = self._items
        count = 0
        for entry in queue:
            if count >= limit:
                break
            if entry.epoch < epoch:
                continue  # leftovers of an abandoned epoch, dropped when taking
            if entry.epoch != epoch or items[entry.key].state < _READY:
                break
            count += 1
        return count

    def _take_ready(self, job: Job, epoch: int, max_items: int) -> Batch | None:
        queue = job.queue
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
        while queue and len(item_ids) < max_items:
            entry = queue[0]
            if entry.epoch != epoch:
                break
            item = items[entry.key]
            if item.state == _READY:
                item_ids.append(entry.item_id)
                labels.append(int(source_labels[entry.item_id]))
                offsets.append(item.slot * slot_bytes)
                job.outstanding[entry.key] += 1  # the queue's pin now covers the handed-out copy
            elif item.state == _FAILED:
                failed.append(
                    (entry.item_id, source.listing.paths[entry.item_id], source.failed[entry.item_id])
                )
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
                    job.ready.notify_all()
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
        for job_id, item_id in picks.items():
            key = base + item_id
            item = items.get(key)
            if item is None:
                item = items[key] = Item(source, item_id)
                item.pins = 1
                heapq.heappush(self._demand, (self._round_seq, key))
                self.misses += 1
            elif item.state == _READY:
                policy.add_refcount(key, -1)
                policy.pin(key)
                self.hits += 1
            elif item.state != _FAILED:
                item.pins += 1
                self.hits += 1
            job = jobs[job_id]
            job.queue.append(Entry(job.sampler_epoch, item_id, key))
            if item.state < _READY:
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
            if item is None or item.state != _WAITING:
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
            item.state = _DECODING
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
        if item.state == _READY:
            self._policy.unpin(key)
        elif item.state != _FAILED:
            item.pins -= 1

    def _expire_leases(self) -> None:
        deadline = self._clock() - self.config.lease_s
        for job in [j for j in self._jobs.values() if j.last_seen_s < deadline]:
            self.remove_job(job.job_id, f"no request for {self.config.lease_s:g} s")

    # ----------------------------------------------------------------------------- results

    def file_result(self, key: int, ok: bool, error: str | None, decode_s: float) -> None:
        """Files one finished decode (called by the results thread)."""
        with self._cond:
            item = self._items.get(key)
            if item is None or item.state != _DECODING:
                logger.warning("decode result for unknown item key %d ignored", key)
                return
            source = item.source
            self.decode_s += decode_s
            if ok:
                item.state = _READY
                sampler = source.sampler
                refcount = sum(1 for j in source.job_ids if sampler.needs(j, item.item_id))
                self._policy.insert(key, refcount, pinned=item.pins)
                item.pins = 0
                source.cached_ids.add(item.item_id)
                self.items_decoded += 1
            else:
                item.state = _FAILED
                self._slots.release(item.slot)
                item.slot = -1
                item.pins = 0
                source.failed[item.item_id] = error or "unknown error"
                logger.warning(
                    "source %s: item %d (%s) could not be decoded and is skipped: %s",
                    source.name, item.item_id, source.listing.paths[item.item_id], error,
                )
            for job in item.waiters:
                job.ready.notify_all()
            item.waiters = []
            self._dispatch()

    # ----------------------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            for job in self._jobs.values():
                job.ready.notify_all()

    def status(self) -> dict[str, Any]:
        """A JSON-ready snapshot (the schema `joader status --json` documents)."""
        with self._cond:
            now = self._clock()
            policy_stats = self._policy.statistics()
            waiting_pinned = sum(1 for i in self._items.values() if i.pins and i.state in (_WAITING, _DECODING))
            used_slots = self._num_slots - self._slots.num_free
            failed = [
                {"source": s.name, "item_id": i, "path": s.listing.paths[i], "reason": r}
                for s in self._sources.values()
                for i, r in sorted(s.failed.items())
            ]
            return {
                "uptime_s": round(now - self._started_s, 3),
                "sources": [
                    {
                        "name": s.name,
                        "root": str(s.listing.root),
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
                "failed": failed[:50],
                "decode_s": round(self.decode_s, 3),
                "sharing_factor": (
                    round(self.items_delivered / self.items_decoded, 4) if self.items_decoded else None
                ),
            }


def _describe_ids(ids: BitMap) -> str:
    """`5..9 and 12` style, short, for error messages."""
    if len(ids) <= 3:
        return ", ".join(str(i) for i in ids)
    return f"{ids.min()}..{ids.max()} ({len(ids)} ids)"
