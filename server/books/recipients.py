"""Who received each cached copy: the books behind status's sharing figures and top's SHARED.

NOTE [ Who received a copy ]
A delivery counts as *reused* when the job received this very copy before (an earlier epoch
read it from the cache, or a padding copy), and as *shared* when another job received it first
(one decode served both): status's sharing figures. A job's copies that another job received
too, whichever came first, are counted per job as they become common (`with_others`: status's
`items_with_others`, top's SHARED; NOTE [ What SHARED means ] in client/tools/top.py): the job that
paid for a decode counts it once another job receives the copy. Each `Item` used to keep the set of the
jobs it went to, which grew with every job that ever read it and never shrank (+200 MiB over
31 jobs at 128k items). The cache keeps a bitmap of keys per live job instead, and one of
the keys some job received; an evicted key leaves them all (its next decode is a new copy),
and a job's bitmap goes with the job (`forget_job`).

Plain logic, no lock: the `ItemCache` that owns it is called under the registry's lock.
"""

from __future__ import annotations

from pyroaring import BitMap


class CopyRecipients:
    """Per cached key, which jobs received its current copy (NOTE [ Who received a copy ])."""

    def __init__(self) -> None:
        # keys whose current copy some job received, and per job the keys whose current copy it
        # received (until the copy is evicted or the job ends)
        self._served_any = BitMap()
        self._served_to: dict[str, BitMap] = {}
        self._served_many = BitMap()  # keys whose current copy two jobs or more received
        self.with_others: dict[str, int] = {}  # per job: its copies another job received too

    def deliver(self, job_id: str, key: int) -> tuple[bool, bool]:
        """A copy of `key` goes to a job: returns (reused, shared). Reused: the job received
        this copy before (an earlier epoch, or a padding copy); shared: another job received it
        first (one decode served both)."""
        served = self._served_to.get(job_id)
        if served is None:
            served = self._served_to[job_id] = BitMap()
        if key in served:
            return True, False
        served.add(key)
        if key in self._served_any:
            self._count_common(job_id, BitMap([key]))
            return False, True
        self._served_any.add(key)
        return False, False

    def deliver_many(self, job_id: str, got: BitMap) -> tuple[int, int]:
        """`deliver` for every key of `got` (distinct keys), in a few bitmap operations: returns
        how many were (reused, shared)."""
        served = self._served_to.get(job_id)
        if served is None:
            served = self._served_to[job_id] = BitMap()
        reused = got.intersection_cardinality(served)
        new = got - served
        served |= new
        common = new & self._served_any
        if common:
            self._count_common(job_id, common)
        self._served_any |= new
        return reused, len(common)

    def _count_common(self, job_id: str, common: BitMap) -> None:
        """`common`: keys `job_id` has just received whose copy another job received first. Each
        counts for `job_id`; a copy common for the first time counts also for the one job that
        had it."""
        first = common - self._served_many
        if first:
            for other, served in self._served_to.items():
                if other != job_id and (n := first.intersection_cardinality(served)):
                    self.with_others[other] = self.with_others.get(other, 0) + n
            self._served_many |= first
        self.with_others[job_id] = self.with_others.get(job_id, 0) + len(common)

    def evicted(self, key: int) -> None:
        """The copy of `key` is gone: a new decode is a new copy, which nobody received yet."""
        if key in self._served_any:
            self._served_any.discard(key)
            self._served_many.discard(key)
            for served in self._served_to.values():
                served.discard(key)

    def forget_job(self, job_id: str) -> None:
        """A job ended: its record of the copies it received goes (nothing grows with jobs)."""
        self._served_to.pop(job_id, None)
        self.with_others.pop(job_id, None)
