"""DSA, the dependent sampling algorithm (Xie et al., NeurIPS 2022, sec. 3.1), on the chain tree.

One round with participants P (the others sit out and keep R intact) walks the chain of
`joader.sampling.chain` from the root. At node k, with the participants P_k still undecided
(P_1 = P), draw ONE uniform u in [0, 1) for the node. A job j in P_k *selects* the vertex iff

    u < |I_k| / |R'_j|,   R'_j = R_j \\ (I_1 ∪ ... ∪ I_{k-1})   (j's remaining set seen at node k)

All selectors receive the same item, drawn uniformly from I_k. If j_k participates and did not
select, it draws uniformly from its leaf L_k. The other non-selectors go on to node k+1.

Because u is shared, the selections are nested: if a job with |R'| = a selects, so does every job
with |R'| <= a; and P(job i selects | job i-1 selected) = |R'_{i-1}| / |R'_i|, the paper's chain
probabilities. Correctness does not depend on the chain order being up to date (it goes stale as
jobs consume items at different rates); only the amount of sharing does.

Claim: in every round, a participant j receives each x in R_j with probability 1/|R_j|, given
everything that happened before the round. Proof by induction over the nodes on j's path
(j = j_m, nodes k = 1..m): suppose j reaches node k with probability |R'_j(k)| / |R_j|, where
R'_j(k) = I_k ⊔ ... ⊔ I_m ⊔ L_m. For k = 1 this is 1. The u of node k is drawn afresh, so j
selects with probability |R'_j(k)|/|R_j| * |I_k|/|R'_j(k)| = |I_k|/|R_j| and then gets each
x in I_k with probability 1/|I_k|, i.e. 1/|R_j| each. Otherwise (probability
(|R'_j(k)| - |I_k|)/|R_j|): if k = m it draws from L_m, |L_m| = |R'_j(m)| - |I_m|, so each leaf
item has probability 1/|R_j|; if k < m it reaches node k+1 with probability |R'_j(k+1)|/|R_j|,
the induction hypothesis. The sets I_1..I_m, L_m partition R_j, so every x in R_j gets exactly
1/|R_j|. (A job never reaches a node with R'_j empty: R'_j(k+1) empty means R'_j(k) = I_k and
j selected there with probability 1.) The item leaves R_j, so the job's picks within an epoch are
a uniformly random permutation of D_j whatever the other jobs and the sit-outs do, as long as the
participant lists do not depend on future draws. The tree is updated only after the whole round,
so that an item moved to a deeper vertex cannot be drawn twice by the same round's walk.

Two jobs share a round with probability P(both select I_1) = |R_1 ∩ R_2| / max(|R_1|, |R_2|),
the Theorem 1 bound for their current sets, whatever the chain order. Over whole epochs this
reaches the dataset bound |D_1 ∩ D_2| / max(|D_1|, |D_2|) when the epochs stay aligned (equal
sizes, same start, no sitting out: then every shared item is consumed by a shared round, so each
epoch has exactly |D_1 ∩ D_2| shared rounds). When they drift apart (unequal sizes, a late join,
sitting out) the sets drawn from overlap less and sharing falls: 600 and 1000 items with 300
shared give about 0.16 of rounds, not 0.3; two 50%-overlapping jobs of equal size, the second
joining half an epoch late, about 0.16, not 0.5, for as long as they run. No uniform sampler can
do better round by round (that is Theorem 1); aligning epochs is a server policy question. For n jobs, the selectors
of node k share one item; the expected number of distinct items in a round is
sum_k P(someone selects I_k) + sum_k P(j_k takes its leaf); with identical datasets it is 1.

Incremental update, after item x went to the set G of jobs (O(n) bitmap adds and removes):
- x from L_k (G = {j_k}): remove x from L_k and R_{j_k}. No other vertex changes: I_m for m <= k
  never held x (it is in the leaf), and I_m, L_m for m != k do not depend on x ∈ R_{j_k}.
- x from I_k: remove x from I_k and from R_j for j in G. H = {j_k..j_n} \\ G still need x; vertices
  above k never held it. Let m* = 1 + the deepest chain position in G: the suffix {j_m*..j_n} is
  the first one inside H, so x moves to I_m* (if m* <= n), and into L_m for every m in [k, m*)
  with j_m in H. A unit test checks this against `build_chain` after random rounds.

Epochs: a participant whose R is empty at the start of a round gets R = D (a new epoch); this,
add_job, remove_job and reset_epoch rebuild the chain in the ascending size order. A resumed epoch
(add_job or reset_epoch with `remaining`) is just a starting R smaller than D; nothing above
assumes R = D at an epoch's start, so its order is a uniform permutation of that R.

Random streams. Each job has a stream: its own `rng` from add_job, or the sampler's. A round
draws every number it needs (each node's u, each index) from the stream of its root-most
participant: the participant that comes first in chain order. Why the proof above still holds:
it needs only that each u and each index draw is uniform on [0, 1) and independent of everything
before it (earlier rounds, and earlier nodes of the same round). Model the streams as independent
sequences of independent uniforms. The stream of a round is chosen from the participant list and
the chain order, both fixed before the round's first draw: the list comes from the caller (who
must not choose it by looking at future draws, the condition the proof already had), the order is
a function of the remaining sets, i.e. of the past. A rule that picks which stream to read next
from the past only never sees the number it is about to read, so that number is still uniform and
independent of every number used so far, from its own stream or from others. So every draw of
the round is a fresh uniform given the past, whichever stream it came from, and the induction goes
through unchanged; jobs sharing a stream (all those without `rng` share the sampler's) are the old
single-stream case. (What would break it: choosing the stream after peeking at its next value.)

Epoch alignment (`align`). Two jobs on the same dataset whose epochs are out of phase (one
started half an epoch after the other) share about 0.31 of rounds for as long as they run: DSA
can share only what both still need. With `align="first"`, a job whose FIRST epoch starts
(its first round) while another job on the same dataset D is mid-epoch, with epoch remaining P
(0 < |P| < |D|), runs that epoch in two phases: a uniform order of P, then of D \\ P. Both
jobs then need the same items for the rest of the other's epoch and share every round of it.
Why the epoch stays marginally uniform: the other job's epoch is marginally uniform (by the
claim above, or by this argument for its own phases), so P(x in P) = |P|/|D| for every x, and
|P| is fixed by how many rounds it took part in, not by which items; x then lands at each
position of phase 1 with probability (|P|/|D|)/|P| and of phase 2 with ((|D|-|P|)/|D|)/(|D|-|P|),
both 1/|D|. Only identical datasets are aligned: with a superset the size of P would depend on
which items it holds. `align="always"` does it at every epoch's start: the jobs then share
every round, but a job that is half an epoch behind always takes the same half first (epoch
e+1's first half is epoch e's: full sharing at a fixed offset forces it), so consecutive epochs
are far from independent (measured in tests/statistical/test_sampling_alignment.py); it is an
opt-in trade. "first" leaves later epochs alone.

Independent jobs (`add_job(..., independent=True)`, a job's `order="independent"`). Such a job
is kept out of the chain: it has no vertex, no leaf and no chain position, and `sample` gives
it a round of its own whatever else is listed: one draw from its own stream picks x uniformly
from its remaining set (the single-participant round above, with a chain of one). Its stream is
its own `rng` (or, without one, a `random.Random` seeded once from the sampler's stream when it
is added); no other job's round ever reads it. Why its order is independent of every other
job's:
- its picks are a function of its own stream U alone: R starts at D (or the resumed R0), each
  pick is R's element at index floor(u |R|) for its next u, and R then loses that item; nothing
  else reads or changes R. So the whole sequence of its picks is F(U);
- the other jobs' rounds read the other streams V (independent of U) and their chain, built from
  their own remaining sets only. Condition on U: the participant lists still come from the past
  only (the condition the claim above already has; the scheduler's lists depend on queue
  lengths, never on a draw not made yet), every u the chain's rounds read is still a fresh
  uniform, and the claim goes through unchanged: each other job's order is a uniform
  permutation given U, hence independent of U and of F(U). When the participant lists do not
  depend on U at all (the statistical tests, or jobs reading at steady speeds), the other jobs'
  joint law (their sharing too) is a function of V and the lists only, so the independent job is
  independent of all of them jointly, not only of each one.
Keeping it out of the chain matters for the others: a non-participant's set in the chain splits
the vertices the participants walk, and changes how often they share (two jobs with R = {1, 2}
and {1, 2, 3, 4} share a round with probability 1/2; a third job {1, 3} in the chain between
them, sitting out, makes it 5/12). The jobs that share are thus exactly the DSA of the jobs that
chose to share. An independent job is never aligned (`align`) and no job is aligned with it:
an aligned first phase is another job's remaining set, a function of that job's draws. Its own
epochs are marginally uniform and exactly once (uniform draws without replacement).

A round with a single participant j skips the walk: one draw picks x uniformly from R_j (the
distribution the walk gives, by the claim above), then the same incremental update runs, with x
found in the one vertex I_1..I_{k_j} or leaf L_{k_j} that holds it. The joint law of everything
is unchanged, and a job alone in its rounds gets picks that depend only on its own remaining sets
and its own stream, whatever other jobs are registered: with `rng=random.Random(7)`, the same
picks in every run. With several participants the picks also depend on the other jobs' sets.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pyroaring import AbstractBitMap, BitMap, FrozenBitMap

from joader.errors import InvalidArgumentError
from joader.sampling.base import Sampler, copy_bitmap
from joader.sampling.chain import build_chain, chain_order

logger = logging.getLogger(__name__)

__all__ = ["ALIGN_MODES", "ChainNode", "DependentSampler"]

ALIGN_MODES = ("off", "first", "always")


@dataclass(frozen=True)
class ChainNode:
    """A snapshot of one node of the chain: its job, its vertex I_k and its job's leaf L_k."""

    job_id: str
    vertex: FrozenBitMap
    leaf: FrozenBitMap


