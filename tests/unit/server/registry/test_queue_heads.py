"""A rank's ready head and failed entries, kept as items settle (server/registry/queue_heads.py), against
the brute-force walks they replace (`reference_count_ready`, `reference_recheck_failures`: the
Next protocol's code before issue 37), on seeded random sequences of events; and a poll that
looks at each waiting entry about once, not at the whole queue every time."""

from __future__ import annotations

import random
import threading
import types
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from joader.server.books.pacing import RateMeter
from joader.server.books.records import Entry, Item, ItemState, PassBook, Rank
from joader.server.registry.next_protocol import NextProtocol

pytestmark = pytest.mark.timeout(60)

RETRY_S = 10.0


class FakeCache:
    """The parts of `ItemCache` the Next protocol's head uses, with its counters and retry rule."""

    def __init__(self, clock: Callable[[], float], items: dict[int, Item] | None = None) -> None:
        self._clock = clock
        self.items: dict[int, Item] = {} if items is None else items
        self.retry_failed_s = RETRY_S
        self.items_retried = 0
        self.decode_failures = 0
        self.quarantine: set[int] = set()
        self.failed_at: dict[int, float] = {}  # `ItemCache.failed_at`: FAILED items only
        self.waiters: dict[int, list[Any]] = {}

    def add_waiter(self, item: Item, job: Any) -> None:
        self.waiters.setdefault(item.key, []).append(job)

    @property
    def num_failed(self) -> int:
        return sum(1 for item in self.items.values() if item.state is ItemState.FAILED)

    def quarantined(self, item: Item) -> bool:
        return item.key in self.quarantine

    def retry_due(self, item: Item, due_s: float) -> bool:
        if (item.state is not ItemState.FAILED or self._clock() - self.failed_at[item.key] < self.retry_failed_s
                or self.quarantined(item)):
            return False
        item.move(ItemState.WAITING)
        del self.failed_at[item.key]
        self.items_retried += 1
        return True

    def deliver_ready(self, job_id: str, keys: list[int]) -> tuple[int, int]:
        return 0, 0

    def unplan(self, key: int) -> None:
        pass

    def release(self, key: int) -> None:
        pass


class Protocol(NextProtocol):
    def __init__(self, cache: FakeCache, clock: Callable[[], float]) -> None:
        self.cache = cache  # type: ignore[assignment]
        self._clock = clock
        self._cond = threading.Condition()
        self._scheduler = types.SimpleNamespace(pin_ahead=lambda job, rank, now=None: False)  # type: ignore[assignment]
        self.items_delivered = self.items_reused = 0


SOURCE = types.SimpleNamespace(key_base=0, name="demo", failed=defaultdict(lambda: "bad file"), checksums=np.zeros(64, np.uint32),
                               offsets=np.zeros(64, np.int64),
                               listing=types.SimpleNamespace(labels=[0] * 64, paths=[f"f{i}" for i in range(64)]))


def make_job() -> Any:
    return types.SimpleNamespace(
        job_id="job", source=SOURCE, rate=RateMeter(), items_delivered=0, items_skipped=0, items_reused=0,
        items_shared=0, wakers=set(), wake=lambda: None, resume=None, shares={}, sampler_epoch=1,
        sampler_abandoned=set(), copies_share=1, queue_capacity=1)


def reference_count_ready(protocol: NextProtocol, rank: Rank, epoch: int, limit: int) -> int:
    """The walk `_count_ready` did before issue 37."""
    items = protocol.cache.items
    count = 0
    for position, entry in enumerate(rank.queue):
        if count >= limit or position >= rank.pinned:
            break
        if entry.epoch < epoch:
            continue
        if entry.epoch != epoch or not items[entry.key].state.settled:
            break
        count += 1
    return count


