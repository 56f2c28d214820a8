"""Resumes: an epoch that goes on without what its readers already consumed.

A pass may *resume* an epoch from a checkpoint: its first request carries the epoch and the ids
its reader consumed, and `resume_parts` (how many readers of the rank report: a
StatefulDataLoader restores each DataLoader worker's own state). The job sits out of rounds
until every rank has that many reports, then the epoch goes on without their union
(`Scheduler.start_resumed`).

After a joaderd restart the decision is not the readers' (`decide_restart`): each rank's lease
keeper re-attaches with its client board's newest epoch and what the rank received of it, and
once every rank attached, the newest reported epoch resumes without those items, at once. The
readers then only say which pass they are: a pass some reader of which received items from the
dead server continues its epoch (`NextArgs.continue_epoch`); any other pass is a new pass, the
rank's next epoch after the one its keeper reported, whatever rank, worker or epoch number asks
for it (`Resumes.after_restart`, used by `PassTable.claim`).

NOTE [ The keepers decide a restart ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The lease keepers' reports decide a restart's resume, never the readers'. A reader reports only
when its loop asks, and a DDP loop may be blocked in a collective that waits for another rank's
resumed epoch. And a reader can only guess whether its pass is new or interrupted from epoch
numbers, which a plain start of the next epoch also carries: taken for a resume, the start of
epoch 2 made the job wait for a report that never came, or deal epoch 2 twice.

NOTE [ An elastic resume ]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A checkpoint saved by W1 ranks may resume on W2 (`joader.client.relayout`): the rest of the epoch
(the job's items that no old rank consumed) is dealt anew, each new rank getting an equal share
of it, as DistributedSampler would deal a fresh epoch of that size. Every new rank reports the
union of what the old ranks consumed, which is more than one rank's share, so the whole-epoch
rule (a rank's share less what it consumed) would give it nothing: the report carries the
rank's share of the rest instead (`RestShare`: `share` items, counted from a consumed set of
`base` items). The epoch's remaining set is the job's items less the union, as for any resume;
the ranks' targets are their rest shares, padded (or dropped, drop_last) to them. The share
travels on: a checkpoint saved later in that epoch, and a lease keeper's report after a joaderd
restart in it, carry it with their consumed set, so that what a rank consumed beyond `base`
comes off its share and not off a whole epoch's. The client computes the share, not joaderd:
on several hosts each host's joaderd sees only its part, and the shares must be equal on all.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from pyroaring import BitMap

from joader.server.books.records import Job, PassBook, Rank, RestShare, Resume
from joader.server.registry.next_call import NextArgs
from joader.server.scheduling.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RestartResume:
    """What a restarted joaderd resumes, decided from the lease keepers' reports alone."""

    epoch: int  # the epoch that goes on
    consumed: list[BitMap]  # per rank: what it received of `epoch` (none if it reported an older one)
    claimed: list[int]  # per rank: the epoch its next new pass follows
    behind: list[int]  # ranks whose keeper reported an older epoch (their pass of it is over)
    rest: list[RestShare | None]  # per rank: its share of an elastic resume's rest (see NOTE)


def decide_restart(reports: dict[int, tuple[int, BitMap, RestShare | None]],
                   world_size: int) -> RestartResume | None:
    """The restart's resume, from each rank's keeper report: rank -> (the newest epoch its
    readers received items of, those items); a rank that reported nothing received nothing.
    None: no rank received anything, the job starts afresh.

    The newest reported epoch resumes: a rank that reported an older one had received its
    whole share of that one (DDP ranks step together; an epoch's last batch is read by every
    rank before any starts the next), and its next new pass reads the resumed epoch. See
    NOTE [ The keepers decide a restart ]."""
    epoch = max((report[0] for report in reports.values()), default=0)
    if epoch <= 0:
        return None
    current = {r: report for r, report in reports.items() if report[0] == epoch}
    consumed = [BitMap(current[r][1]) if r in current else BitMap() for r in range(world_size)]
    rest = [current[r][2] if r in current else None for r in range(world_size)]
    claimed = [max(reports[r][0] if r in reports else 0, epoch - 1) for r in range(world_size)]
    behind = [r for r in range(world_size) if r in reports and 0 < reports[r][0] < epoch]
    return RestartResume(epoch, consumed, claimed, behind, rest)


