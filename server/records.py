"""The registry's records: sources, items in the cache's life cycle, job queues, passes, batches.

Plain data with no locking of their own: the `Registry` owns every instance and guards them all
with its one lock.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pyroaring import BitMap

from joader.sampling import DependentSampler
from joader.sources.imagefolder import SourceListing


class ItemState(enum.Enum):
    """Where an item is in its life. An `Item` exists while it is wanted, decoding, cached or bad.

    Transitions (every other one is a bug, and `Item.move` raises on it):

        WAITING  -> DECODING   a slot was found and the decode pool took the task
        DECODING -> READY      the decode landed in its slot (the cache policy now owns it)
        DECODING -> FAILED     the file could not be read or decoded (or hung / crashed twice)
        FAILED   -> WAITING    a round picked it again after `retry_failed_s`: retry the file
        (READY items leave by eviction, WAITING items when nobody wants them any more: the
        `Item` is then dropped, not moved.)

    SETTLED states are the ones a `Next` can hand out: the item's pixels, or its failure.
    """

    WAITING = "waiting"
    DECODING = "decoding"
    READY = "ready"
    FAILED = "failed"

    @property
    def settled(self) -> bool:
        return self in _SETTLED


_SETTLED = frozenset({ItemState.READY, ItemState.FAILED})
_TRANSITIONS = {
    ItemState.WAITING: frozenset({ItemState.DECODING}),
    ItemState.DECODING: frozenset({ItemState.READY, ItemState.FAILED}),
    ItemState.FAILED: frozenset({ItemState.WAITING}),
    ItemState.READY: frozenset(),
}


@dataclass
class Source:
    """A served source: its listing, its sampler and the ids of its items now in the cache."""

    name: str
    listing: SourceListing
    image_size: int
    key_base: int
    seed: int
    sampler: DependentSampler = field(init=False)
    cached_ids: BitMap = field(default_factory=BitMap)
    failed: dict[int, str] = field(default_factory=dict)  # item id -> reason, until it decodes
    job_ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sampler = DependentSampler(seed=self.seed)

    @property
    def num_items(self) -> int:
        return len(self.listing.paths)

    @property
    def item_nbytes(self) -> int:
        return 3 * self.image_size * self.image_size


class Item:
    """One item of one source, keyed by `source.key_base + item_id` in the registry."""

    __slots__ = ("failed_s", "item_id", "pins", "slot", "source", "state", "waiters")

    def __init__(self, source: Source, item_id: int) -> None:
        self.source = source
        self.item_id = item_id
        self.state = ItemState.WAITING
        self.slot = -1
        # Pins (queue entries and handed-out copies) while the item is not READY; once READY the
        # cache policy holds them, so that it never evicts a pinned item.
        self.pins = 0
        self.failed_s = 0.0  # when it last failed (clock of the registry)
        self.waiters: list[Job] = []  # jobs with this item queued, to wake when it settles

    def move(self, state: ItemState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise AssertionError(f"item {self.item_id}: no transition {self.state.name} -> {state.name}")
        self.state = state


class Entry:
    """One queued item of a job: which epoch of the job it belongs to."""

    __slots__ = ("epoch", "item_id", "key")

    def __init__(self, epoch: int, item_id: int, key: int) -> None:
        self.epoch = epoch
        self.item_id = item_id
        self.key = key


@dataclass
class Pass:
    """One pass of a client over a job: one `iter()` of the dataset, one epoch of the job.

    The DataLoader workers of one pass share its token; each worker is also known by its worker
    id and pid. A pass is *superseded* when a newer pass of the same job starts: its requests
    then fail with `PassSupersededError` instead of quietly ending.
    """

    token: int
    epoch: int
    members: dict[int, int] = field(default_factory=dict)  # worker id -> pid
    superseded: bool = False
    outstanding: Counter[int] = field(default_factory=Counter)  # key -> unacknowledged copies
    release_at_s: float | None = None  # superseded: release unacknowledged copies then


@dataclass
class Job:
    """One registered training job."""

    job_id: str
    name: str
    secret: bytes
    source: Source
    dataset: BitMap
    batch_size: int
    created_s: float
    last_seen_s: float
    queue: deque[Entry] = field(default_factory=deque)
    queue_capacity: int = 1
    sampler_epoch: int = 1  # the epoch the sampler is filling the queue with
    claimed_epoch: int = 0  # the epoch the client's current pass is reading
    passes: dict[int, Pass] = field(default_factory=dict)  # token -> pass, newest last
    current: Pass | None = None
    retired: dict[tuple[int, int], None] = field(default_factory=dict)  # (token, pid) of old passes
    handed: Counter[int] = field(default_factory=Counter)  # epoch -> items handed out or skipped
    abandoned: set[int] = field(default_factory=set)
    items_delivered: int = 0
    items_skipped: int = 0
    wait_s: float = 0.0
    # Called (under the registry's lock) when items of this job may have become ready; each
    # waiting `Next` registers one. They must not block.
    wakers: set[Callable[[], None]] = field(default_factory=set)
    on_removed: list[Callable[[str], None]] = field(default_factory=list)
    reading: bool = False  # rounds include a job from its first request for items on

    @property
    def num_items(self) -> int:
        return len(self.dataset)

    def wake(self) -> None:
        for waker in list(self.wakers):
            waker()


@dataclass(frozen=True)
class Batch:
    """What one `Next` returns: ready items of one epoch, or the end of that epoch."""

    epoch: int
    end_of_epoch: bool
    item_ids: list[int]
    labels: list[int]
    offsets: list[int]
    failed: list[tuple[int, str, str]]  # (item id, relative path, reason)


@dataclass(frozen=True)
class NextArgs:
    """One `Next` request, as the registry sees it."""

    job_id: str
    secret: bytes
    token: int
    max_items: int
    acks: tuple[int, ...] = ()
    worker_id: int = 0
    pid: int = 0


@dataclass
class NextCall:
    """A `Next` in progress: `Registry.begin_next`, then `poll_next` until a batch, `end_next`."""

    job: Job
    pass_: Pass
    max_items: int
    started_s: float
    deadline_s: float
    waker: Callable[[], None]
    linger_until_s: float | None = None
