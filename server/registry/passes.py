"""Passes: which pass a `Next` belongs to, and the copies its readers hold.

Within a rank, a *pass* (one `iter()` of the dataset, shared by the DataLoader workers of that
iterator) reads one epoch. A request's token names its pass. A new pass supersedes the rank's
current one; the old pass's next request raises `PassSupersededError` instead of ending quietly,
and its unacknowledged copies stay pinned for one lease at most (`supersede`). Passes are named
by a token the client derives from the workers' base seed; since that seed repeats whenever a
user re-seeds torch, a known token arriving from a *new process* in a worker slot the pass
already has is a new pass too (fresh workers), not a continuation.

A pass's first request may resume an epoch, or continue one a joaderd restart interrupted: the
`Resumes` decide which epoch it reads.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

from joader.errors import (
    InvalidArgumentError,
    InvariantError,
    PassSupersededError,
    superseded_message,
)
from joader.server.books.item_cache import ItemCache
from joader.server.books.records import Job, PassBook, Rank
from joader.server.registry.next_call import NextArgs
from joader.server.registry.resumes import Resumes
from joader.server.scheduling.scheduler import Scheduler

logger = logging.getLogger(__name__)

_MAX_PASSES_PER_RANK = 8
_MAX_RETIRED_PER_RANK = 256
# Readers of one rank a resume may say report (`resume_parts`): DataLoader workers of one
# process. More is no real configuration (and the client refuses such a state, too).
MAX_RESUME_PARTS = 1024


class PassTable:
    """The passes of every rank (see the module docstring). No lock: the `Registry` holds one."""

    def __init__(self, cache: ItemCache, scheduler: Scheduler, resumes: Resumes, *, lease_s: float,
                 clock: Callable[[], float]) -> None:
        self._cache = cache
        self._scheduler = scheduler
        self._resumes = resumes
        self.lease_s = lease_s
        self._clock = clock

    def rank_of(self, job: Job, args: NextArgs) -> Rank:
        if not 0 <= args.rank < job.world_size:
            raise InvalidArgumentError(
                f"job {job.job_id}: rank {args.rank} is outside 0..{job.world_size - 1}")
        return job.ranks[args.rank]

    def claim(self, job: Job, rank: Rank, args: NextArgs) -> PassBook:
        """The pass a request belongs to; a new token, or fresh workers, start a new one."""
        if not 1 <= args.resume_parts <= MAX_RESUME_PARTS:
            raise InvalidArgumentError(
                f"job {job.job_id}: resume_parts {args.resume_parts} is not a number of readers of "
                f"one rank (1..{MAX_RESUME_PARTS}); it counts the DataLoader workers that report a "
                "part of the resumed epoch: load a state_dict this client saved, with the "
                "DataLoader's num_workers unchanged")
        if (args.token, args.pid) in rank.retired:
            raise PassSupersededError(self._superseded(job, rank.passes.get(args.token)))
        pass_ = self._claim(job, rank, args)
        pass_.num_workers = max(pass_.num_workers, args.num_workers)
        return pass_

    def _claim(self, job: Job, rank: Rank, args: NextArgs) -> PassBook:
        if job.restart_reports is not None:
            args = self._resumes.after_restart(job, rank, args)
        pass_ = rank.passes.get(args.token)
        if pass_ is not None and not pass_.superseded:
            member = pass_.members.get(args.worker_id)
            if member is None or member == args.pid:
                pass_.members[args.worker_id] = args.pid
                if 0 < args.resume_epoch != pass_.epoch and not rank.handed[pass_.epoch]:
                    self._resumes.relabel(job, rank, pass_, args.resume_epoch)
                self._resumes.report(job, rank, args, pass_.epoch)
                return pass_
            # The same token from a new process in a worker slot the pass already has: fresh
            # DataLoader workers whose base seed repeated (the user re-seeded torch). A new pass.
            logger.info(
                "job %s: worker %d of pass %x is a new process (pid %d, was %d): a new pass",
                job.job_id, args.worker_id, args.token, args.pid, member,
            )
        continued = False
        if args.resume_epoch > 0:  # a checkpoint
            epoch = args.resume_epoch
        elif pass_ is None and 0 < args.continue_epoch <= rank.claimed_epoch:
            # A pass a restart interrupted (this server never saw its token). A known token
            # from a new process is fresh workers: a new pass, whatever it says.
            current = rank.current
            if current is not None and not current.superseded and current.epoch > args.continue_epoch:
                raise PassSupersededError(self._superseded(job, None))  # a newer pass runs
            epoch, continued = args.continue_epoch, True
        else:
            epoch = rank.claimed_epoch + 1
        pass_ = self._start_pass(job, rank, args, epoch)
        pass_.continued = continued
        self._resumes.report(job, rank, args, epoch)
        return pass_

    def _start_pass(self, job: Job, rank: Rank, args: NextArgs, epoch: int) -> PassBook:
        current = rank.current
        if current is not None and not current.superseded:
            self.supersede(job, rank, current)
        rank.claimed_epoch = epoch
        pass_ = PassBook(args.token, epoch, {args.worker_id: args.pid})
        old = rank.passes.pop(args.token, None)
        if old is not None:
            release_outstanding(self._cache, rank, old)
        rank.passes[args.token] = pass_
        rank.current = pass_
        while len(rank.passes) > _MAX_PASSES_PER_RANK:
            oldest = next(iter(rank.passes))
            release_outstanding(self._cache, rank, rank.passes.pop(oldest))
        return pass_

    def supersede(self, job: Job, rank: Rank, pass_: PassBook) -> None:
        """A newer pass took over: `pass_` may read no more; its unread share is dropped."""
        pass_.superseded = True
        for pid in pass_.members.values():
            rank.retired[(pass_.token, pid)] = None
        while len(rank.retired) > _MAX_RETIRED_PER_RANK:
            del rank.retired[next(iter(rank.retired))]
        # Its clients may still be copying their last batch out of the arena: their copies stay
        # pinned until acknowledged, or for one lease at most (a killed DataLoader worker never
        # acknowledges).
        pass_.release_at_s = self._clock() + self.lease_s
        epoch = pass_.epoch
        share = job.shares.get(epoch)
        if (share is None or rank.handed[epoch] < share.target[rank.index]) and epoch not in rank.abandoned:
            logger.info(
                "job %s: a new pass began before epoch %d ended; dropping its unread items%s",
                job.job_id, epoch, f" (rank {rank.index})" if job.world_size > 1 else "",
            )
            rank.abandoned.add(epoch)
            self._scheduler.drop_queue(rank, lambda entry: entry.epoch == epoch)
            self._scheduler.abandon_if_done(job, epoch)
        job.wake()

    def acknowledge(self, job: Job, rank: Rank, pass_: PassBook, acks: Iterable[int], worker_id: int = 0) -> None:
        """Releases the copies `acks` names (of `pass_`, a pass of `rank`, sent by its reader
        `worker_id`); the rank may then pin more of its queue (the caller runs
        `Scheduler.pin_ahead`)."""
        base = job.source.key_base
        outstanding = pass_.outstanding
        pop = outstanding.pop  # dict methods: a Counter's own are Python code
        released: list[int] = []  # released together, after the loop (`ItemCache.release_many`)
        try:
            for item_id in acks:
                key = base + item_id
                count = pop(key, 0)
                if count <= 0:
                    logger.debug("job %s: ignoring ack of item %d it does not hold", job.job_id, item_id)
                    continue
                if count > 1:
                    outstanding[key] = count - 1
                released.append(key)
        finally:
            _take_held(pass_.held, worker_id, len(released))
            rank.handed_out -= len(released)
            self._cache.release_many(released)

    def _superseded(self, job: Job, pass_: PassBook | None) -> str:
        return superseded_message(job.job_id, pass_.epoch if pass_ is not None else None)

    def superseded_error(self, job: Job, pass_: PassBook) -> PassSupersededError:
        return PassSupersededError(self._superseded(job, pass_))


def _take_held(held: Counter[int], worker_id: int, count: int) -> None:
    """`count` acknowledged copies leave the readers' holdings: the acknowledging reader's
    first. A reader acknowledges what it was handed; should another acknowledge it, some
    reader's count still goes down, so the counts keep summing to the copies out."""
    mine = held[worker_id]
    if mine > 0:
        taken = min(mine, count)
        held[worker_id] = mine - taken
        count -= taken
    for reader, holds in held.items():
        if not count:
            return
        if holds > 0:
            taken = min(holds, count)
            held[reader] = holds - taken
            count -= taken
    if count:
        raise InvariantError(f"{count} acknowledged copies more than the pass's readers held")


def release_outstanding(cache: ItemCache, rank: Rank, pass_: PassBook) -> None:
    """Releases every copy `pass_` (a pass of `rank`) still holds."""
    for key, count in pass_.outstanding.items():
        for _ in range(count):
            cache.release(key)
        rank.handed_out -= count
    pass_.outstanding.clear()
    pass_.held.clear()
    pass_.release_at_s = None
