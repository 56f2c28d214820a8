"""The baseline: every job shuffles on its own, as PyTorch's RandomSampler does.

Each round, each participant draws one item uniformly from its own remaining set and removes it,
independently of the other jobs. That is a lazy Fisher-Yates shuffle: an epoch is a uniform
random permutation of the dataset, with no up-front cost and no memory beyond the remaining set.
Two jobs receive the same item in a round only by chance (probability |R1 ∩ R2| / (|R1| |R2|)),
which is what every sharing measurement compares DSA against.

Each job draws from its own stream: the `rng` given to add_job, or the sampler's. So a job with
an rng of its own gets picks that depend only on that stream and its own remaining sets, whoever
else takes part in its rounds. `independent=True` changes nothing else here (every job already
draws alone): it only gives a job without an rng a stream of its own.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Sequence

from pyroaring import AbstractBitMap, BitMap, FrozenBitMap

from joader.sampling.base import Sampler, copy_bitmap

logger = logging.getLogger(__name__)

__all__ = ["IndependentSampler"]


class IndependentSampler(Sampler):
    """Independent per-job uniform shuffles without replacement, with the `Sampler` API.

    `seed` (or `rng`) fixes the sampler's stream, used by the jobs added without an `rng`.
    """

    def __init__(self, seed: int | None = None, *, rng: random.Random | None = None) -> None:
        super().__init__()
        self._rng = rng if rng is not None else random.Random(seed)
        self._remaining: dict[str, BitMap] = {}
        self._sizes: dict[str, int] = {}
        self._rands: dict[str, Callable[[], float]] = {}  # the job's rng.random, or the sampler's

    def remaining(self, job_id: str) -> FrozenBitMap:
        return FrozenBitMap(self._remaining[self._known(job_id, "remaining")])

    def num_remaining(self, job_id: str) -> int:
        return self._sizes[self._known(job_id, "num_remaining")]

    def needs(self, job_id: str, item: int) -> bool:
        return item in self._remaining[self._known(job_id, "needs")]

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
        self._remaining[job_id] = first
        self._sizes[job_id] = len(first)
        if rng is None and independent:  # a stream of its own, as DependentSampler gives it
            rng = random.Random(self._rng.getrandbits(64))
        self._rands[job_id] = (rng if rng is not None else self._rng).random

    def remove_job(self, job_id: str) -> None:
        self._known(job_id, "remove_job")
        self._unregister(job_id)
        del self._remaining[job_id]
        del self._sizes[job_id]
        del self._rands[job_id]

    def reset_epoch(
        self, job_id: str, remaining: AbstractBitMap | Iterable[int] | None = None
    ) -> None:
        fresh = self._reset(job_id, remaining)
        self._remaining[job_id] = fresh
        self._sizes[job_id] = len(fresh)

    def sample(self, job_ids: Sequence[str]) -> dict[str, int]:
        if not job_ids:
            return {}
        sizes = self._sizes
        if len(set(job_ids)) != len(job_ids) or not all(j in sizes for j in job_ids):
            raise self._bad_participants(job_ids)
        if self._pending_start:
            self._start_pending(job_ids)
        remaining = self._remaining
        rands = self._rands
        picks: dict[str, int] = {}
        for job_id in job_ids:
            size = sizes[job_id]
            if not size:
                remaining[job_id] = copy_bitmap(self._datasets[job_id])
                size = len(remaining[job_id])
                self._epochs[job_id] += 1
            rset = remaining[job_id]
            index = int(rands[job_id]() * size)
            item = rset[index if index < size else size - 1]
            rset.remove(item)
            sizes[job_id] = size - 1
            picks[job_id] = item
        return picks