class DependentSampler(Sampler):
    """DSA over the chain tree: correlated per-job epochs that share as many rounds as possible.

    `seed` (or `rng`, a `random.Random`) fixes the sampler's stream, used by the jobs added
    without an `rng` of their own: the same seeds and the same calls give the same picks. Each
    round draws from the stream of its root-most participant (module docstring).
    """

    def __init__(self, seed: int | None = None, *, rng: random.Random | None = None,
                 align: str = "off") -> None:
        super().__init__()
        if align not in ALIGN_MODES:
            raise InvalidArgumentError(f"align must be one of {ALIGN_MODES}, got {align!r}")
        self._rng = rng if rng is not None else random.Random(seed)
        self._align = align
        self._rest: dict[str, BitMap] = {}  # the second phase of an aligned epoch (module doc)
        self._whole_start: set[str] = set()  # added with a whole first epoch: may be aligned
        self._remaining: dict[str, BitMap] = {}  # the chain's jobs (every job not independent)
        # Independent jobs (module docstring): their remaining sets and streams, outside the chain.
        self._solo: dict[str, BitMap] = {}
        self._solo_rands: dict[str, Callable[[], float]] = {}
        self._job_rngs: dict[str, random.Random] = {}  # the job's rng, or the sampler's
        # The chain, by position: job ids, their remaining sets and sizes, vertices and leaves
        # with their sizes kept as ints, so a round never calls len() on a bitmap.
        self._order: list[str] = []
        self._pos: dict[str, int] = {}
        self._rsets: list[BitMap] = []
        self._rsizes: list[int] = []
        self._inner: list[BitMap] = []
        self._isizes: list[int] = []
        self._leaves: list[BitMap] = []
        self._lsizes: list[int] = []
        self._rands: list[Callable[[], float]] = []  # each position's job's rng.random

    # ----------------------------------------------------------------------------- queries
    def independent(self, job_id: str) -> bool:
        """Whether the job was added with `independent=True` (its rounds are its own)."""
        return self._known(job_id, "independent") in self._solo

    def remaining(self, job_id: str) -> FrozenBitMap:
        solo = self._solo.get(job_id)
        if solo is not None:
            return FrozenBitMap(solo)
        current = self._remaining[self._known(job_id, "remaining")]
        rest = self._rest.get(job_id)
        return FrozenBitMap(current | rest if rest is not None else current)

    def num_remaining(self, job_id: str) -> int:
        solo = self._solo.get(job_id)
        if solo is not None:
            return len(solo)
        size = self._rsizes[self._pos[self._known(job_id, "num_remaining")]]
        rest = self._rest.get(job_id)
        return size + len(rest) if rest is not None else size

    def needs(self, job_id: str, item: int) -> bool:
        solo = self._solo.get(job_id)
        if solo is not None:
            return item in solo
        rest = self._rest.get(job_id)
        return item in self._remaining[self._known(job_id, "needs")] or (rest is not None and item in rest)

    def tree(self) -> list[ChainNode]:
        """A frozen snapshot of the chain, root first (for tests, status pages, debugging)."""
        return [
            ChainNode(job_id, FrozenBitMap(vertex), FrozenBitMap(leaf))
            for job_id, vertex, leaf in zip(self._order, self._inner, self._leaves, strict=True)
        ]

    # ----------------------------------------------------------------------------- changes
    def add_job(
        self,
        job_id: str,
        dataset: AbstractBitMap | Iterable[int],
        *,
        remaining: AbstractBitMap | Iterable[int] | None = None,
        rng: random.Random | None = None,
        independent: bool = False,
    ) -> None:
        _, first = self._register(job_id, dataset, remaining, rng)
        if independent:
            # A stream no other job reads (module docstring, "Independent jobs").
            own = rng if rng is not None else random.Random(self._rng.getrandbits(64))
            self._solo[job_id] = first
            self._solo_rands[job_id] = own.random
            return
        self._remaining[job_id] = first
        self._job_rngs[job_id] = rng if rng is not None else self._rng
        if remaining is None:
            self._whole_start.add(job_id)
        self._rebuild()

    def remove_job(self, job_id: str) -> None:
        self._known(job_id, "remove_job")
        self._unregister(job_id)
        if job_id in self._solo:
            del self._solo[job_id]
            del self._solo_rands[job_id]
            return
        del self._remaining[job_id]
        del self._job_rngs[job_id]
        self._rest.pop(job_id, None)
        self._whole_start.discard(job_id)
        self._rebuild()

    def reset_epoch(
        self, job_id: str, remaining: AbstractBitMap | Iterable[int] | None = None
    ) -> None:
        fresh = self._reset(job_id, remaining)
        if job_id in self._solo:
            self._solo[job_id] = fresh
            return
        self._remaining[job_id] = fresh
        self._rest.pop(job_id, None)
        self._whole_start.discard(job_id)  # a resumed or abandoned epoch is not aligned
        self._rebuild()

    def _aligned_phase(self, job_id: str) -> BitMap | None:
        """The first phase of `job_id`'s new whole epoch under `align` (module docstring): the
        epoch remaining of another job on the same dataset that is mid-epoch and not starting
        now, the largest such (ties: chain order); None if there is none."""
        dataset = self._datasets[job_id]
        size = len(dataset)
        best: BitMap | None = None
        for other in self._order:
            if other == job_id or other in self._pending_start or self._datasets[other] != dataset:
                continue
            rest = self._rest.get(other)
            left = self._remaining[other] | rest if rest is not None else self._remaining[other]
            if 0 < len(left) < size and (best is None or len(left) > len(best)):
                best = left
        return BitMap(best) if best is not None else None

    def _start_aligned(self, job_id: str) -> bool:
        """Starts `job_id`'s whole epoch in two phases if `_aligned_phase` finds one."""
        phase = self._aligned_phase(job_id)
        if phase is None:
            return False
        self._remaining[job_id] = phase
        self._rest[job_id] = BitMap(self._datasets[job_id]) - phase
        logger.debug("job %s: epoch aligned, %d items first, then %d", job_id, len(phase),
                     len(self._rest[job_id]))
        return True

    def _start_pending(self, job_ids: Sequence[str]) -> bool:
        """Count the epochs that start with this round; align a whole first epoch (`align`).
        Returns whether the chain was rebuilt (its positions changed)."""
        aligned = False
        if self._align != "off":
            starting = [j for j in job_ids if j in self._pending_start and j in self._whole_start]
            for job_id in starting:
                self._whole_start.discard(job_id)
                aligned |= self._start_aligned(job_id)
            if aligned:
                self._rebuild()
        super()._start_pending(job_ids)
        return aligned

    def _rebuild(self) -> None:
        remaining = self._remaining
        order = chain_order(remaining)
        self._order = order
        self._pos = {job_id: k for k, job_id in enumerate(order)}
        self._rsets = [remaining[job_id] for job_id in order]
        self._rsizes = [len(r) for r in self._rsets]
        self._inner, self._leaves = build_chain(self._rsets)
        self._isizes = [len(b) for b in self._inner]
        self._lsizes = [len(b) for b in self._leaves]
        job_rngs = self._job_rngs
        self._rands = [job_rngs[job_id].random for job_id in order]

    def _refill(self, positions: list[int]) -> None:
        """Start a new epoch (R = D) for the jobs at these chain positions, or the second phase
        of an aligned epoch (`align`), then rebuild."""
        starting = []
        for p in positions:
            job_id = self._order[p]
            rest = self._rest.pop(job_id, None)
            if rest is not None:
                self._remaining[job_id] = rest
                continue
            self._remaining[job_id] = copy_bitmap(self._datasets[job_id])
            self._epochs[job_id] += 1
            starting.append(job_id)
            logger.debug("job %s: epoch %d starts", job_id, self._epochs[job_id])
        if self._align == "always":
            for job_id in starting:
                self._start_aligned(job_id)
        self._rebuild()

    # ----------------------------------------------------------------------------- a round
    def sample(self, job_ids: Sequence[str]) -> dict[str, int]:
        if not job_ids:
            return {}
        if self._solo and any(job_id in self._solo for job_id in job_ids):
            return self._sample_with_solo(job_ids)
        pos = self._pos
        try:
            active = [pos[job_id] for job_id in job_ids]
        except (KeyError, TypeError):
            raise self._bad_participants(job_ids) from None
        if len(set(active)) != len(active):
            raise self._bad_participants(job_ids)
        if self._pending_start and self._start_pending(job_ids):
            # NOTE: an aligned start rebuilt the chain, which reorders it (ascending remaining
            # size): positions taken before are stale. With them, a late joiner's first round
            # gave its pick to another job, refilled a job that sat out, and the scheduler's
            # refcounts fell below zero.
            active = [self._pos[job_id] for job_id in job_ids]
        rsizes = self._rsizes
        empty = [p for p in active if not rsizes[p]]
        if empty:
            self._refill(empty)
            pos = self._pos
            rsizes = self._rsizes
            active = [pos[job_id] for job_id in job_ids]
        active.sort()
        return self._walk(active)

    def sample_rounds(self, job_ids: Sequence[str], rounds: int) -> list[dict[str, int]]:
        """`rounds` rounds with the same participants, in order: the picks as many calls of
        `sample` give, from the same draws (each round is the same walk), with the work of a
        call (its checks, the participants' positions) done once while the chain is unchanged.

        A caller that draws several rounds at once must have chosen how many from the past
        (queue lengths, what is left of epochs), never from a draw: the condition the module
        docstring's claim needs of participant lists."""
        picks = [self.sample(job_ids)]
        solo = self._solo
        if solo and any(job_id in solo for job_id in job_ids):
            picks.extend(self.sample(job_ids) for _ in range(rounds - 1))
            return picks
        rsizes = self._rsizes  # a rebuilt chain has new lists
        active = sorted(self._pos[job_id] for job_id in job_ids)
        left = min(rsizes[p] for p in active)  # rounds before a participant's epoch is over:
        for _ in range(rounds - 1):  # each round takes one item from each participant's set
            if left and self._rsizes is rsizes:
                picks.append(self._walk(active.copy()))
                left -= 1
                continue
            # The chain was rebuilt, or a participant's epoch is over: the whole of `sample`.
            picks.append(self.sample(job_ids))
            rsizes = self._rsizes
            active = sorted(self._pos[job_id] for job_id in job_ids)
            left = min(rsizes[p] for p in active)
        return picks

    def _walk(self, active: list[int]) -> dict[str, int]:
        """One round's walk down the chain for the participants at positions `active`
        (ascending, distinct, every remaining set non-empty; consumed), and its update."""
        rand = self._rands[active[0]]  # the root-most participant's stream, for the whole round
        if len(active) == 1:
            return self._sample_alone(active[0], rand)

        order = self._order
        rsizes = self._rsizes
        inner = self._inner
        isizes = self._isizes
        leaves = self._leaves
        lsizes = self._lsizes
        picks: dict[str, int] = {}
        # (node, item, selector positions); None for a leaf draw. Applied after the walk.
        deliveries: list[tuple[int, int, list[int] | None]] = []
        consumed = 0  # |I_1| + ... + |I_{k-1}|: R'_j = R_j minus these, for every j at node k
        k = 0
        while active:
            size = isizes[k]
            if size:
                u = rand()
                selected = []
                rest = []
                for p in active:
                    if u * (rsizes[p] - consumed) < size:
                        selected.append(p)
                    else:
                        rest.append(p)
                if selected:
                    index = int(rand() * size)
                    item = inner[k][index if index < size else size - 1]
                    for p in selected:
                        picks[order[p]] = item
                    deliveries.append((k, item, selected))
                    active = rest
                    if not rest:
                        break
                consumed += size
            if active[0] == k:  # j_k takes part and did not select I_k: its leaf
                size = lsizes[k]
                index = int(rand() * size)
                item = leaves[k][index if index < size else size - 1]
                picks[order[k]] = item
                deliveries.append((k, item, None))
                del active[0]
            k += 1

        self._apply(deliveries)
        return picks

    def _sample_with_solo(self, job_ids: Sequence[str]) -> dict[str, int]:
        """A round listing independent jobs: the chain's participants walk together, then each
        independent job draws alone from its own stream (module docstring)."""
        if len(set(job_ids)) != len(job_ids) or not all(j in self._datasets for j in job_ids):
            raise self._bad_participants(job_ids)
        solo = self._solo
        chained = [job_id for job_id in job_ids if job_id not in solo]
        picks = self.sample(chained) if chained else {}
        for job_id in job_ids:
            if job_id in solo:
                picks[job_id] = self._sample_solo(job_id)
        return picks

    def _sample_solo(self, job_id: str) -> int:
        """An independent job's round: x uniform in its R, from its own stream; a new epoch
        (R = D) first when R is empty."""
        remaining = self._solo[job_id]
        if job_id in self._pending_start:
            super()._start_pending([job_id])
        elif not remaining:
            remaining = self._solo[job_id] = copy_bitmap(self._datasets[job_id])
            self._epochs[job_id] += 1
            logger.debug("job %s: epoch %d starts", job_id, self._epochs[job_id])
        size = len(remaining)
        index = int(self._solo_rands[job_id]() * size)
        item = remaining[index if index < size else size - 1]
        remaining.remove(item)
        return item

    def _sample_alone(self, p: int, rand: Callable[[], float]) -> dict[str, int]:
        """The round of a single participant, at chain position p: x uniform in R_p, one draw
        (module docstring), then the update of the vertex or leaf that held x."""
        size = self._rsizes[p]
        index = int(rand() * size)
        item = self._rsets[p][index if index < size else size - 1]
        if item in self._leaves[p]:
            self._apply([(p, item, None)])
        else:
            inner = self._inner
            k = 0
            while item not in inner[k]:  # R_p = I_1 ⊔ ... ⊔ I_p ⊔ L_p: it is in one of them
                k += 1
            self._apply([(k, item, [p])])
        return {self._order[p]: item}

    def _apply(self, deliveries: list[tuple[int, int, list[int] | None]]) -> None:
        """The incremental update of the module docstring, for each delivery of the round."""
        rsets = self._rsets
        rsizes = self._rsizes
        inner = self._inner
        isizes = self._isizes
        leaves = self._leaves
        lsizes = self._lsizes
        n = len(rsets)
        for k, item, selected in deliveries:
            if selected is None:
                leaves[k].remove(item)
                lsizes[k] -= 1
                rsets[k].remove(item)
                rsizes[k] -= 1
                continue
            inner[k].remove(item)
            isizes[k] -= 1
            for p in selected:
                rsets[p].remove(item)
                rsizes[p] -= 1
            deepest = selected[-1]  # positions are visited in ascending order
            if deepest > k:
                chosen = set(selected)
                for m in range(k + 1, deepest):
                    if m not in chosen:
                        leaves[m].add(item)
                        lsizes[m] += 1
            # j_k is in H when it did not select: it keeps needing the item, in its leaf
            if selected[0] != k:
                leaves[k].add(item)
                lsizes[k] += 1
            if deepest + 1 < n:
                inner[deepest + 1].add(item)
                isizes[deepest + 1] += 1
