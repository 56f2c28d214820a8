"""The job registry: jobs, the RefCnt item cache and the scheduler, behind one plain lock.

Its parts, each readable on its own: `ItemCache` (item_cache.py: item states, pins, arena
bytes, eviction), `JobTable` (jobs.py: jobs, ranks, leases), `PassTable` (passes.py: passes and
the copies their readers hold), `Resumes` (resumes.py: checkpoint and restart resumes),
`Scheduler` (scheduler.py: DSA rounds dealt to the ranks' queues). This module holds the lock
and the jobs' entry points; the gRPC servicer is a thin adapter over it. Three kinds of callers
come in:

- the scheduler thread (`run_scheduler`, scheduler_thread.py) runs rounds, hands decodes to the
  pool in order of need and expires leases;
- the results thread files finished decodes into the cache (`file_result`, filing.py);
- the servicer calls `attach`, `touch`, `remove_job`, `status` and, for `Next`, the three steps
  `begin_next` / `poll_next` / `end_next` (next_protocol.py). None of them blocks;
- with `--idle-exit-s`, joaderd's idle thread asks `exit_if_idle` about once a second (the rule
  is `idle_exit.IdleExit`, told of every job that comes or goes, here, under the lock).

`check_invariants` compares the cache's books with the jobs' queues and copies (tests call it
after every step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pyroaring import BitMap

from joader.errors import (
    InvalidArgumentError,
    ServerExitingError,
    ServerFailedError,
    UnknownSourceError,
)
from joader.server.books.containment import contained
from joader.server.books.item_cache import DecodeSubmitter, ItemCache
from joader.server.books.records import (
    Item,
    Job,
    RestShare,
    Source,
)
from joader.server.registry.filing import ResultFiling
from joader.server.registry.idle_exit import IdleExit, exiting_message
from joader.server.registry.jobs import JobTable, printable_name
from joader.server.registry.next_protocol import NextProtocol
from joader.server.registry.passes import PassTable
from joader.server.registry.resumes import Resumes
from joader.server.registry.scheduler_thread import SchedulerThread
from joader.server.registry.status import snapshot
from joader.server.scheduling.scheduler import Scheduler

__all__ = ["DecodeSubmitter", "Registry", "RegistryConfig", "Source", "max_indices_bytes", "printable_name"]

logger = logging.getLogger(__name__)

# The hazard of one planned read (a queue entry) in eviction: above any remaining-set draw's.
PLANNED_HAZARD = 1e6
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
    # Slots of decode tasks (server/pool/batching.py: about 5 ms of decoding each) in flight per
    # decode worker, not single decodes.
    decodes_in_flight_per_worker: int = 2
    retry_failed_s: float = 60.0  # a failed file is decoded again at its next use after this
    max_jobs: int = 1024
    max_items_per_request: int = 4096
    # Decode earliest-due first and evict by expected time to next use (joader.server.books.pacing);
    # False: decode in round order, plain RefCnt (for side-by-side benches).
    deadline_pacing: bool = True
    # A job that starts reading waits this long for its source's other attached jobs to start
    # too (a sweep launched together then begins in step: see Scheduler.run_round).
    start_grace_s: float = 0.2
    # A job whose ranks do not all attach within this long (of its first) ends: its attached
    # ranks cannot read anyway, and a stale half-attached job would capture the next run's ranks.
    # Shorter than a client's item timeout (300 s), so the error names the missing rank.
    rank_attach_timeout_s: float = 60.0
    # A rank with fewer queued items than this share of the cache's items takes part in rounds
    # (NOTE [ Planning a lagging job ahead ] in in_step.py); 0 (the default, NOTE [ The in-step
    # rules are opt-in ] there): twice its queue's capacity.
    plan_horizon: float = 0.0
    # The longest a source's rounds wait at a time for a CPU-bound job behind, on a busy host
    # (NOTE [ A leader waits only where it costs the sweep nothing ] in in_step.py); 0: never
    # (the default: see NOTE [ The in-step rules are opt-in ] there).
    max_hold_s: float = 0.0
    # Exit after this long with no job attached (server/registry/idle_exit.py); 0: never.
    idle_exit_s: float = 0.0


class Registry(NextProtocol, SchedulerThread, ResultFiling):
    """All jobs, sources and the cache of one joaderd, behind one lock.

    Its calls live beside it, one concern to a module: `Next` (next_protocol.py), the scheduler
    thread's turns (scheduler_thread.py), filing decodes and source verdicts (filing.py). This
    class holds the lock, the jobs' entry points, the cache's shares and containment.
    """

    def __init__(
        self,
        sources: Sequence[Source],
        capacity_bytes: int,
        pool: DecodeSubmitter,
        config: RegistryConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or RegistryConfig()
        self._clock = clock
        # One lock, not re-entrant: the parts below never call back into the registry. `_cond`
        # wakes the scheduler (queue room, freed pins, jobs coming and going); each job's
        # wakers wake only that job's waiting `Next`s, so a decode landing does not wake every
        # waiting request of every job.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._sources = {s.name: s for s in sources}
        self._source_index = {s.name: i for i, s in enumerate(sources)}
        self._pool = pool
        self.cache = ItemCache(capacity_bytes, retry_failed_s=self.config.retry_failed_s, clock=clock)
        self._scheduler = Scheduler(self.cache, clock, deadlines=self.config.deadline_pacing,
                                    start_grace_s=self.config.start_grace_s, max_hold_s=self.config.max_hold_s)
        if self.config.deadline_pacing:
            self.cache.reuse_hazard = self._reuse_hazard
        self.jobs = JobTable(self.cache, self._scheduler, lease_s=self.config.lease_s,
                             max_jobs=self.config.max_jobs, clock=clock,
                             rank_attach_timeout_s=self.config.rank_attach_timeout_s)
        self.resumes = Resumes(self._scheduler, clock)
        self.passes = PassTable(self.cache, self._scheduler, self.resumes, lease_s=self.config.lease_s,
                                clock=clock)
        self._stopped = False
        self._failure: str | None = None
        self._started_s = clock()
        self.idle = IdleExit(self.config.idle_exit_s, self._started_s)  # jobs_now on every come and go
        self._exiting = False  # exit_if_idle decided: attaches are refused from then on
        self.items_delivered = 0
        self.items_reused = 0  # deliveries of a copy its job had already had (cross-epoch reuse)
        self.jobs_ended_by_errors = 0  # jobs `contain` ended: each a bug, logged with its traceback
        self.internal_errors = 0

    # ----------------------------------------------------------------------------- jobs

    def source(self, name: str) -> Source:
        source = self._sources.get(name)
        if source is None:
            known = ", ".join(sorted(self._sources)) or "(none)"
            raise UnknownSourceError(
                f"unknown source {name!r}; this joaderd serves: {known}. "
                "Start joaderd with --source NAME=PATH to add one."
            )
        if source.watch is not None:
            source.watch.check_attach()  # changed on disk: refused (server/books/source_watch.py)
        return source

    @contained("Attach", lambda registry, source_name, indices, name, *_, **__: registry.jobs.named(name))
    def attach(self, source_name: str, indices: BitMap | None, name: str, batch_size: int, *,
               rank: int = 0, world_size: int = 1, drop_last: bool = False,
               seed: int | None = None, restart_report: tuple[int, BitMap, RestShare | None] | None = None,
               order: str = "shared") -> Job:
        """Registers rank `rank` of a job on `source_name` over `indices` (None: the whole
        source): a new job, or the job the other ranks of the same name already started.
        `restart_report` (epoch, items received, its share of an elastic resume's rest or None):
        a lease keeper attaching again after a restart reports for its rank (`JobTable.report_restart`). `order`: "shared" or
        "independent" (joader.sampling.ORDERS; every rank of a job must give the same)."""
        with self._cond:
            self._check_alive()
            if self._exiting:  # NOTE [ Deciding to exit refuses the next attach ] in idle_exit.py
                raise ServerExitingError(exiting_message(self.config.idle_exit_s))
            source = self.source(source_name)
            dataset = BitMap(range(source.num_items)) if indices is None else BitMap(indices)
            if not dataset:
                raise InvalidArgumentError(
                    f"job {printable_name(name)!r}: the dataset is empty; pass at least one index of {source_name!r}"
                )
            if dataset.max() >= source.num_items:
                bad = dataset - BitMap(range(source.num_items))
                raise InvalidArgumentError(
                    f"job {printable_name(name)!r}: indices {_describe_ids(bad)} are outside source "
                    f"{source_name!r}, which has items 0..{source.num_items - 1}"
                )
            job, _ = self.jobs.attach(source, dataset, name, batch_size, rank=rank,
                                      world_size=world_size, drop_last=drop_last, seed=seed,
                                      order=order)
            self.idle.jobs_now(self._clock(), len(self.jobs.jobs))
            if restart_report is not None:
                self.resumes.report_restart(job, rank, *restart_report)
            self.resumes.settle_restart(job)  # the last rank of a restarted job: it resumes now
            if job.reading:
                job.wake()  # the last rank came: the waiting ones may start
            self._resize_queues()
            self._cond.notify_all()
            return job

    def job_source(self, job_id: str) -> Source | None:
        """The source of a live job (to bound what its requests may carry), else None."""
        with self._cond:
            job = self.jobs.jobs.get(job_id)
            return job.source if job is not None else None

    @contained("a heartbeat", lambda registry, job_id, *_, **__: [job_id])
    def touch(self, job_id: str, rank: int = 0) -> None:
        """Renews a rank's lease (its lease stream sent a heartbeat)."""
        with self._cond:
            self.jobs.touch(job_id, rank)

    def on_removed(self, job_id: str, callback: Callable[[str], None]) -> None:
        """Calls `callback(reason)` (under the lock; it must not block) when the job goes."""
        with self._cond:
            job = self.jobs.jobs.get(job_id)
            if job is None:
                callback(self.jobs.removed_reason(job_id))
            else:
                job.on_removed.append(callback)

    @contained("removing a job", lambda registry, job_id, *_, **__: [job_id])
    def remove_job(self, job_id: str, reason: str) -> bool:
        """Removes a job and releases everything it held. False if it was already gone."""
        with self._cond:
            return self._remove(job_id, reason)

    @contained("closing a rank", lambda registry, job_id, *_, **__: [job_id])
    def close_rank(self, job_id: str, rank: int) -> None:
        """A rank closed its lease on purpose: the job ends once no rank of it is attached."""
        with self._cond:
            job = self.jobs.jobs.get(job_id)
            if job is None:
                return
            ending = self.jobs.close_rank(job, rank)
            if ending is not None:
                self._remove(job_id, ending)
            else:
                self._resize_queues()  # the closed rank's share goes to the others
                self._cond.notify_all()

    def _remove(self, job_id: str, reason: str) -> bool:
        live = self.jobs.jobs.get(job_id)
        try:
            job = self.jobs.remove(job_id, reason)
        except Exception:
            # Its books broke (the bug `contain` is for): drop it without trusting them, then
            # rebuild the cache's counts from the jobs left.
            logger.exception("job %s: its removal (%s) found its books broken; dropping it and "
                             "recounting the cache from the other jobs", job_id, reason)
            self.internal_errors += 1
            job = live
            if job is not None:
                self.jobs.forget(job, reason)
            self.cache.resync(self.jobs.expected_pins(), self.jobs.expected_planned(), self._needed)
        self.idle.jobs_now(self._clock(), len(self.jobs.jobs))
        if job is None:
            return False
        self._resize_queues()
        logger.info("job %s: removed (%s) after %d items delivered", job_id, reason, job.items_delivered)
        self._cond.notify_all()
        job.wake()  # its waiting Nexts find it gone
        for callback in job.on_removed:
            callback(reason)
        return True

    def _resize_queues(self) -> None:
        # Each rank's share of the cache (`Job.cache_share`) is the cache over the ranks not
        # closed: what its pinned queue entries and its handed-out, unacknowledged copies may
        # hold together (`Scheduler.pin_ahead` pins or unpins queue entries to match, so queues
        # shrink the moment jobs arrive). A queue's capacity (its lookahead) is its share of
        # half the cache (so that, at their limit of twice the capacity, all queues together
        # fit in it), but at least one batch while the whole cache can still hold every queue
        # at its limit: a rank that reads a batch at a time and finds less than a batch queued
        # sits out rounds it should share. Counted in items of each job's source's largest size.
        jobs = self.jobs.jobs.values()
        num_queues = max(1, sum(1 for job in jobs for rank in job.ranks if not rank.closed))
        for job in jobs:
            num_items = self.cache.capacity_bytes // max(1, job.source.max_item_bytes)
            share = num_items // (4 * num_queues)
            floor = min(job.batch_size, num_items // (2 * num_queues))
            wanted = self.config.lookahead_batches * job.batch_size
            job.queue_capacity = max(1, min(wanted, max(share, floor)))
            if job.queue_capacity < job.batch_size and not job.partial_warned:
                # Replies then come short, each DataLoader worker's last batch too: more batches
                # than len(loader), and a DDP job whose ranks count differently hangs in its
                # collectives. Said once, in joaderd's log, with the fix.
                job.partial_warned = True
                logger.warning(
                    "job %s: the cache holds %d items of source %s for %d job queues, less than a "
                    "batch of %d per queue: replies will be short, and an epoch may have more "
                    "batches than len(loader) (ranks may differ). Raise --cache-size to at least "
                    "%d items' worth.", job.job_id, num_items, job.source.name, num_queues,
                    job.batch_size, 2 * num_queues * job.batch_size)
            job.plan_horizon = max(2 * job.queue_capacity, int(num_items * self.config.plan_horizon))
            job.cache_share = max(1, num_items // num_queues)
            job.queue_fill = _queue_fill(job)
            job.copies_share = max(1, num_items // (num_queues + 1))  # NOTE [ Room for a job that joins ]
            for rank in job.ranks:
                if self._scheduler.pin_ahead(job, rank):
                    job.wake()

    def _reuse_hazard(self, key: int) -> float:
        item = self.cache.items[key]
        hazard = self._scheduler.reuse_hazard(item.source, item.item_id, self.jobs.jobs, self._clock())
        # A planned read comes within a queue's horizon: sooner than any draw from a remaining
        # set can be counted on (NOTE [ Planned reads ] in item_cache.py).
        return hazard + PLANNED_HAZARD * self.cache.planned.get(key, 0)

    def set_cpu(self, host_busy: bool, busy_jobs: set[str]) -> None:
        """The CPU meter's reading (server/cpu_meter.py): whether every core of the host was
        busy, and the jobs whose training processes kept a core busy."""
        with self._cond:
            self._scheduler.host_busy = host_busy
            for job in self.jobs.jobs.values():
                job.cpu_bound = job.job_id in busy_jobs
            self._cond.notify_all()

    def job_pids(self) -> dict[str, set[int]]:
        """The pids that read for each live job (its passes' readers), for the CPU meter."""
        with self._cond:
            return {job.job_id: {pid for rank in job.ranks for pass_ in rank.passes.values()
                                 for pid in pass_.members.values() if pid > 0}
                    for job in self.jobs.jobs.values()}

    def _needed(self, item: Item) -> int:
        """A cached item's refcount: the jobs that still need it, plus its planned reads."""
        return self._scheduler.needed(item.source, item.item_id) + self.cache.planned.get(item.key, 0)

    def contain(self, error: Exception, job_ids: Sequence[str], where: str) -> str:
        """Ends `job_ids` after a bookkeeping error in `where` (server/books/containment.py); returns
        the reason their clients are given."""
        with self._cond:
            return self._contain(error, job_ids, where)

    def _contain(self, error: Exception, job_ids: Sequence[str], where: str) -> str:
        ended = [job_id for job_id in dict.fromkeys(job_ids) if job_id in self.jobs.jobs]
        self.internal_errors += 1
        self.jobs_ended_by_errors += len(ended)
        logger.error(
            "internal error in %s (%s: %s); ending job(s) %s so that every other job goes on. "
            "This is a bug in joaderd: please report it with this log.", where, type(error).__name__,
            error, ", ".join(ended) or "(none)", exc_info=error)
        reason = (
            f"joaderd ended the job after an internal error in {where} ({type(error).__name__}: "
            f"{error}); joaderd and the other jobs go on. This is a bug in joaderd (its log has "
            "the traceback; please report it): start the job again, from its checkpoint if it saved one")
        for job_id in ended:
            self._remove(job_id, reason)
        self.cache.resync(self.jobs.expected_pins(), self.jobs.expected_planned(), self._needed)
        self._cond.notify_all()
        return reason

    def check_invariants(self) -> None:
        """Raises AssertionError when the cache's pins or refcounts disagree with the jobs."""
        with self._cond:
            self.cache.check_invariants(self.jobs.expected_pins(), self._needed, self.jobs.expected_planned())
            self.jobs.check_pinned_items(self.cache.items)

    # ----------------------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            for job in self.jobs.jobs.values():
                job.wake()

    def fail(self, reason: str) -> None:
        """An internal part of joaderd broke: every request from now on gets `ServerFailedError`."""
        with self._cond:
            if self._failure is None:
                self._failure = reason
            self._stopped = True
            self._cond.notify_all()
            for job in self.jobs.jobs.values():
                job.wake()

    def serving(self) -> None:
        """joaderd accepts calls from now: `--idle-exit-s` counts from here (`IdleExit.serving`)."""
        with self._cond:
            self.idle.serving(self._clock())

    def exit_if_idle(self) -> float | None:
        """`--idle-exit-s`: the seconds joaderd has had no job if it should exit now (and from
        now on every attach is refused: NOTE [ Deciding to exit refuses the next attach ] in
        idle_exit.py), else None. Asked by joaderd's idle thread."""
        with self._cond:
            now = self._clock()
            if self._exiting or not self.idle.due(now):
                return None
            self._exiting = True
            return self.idle.idle_s(now)

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise ServerFailedError(
                f"joaderd is stopping after an internal error ({self._failure}); its log has the "
                "traceback. Restart joaderd, then the job."
            )

    def status(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """A JSON-ready snapshot (`joader.server.registry.status`; the schema `joader status --json`
        documents)."""
        with self._cond:
            now = self._clock()
            status = snapshot(self, now)
            status["internal_errors"] = self.internal_errors
            status["jobs_ended_by_errors"] = self.jobs_ended_by_errors
            for job, entry in zip(self.jobs.jobs.values(), status["jobs"], strict=True):
                entry["waiting"] = self.jobs.waiting(job, now)
                entry["cache_share"] = job.cache_share * job.world_size
                entry["handed_out"] = sum(rank.handed_out for rank in job.ranks)
        if extra:
            status.update(extra)
        return status


def _describe_ids(ids: BitMap) -> str:
    """`5..9 and 12` style, short, for error messages."""
    if len(ids) <= 3:
        return ", ".join(str(i) for i in ids)
    return f"{ids.min()}..{ids.max()} ({len(ids)} ids)"


def _queue_fill(job: Job) -> int:
    """How far rounds fill each of the job's queues (`Job.queue_fill`; 0: its capacity).

    NOTE [ Filling for replies of several batches ]
    A reply beside other jobs takes extra batches only from what its queue holds beyond its
    capacity (NOTE [ Extra batches ] in dealing.py: a queue drained below it loses rounds it
    should share), and rounds filled a queue only up to its capacity: so a warm job got one
    batch per reply, and paid one gRPC call per batch (about 300 us of the main process's CPU,
    bench/micro/grpc_floor.py: 5 us per item of 64, issue 37). Where the cache has room, rounds now
    fill a queue further, by the extra batches its readers ask for (`reply_batches` - 1, the
    client asks for 4), never to twice its capacity less a batch (beyond twice it sits out
    rounds), and only while no decode waits or runs as a batch of rounds starts
    (`Scheduler.run_round`, `_fill`; a batch that then asks for decodes still fills): a reply
    whose items are still decoding takes no extra batch anyway, and the deeper queue then cost
    6% more main CPU per decode (two alternating pairs of 128k-item first epochs). Room: the
    rank's share of the cache holds four times its capacity plus twice the extra, so the
    queues at their fill and the copies a reply hands out stay well within the cache however
    the jobs read. A tight cache keeps the old rule: a job that stops reading with
    its copies out then still leaves the others' queues the slots for their next batch
    (test_next_protocol's `stops_reading`)."""
    capacity, batch = job.queue_capacity, job.batch_size
    extra = (job.reply_batches - 1) * batch
    if extra <= 0 or job.cache_share < 4 * capacity + 2 * extra:
        return 0
    return max(capacity, min(capacity + extra, 2 * capacity - batch))
