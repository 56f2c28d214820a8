"""Rounds in batches: what a batch of DSA rounds with the same participants keeps and asks
(`Scheduler.run_round`, server/scheduling/scheduler.py).

NOTE [ Rounds in batches ]
A round is one pick per participant, and its fixed costs (who takes part, the plan, the
sampler's call, pinning each receiving rank's head) were most of the scheduler's main-
process CPU per item (issue 37). A turn holds the lock for up to `rounds_per_lock`
rounds, and no queue changes between them but by the rounds themselves. So, with the
default plan (in_step's plans are made round by round), the rounds single ones would run
in a row run as one batch with the first round's participants: `goes_on` checks the
rule after each (some job below its capacity, no participant at twice its capacity) at
the cost of a length per participant; each rank that received picks pins its head once,
after the batch, in pick order. A batch stops after a round that ends a participant's
sampler epoch, so the next one starts the new epoch as a single round does. Nothing
here looks at which items were drawn, so the participant lists still come from the past
(the condition DSA's uniformity needs: joader/sampling/dependent.py); a unit test checks
that batches leave every queue, pin and remaining set as single rounds do. Where every
participant is of world size 1 (`rounds_ahead`), a batch's length is known before its
first round, from the queue lengths and what is left of the epochs (still the past): its
rounds are drawn in one sampler call (`DependentSampler.sample_rounds`, the same draws as
one call a round; a unit test checks that on twin samplers), each job's picks are dealt at
once (`Scheduler._deal_drawn`), and `goes_on` is not asked. In warm epochs a third of the
rounds had one participant (jobs reading at different speeds sit rounds out), so a round's
fixed cost was paid per pick. Filling
queues further (to twice their capacity, for fewer calls per item) was tried: in a tight
cache, a job that stops reading with its copies out then leaves the other jobs' fuller
queues no slots for their next batch (test_next_protocol's `stops_reading` hung).
"""

from __future__ import annotations

from joader.sampling import DependentSampler
from joader.server.books.records import Job, Source

# Per-pair sharing is counted in rounds of at most this many jobs: the count is quadratic in
# the participants, and a round is a few microseconds of Python.
MAX_PAIR_COUNTED_JOBS = 16


class BatchBooks:
    """What a batch of rounds with the same participants keeps as it goes (NOTE [ Rounds in
    batches ]): the participants (every round's picks are for exactly them), their pairs'
    counts (`sharing_pairs`), added once the batch is over (`flush`), and each job's picks
    left in its sampler epoch (`Scheduler._deal`)."""

    __slots__ = ("all_shared", "left", "pairs", "participants", "rounds")

    def __init__(self, participants: list[str], pairs: list[tuple[str, str, list[int]]]) -> None:
        self.participants = frozenset(participants)
        self.pairs = pairs
        self.rounds = 0
        self.all_shared = 0  # rounds that gave every participant the same item
        self.left: dict[str, int] = {}

    def count(self, picks: dict[str, int]) -> None:
        """A round's picks: the pairs that got the same item shared it."""
        self.rounds += 1
        if len(set(picks.values())) == 1:  # in-step jobs, the usual round: every pair shared
            self.all_shared += 1
            return
        for a, b, counts in self.pairs:
            if picks[a] == picks[b]:
                counts[1] += 1

    def flush(self) -> None:
        """Every pair took part in each round counted."""
        for _, _, counts in self.pairs:
            counts[0] += self.rounds
            counts[1] += self.all_shared
        self.rounds = self.all_shared = 0


def fill(job: Job, warm: bool) -> int:
    """How far a round fills the job's receiving rank: its fill where the cache has room and
    nothing is being decoded, else its capacity (`Job.queue_fill`)."""
    return job.queue_fill if warm and job.queue_fill else job.queue_capacity


def rounds_ahead(taking: list[Job], others_short: bool, warm: bool, max_rounds: int,
                  sampler: DependentSampler) -> int | None:
    """The rounds a batch runs, known before its first (NOTE [ Rounds in batches ]), when every
    participant is of world size 1, its rank not closed and its share not dealt out: each round
    then adds one entry to each participant's queue, so what `goes_on` answers after each round
    follows from the lengths now; and a batch ends with the round that ends a participant's
    sampler epoch. None otherwise: the batch asks `goes_on` after each round."""
    rounds = max_rounds
    short = max_rounds if others_short else 0  # rounds until no job is below its fill
    for job in taking:
        rank = job.ranks[0]
        share = job.shares[job.sampler_epoch]
        undealt = share.target[0] - share.assigned[0]
        if job.world_size != 1 or rank.closed or undealt <= 0:
            return None
        length = len(rank.queue)
        rounds = min(rounds, 2 * job.queue_capacity - length, undealt, sampler.num_remaining(job.job_id))
        short = max(short, fill(job, warm) - length)
    return max(1, min(rounds, short))


def goes_on(taking: list[Job], others_short: bool, warm: bool) -> bool:
    """Whether the next single round would run with the same participants (NOTE [ Rounds in
    batches ]): some job's receiving rank is below its capacity (`others_short`: one sitting
    out), and none of the participants' has reached twice its capacity (it would sit out)."""
    short = others_short
    for job in taking:
        receiver = job.shares[job.sampler_epoch].receiver()
        length = len(job.ranks[receiver].queue) if receiver is not None else 0
        capacity = job.queue_capacity
        if length >= 2 * capacity:
            return False
        short = short or length < fill(job, warm)
    return short


def alone(job: Job) -> bool:
    """Whether the job opted out of correlated orders (`Job.order`)."""
    return job.order == "independent"


def sharing_pairs(source: Source, participants: list[str], jobs: dict[str, Job]) -> list[tuple[str, str, list[int]]]:
    """The pairs a round of `participants` counts, each with its counts in `source.pair_rounds`
    ([rounds both took part in, rounds that gave both one item]: the figure Theorem 1 bounds,
    |D1 ∩ D2| / max(|D1|, |D2|)); made once per batch of rounds, which all have the same
    participants. At most MAX_PAIR_COUNTED_JOBS jobs are counted (the pairs are quadratic).

    NOTE [ Independent jobs share no round ]: a job with order="independent" draws alone (its
    own stream, outside the chain; joader.sampling.dependent, "Independent jobs"), so it took
    part in no round with anyone, even when its pick happens to equal another job's (it then
    shares that decode, which the cache counts, not a round)."""
    ids = sorted(job_id for job_id in participants if not alone(jobs[job_id]))
    if not 2 <= len(ids) <= MAX_PAIR_COUNTED_JOBS:
        return []
    counts = source.pair_rounds
    return [(a, b, counts.setdefault((a, b), [0, 0])) for i, a in enumerate(ids) for b in ids[i + 1:]]