class Resumes:
    """Gathers the resume reports of checkpoints and of restarts, and starts resumed epochs.
    No lock: the `Registry` holds one."""

    def __init__(self, scheduler: Scheduler, clock: Callable[[], float]) -> None:
        self._scheduler = scheduler
        self._clock = clock

    def relabel(self, job: Job, rank: Rank, pass_: PassBook, epoch: int) -> None:
        """A reader with a checkpoint joined a pass that readers without one started (the
        DataLoader workers of one iterator ask in any order) before anything was handed out:
        the pass resumes `epoch`, and its earlier readers count as having consumed nothing."""
        logger.info("job %s: pass %x resumes epoch %d", job.job_id, pass_.token, epoch)
        pass_.epoch = epoch
        rank.claimed_epoch = epoch
        resume = job.resume = Resume(epoch, self._clock())
        for worker_id in pass_.members:
            resume.reports[(rank.index, worker_id)] = BitMap()

    def report_restart(self, job: Job, rank_index: int, epoch: int, consumed: BitMap,
                       rest: RestShare | None = None) -> None:
        """A lease keeper attached rank `rank_index` again after joaderd restarted, with the
        newest epoch its readers received items of and those items (its client board), and the
        rank's share of that epoch's rest if it was an elastic resume's. Kept
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
        job.restart_reports[rank_index] = (epoch, BitMap(consumed) & job.dataset, rest)
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
            epoch, received, _ = job.restart_reports[index]
            if len(received) < job.per_rank:
                logger.warning(
                    "job %s: rank %d was still in epoch %d (%d of its %d items) while another rank "
                    "read epoch %d when joaderd restarted; epoch %d resumes and rank %d's rest of "
                    "epoch %d is not delivered", job.job_id, index, epoch, len(received), job.per_rank,
                    decision.epoch, decision.epoch, index, epoch)
        job.resume = None
        job.resumed_epoch = decision.epoch
        self._scheduler.start_resumed(job, decision.epoch, decision.consumed, decision.rest)
        job.wake()

    def after_restart(self, job: Job, rank: Rank, args: NextArgs) -> NextArgs:
        """A request of a restarted job, as what it is: a resume from a reader of an epoch the
        rank's keeper reported (or older) continues that epoch (the restart decided it); one of
        a later epoch with nothing consumed is a new pass (a client that numbers its epochs
        across the restart); a later epoch with items consumed is a checkpoint."""
        epoch = args.resume_epoch
        if epoch <= 0:
            return args
        if epoch <= max(rank.reported_epoch, job.resumed_epoch):
            return dataclasses.replace(args, resume_epoch=0, resume_consumed=None, resume_parts=1, resume_rest=None,
                                       continue_epoch=epoch)
        if not args.resume_consumed:
            return dataclasses.replace(args, resume_epoch=0, resume_consumed=None, resume_parts=1, resume_rest=None,
                                       continue_epoch=0)
        return args

    def report(self, job: Job, rank: Rank, args: NextArgs, epoch: int) -> None:
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
        if args.resume_rest is not None:
            resume.rest[rank.index] = args.resume_rest
        consumed = args.resume_consumed if args.resume_consumed is not None else BitMap()
        resume.reports[(rank.index, args.worker_id)] = consumed
        self._start_if_complete(job)

    def _start_if_complete(self, job: Job) -> None:
        resume = job.resume
        if resume is not None and resume.complete(job.world_size):
            job.resume = None
            job.resumed_epoch = resume.epoch
            consumed = [resume.consumed_by(r) for r in range(job.world_size)]
            rest = [resume.rest.get(r) for r in range(job.world_size)]
            self._scheduler.start_resumed(job, resume.epoch, consumed, rest)
            job.wake()


def resume_waiting(job: Job, now: float) -> dict[str, object] | None:
    """A resumed epoch still gathering its readers' reports, for status (which rank, how many
    of how many); None if the job waits for none."""
    resume = job.resume
    if resume is None:
        return None
    ranks: list[dict[str, Any]] = []
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
