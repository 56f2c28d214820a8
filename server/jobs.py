"""Jobs, their ranks, passes and leases.

A *job* is one DSA job: a dataset read by `world_size` ranks (the processes of one DDP job, or
one process). The ranks of one job attach one by one with the same name, source, indices and
world size; the first creates the job, the others join it. Every rank holds its own lease (its
lease keeper's stream); when any rank's lease ends the whole job goes, and the other ranks are
told why at their next request (DDP cannot go on without a rank anyway). A job with no rank
attached any more ends too: at once when its last attached rank closes its lease, and after
`rank_attach_timeout_s` when some of its ranks never attach. Otherwise a half-attached job
lingered for good, and the next run of the same name was split between it and a new job (one
rank joined the stale job and read the whole epoch alone). A rank arriving for an ended job (or
for a rank that closed) starts a new job.

Who may read a job: whoever holds its secret, which `attach` returns to the lease holders only
(`status` lists job ids, never secrets). Within a rank, a *pass* (one `iter()` of the dataset,
shared by the DataLoader workers of that iterator) reads one epoch. A new pass supersedes the
rank's current one; the old pass's next request raises `PassSupersededError` instead of ending
quietly. Passes are named by a token the client derives from the workers' base seed; since that
seed repeats whenever a user re-seeds torch, a known token arriving from a *new process* in a
worker slot the pass already has is a new pass too (fresh workers), not a continuation.

A pass may *resume* an epoch from a checkpoint: its readers report the items they consumed;
once every rank's readers reported, the epoch goes on without them (`Scheduler.start_resumed`).

After a joaderd restart the decision is not the readers' (`decide_restart`): each rank's lease
keeper re-attaches with its client board's newest epoch and what the rank received of it, and
once every rank attached, the newest reported epoch resumes without those items, at once. The
readers then only say which pass they are: a pass some reader of which received items from the
dead server continues its epoch (`NextArgs.continue_epoch`); any other pass is a new pass, the
rank's next epoch after the one its keeper reported, whatever rank, worker or epoch number asks
for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import random
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterable

from pyroaring import BitMap

from joader.errors import (
    InvalidArgumentError,
    PassSupersededError,
    TooManyJobsError,
    UnknownJobError,
    superseded_message,
)
from joader.server.item_cache import ItemCache
from joader.server.records import Job, NextArgs, PassBook, Rank, Resume, Source
from joader.server.scheduler import Scheduler

logger = logging.getLogger(__name__)

_MAX_PASSES_PER_RANK = 8
_MAX_RETIRED_PER_RANK = 256
_MAX_REMOVED_REMEMBERED = 4096
MAX_WORLD_SIZE = 4096
# Readers of one rank a resume may say report (`resume_parts`): DataLoader workers of one
# process. More is no real configuration (and the client refuses such a state, too).
MAX_RESUME_PARTS = 1024


@dataclasses.dataclass(frozen=True)
class RestartResume:
    """What a restarted joaderd resumes, decided from the lease keepers' reports alone."""

    epoch: int  # the epoch that goes on
    consumed: list[BitMap]  # per rank: what it received of `epoch` (none if it reported an older one)
    claimed: list[int]  # per rank: the epoch its next new pass follows
    behind: list[int]  # ranks whose keeper reported an older epoch (their pass of it is over)


def decide_restart(reports: dict[int, tuple[int, BitMap]], world_size: int) -> RestartResume | None:
    """The restart's resume, from each rank's keeper report: rank -> (the newest epoch its
    readers received items of, those items); a rank that reported nothing received nothing.
    None: no rank received anything, the job starts afresh.

    The newest reported epoch resumes: a rank that reported an older one had received its
    whole share of that one (DDP ranks step together; an epoch's last batch is read by every
    rank before any starts the next), and its next new pass reads the resumed epoch. Why the
    keepers and never the readers: a reader reports only when its loop asks, and a DDP loop
    may be blocked in a collective that waits for another rank's resumed epoch; and a reader
    can only guess whether its pass is new or interrupted from epoch numbers, which a plain
    start of the next epoch also carries (issue 27: the start of epoch 2 was taken for a
    resume, and the job waited for a report that never came, or dealt epoch 2 twice)."""
    epoch = max((e for e, _ in reports.values()), default=0)
    if epoch <= 0:
        return None
    consumed = [BitMap(reports[r][1]) if r in reports and reports[r][0] == epoch else BitMap()
                for r in range(world_size)]
    claimed = [max(reports[r][0] if r in reports else 0, epoch - 1) for r in range(world_size)]
    behind = [r for r in range(world_size) if r in reports and 0 < reports[r][0] < epoch]
    return RestartResume(epoch, consumed, claimed, behind)


