"""Keeping jobs in step: who takes part in a DSA round, and when a leader waits. Pure: numbers in,
decisions out (the scheduler gathers the numbers; tests/unit/server/scheduling/test_in_step.py models them).

Two jobs share a decode only when one round gives both the same item and the cache still holds it
when the second reads it. Jobs of a sweep start together and drift: step times jitter, the jobs
compete for cores, and once one is behind it draws alone, misses the cache, waits for decodes,
and falls further behind. Two rules keep them together.

NOTE [ Planning a lagging job ahead ]
A rank takes part in a round below twice its queue's capacity (the lookahead, one batch of slack),
and also while

    its queue's wait (queued items / its rate) <= the shortest wait of this round's jobs
                                                  + plan_horizon x cache items / decode rate

and its queue is below `plan_horizon` x the cache's items. Picks are only indices, cheap to make
early: a job behind takes the same picks as the leader now and reads them later, and the cache
keeps each item until it comes to it (its queue entries are planned reads, NOTE [ Planned reads ]
in item_cache.py). `cache items / decode rate` is how long the cache keeps what it decodes; the
rule plans no further behind the leader than that. A job slower for good reaches the bound and
sits out rounds as before: it shares what it draws beside the leader. With the old rule alone,
the job behind sat out once one batch behind, the leader drew alone, their remaining sets parted,
and Theorem 1's share |R1 ∩ R2| / max(|R1|, |R2|) fell for the rest of the epoch (three jobs with
30% step jitter, simulated by bench/micro/drift_sim.py: 2.75 jobs served per decode, not 3; 3.02 with
the rule).

NOTE [ A leader waits only where it costs the sweep nothing ]
Past the bound, planning stops and the job behind sits out. On a host whose CPUs are all busy,
with the leader's own process busy computing (a model trained on the CPU), the leader's lead is
not its own: each core-second it spends the others do not get. Then the round that would leave
a job of about its speed (at least `SIMILAR_SPEED` of the fastest waiting job's rate) behind
does not run yet: the waiting jobs drain their queues a little longer, their CPU goes to the job
behind, and it catches up within the bound, where the next round takes it along. Never for
longer than `max_hold_s` at a time (then a round runs without the job behind), never for a job
that is not CPU-bound (a GPU-bound job's wait frees no CPU: it would only lose time), never for
a job much slower (different models keep their own speeds; a slow job loses sharing, not the
others their speed), never on an idle host, and never for or by an order="independent" job.

NOTE [ The in-step rules are opt-in ]
Measured with real training (bench/field/field.py: three CPU-bound jobs of a digits lr sweep, a quarter
cache, medians of 3 on a quiet host), both rules help jobs started together from a start file
(jobs served per decode: 2.91 with neither, 3.12 and 2.43 in two runs with planning, 3.44 with
holds too, which also finished sooner, 11.2 s against 13.4) but not the same jobs launched as
plain scripts, which start reading up to a second apart: 2.53 with neither (median of 6), 2.11
with planning (of 9), 2.22 with holds, and makespans of 14 s against 17-18 s, with more CPU. The
simulation (bench/micro/drift_sim.py) shows the gains and not that cost, so what the real runs pay is
not modelled there; candidates: the longer queues' per-request scans (`_count_ready`,
`_recheck_failures` walk the queue), held jobs' empty replies and re-asks, a job still starting
counted as behind. Until that is found, `--plan-horizon` and `--max-hold-s` are 0 by default:
what users run gets the old rule.

Why each job's order stays exactly once and uniform: DSA's claim (joader.sampling.dependent)
needs only that the participant list of a round is fixed before its first draw and chosen from
the past, not from future draws. Both rules are functions of queue lengths, measured rates, the
decode rate and CPU readings, all results of earlier rounds, requests, decodes and time; whether
a round runs now or later changes when its draws happen, not their law. (A rule that looked at
what a job would draw next would break it.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A job at least this share of the fastest waiting job's rate is "of about its speed": drift,
# not a different model; a leader may wait for it (NOTE [ A leader waits only where ... ]).
SIMILAR_SPEED = 0.67


@dataclass(frozen=True)
class Candidate:
    """One job's receiving rank, as a round sees it."""

    job_id: str
    queued: int  # entries in its queue
    capacity: int  # its queue's capacity (the lookahead)
    horizon: int  # `Job.plan_horizon`: the longest queue planning may build
    rate: float | None  # items/s it was served lately; None: not measured yet
    cpu_bound: bool = False  # its training process kept a core busy lately
    reading: bool = True  # it asked for items lately (a paused job is not waited for)
    independent: bool = False  # order="independent": it neither waits nor is waited for

    @property
    def wait_s(self) -> float | None:
        """How long its queue lasts at its rate."""
        return self.queued / self.rate if self.rate else None


@dataclass(frozen=True)
class Plan:
    """What a round should do: take `participants` now, or `hold` (run no round yet)."""

    participants: tuple[str, ...]
    hold: bool = False
    behind: tuple[str, ...] = ()  # the jobs a hold waits for
    # The default rule alone (every job within twice its capacity takes part, nothing measured):
    # the scheduler may then run the next rounds as one batch (NOTE [ Rounds in batches ]).
    simple: bool = False


def plan_round(candidates: Sequence[Candidate], *, decode_rate: float | None, host_busy: bool,
               held_s: float, max_hold_s: float) -> Plan:
    """The round's participants, or a hold. `decode_rate`: decodes/s lately (None: unknown);
    `host_busy`: every core of the host was busy lately; `held_s`: how long this source's rounds
    have been held so far (0 if not held)."""
    soonest = min((c.wait_s if c.wait_s is not None else 0.0 for c in candidates), default=0.0)
    participants: list[str] = []
    left_out: list[Candidate] = []
    for c in candidates:
        if c.queued < 2 * c.capacity:
            participants.append(c.job_id)
        elif (c.wait_s is not None and decode_rate and c.queued < c.horizon
              and c.wait_s <= soonest + c.horizon / decode_rate):
            participants.append(c.job_id)
        else:
            left_out.append(c)
    plan = Plan(tuple(participants))
    if not (host_busy and decode_rate and left_out and held_s < max_hold_s):
        return plan
    waiting = [c for c in candidates if c.queued < c.capacity]  # the jobs the round is for
    if not waiting or not all(c.cpu_bound and not c.independent and c.rate for c in waiting):
        return plan
    fastest = max(c.rate for c in waiting if c.rate)
    behind = tuple(c.job_id for c in left_out
                   if c.reading and not c.independent and c.rate and c.rate >= SIMILAR_SPEED * fastest)
    if not behind:
        return plan
    return Plan(plan.participants, hold=True, behind=behind)
