"""The registry's records: sources, items in the cache's life cycle, job queues and batches.

Plain data with no locking of their own: the `Registry` owns every instance and guards them all
with its one lock.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field

from pyroaring import BitMap

from joader.sampling import DependentSampler
from joader.sources.imagefolder import SourceListing

# Item states. A state object exists while an item is wanted, decoding, cached, or known bad.
_WAITING = 0  # picked, waiting for a decode slot
_DECODING = 1
_READY = 2
_FAILED = 3

_MAX_TOKENS_PER_JOB = 8


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
    failed: dict[int, str] = field(default_factory=dict)
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
    __slots__ = ("source", "item_id", "state", "slot", "pins", "waiters")

    def __init__(self, source: Source, item_id: int) -> None:
        self.source = source
        self.item_id = item_id
        self.state = _WAITING
        self.slot = -1
        self.pins = 0  # pins taken before the item reached the cache policy
        self.waiters: list[Job] = []  # jobs with this item queued, to wake when it lands


class Entry:
    __slots__ = ("epoch", "item_id", "key")

    def __init__(self, epoch: int, item_id: int, key: int) -> None:
        self.epoch = epoch
        self.item_id = item_id
        self.key = key


@dataclass
class Job:
    """One registered training job."""

    job_id: str
    name: str
    source: Source
    dataset: BitMap
    batch_size: int
    created_s: float
    last_seen_s: float
    queue: deque[Entry] = field(default_factory=deque)
    queue_capacity: int = 1
    sampler_epoch: int = 1  # the epoch the sampler is filling the queue with
    claimed_epoch: int = 0  # the epoch the client's current pass is reading
    tokens: dict[int, int] = field(default_factory=dict)
    handed: Counter[int] = field(default_factory=Counter)  # epoch -> items handed out or skipped
    abandoned: set[int] = field(default_factory=set)
    outstanding: Counter[int] = field(default_factory=Counter)  # key -> unacknowledged copies
    items_delivered: int = 0
    items_skipped: int = 0
    wait_s: float = 0.0
    ready: threading.Condition = field(default_factory=threading.Condition)  # replaced in attach
    reading: bool = False  # rounds include a job from its first request for items on

    @property
    def num_items(self) -> int:
        return len(self.dataset)


@dataclass(frozen=True)
class Batch:
    """What one `Next` returns: ready items of one epoch, or the end of that epoch."""

    epoch: int
    end_of_epoch: bool
    item_ids: list[int]
    labels: list[int]
    offsets: list[int]
    failed: list[tuple[int, str, str]]  # (item id, relative path, reason)
