"""Jobs, their ranks and leases.

A *job* is one DSA job: a dataset read by `world_size` ranks (the processes of one DDP job, or
one process). The ranks of one job attach one by one with the same name, source, indices and
world size; the first creates the job, the others join it. Every rank holds its own lease (its
lease keeper's stream); when any rank's lease ends the whole job goes, and the other ranks are
told why at their next request (DDP cannot go on without a rank anyway). A job with no rank
attached any more ends too: at once when its last attached rank closes its lease, and after
`rank_attach_timeout_s` when some of its ranks never attach (NOTE [ A job with no rank
attached ends ]). A rank arriving for an ended job (or
for a rank that closed) starts a new job.

Who may read a job: whoever holds its secret, which `attach` returns to the lease holders only
(`status` lists job ids, never secrets). What a rank reads is its passes' business
(`server/registry/passes.py`), and which epoch a pass reads after a checkpoint or a restart the resumes'
(`server/registry/resumes.py`).

NOTE [ A job with no rank attached ends ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A half-attached job that stays registered captures the next run of its name: that run's ranks
are split between it and a new job, and one rank joins the stale job and reads the whole epoch
alone. So a job ends once no rank of it is attached (`close_rank`), and when its missing ranks
do not come within `rank_attach_timeout_s` (`expire`).

NOTE [ A client that never asks ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Heartbeats alone keep a job registered whose client cannot read the arena (another user's, over
TCP), holding a --max-jobs slot and a share of the cache for good. A JoaderDataset's
lease keeper checks the arena and sends a request at once; a rank whose client sends none
within its lease of attaching is removed (`expire`).

NOTE [ Two live jobs of one name ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A name is how the ranks of one job find it, so the ranks of a job share one by design. Two
*jobs* of one name (another source or indices, a new run while the last one's ranks finish, the
trials of a sweep given the same `name=`) are still two jobs, and both are served: refusing the
second would stop a run over a label. But `joader status`, `top` and the metrics' `job` label
show the name, and six Optuna trials all shown as `optuna_sweep.py-7925` could not be told
apart; the same name twice at once was accepted silently. So the rank that attaches under a
name another live job has gets a `notice` in its Attach reply (the dataset logs it once as a
warning, naming the fix), and joaderd logs it too.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import random
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable

from pyroaring import BitMap

from joader.errors import InvalidArgumentError, TooManyJobsError, UnknownJobError
from joader.sampling import check_order
from joader.server.books.item_cache import ItemCache
from joader.server.books.records import Item, Job, Rank, Source
from joader.server.registry.passes import release_outstanding
from joader.server.registry.resumes import resume_waiting
from joader.server.scheduling.scheduler import Scheduler

logger = logging.getLogger(__name__)

_MAX_REMOVED_REMEMBERED = 4096
MAX_WORLD_SIZE = 4096


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
               world_size: int = 1, drop_last: bool = False, seed: int | None = None,
               order: str = "shared") -> tuple[Job, Rank]:
        """Registers rank `rank` of a job: creates the job, or joins the one its ranks share."""
        name = printable_name(name)
        check_order(order)
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
                if order != job.order:
                    raise InvalidArgumentError(
                        f"job {name!r}: rank {rank} asks for order={order!r}, but rank 0..{world_size - 1} "
                        f"of this job started with order={job.order!r}; give every rank the same order")
                member = job.ranks[rank]
                member.attached = True
                member.last_seen_s = member.attached_s = now
                member.notice = self._name_notice(job)
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
                  world_size, drop_last, seed, random.Random(seed), ranks, group_key=key, order=order)
        self.jobs[job_id] = job
        self._scheduler.add(job)
        logger.info(
            "job %s: attached to source %s with %d items%s%s", job_id, source.name, len(dataset),
            f" (rank {rank} of {world_size})" if world_size > 1 else "",
            ", its own order (independent)" if order == "independent" else "",
        )
        ranks[rank].notice = self._name_notice(job)
        if ranks[rank].notice:
            logger.info("job %s: %s", job_id, ranks[rank].notice)  # the client shows it as a warning
        return job, ranks[rank]

    def _name_notice(self, job: Job) -> str:
        """What to tell a rank of `job` when another live job has its name, else "" (see
        NOTE [ Two live jobs of one name ])."""
        others = [other.job_id for other in self.jobs.values() if other.name == job.name and other is not job]
        if not others:
            return ""
        which = f"a job named {job.name!r} is" if len(others) == 1 else f"{len(others)} jobs named {job.name!r} are"
        return (f"{which} already attached (job id {', '.join(others)}); this one ({job.job_id}) "
                "is served as a separate job under the same name. Pass each JoaderDataset its own "
                "name= to tell them apart in joader status")

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
        must: no rank of it is attached any more (every rank closed, or the others never came).
        See NOTE [ A job with no rank attached ends ]."""
        rank = job.ranks[index]
        rank.attached = False
        rank.closed = True
        self._scheduler.drop_queue(rank, lambda entry: True)
        for pass_ in rank.passes.values():
            release_outstanding(self._cache, rank, pass_)
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
                    # See NOTE [ A client that never asks ].
                    expired.append((job, (
                        f"{what}its client sent no request within {self.lease_s:g} s of attaching "
                        "(a client that cannot read joaderd's arena, e.g. another user's over TCP, "
                        "or a joader client older than this joaderd); run the job as the user "
                        "that runs joaderd, with the same joader version")))
                    break
                for pass_ in rank.passes.values():
                    if pass_.release_at_s is not None and pass_.release_at_s <= now:
                        release_outstanding(self._cache, rank, pass_)
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
        epoch still gathering its readers' reports (`resume_waiting`)."""
        if not job.all_attached:
            missing = [r.index for r in job.ranks if not (r.attached or r.closed)]
            return {
                "for": "ranks", "ranks": missing,
                "detail": (f"rank {_ranks(missing)} of {job.world_size} not attached yet; the job "
                           f"ends if they do not attach within {self.rank_attach_timeout_s:g} s"),
                "since_s": round(now - job.created_s, 3), "limit_s": self.rank_attach_timeout_s,
            }
        return resume_waiting(job, now)

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
                release_outstanding(self._cache, rank, pass_)
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

    # ----------------------------------------------------------------------------- checks

    def expected_planned(self) -> dict[int, int]:
        """key -> queue entries holding it, over every job: the planned reads
        (NOTE [ Planned reads ] in item_cache.py)."""
        planned: dict[int, int] = {}
        for job in self.jobs.values():
            for rank in job.ranks:
                for entry in rank.queue:
                    planned[entry.key] = planned.get(entry.key, 0) + 1
        return planned

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

    def check_pinned_items(self, items: dict[int, Item]) -> None:
        """Asserts that every pinned queue entry's `Entry.item` is the cache's item of its key."""
        for job in self.jobs.values():
            for rank in job.ranks:
                for position, entry in enumerate(rank.queue):
                    if position >= rank.pinned:
                        break
                    assert entry.item is items.get(entry.key), (
                        f"job {job.job_id} rank {rank.index}: pinned entry {position} (item {entry.item_id}) "
                        "holds another item than the cache's")


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