def reference_recheck_failures(protocol: NextProtocol, job: Any, rank: Rank, epoch: int, limit: int) -> None:
    """The walk `_recheck_failures` did before issue 37."""
    items = protocol.cache.items
    now = protocol._clock()
    seen = 0
    for position, entry in enumerate(rank.queue):
        if position >= rank.pinned or seen >= limit:
            break
        if entry.epoch != epoch:
            if entry.epoch > epoch:
                break
            continue
        seen += 1
        item = items[entry.key]
        if item.state is ItemState.FAILED and not entry.rechecked and protocol.cache.retry_due(item, now):
            entry.rechecked = True
            protocol.cache.add_waiter(item, job)


class World:
    """One rank's queue, its items and the clock, driven by `apply`."""

    def __init__(self, items: dict[int, Item] | None = None) -> None:
        self.now = 0.0
        self.cache = FakeCache(lambda: self.now, items)
        self.protocol = Protocol(self.cache, lambda: self.now)
        self.rank = Rank(0, 0.0)
        self.job = make_job()
        self.pass_ = PassBook(token=1, epoch=1)

    def item(self, key: int) -> Item:
        item = self.cache.items.get(key)
        if item is None:
            item = self.cache.items[key] = Item(SOURCE, key)  # type: ignore[arg-type]
        return item

    def pinned_keys(self) -> set[int]:
        return {self.rank.queue[i].key for i in range(self.rank.pinned)}

    def apply(self, event: tuple[Any, ...]) -> Any:
        kind, *args = event
        rank, cache = self.rank, self.cache
        if kind == "append":
            epoch, keys = args
            rank.queue.extend(Entry(epoch, key, key) for key in keys)
        elif kind == "pin":
            for _ in range(min(args[0], len(rank.queue) - rank.pinned)):
                entry = rank.queue[rank.pinned]
                item = entry.item = self.item(entry.key)  # `Scheduler.pin_ahead` sets `Entry.item`
                if item.state is ItemState.FAILED and self.now - cache.failed_at[item.key] >= RETRY_S:
                    item.move(ItemState.WAITING)  # `ItemCache.want` retries it
                    del cache.failed_at[item.key]
                    cache.items_retried += 1
                rank.pinned += 1
        elif kind == "unpin":
            for _ in range(min(args[0], rank.pinned)):
                rank.pinned -= 1
                key = rank.queue[rank.pinned].key
                item = cache.items.get(key)
                if item is not None and item.state is ItemState.READY and key not in self.pinned_keys():
                    del cache.items[key]  # evicted: decoded again when pinned again
        elif kind == "settle":
            key, ok = args
            item = cache.items.get(key)
            if item is None or key not in self.pinned_keys() or item.state.settled:
                return None
            if item.state is ItemState.WAITING:
                item.move(ItemState.DECODING)
            if ok:
                item.move(ItemState.READY)
            else:
                item.move(ItemState.FAILED)
                cache.failed_at[key] = self.now
                cache.decode_failures += 1
        elif kind == "retry":  # another job's round picked a failed item again
            item = cache.items.get(args[0])
            if item is not None and item.state is ItemState.FAILED:
                item.move(ItemState.WAITING)
                del cache.failed_at[item.key]
                cache.items_retried += 1
        elif kind == "clock":
            self.now += args[0]
        elif kind == "quarantine":
            cache.quarantine ^= {args[0]}
        elif kind == "drop":  # `Scheduler.drop_queue`: a new deque, the pinned ones still first
            (epoch,) = args
            kept: deque[Entry] = deque()
            pinned = 0
            for position, entry in enumerate(rank.queue):
                if entry.epoch != epoch:
                    kept.append(entry)
                    pinned += position < rank.pinned
            rank.queue, rank.pinned = kept, pinned
        elif kind == "clear":  # `JobTable.forget`
            rank.queue.clear()
            rank.pinned = 0
        elif kind == "epoch":
            self.pass_ = PassBook(token=self.pass_.token + 1, epoch=args[0])
        elif kind == "take":
            with self.protocol._cond:
                batch = self.protocol._take_ready(self.job, rank, self.pass_, args[0])
            return None if batch is None else (batch.item_ids, [f[0] for f in batch.failed])
        return None

    def state(self) -> tuple[Any, ...]:
        return (
            [(e.epoch, e.key, e.rechecked) for e in self.rank.queue], self.rank.pinned,
            sorted((k, i.state.name, self.cache.failed_at.get(k), len(self.cache.waiters.get(k, ())))
                   for k, i in self.cache.items.items()),
            self.cache.items_retried,
        )


