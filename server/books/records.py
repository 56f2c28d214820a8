"""The registry's records: sources, items in the cache's life cycle, jobs, ranks, passes.

Plain data with no locking of their own: the `Registry` owns every instance and guards them all
with its one lock. Who changes what: `ItemCache` (item_cache.py) moves items and their pins;
`JobTable` (jobs.py) owns jobs, ranks, passes and leases; `Scheduler` (scheduler.py) fills the
ranks' queues from DSA rounds. The Next call's own records (its arguments, the call in
progress, the batch it returns) are beside the Next protocol: `joader.server.registry.next_call`.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pyroaring import BitMap

from joader.sampling import DependentSampler
from joader.server.books.pacing import RateMeter


class ItemState(enum.Enum):
    """Where an item is in its life. An `Item` exists while it is wanted, decoding, cached or bad.

    Transitions (every other one is a bug, and `Item.move` raises on it):

        WAITING  -> DECODING   a slot was found and the decode pool took the task
        DECODING -> READY      the decode landed in its slot (the cache policy now owns it)
        DECODING -> FAILED     the file could not be read or decoded (or hung / crashed twice)
        DECODING -> WAITING    the decode settled nothing: a size to place exactly (size first),
                               or a read held for its source's verdict
        FAILED   -> WAITING    after `retry_failed_s`: a round picked it again, or a `Next` (or
                               a new pass) reached a copy queued before then: retry the file
        (READY items leave by eviction, WAITING items when nobody wants them any more: the
        `Item` is then dropped, not moved.)

    SETTLED states are the ones a `Next` can hand out: the item's pixels, or its failure.
    """

    settled: bool  # a plain attribute of each member, set below (not a member itself)

    WAITING = "waiting"
    DECODING = "decoding"
    READY = "ready"
    FAILED = "failed"


# NOTE: `settled` is read for every queue entry a `Next` looks at (issue 37). As a property it
# tested membership in a set of members, and an Enum member's `__hash__` is Python code in 3.11:
# 105 ns a read; an attribute is 3 ns.
for _state in ItemState:
    _state.settled = _state is ItemState.READY or _state is ItemState.FAILED
del _state
_TRANSITIONS = {
    ItemState.WAITING: frozenset({ItemState.DECODING}),
    ItemState.DECODING: frozenset({ItemState.READY, ItemState.FAILED, ItemState.WAITING}),
    ItemState.FAILED: frozenset({ItemState.WAITING}),
    ItemState.READY: frozenset(),
}


@dataclass
class Source:
    """A served source: its items (any `ItemSource`), its shared stage, its sampler, and the ids
    of its items now in the cache."""

    name: str
    listing: Any  # joader.sources.base.ItemSource: paths, labels, classes, root, read()
    stage: Any  # joader.stages.Stage: name, spec (shape or None, dtype, max_nbytes), prepare()
    key_base: int
    seed: int
    sampler: DependentSampler = field(init=False)
    cached_ids: BitMap = field(default_factory=BitMap)
    # zlib.crc32 of each READY item's bytes as its decode wrote them (clients may verify), by
    # item id: one array per source from its first decode, not an int object per cached item.
    checksums: np.ndarray | None = field(default=None, compare=False, repr=False)
    # Each item's offset in the arena while it is DECODING or READY (-1: none), by item id, the
    # same way (NOTE [ An item's footprint ]): `Item.offset` reads and writes it.
    offsets: np.ndarray | None = field(default=None, compare=False, repr=False)
    failed: dict[int, str] = field(default_factory=dict)  # item id -> reason, until it decodes
    job_ids: list[str] = field(default_factory=list)
    small_items: int = 0  # items smaller than the stage's size (served as they are, not upscaled)
    jobs_attached: int = 0  # jobs created on this source without a seed (each gets one from it)
    # (job a, job b) with a < b -> [rounds both took part in, rounds that gave both one item]
    pair_rounds: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    # pairs with a removed job, newest last: (name a, name b, rounds, shared, bound)
    pair_history: dict[tuple[str, str], tuple[str, str, int, int, float]] = field(default_factory=dict)

    # Rounds held for a job behind (server/scheduling/in_step.py): since when (None: not held), how
    # often, and for how long in all (status: `holds`, `held_s`).
    held_since_s: float | None = None
    holds: int = 0
    held_s: float = 0.0

    # joaderd's --epoch-align (joader.sampling.dependent, "Epoch alignment")
    epoch_align: str = "first"
    # Its health on disk (joader.server.books.source_watch.SourceWatch): set by joaderd; None in
    # tests that build a registry without the checker (reads then fail as they come).
    watch: Any = None

    def __post_init__(self) -> None:
        self.sampler = DependentSampler(seed=self.seed, align=self.epoch_align)

    @property
    def num_items(self) -> int:
        return len(self.listing.paths)

    @functools.cached_property
    def fingerprint(self) -> str:
        """What a client resuming after a restart checks: the same items, labels and stage.
        A digest of the item count, every path and label, and the stage's spec; computed once
        (about a second per million items), at the first attach."""
        digest = hashlib.sha256(f"{self.num_items}\0{self.stage.name}\0".encode())
        for path in self.listing.paths:
            digest.update(os.fsencode(path) + b"\0")
        digest.update(np.ascontiguousarray(self.listing.labels, dtype="<i8").tobytes())
        return f"{self.num_items}:{self.stage.name}:{digest.hexdigest()[:32]}"

    @property
    def max_item_bytes(self) -> int:
        """What a decode of this source may need, allocated before it (shrunk after)."""
        return int(self.stage.spec.max_nbytes)


class Item:
    """One item of one source, keyed by `source.key_base + item_id` in the registry.

    One per item joaderd holds, hundreds of thousands at once: its state is kept to a few slots
    of shared or small values (NOTE [ An item's footprint ]).
    """

    __slots__ = ("due_s", "form", "key", "pins", "source", "state")

    def __init__(self, source: Source, item_id: int, key: int | None = None) -> None:
        self.source = source
        # `key`: the caller's own int (the cache's dict key), so that both share one object;
        # `item_id` is computed from it
        self.key = source.key_base + item_id if key is None else key
        self.state = ItemState.WAITING
        # Once READY: (size in bytes, shape, dtype), one tuple shared by every item of that form
        # (`ItemCache` interns them): a reply reads it once per item (`nbytes`, `shape`, `dtype`).
        self.form: Form = NO_FORM
        # Queue entries and handed-out, unacknowledged copies, for the item's whole life (the
        # cache policy mirrors them while it is READY, so that it never evicts a pinned item).
        self.pins = 0
        self.due_s = NEVER_DUE  # while WAITING: when the first job queueing it will read it
        # Which jobs received this copy: `ItemCache.deliver` (per job, not per item); which jobs
        # wait for it to settle, and when it failed: `ItemCache.waiters`, `ItemCache.failed_at`.

    @property
    def item_id(self) -> int:
        """Its index in its source (`key` less the source's `key_base`)."""
        return self.key - self.source.key_base

    @property
    def nbytes(self) -> int:
        """Its size once READY (0 before)."""
        return self.form[0]

    @property
    def shape(self) -> tuple[int, ...]:
        """Its shape once READY (() before)."""
        return self.form[1]

    @property
    def dtype(self) -> str:
        """Its dtype's name once READY ("" before)."""
        return self.form[2]

    @property
    def offset(self) -> int:
        """Where its bytes are in the arena while DECODING or READY, else -1 (`Source.offsets`)."""
        offsets = self.source.offsets
        return int(offsets[self.key - self.source.key_base]) if offsets is not None else -1

    @offset.setter
    def offset(self, offset: int) -> None:
        source = self.source
        if source.offsets is None:
            if offset == -1:
                return
            source.offsets = np.full(source.num_items, -1, np.int64)
        source.offsets[self.key - source.key_base] = offset

    @property
    def checksum(self) -> int:
        """zlib.crc32 of its bytes as the decode wrote them, once READY (`Source.checksums`)."""
        checksums = self.source.checksums
        return int(checksums[self.key - self.source.key_base]) if checksums is not None else 0

    def move(self, state: ItemState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise AssertionError(f"item {self.item_id}: no transition {self.state.name} -> {state.name}")
        self.state = state


# NOTE [ An item's footprint ]
# joaderd holds an `Item` for every cached item: 1.28M of them for ImageNet. Each used to carry
# a set of the jobs its copy was delivered to (216 bytes empty, growing with every job that
# ever read it, and never shrinking), an empty waiters list, its own float for `due_s`, and a
# key int apart from the cache's dict key. Now: who received a copy is a bitmap per job in the
# cache (`ItemCache.deliver`, dropped with the job); the jobs waiting for it and when it failed
# are entries of the cache's dicts while they exist (`ItemCache.waiters`, `failed_at`: a few
# items at a time, not a slot each); `due_s` is the shared NEVER_DUE once the item settled; the
# key is the dict's own int, and the item id is computed from it; its size, shape and dtype are
# one tuple shared by the items of that form (`ItemCache` interns them); its offset and checksum
# are entries of arrays of its source (an int object per offset was 32 bytes and a slot, and a
# reply gathers them in one call). Six slots: 80 bytes an item with its object and GC headers
# (ten were 112).
NEVER_DUE = float("inf")
Form = tuple[int, tuple[int, ...], str]  # an item's (size in bytes, shape, dtype name)
NO_FORM: Form = (0, (), "")


class Entry:
    """One queued item of a job: which epoch of the job it belongs to.

    Only the first `Rank.pinned` entries of a queue pin their item (and ask for its decode);
    the rest are the rank's picks beyond its share of the cache, pinned when they come within
    it. `rechecked`: a failure this entry was dealt has been looked at again when its pass
    started or a `Next` reached it (a file is retried at most once per entry there, so a file
    that fails at once cannot loop).
    """

    __slots__ = ("epoch", "item", "item_id", "key", "rechecked")

    def __init__(self, epoch: int, item_id: int, key: int) -> None:
        self.epoch = epoch
        self.item_id = item_id
        self.key = key
        self.rechecked = False
        # Its item while the entry is pinned (`Scheduler.pin_ahead`), when it is the cache's
        # `items[key]`: a pinned item never leaves the cache (NOTE [ A rank's ready head, kept
        # as items settle ]). The Next protocol reads it without a lookup in a dict of every
        # cached item. None, or stale, while unpinned: read only within `Rank.pinned`.
        self.item: Item | None = None


@dataclass
class PassBook:
    """joaderd's books of one pass: who reads it, what each reader holds and was served.

    A pass is one `iter()` of a client's dataset in one rank, reading one epoch of the job (the
    client's own record of it is `joader.client.passes.Pass`). The DataLoader workers of one pass share its token; each worker is also known by its worker
    id and pid. A pass is *superseded* when a newer pass of the same job starts: its requests
    then fail with `PassSupersededError` instead of quietly ending.
    """

    token: int
    epoch: int
    members: dict[int, int] = field(default_factory=dict)  # worker id -> pid
    superseded: bool = False
    outstanding: Counter[int] = field(default_factory=Counter)  # key -> unacknowledged copies
    release_at_s: float | None = None  # superseded: release unacknowledged copies then
    held: Counter[int] = field(default_factory=Counter)  # worker id -> its unacknowledged copies
    asking: Counter[int] = field(default_factory=Counter)  # worker id -> its Next calls in progress
    # The DataLoader's turn (`dealing.turn`): how many workers read the pass, the
    # items each was dealt, and the workers whose part of the epoch ended.
    num_workers: int = 0
    served: Counter[int] = field(default_factory=Counter)
    ended: set[int] = field(default_factory=set)
    # Created for a pass a joaderd restart interrupted (`NextArgs.continue_epoch`): what each
    # worker was served, and whose part ended, is on the dead server, so no turn is kept.
    continued: bool = False


@dataclass
class Rank:
    """One rank of a job (a job of world size 1 has one): its queue, passes and epoch shares.

    The job's sampler picks are dealt to its ranks (`Scheduler`); each rank reads its own queue,
    one pass (one `iter()` of its dataset) per epoch, and holds its own lease.
    """

    index: int
    last_seen_s: float
    attached: bool = True  # its lease stream is open (ranks join a job one by one)
    closed: bool = False  # it closed its lease on purpose: done, its picks are not queued
    queue: deque[Entry] = field(default_factory=deque)
    claimed_epoch: int = 0  # the epoch its current pass reads
    # After a joaderd restart: the epoch its lease keeper reported (the client board's newest;
    # 0: it had received nothing). A pass interrupted by the restart continues at most this.
    reported_epoch: int = 0
    passes: dict[int, PassBook] = field(default_factory=dict)  # token -> pass, newest last
    current: PassBook | None = None
    retired: dict[tuple[int, int], None] = field(default_factory=dict)  # (token, pid) of old passes
    handed: Counter[int] = field(default_factory=Counter)  # epoch -> items handed out or skipped
    abandoned: set[int] = field(default_factory=set)  # epochs a newer pass cut short
    # Its part of the cache: `pinned` head entries of its queue plus `handed_out` copies (over
    # all its passes, not yet acknowledged) stay within `Job.cache_share` (Scheduler.pin_ahead).
    pinned: int = 0
    handed_out: int = 0
    last_read_s: float | None = None  # its last Next asking for items; None: it never asked
    # When its lease stream attached, and whether any request of its client came since: a rank
    # whose client sends none within its lease is removed (`JobTable.expire`).
    attached_s: float = 0.0
    requested: bool = False
    # What joaderd told it when it attached (`AttachResponse.notice`): another live job has its
    # name (NOTE [ Two live jobs of one name ] in jobs.py); "" when nothing.
    notice: str = ""
    # What its `Next` needs of the queue's head, kept as items settle (server/registry/queue_heads.py).
    heads: Any = None
    # The lowest `pinned` has been since `heads` last looked (see `Rank.pinned` below): an entry
    # unpinned meanwhile may have lost its item (evicted, decoded again).
    pinned_low: int = field(default=1 << 62, repr=False)


def _get_pinned(rank: Rank) -> int:
    return rank._pinned  # type: ignore[attr-defined, no-any-return]


def _set_pinned(rank: Rank, value: int) -> None:
    rank._pinned = value  # type: ignore[attr-defined]
    if value < rank.pinned_low:
        rank.pinned_low = value


# `Rank.pinned` keeps its low-water mark (`pinned_low`) whoever changes it (the scheduler pins
# and unpins, the Next protocol hands out): NOTE [ A rank's ready head, kept as items settle ]
# in queue_heads.py. Set after the class, so that the dataclass keeps `pinned` as a field.
Rank.pinned = property(_get_pinned, _set_pinned)  # type: ignore[assignment, method-assign]


@dataclass
class EpochShare:
    """How epoch `epoch` of a job is split between its ranks.

    `target[r]` items go to rank r (the same count for every rank, less what a rank consumed
    before a resume); picks are dealt to the rank furthest from its target, round-robin for a
    fresh epoch; once the sampler's epoch is over, ranks still short get padding copies of the
    epoch's first picks (as `DistributedSampler(drop_last=False)` repeats its first indices).
    """

    epoch: int
    target: list[int]
    assigned: list[int]
    head: list[int] = field(default_factory=list)  # the epoch's first picks, for padding
    complete: bool = False  # the sampler has picked all of it (padding done)

    def receiver(self) -> int | None:
        """The rank the next pick goes to, or None when every rank has its share (drop_last)."""
        target, assigned = self.target, self.assigned
        if len(target) == 1:  # world size 1, the common case: no walk (it runs twice a round)
            return 0 if target[0] > assigned[0] else None
        best, best_need = None, 0
        for rank, want in enumerate(target):
            if want - assigned[rank] > best_need:
                best, best_need = rank, want - assigned[rank]
        return best


@dataclass(frozen=True)
class RestShare:
    """A rank's share of an epoch whose rest was dealt anew to another layout of ranks (an
    elastic resume, NOTE [ An elastic resume ] in server/registry/resumes.py): `share` items,
    counted from a consumed set of `base` items; what the rank consumed beyond `base` since
    comes off it."""

    share: int
    base: int

    def target(self, consumed: int) -> int:
        """Items the rank still gets of the epoch, having consumed `consumed` of it."""
        return max(0, self.share - max(0, consumed - self.base))


@dataclass
class Resume:
    """A resumed epoch being gathered: each rank's readers report what they consumed.

    StatefulDataLoader restores each DataLoader worker's own state, so each worker reports
    only its own items; the epoch starts when every rank has `parts` reports, with the union.
    """

    epoch: int
    started_s: float = 0.0  # when its first report came (registry clock), for status
    parts: dict[int, int] = field(default_factory=dict)  # rank -> reports it expects
    reports: dict[tuple[int, int], BitMap] = field(default_factory=dict)  # (rank, worker) -> ids
    rest: dict[int, RestShare] = field(default_factory=dict)  # rank -> its share of a dealt-anew rest

    def complete(self, world_size: int) -> bool:
        return all(
            rank in self.parts and sum(1 for r, _ in self.reports if r == rank) >= self.parts[rank]
            for rank in range(world_size)
        )

    def consumed_by(self, rank: int) -> BitMap:
        union = BitMap()
        for (r, _), ids in self.reports.items():
            if r == rank:
                union |= ids
        return union


@dataclass
class Job:
    """One registered training job: one DSA job, read by `world_size` ranks."""

    job_id: str
    name: str
    secret: bytes
    source: Source
    dataset: BitMap
    batch_size: int
    created_s: float
    world_size: int
    drop_last: bool
    seed: int
    rng: random.Random
    ranks: list[Rank]
    group_key: tuple[object, ...] = ()
    # joader.sampling.ORDERS: "shared" (its order is correlated with the other jobs' on the
    # source, to share rounds) or "independent" (its rounds are its own: DependentSampler,
    # "Independent jobs")
    order: str = "shared"
    # Its training process kept a core busy lately (joaderd's CPU meter, server/cpu_meter.py):
    # a round may wait for a job behind it (server/scheduling/in_step.py).
    cpu_bound: bool = False
    queue_capacity: int = 1  # per rank
    # Rounds fill a rank's queue up to this many entries (0: its capacity), beyond its capacity
    # where the cache has room, so that a reply can take several batches and the queue still
    # keep its capacity (NOTE [ Filling for replies of several batches ] in registry.py).
    queue_fill: int = 0
    reply_batches: int = 1  # the most batches its readers asked for in one reply
    partial_warned: bool = False  # logged once: the cache is too small for its whole batches
    # Items (of its source's largest size) of the cache each of its ranks may hold: queued
    # entries pinned ahead plus copies handed out and not yet acknowledged (Registry._resize_queues).
    cache_share: int = 1
    # A rank below this many queued items takes part in its source's rounds (NOTE [ Planning a
    # lagging job ahead ] in scheduler.py); a round runs once some rank is below queue_capacity.
    plan_horizon: int = 2
    copies_share: int = 1  # what its copies may take: see NOTE [ Room for a job that joins ]
    sampler_epoch: int = 1  # the epoch the sampler is filling the queues with
    shares: dict[int, EpochShare] = field(default_factory=dict)  # epoch -> its split
    sampler_abandoned: set[int] = field(default_factory=set)  # epochs the sampler gave up
    resume: Resume | None = None  # a resumed epoch still gathering its reports
    resumed_epoch: int = 0  # the last epoch that resumed (later reports of it are late)
    # Set when a lease keeper re-attached the job after joaderd restarted: rank -> (its board's
    # newest epoch, the items it received of it, its share of an elastic resume's rest). Decided once every rank attached
    # (`JobTable.settle_restart`, which sets `resumed_epoch`).
    restart_reports: dict[int, tuple[int, BitMap, RestShare | None]] | None = None
    restart_settled: bool = False
    items_delivered: int = 0
    items_reused: int = 0  # of those, copies this job had been delivered before (an earlier epoch)
    items_shared: int = 0  # of those, first deliveries of a copy another job had received first
    items_skipped: int = 0
    wait_s: float = 0.0  # time its `Next` calls waited in joaderd for a ready item
    stall: StallBook = field(default_factory=lambda: StallBook())
    # Called (under the registry's lock) when items of this job may have become ready; each
    # waiting `Next` registers one. They must not block.
    wakers: set[Callable[[], None]] = field(default_factory=set)
    # Its `Next`s waiting after a poll, by waker: the call and how many ready items at its
    # rank's head would change its answer (0: any change may); `NextProtocol.item_settled`.
    nexts_waiting: dict[Callable[[], None], tuple[Any, int]] = field(default_factory=dict)
    on_removed: list[Callable[[str], None]] = field(default_factory=list)
    reading: bool = False  # rounds include a job once all its ranks asked for items
    reading_since_s: float = 0.0  # when it started reading (registry clock)
    rate: RateMeter = field(default_factory=RateMeter)  # items/s delivered: decodes' due times

    @property
    def num_items(self) -> int:
        return len(self.dataset)

    @property
    def per_rank(self) -> int:
        """Items each rank gets in a whole epoch: ceil (padding) or floor (drop_last) of N / W."""
        if self.drop_last:
            return self.num_items // self.world_size
        return -(-self.num_items // self.world_size)

    @property
    def all_attached(self) -> bool:
        return all(rank.attached or rank.closed for rank in self.ranks)

    @property
    def claimed_epoch(self) -> int:
        return max(rank.claimed_epoch for rank in self.ranks)

    def wake(self) -> None:
        for waker in list(self.wakers):
            waker()


class StallBook:
    """The data stall of one job's training loop, as its readers report it (`NextRequest`'s
    stall fields): per epoch and reader (rank, pass token), the cumulative seconds spent inside
    `next()` waiting for data and between calls (the step). The stall fraction of an epoch is
    wait / (wait + step), summed over its readers. Only a reader in the training process
    (num_workers=0) measures it; DataLoader workers cannot see the training loop."""

    KEEP_EPOCHS = 8
    STUCK_S = 1.0  # an epoch's wait with no step yet that already says the loop is stalled

    def __init__(self) -> None:
        # epoch -> reader -> (wait s, step s, items yielded)
        self.epochs: dict[int, dict[tuple[int, int], tuple[float, float, int]]] = {}
        self._dropped = (0.0, 0.0, 0)  # totals of epochs no longer kept

    def report(self, epoch: int, reader: tuple[int, int], wait_s: float, step_s: float, items: int = 0) -> None:
        if epoch <= 0 or wait_s < 0 or step_s < 0 or items < 0:
            return
        self.epochs.setdefault(epoch, {})[reader] = (wait_s, step_s, items)
        while len(self.epochs) > self.KEEP_EPOCHS:
            oldest = min(self.epochs)
            self._dropped = _add(self._dropped, self.epoch(oldest))
            del self.epochs[oldest]

    def epoch(self, epoch: int) -> tuple[float, float, int]:
        """(wait s, step s, items) of `epoch`, over its readers."""
        total: tuple[float, float, int] = (0.0, 0.0, 0)
        for figures in self.epochs.get(epoch, {}).values():
            total = _add(total, figures)
        return total

    def total(self) -> tuple[float, float, int]:
        total = self._dropped
        for epoch in self.epochs:
            total = _add(total, self.epoch(epoch))
        return total

    @property
    def latest(self) -> int:
        """The newest epoch whose stall is known: one with a step measured, or one whose wait
        alone passed `STUCK_S` (a loop stuck waiting). An epoch just begun reports zeros with its
        first request (status showed none, between epochs), then its first batch's wait with
        no step yet (status showed 100% stall for a job that never waited long: issue 38)."""
        measured = []
        for epoch in self.epochs:
            wait_s, step_s, _ = self.epoch(epoch)
            if step_s > 0 or wait_s >= self.STUCK_S:
                measured.append(epoch)
        return max(measured, default=max(self.epochs, default=0))


def _add(a: tuple[float, float, int], b: tuple[float, float, int]) -> tuple[float, float, int]:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def stall_fraction(wait_s: float, step_s: float) -> float | None:
    return round(wait_s / (wait_s + step_s), 4) if wait_s + step_s > 0 else None