class JobTable:
    """The registered jobs (see the module docstring). No lock: the `Registry` holds one."""

    def __init__(self, cache: ItemCache, scheduler: Scheduler, *, lease_s: float, max_jobs: int,
                 clock: Callable[[], float], rank_attach_timeout_s: float = 60.0) -> None:
        self._cache = cache
        self._scheduler = scheduler
        self.lease_s = lease_s
        self.rank_attach_timeout_s = rank_attach_timeout_s
        self.max_jobs = max_jobs
        self._clock = clock
        self.jobs: dict[str, Job] = {}
        self._removed: OrderedDict[str, str] = OrderedDict()  # job id -> why it was removed

    # ----------------------------------------------------------------------------- attach

    def attach(self, source: Source, dataset: BitMap, name: str, batch_size: int, *, rank: int = 0,
               world_size: int = 1, drop_last: bool = False, seed: int | None = None) -> tuple[Job, Rank]:
        """Registers rank `rank` of a job: creates the job, or joins the one its ranks share."""
        name = printable_name(name)
        if batch_size < 1:
            raise InvalidArgumentError(f"job {name!r}: batch_size must be >= 1, got {batch_size}")
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise InvalidArgumentError(
                f"job {name!r}: world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size}")
        if not 0 <= rank < world_size:
            raise InvalidArgumentError(
                f"job {name!r}: rank must be in 0..{world_size - 1} for world_size {world_size}, "
                f"got {rank}; pass the process's own rank (torch.distributed.get_rank())")
        if world_size > 1 and not name:
            raise InvalidArgumentError("the ranks of a job find each other by name: pass name=")
        if drop_last and len(dataset) < world_size:
            raise InvalidArgumentError(
                f"job {name!r}: drop_last with {len(dataset)} items and world_size {world_size} "
                "leaves every rank an empty epoch; use more items or drop_last=False")
        now = self._clock()
        key = (name, source.name, dataset.serialize(), world_size, drop_last)
        if world_size > 1:
            job = self._group(key, rank)
            if job is not None:
                if seed is not None and seed != job.seed:
                    raise InvalidArgumentError(
                        f"job {name!r}: rank {rank} asks for seed {seed}, but rank 0..{world_size - 1} "
                        f"of this job started with seed {job.seed}; give every rank the same seed")
                member = job.ranks[rank]
                member.attached = True
                member.last_seen_s = member.attached_s = now
                logger.info("job %s: rank %d of %d attached", job.job_id, rank, world_size)
                return job, member
        if len(self.jobs) >= self.max_jobs:
            raise TooManyJobsError(
                f"job {name!r}: joaderd already serves {len(self.jobs)} jobs, its limit; "
                f"finish some jobs, or restart joaderd with a higher --max-jobs (now {self.max_jobs})"
            )
        job_id = f"{_id_prefix(name)}-{secrets.token_hex(4)}"
        if seed is None:
            # From joaderd's --seed and the job's arrival on its source: a rerun of the same
            # jobs on a server with the same --seed draws the same streams.
            source.jobs_attached += 1
            seed = random.Random(f"joader-job:{source.seed}:{source.jobs_attached}").getrandbits(63)
        ranks = [Rank(r, now, attached=(r == rank), attached_s=now) for r in range(world_size)]
        job = Job(job_id, name or job_id, secrets.token_bytes(16), source, dataset, batch_size, now,
                  world_size, drop_last, seed, random.Random(seed), ranks, group_key=key)
        self.jobs[job_id] = job
        self._scheduler.add(job)
        logger.info(
            "job %s: attached to source %s with %d items%s", job_id, source.name, len(dataset),
            f" (rank {rank} of {world_size})" if world_size > 1 else "",
        )
        return job, ranks[rank]

    def _group(self, key: tuple[object, ...], rank: int) -> Job | None:
        """The job whose ranks `key` describes, still missing rank `rank`.

        A job whose rank `rank` closed already is the previous run's, still finishing on its
        other ranks: this rank belongs to a new run, hence to a new job.
        """
        taken = None
        for job in self.jobs.values():
            if job.group_key == key:
                member = job.ranks[rank]
                if not member.attached and not member.closed and member.current is None:
                    return job
                if not member.closed:
                    taken = job
        if taken is not None:
            raise InvalidArgumentError(
                f"job {taken.name!r}: rank {rank} is already attached (job {taken.job_id}); every "
                "process of a job needs its own rank (check RANK / rank=), or give a new run "
                "another name")
        return None

    # ----------------------------------------------------------------------------- leases

    def touch(self, job_id: str, rank: int = 0) -> None:
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJobError(self.gone_message(job_id))
        job.ranks[rank].last_seen_s = self._clock()

    def close_rank(self, job: Job, index: int) -> str | None:
        """Rank `index` is done (closed its lease on purpose). Returns why the job ends, if it
        must: no rank of it is attached any more (every rank closed, or the others never came:
        nobody could ever read the job again, and the next run must not join it)."""
        rank = job.ranks[index]
        rank.attached = False
        rank.closed = True
        self._scheduler.drop_queue(rank, lambda entry: True)
        for pass_ in rank.passes.values():
            self.release_outstanding(rank, pass_)
        logger.info("job %s: rank %d closed", job.job_id, index)
        if any(r.attached for r in job.ranks):
            return None
        if job.world_size == 1:
            return "closed by its client"
        missing = [r.index for r in job.ranks if not r.closed]
        if not missing:
            return "all its ranks closed"
        closed = [r.index for r in job.ranks if r.closed]
        return (f"rank {_ranks(closed)} closed while rank {_ranks(missing)} of {job.world_size} never "
                "attached; a job with no rank attached ends (a new run of its name starts a new job)")

    def expire(self) -> list[tuple[Job, str]]:
        """Jobs with a rank whose lease expired, or whose missing ranks did not attach within
        `rank_attach_timeout_s` (the caller removes them); releases the copies of superseded
        passes whose grace time ended."""
        now = self._clock()
        deadline = now - self.lease_s
        expired = []
        for job in self.jobs.values():
            if not job.all_attached and now - job.created_s >= self.rank_attach_timeout_s:
                expired.append((job, self._attach_timeout_reason(job)))
                continue
            for rank in job.ranks:
                what = f"rank {rank.index}: " if job.world_size > 1 else ""
                if rank.attached and rank.last_seen_s < deadline:
                    expired.append((job, f"{what}no request for {self.lease_s:g} s, nor a heartbeat (lease expired)"))
                    break
                if rank.attached and not rank.requested and rank.attached_s < deadline:
                    # NOTE: heartbeats alone kept a job whose client could not read the arena
                    # (another user's, over TCP) registered for good, holding a --max-jobs slot
                    # and a share of the cache (issue 27). A JoaderDataset's lease keeper checks
                    # the arena and sends a request at once; a client that cannot, or never
                    # does, loses the job within its lease.
                    expired.append((job, (
                        f"{what}its client sent no request within {self.lease_s:g} s of attaching "
                        "(a client that cannot read joaderd's arena, e.g. another user's over TCP, "
                        "or a joader client older than this joaderd); run the job as the user "
                        "that runs joaderd, with the same joader version")))
                    break
                for pass_ in rank.passes.values():
                    if pass_.release_at_s is not None and pass_.release_at_s <= now:
                        self.release_outstanding(rank, pass_)
                        if self._scheduler.pin_ahead(job, rank, now):
                            job.wake()
        return expired

    def _attach_timeout_reason(self, job: Job) -> str:
        missing = [r.index for r in job.ranks if not (r.attached or r.closed)]
        return (f"rank {_ranks(missing)} of {job.world_size} did not attach within "
                f"{self.rank_attach_timeout_s:g} s of the first; start every rank with the same "
                "name, indices, world_size and drop_last (check WORLD_SIZE and RANK), or raise "
                "joaderd's --rank-attach-timeout-s if ranks start that far apart")

    def waiting(self, job: Job, now: float) -> dict[str, object] | None:
        """What keeps the job from reading, for status: ranks not attached yet, or a resumed
        epoch still gathering its readers' reports (which rank, how many of how many)."""
        if not job.all_attached:
            missing = [r.index for r in job.ranks if not (r.attached or r.closed)]
            return {
                "for": "ranks", "ranks": missing,
                "detail": (f"rank {_ranks(missing)} of {job.world_size} not attached yet; the job "
                           f"ends if they do not attach within {self.rank_attach_timeout_s:g} s"),
                "since_s": round(now - job.created_s, 3), "limit_s": self.rank_attach_timeout_s,
            }
        resume = job.resume
        if resume is None:
            return None
        ranks = []
        for index in range(job.world_size):
            reports = sum(1 for r, _ in resume.reports if r == index)
            ranks.append({"rank": index, "reports": reports, "parts": resume.parts.get(index)})
        short = [
            f"rank {r['rank']}: {r['reports']} of {r['parts']}" if r["parts"] is not None
            else f"rank {r['rank']}: no report yet"
            for r in ranks if r["parts"] is None or r["reports"] < r["parts"]
        ]
        return {
            "for": "resume_reports", "epoch": resume.epoch, "ranks": ranks,
            "detail": (f"epoch {resume.epoch} resumes once every reader reported what it consumed "
                       f"({'; '.join(short)}); resume_parts must be the rank's number of readers "
                       "(its DataLoader's num_workers, or 1)"),
            "since_s": round(now - resume.started_s, 3),
        }

    def remove(self, job_id: str, reason: str) -> Job | None:
        """Forgets a job and releases everything it held; None if it was already gone."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return None
        self._removed[job_id] = reason
        while len(self._removed) > _MAX_REMOVED_REMEMBERED:
            self._removed.popitem(last=False)
        for rank in job.ranks:
            self._scheduler.drop_queue(rank, lambda entry: True)
            for pass_ in rank.passes.values():
                self.release_outstanding(rank, pass_)
        self._scheduler.remove(job, self.jobs)
        return job

    def named(self, name: str) -> list[str]:
        """The ids of the live jobs called `name`."""
        return [job.job_id for job in self.jobs.values() if job.name == name]

    def forget(self, job: Job, reason: str) -> None:
        """Removes a job whose own books broke (`remove` raised, perhaps half way): drops it
        from the tables and the sampler without releasing what its books say it holds, since
        they cannot be trusted; the caller then rebuilds the cache's pins and refcounts from the
        jobs left (`ItemCache.resync`)."""
        job_id = job.job_id
        if self.jobs.get(job_id) is job:
            del self.jobs[job_id]
        self._removed[job_id] = reason
        source = job.source
        with contextlib.suppress(KeyError):  # UnknownJobError: its removal got that far
            source.sampler.remove_job(job_id)
        if job_id in source.job_ids:
            source.job_ids.remove(job_id)
        for rank in job.ranks:
            rank.queue.clear()
            rank.pinned = rank.handed_out = 0
            for pass_ in rank.passes.values():
                pass_.outstanding.clear()
                pass_.held.clear()

    def lookup(self, job_id: str, secret: bytes) -> Job:
        job = self.jobs.get(job_id)
        # One message for "no such job" and "wrong secret": the reply must not tell a stranger
        # which job ids are live.
        if job is None or not hmac.compare_digest(job.secret, secret):
            raise UnknownJobError(self.gone_message(job_id))
        return job

    def gone_message(self, job_id: str) -> str:
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

    def removed_reason(self, job_id: str) -> str:
        return self._removed.get(job_id, "removed")

    # ----------------------------------------------------------------------------- passes

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
            args = self._after_restart(job, rank, args)
        pass_ = rank.passes.get(args.token)
        if pass_ is not None and not pass_.superseded:
            member = pass_.members.get(args.worker_id)
            if member is None or member == args.pid:
                pass_.members[args.worker_id] = args.pid
                if 0 < args.resume_epoch != pass_.epoch and not rank.handed[pass_.epoch]:
                    self._relabel(job, rank, pass_, args.resume_epoch)
                self._report_resume(job, rank, args, pass_.epoch)
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
        self._report_resume(job, rank, args, epoch)
        return pass_

    def _relabel(self, job: Job, rank: Rank, pass_: PassBook, epoch: int) -> None:
        """A reader with a checkpoint joined a pass that readers without one started (the
        DataLoader workers of one iterator ask in any order) before anything was handed out:
        the pass resumes `epoch`, and its earlier readers count as having consumed nothing."""
        logger.info("job %s: pass %x resumes epoch %d", job.job_id, pass_.token, epoch)
        pass_.epoch = epoch
        rank.claimed_epoch = epoch
        resume = job.resume = Resume(epoch, self._clock())
        for worker_id in pass_.members:
            resume.reports[(rank.index, worker_id)] = BitMap()

    def report_restart(self, job: Job, rank_index: int, epoch: int, consumed: BitMap) -> None:
        """A lease keeper attached rank `rank_index` again after joaderd restarted, with the
        newest epoch its readers received items of and those items (its client board). Kept
        until every rank attached (`settle_restart`). The rank's next new pass follows `epoch`
        from now on, even before then: its numbering is the client's, not this server's."""
        if not 0 <= rank_index < job.world_size or epoch <= 0:
            return  # Attach refuses a bad rank; epoch 0: it received nothing, as a fresh rank
        if job.restart_settled:
            logger.warning("job %s: a restart report of rank %d came after the job's ranks all "
                           "attached; ignored", job.job_id, rank_index)
            return
        if job.restart_reports is None:
            job.restart_reports = {}
        job.restart_reports[rank_index] = (epoch, BitMap(consumed) & job.dataset)
        rank = job.ranks[rank_index]
        rank.reported_epoch = epoch
        rank.claimed_epoch = max(rank.claimed_epoch, epoch)

    def settle_restart(self, job: Job) -> None:
        """Once every rank attached: the restart's resume (`decide_restart`) starts at once, on
        the keepers' reports. No reader is waited for, and none can change the decision."""
        if job.restart_reports is None or job.restart_settled or not job.all_attached:
            return
        job.restart_settled = True
        decision = decide_restart(job.restart_reports, job.world_size)
        if decision is None:
            return
        for rank, claimed in zip(job.ranks, decision.claimed, strict=True):
            rank.claimed_epoch = max(rank.claimed_epoch, claimed)
        for index in decision.behind:
            epoch, received = job.restart_reports[index]
            if len(received) < job.per_rank:
                logger.warning(
                    "job %s: rank %d was still in epoch %d (%d of its %d items) while another rank "
                    "read epoch %d when joaderd restarted; epoch %d resumes and rank %d's rest of "
                    "epoch %d is not delivered", job.job_id, index, epoch, len(received), job.per_rank,
                    decision.epoch, decision.epoch, index, epoch)
        job.resume = None
        job.resumed_epoch = decision.epoch
        self._scheduler.start_resumed(job, decision.epoch, decision.consumed)
        job.wake()

    def _after_restart(self, job: Job, rank: Rank, args: NextArgs) -> NextArgs:
        """A request of a restarted job, as what it is: a resume from a reader of an epoch the
        rank's keeper reported (or older) continues that epoch (the restart decided it); one of
        a later epoch with nothing consumed is a new pass (a client that numbers its epochs
        across the restart); a later epoch with items consumed is a checkpoint."""
        epoch = args.resume_epoch
        if epoch <= 0:
            return args
        if epoch <= max(rank.reported_epoch, job.resumed_epoch):
            return dataclasses.replace(args, resume_epoch=0, resume_consumed=None, resume_parts=1,
                                       continue_epoch=epoch)
        if not args.resume_consumed:
            return dataclasses.replace(args, resume_epoch=0, resume_consumed=None, resume_parts=1,
                                       continue_epoch=0)
        return args

    def _report_resume(self, job: Job, rank: Rank, args: NextArgs, epoch: int) -> None:
        pending = job.resume
        if args.resume_epoch <= 0:
            if pending is None:
                return
            if pending.epoch == epoch and (rank.index, args.worker_id) not in pending.reports:
                # Another reader of the resuming pass with nothing to report: a DataLoader
                # worker that had yielded no batch before the checkpoint has no saved state.
                pending.reports[(rank.index, args.worker_id)] = BitMap()
                self._start_if_complete(job)
            elif pending.epoch != epoch:
                # A new pass that resumes nothing: the checkpoint's iterator was dropped before
                # its readers all reported (StatefulDataLoader does that after a finished
                # epoch). The job goes on with a whole epoch under the new pass's number.
                job.resume = None
                self._scheduler.start_resumed(job, epoch, [BitMap()] * job.world_size)
                job.wake()
            return
        if args.resume_epoch != epoch:
            return
        resume = pending
        if resume is None:
            if job.resumed_epoch == epoch or any(r.handed[epoch] for r in job.ranks):
                return  # this epoch already resumed, or is being read: a late report joins it
            if (job.world_size == 1 and args.resume_parts <= 1 and not args.resume_consumed
                    and epoch == job.sampler_epoch):
                return  # nothing to resume: the epoch is whole already
            resume = job.resume = Resume(epoch, self._clock())
        elif resume.epoch != epoch:
            if resume.epoch > epoch:
                return
            resume = job.resume = Resume(epoch, self._clock())  # a newer checkpoint replaces an older one
        resume.parts[rank.index] = max(1, args.resume_parts)
        consumed = args.resume_consumed if args.resume_consumed is not None else BitMap()
        resume.reports[(rank.index, args.worker_id)] = consumed
        self._start_if_complete(job)

    def _start_if_complete(self, job: Job) -> None:
        resume = job.resume
        if resume is not None and resume.complete(job.world_size):
            job.resume = None
            job.resumed_epoch = resume.epoch
            consumed = [resume.consumed_by(r) for r in range(job.world_size)]
            self._scheduler.start_resumed(job, resume.epoch, consumed)
            job.wake()

    def _start_pass(self, job: Job, rank: Rank, args: NextArgs, epoch: int) -> PassBook:
        current = rank.current
        if current is not None and not current.superseded:
            self.supersede(job, rank, current)
        rank.claimed_epoch = epoch
        pass_ = PassBook(args.token, epoch, {args.worker_id: args.pid})
        old = rank.passes.pop(args.token, None)
        if old is not None:
            self.release_outstanding(rank, old)
        rank.passes[args.token] = pass_
        rank.current = pass_
        while len(rank.passes) > _MAX_PASSES_PER_RANK:
            oldest = next(iter(rank.passes))
            self.release_outstanding(rank, rank.passes.pop(oldest))
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
        held = pass_.held
        for item_id in acks:
            key = base + item_id
            if outstanding[key] <= 0:
                logger.debug("job %s: ignoring ack of item %d it does not hold", job.job_id, item_id)
                continue
            outstanding[key] -= 1
            if not outstanding[key]:
                del outstanding[key]
            # A reader acknowledges what it was handed; should another acknowledge it, some
            # reader's count still goes down, so the counts keep summing to the copies out.
            reader = worker_id if held[worker_id] > 0 else next(w for w, n in held.items() if n > 0)
            held[reader] -= 1
            rank.handed_out -= 1
            self._cache.release(key)

    def release_outstanding(self, rank: Rank, pass_: PassBook) -> None:
        """Releases every copy `pass_` (a pass of `rank`) still holds."""
        for key, count in pass_.outstanding.items():
            for _ in range(count):
                self._cache.release(key)
            rank.handed_out -= count
        pass_.outstanding.clear()
        pass_.held.clear()
        pass_.release_at_s = None

    def _superseded(self, job: Job, pass_: PassBook | None) -> str:
        return superseded_message(job.job_id, pass_.epoch if pass_ is not None else None)

    def superseded_error(self, job: Job, pass_: PassBook) -> PassSupersededError:
        return PassSupersededError(self._superseded(job, pass_))

    # ----------------------------------------------------------------------------- checks

    def expected_pins(self) -> dict[int, int]:
        """key -> pinned queue entries plus unacknowledged copies, over every job (for
        invariants); asserts each rank's own counts of both agree with its queue and passes."""
        pins: dict[int, int] = {}
        for job in self.jobs.values():
            for rank in job.ranks:
                assert 0 <= rank.pinned <= len(rank.queue), (job.job_id, rank.index, rank.pinned, len(rank.queue))
                for position, entry in enumerate(rank.queue):
                    if position >= rank.pinned:
                        break
                    pins[entry.key] = pins.get(entry.key, 0) + 1
                handed_out = 0
                for pass_ in rank.passes.values():
                    for key, count in pass_.outstanding.items():
                        pins[key] = pins.get(key, 0) + count
                        handed_out += count
                    assert sum(pass_.held.values()) == sum(pass_.outstanding.values()), (pass_.held, pass_.outstanding)
                assert rank.handed_out == handed_out, (job.job_id, rank.index, rank.handed_out, handed_out)
                assert rank.pinned <= max(0, job.cache_share - handed_out), (
                    f"job {job.job_id} rank {rank.index}: {rank.pinned} entries pinned and {handed_out} "
                    f"copies out, over its share of {job.cache_share}")
        return pins


def _ranks(indices: list[int]) -> str:
    """`1`, `1 and 3`, `1, 2 and 3`: ranks named in a message."""
    names = [str(i) for i in indices]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def printable_name(name: str, limit: int = 80) -> str:
    """`name` with control and other unprintable characters escaped, so logs cannot be forged."""
    cleaned = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)
    return cleaned[:limit]


def _id_prefix(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:40] or "job"