def random_event(rng: random.Random, world: World) -> tuple[Any, ...]:
    queue = world.rank.queue
    tail = queue[-1].epoch if queue else world.pass_.epoch
    roll = rng.random()
    if roll < 0.15:
        epoch = tail + (rng.random() < 0.15)
        return ("append", epoch, [rng.randrange(40) for _ in range(rng.randrange(1, 12))])
    if roll < 0.3:
        return ("pin", rng.randrange(1, 10))
    if roll < 0.36:
        return ("unpin", rng.randrange(1, 6))
    if roll < 0.62:
        return ("settle", rng.randrange(40), rng.random() < 0.8)
    if roll < 0.66:
        failed = sorted(k for k, i in world.cache.items.items() if i.state is ItemState.FAILED)
        return ("retry", rng.choice(failed) if failed else 0)
    if roll < 0.74:
        return ("clock", rng.choice([0.5, 3.0, RETRY_S]))
    if roll < 0.77:
        return ("quarantine", rng.randrange(40))
    if roll < 0.785:
        return ("drop", rng.choice([world.pass_.epoch, tail]))
    if roll < 0.79:
        return ("clear",)
    if roll < 0.83:
        return ("epoch", rng.choice([world.pass_.epoch, tail, tail + 1]))
    return ("take", rng.randrange(1, 9))


@pytest.mark.parametrize("seed", range(12))
def test_the_books_answer_as_the_brute_force_walks(seed: int) -> None:
    rng = random.Random(seed)
    books, reference = World(), World()
    for _ in range(1500):
        event = random_event(rng, books)
        assert books.apply(event) == reference.apply(event), event
        epoch = books.pass_.epoch + rng.choice([0, 0, 0, -1, 1])
        for limit in (0, 1, 3, 8, 64):
            got = books.protocol._count_ready(books.rank, epoch, limit)
            assert got == reference_count_ready(reference.protocol, reference.rank, epoch, limit), (event, limit)
        limit = rng.choice([0, 1, 4, 16, 1000])
        books.protocol._recheck_failures(books.job, books.rank, epoch, limit)
        reference_recheck_failures(reference.protocol, reference.job, reference.rank, epoch, limit)
        assert books.state() == reference.state(), event


class CountingItems(dict):  # type: ignore[type-arg]
    """A cache's items that count how often an item is looked up."""

    lookups = 0

    def __getitem__(self, key: int) -> Item:
        CountingItems.lookups += 1
        return super().__getitem__(key)


def test_a_waiting_next_looks_at_each_entry_about_once_not_at_the_whole_queue_per_poll() -> None:
    """Issue 37: every poll of a waiting `Next` walked the rank's queue (1,024 entries) for
    failed items, and it is polled again each time one of its items settles: 60% of joaderd's
    GIL in a decoding epoch. 1,024 pinned entries settling one by one, a poll after each."""
    items = CountingItems()
    world = World(items)
    world.apply(("append", 1, list(range(1024))))
    world.apply(("pin", 1024))
    world.apply(("settle", 500, False))  # one failed item in the queue, not due yet
    CountingItems.lookups = 0
    for key in range(1024):
        world.apply(("settle", key, True))
        world.protocol._recheck_failures(world.job, world.rank, 1, 1024)
        world.protocol._count_ready(world.rank, 1, 256)
    assert CountingItems.lookups <= 5 * 1024, f"{CountingItems.lookups} item lookups for 1,024 polls"
