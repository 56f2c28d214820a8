"""The item cache: every item joaderd knows of, its state, its pins, its bytes, and eviction.

An `Item` exists from the round that first wants it until it is evicted (READY), dropped
unwanted (WAITING), or forever while it fails (FAILED, until retried). Its states and their
transitions are `ItemState` (records.py); this module is the only one that moves them.

Pins: `Item.pins` counts, for the item's whole life, every pinned queue entry (a rank pins the
head of its queue, within its share of the cache: `Scheduler.pin_ahead`) and every handed-out,
unacknowledged copy of it. While the item is READY the RefCnt policy is told of every pin and
unpin too (it must never choose a pinned victim), so `check_invariants` can compare both. The
policy's refcount of a READY item is the number of reads still to come that the jobs' books
know of: the jobs (of its source) that still need it in their current epoch, plus the queue
entries that hold it (`planned`); callers keep it current with `add_refcount`, `plan` and `unplan`.

NOTE [ Planned reads ]
A DSA round gives an item to every job that takes part, and it leaves their remaining sets at
once; the jobs read it later, each from its own queue. A job that lags reads it seconds after the
job that asked for its decode. Counting only the remaining sets, that item has refcount 0 the
moment the leader acknowledged it, the first victim, and the lagging job decodes it again: jobs
that drift apart lose their sharing exactly when it is worth most. So every queue entry counts as
a reference until it leaves its queue (handed out, skipped or dropped), pinned or not: an item
some queue will still read is evicted only after every item nobody will read, and among the
others (`RefCntPolicy.victim` with `Registry._reuse_hazard`) after the items whose next read is
only a draw from a remaining set.

Bytes: an item's range of the arena comes from a `ByteAllocator`, and a decode is given exactly
the item's bytes whenever they are known. When no hole fits, victims are evicted (RefCnt order)
until one does; with everything pinned, decoding waits for acknowledgements. Victims are chosen
by RefCnt weighted by the jobs' speeds when the registry sets `reuse_hazard` (`RefCntPolicy.victim`).

Exact sizes (`joader.server.books.item_sizes`): a decode is given exactly its item's bytes whenever
they are known: from the size memory, from a probe of the file's header, or, size first, from a
result that did not fit (the worker keeps the prepared item and the cache places it then).
`dispatch` chooses each decode's range (`range_kind`); `_capacity` books what each decode in
flight was given.

Plain logic, no lock: the `Registry` calls it under its own lock.
"""

from __future__ import annotations

import heapq
import logging
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pyroaring import AbstractBitMap, BitMap

from joader.cache.allocator import ByteAllocator
from joader.cache.interning import Interner
from joader.cache.policy import RefCntPolicy
from joader.errors import InvariantError
from joader.server.books import cache_audit
from joader.server.books.cache_records import DecodeSubmitter, Filed, Lookups, submit_together
from joader.server.books.item_sizes import ItemSizes, bound_is_nominal, range_kind
from joader.server.books.pacing import RateMeter
from joader.server.books.recipients import CopyRecipients
from joader.server.books.records import NEVER_DUE, Item, ItemState, Source

logger = logging.getLogger(__name__)

_MAX_SHARED = 1 << 16  # distinct forms (size, shape, dtype) shared between items (beyond: each its own)

class ItemCache:
    """Items, pins, arena bytes and the RefCnt policy of one joaderd (see the module docstring)."""

    def __init__(self, capacity_bytes: int, *, retry_failed_s: float, clock: Callable[[], float]) -> None:
        self.retry_failed_s = retry_failed_s
        self._clock = clock
        self.items: dict[int, Item] = {}
        self.policy = RefCntPolicy()
        self.allocator = ByteAllocator(capacity_bytes)
        self.capacity_bytes = self.allocator.capacity
        # key -> how soon some job reads the item again (set by the registry, which knows the
        # jobs' speeds): eviction by expected time to next use; None: plain RefCnt.
        self.reuse_hazard: Callable[[int], float] | None = None
        self._demand: list[tuple[float, int, int]] = []  # (due, round seq, key): earliest due first
        # What each queue entry found (`Lookups`), for the epoch its job reads and for later
        # epochs (lookahead); and what became of every requested decode.
        # key -> the queue entries that hold it (pinned or not): its planned reads. A READY item's
        # refcount counts them beside the jobs that still need it (NOTE [ Planned reads ]).
        self.planned: Counter[int] = Counter()  # (a Counter: `plan_many` adds in one C loop)
        self.lookups = Lookups()
        self.lookahead = Lookups()
        self.evictions = 0
        self.items_decoded = 0
        self.decode_rate = RateMeter()  # decodes landed per second: how fast the cache turns over
        self.decode_failures = 0
        self.decodes_cancelled = 0  # requested, then dropped: every job that wanted it left first
        self.items_retried = 0
        # decodes asked again when a queued copy of a failed item came up for use after
        # `retry_failed_s` (not a lookup: its entry was counted when it was queued)
        self.retried_at_use = 0
        self.decode_s = 0.0
        # Exact sizes (`joader.server.books.item_sizes`): the size memory, probes, misfits; and the
        # bytes each decode in flight was given.
        self.sizes = ItemSizes()
        self._capacity: dict[int, int] = {}  # key -> bytes allocated for its decode (DECODING items; 0: size first)
        self._dispatcher: tuple[DecodeSubmitter, int, Callable[[Source], int]] | None = None
        self.decodes_exact = 0  # decodes given exactly their item's bytes (known, or fixed-size)
        self.decodes_sized_first = 0  # sent with no range: prepared, kept, placed once its size came
        self.decodes_at_bound = 0  # given their stage's bound, shrunk when they land
        self.decodes_refitted = 0  # outgrew an exact size (the file changed): placed again
        # Status's figures, kept as items change (status is O(1) in the items, issue 37):
        # bytes of the READY items, items not settled, items with a pin, and all pins.
        self.ready_bytes = 0
        self._unsettled = 0
        self.num_failed = 0  # items in state FAILED (a rank's failed entries are looked for only if some)
        self.num_pinned = 0
        self.num_pins = 0
        # which jobs received each cached copy (NOTE [ Who received a copy ] in recipients.py)
        self.recipients = CopyRecipients()
        # key -> the jobs waiting for the item to settle (woken then: `take_waiters`); key -> when
        # a FAILED item last failed. A few items at a time: dicts, not a slot of every `Item`.
        self.waiters: dict[int, list[Any]] = {}
        self.failed_at: dict[int, float] = {}
        # The forms (size, shape, dtype) of cached items, one tuple per distinct form (`Item.form`,
        # NOTE [ An item's footprint ] in records.py); at most _MAX_SHARED of them.
        self._shared_values = Interner(_MAX_SHARED)

    # ----------------------------------------------------------------------------- wanting

    def want(self, source: Source, item_id: int, round_seq: int, *, consumed: bool,
             due_s: float = 0.0, ahead: bool = False) -> Item:
        """A queue entry now holds the item: pin it, counting what it found (`Lookups`).

        `consumed`: the pick took the item out of a job's remaining set, so a cached item loses
        one reference (False for a padding copy, which no remaining set held). `due_s`: when
        this queue will reach it (`joader.server.books.pacing`); decodes run earliest-due first, and
        an item several queues wait for is due at the earliest of their times. `ahead`: the
        entry is for an epoch after the one its job reads (counted apart, as lookahead).
        """
        lookups = self.lookahead if ahead else self.lookups
        key = source.key_base + item_id
        item = self.items.get(key)
        if item is None:
            item = self.items[key] = Item(source, item_id, key)
            self._unsettled += 1
            item.due_s = due_s
            heapq.heappush(self._demand, (due_s, round_seq, key))
            self.sizes.want(item)
            lookups.misses += 1
        elif item.state is ItemState.READY:
            if consumed:
                self.policy.add_refcount(key, -1)
            lookups.hits += 1
        elif item.state is ItemState.FAILED:
            if self._retry_allowed(item):
                # Failures are not forever: the file may have been fixed (or its storage come
                # back) since. Jobs that queued it meanwhile wait for this decode.
                self._move(item, ItemState.WAITING)
                item.due_s = due_s
                heapq.heappush(self._demand, (due_s, round_seq, key))
                self.sizes.want(item)
                self.items_retried += 1
                lookups.misses += 1
            else:
                lookups.failed += 1
        else:
            lookups.joined += 1
            if item.state is ItemState.WAITING and due_s < item.due_s:
                # needed sooner than its first queue thought: a second entry, earlier (the later
                # one is skipped once the item is no longer WAITING)
                item.due_s = due_s
                heapq.heappush(self._demand, (due_s, round_seq, key))
        self.pin(item)
        return item

    def retry_due(self, item: Item, due_s: float) -> bool:
        """Decodes a FAILED item again if `retry_failed_s` has passed since it failed; True if so.

        For a queued copy that comes up for use (its pass starts, or a `Next` reaches it): the
        entry was queued while the item was failed, perhaps an epoch ahead, and that decision
        is old by now. The file may have been fixed since; it is tried again, and every queue
        holding the item waits for that decode.
        """
        if item.state is not ItemState.FAILED or not self._retry_allowed(item):
            return False
        self._move(item, ItemState.WAITING)
        item.due_s = due_s
        heapq.heappush(self._demand, (due_s, 0, item.key))
        self.sizes.want(item)
        self.items_retried += 1
        self.retried_at_use += 1
        return True

    def _retry_allowed(self, item: Item) -> bool:
        """Whether a FAILED item may be decoded again now: `retry_failed_s` has passed since it
        failed, and its file is not quarantined (it hung or crashed a decode worker twice and
        has not changed on disk since: joader.server.pool.quarantine)."""
        return self._clock() - self.failed_at[item.key] >= self.retry_failed_s and not self.quarantined(item)

    def quarantined(self, item: Item) -> bool:
        """Whether the decode pool holds the item's file in quarantine (a pool without
        `is_quarantined` quarantines nothing)."""
        if self._dispatcher is None:
            return False
        pool, _, source_index = self._dispatcher
        check = getattr(pool, "is_quarantined", None)
        return bool(check is not None and check(source_index(item.source), item.item_id))

    def consume_unqueued(self, source: Source, item_id: int) -> None:
        """A pick nobody receives (drop_last) left a job's remaining set: one reference less."""
        key = source.key_base + item_id
        item = self.items.get(key)
        if item is not None and item.state is ItemState.READY:
            self.policy.add_refcount(key, -1)

    def plan(self, key: int, *, moved: bool = False) -> None:
        """A queue entry now holds `key`: one more planned read (NOTE [ Planned reads ]).
        `moved`: the read moved from a job's remaining set into its queue, so the refcount,
        which counts both, stays as it is."""
        self.planned[key] = self.planned.get(key, 0) + 1
        if moved:
            return
        item = self.items.get(key)
        if item is not None and item.state is ItemState.READY:
            self.policy.add_refcount(key, 1)

    def plan_many(self, keys: list[int]) -> None:
        """`plan(key, moved=True)` for each of `keys`: picks that left their jobs' remaining sets
        for their queues (a batch's drawn rounds: `Scheduler._deal_drawn`)."""
        self.planned.update(keys)

    def unplan(self, key: int) -> None:
        """A queue entry of `key` left its queue (handed out, skipped or dropped)."""
        count = self.planned.pop(key, 0)  # (dict's own: a Counter's `del` is Python code)
        if count <= 0:
            raise InvariantError(f"item key {key}: a planned read ended that was never planned")
        if count > 1:
            self.planned[key] = count - 1
        item = self.items.get(key)
        if item is not None and item.state is ItemState.READY:
            self.policy.add_refcount(key, -1)

    def _move(self, item: Item, state: ItemState) -> None:
        """`item.move`, keeping the count of items not settled (and `failed_at` to FAILED items)."""
        settled = item.state.settled
        if item.state is ItemState.FAILED:
            del self.failed_at[item.key]
        self.num_failed += (state is ItemState.FAILED) - (item.state is ItemState.FAILED)
        item.move(state)
        self._unsettled += settled - state.settled

    def add_waiter(self, item: Item, job: Any) -> None:
        """`job` waits for the (unsettled) item: woken when it settles (`take_waiters`)."""
        waiting = self.waiters.get(item.key)
        if waiting is None:
            self.waiters[item.key] = [job]
        else:
            waiting.append(job)

    def take_waiters(self, key: int) -> list[Any]:
        """The jobs waiting for `key`, no longer waiting."""
        return self.waiters.pop(key, None) or []

    def pin(self, item: Item) -> None:
        if not item.pins:
            self.num_pinned += 1
        item.pins += 1
        self.num_pins += 1
        if item.state is ItemState.READY:
            self.policy.pin(item.key)

    def want_ready(self, items: list[Item], ahead: int) -> None:
        """`want(..., consumed=False)` for queue entries whose items are all READY (cache hits;
        `ahead` of them for a later epoch than their job reads): their pins, the policy's in
        bulk (`RefCntPolicy.pin_many`). All or nothing: the policy's check comes first.

        NOTE: a rank pins its queue's head in runs of tens to hundreds of entries (after a batch
        of rounds, or acknowledgements), nearly all hits in a warm epoch; `want` and `pin` per
        entry were a tenth of joaderd's main-process CPU per warm delivery (issue 37)."""
        self.policy.pin_many([item.key for item in items])
        self.lookahead.hits += ahead
        self.lookups.hits += len(items) - ahead
        first = 0
        for item in items:
            if not item.pins:
                first += 1
            item.pins += 1
        self.num_pinned += first
        self.num_pins += len(items)

    def release(self, key: int) -> None:
        """Drops one pin of `key` (a queue entry or a handed-out copy)."""
        item = self.items.get(key)
        if item is None:
            return
        self._drop_pin(item)
        if item.state is ItemState.READY:
            self.policy.unpin(key)

    def _drop_pin(self, item: Item) -> None:
        if item.pins <= 0:
            raise InvariantError(f"item {item.item_id}: released more often than pinned")
        item.pins -= 1
        self.num_pins -= 1
        if not item.pins:
            self.num_pinned -= 1

    def release_many(self, keys: list[int]) -> None:
        """`release` for each key, in order: the items' pins one by one, the policy's in bulk
        (`RefCntPolicy.unpin_many`: the keys whose last pin goes become evictable, youngest
        last, as one by one)."""
        items, ready = self.items, ItemState.READY
        unpinned: list[int] = []
        dropped = emptied = 0  # `_drop_pin`'s counts, inline (it ran once per acknowledged copy)
        try:
            for key in keys:
                item = items.get(key)
                if item is None:
                    continue
                pins = item.pins
                if pins <= 0:
                    raise InvariantError(f"item {item.item_id}: released more often than pinned")
                item.pins = pins - 1
                dropped += 1
                emptied += pins == 1
                if item.state is ready:
                    unpinned.append(key)
        finally:
            self.num_pins -= dropped
            self.num_pinned -= emptied
            self.policy.unpin_many(unpinned)

    @property
    def with_others(self) -> dict[str, int]:
        """Per job, its copies another job received too (`CopyRecipients.with_others`)."""
        return self.recipients.with_others

    def deliver(self, job_id: str, key: int) -> tuple[bool, bool]:
        """A READY item's copy goes to a job: returns (reused, shared) (`CopyRecipients.deliver`)."""
        return self.recipients.deliver(job_id, key)

    def deliver_ready(self, job_id: str, keys: list[int]) -> tuple[int, int]:
        """A reply's READY copies go to a job, and their queue entries end: `deliver` and
        `unplan` for each key, in a few bitmap and numpy operations for the whole reply.
        Returns how many were (reused, shared)."""
        if not keys:
            return 0, 0
        got = BitMap(array("I", keys))  # from an array: pyroaring builds from a list 10x slower
        if len(got) != len(keys):  # a padding copy twice in one reply: one by one, in order
            reused = shared = 0
            for key in keys:
                was_reused, was_shared = self.deliver(job_id, key)
                reused += was_reused
                shared += was_shared
                self.unplan(key)
            return reused, shared
        reused, shared = self.recipients.deliver_many(job_id, got)
        planned = self.planned
        pop = planned.pop  # dict's own methods: a Counter's `del` is Python code
        for key in keys:  # `unplan`'s count, inline (each key was planned: it was queued)
            count = pop(key, 0)
            if count <= 0:
                raise InvariantError(f"item key {key}: a planned read ended that was never planned")
            if count > 1:
                planned[key] = count - 1
        self.policy.add_refcounts(np.fromiter(keys, np.int64, len(keys)), -1)  # all READY
        return reused, shared

    def forget_job(self, job_id: str) -> None:
        """A job ended: its record of the copies it received goes (nothing grows with jobs)."""
        self.recipients.forget_job(job_id)

    def add_refcount(self, source: Source, ids: AbstractBitMap, delta: int) -> None:
        """Every cached item of `ids` gains (or loses) `delta` references: a few bitmap and
        numpy operations however many items (`RefCntPolicy.add_refcounts`)."""
        cached = source.cached_ids & ids
        if cached:
            keys = np.frombuffer(cached.to_array(), dtype=np.uint32).astype(np.int64)
            self.policy.add_refcounts(keys + source.key_base, delta)

    # ----------------------------------------------------------------------------- decoding

    def dispatch(self, pool: DecodeSubmitter, limit: int, source_index: Callable[[Source], int]) -> None:
        """Hands waiting items to the pool, earliest due first, while fewer than `limit` slots'
        worth run, each given exactly its bytes when known (`range_kind`); takes the probes'
        answers first and asks for the sizes of items that started waiting since.

        A slot is `pool.tasks_per_slot` decodes (1 for a pool without it), and the decodes of one
        call go to the pool together (`submit_many`): NOTE [ Decode tasks in batches ] in
        joader.server.pool.batching."""
        self._dispatcher = (pool, limit, source_index)
        self.sizes.probe(pool, source_index, self.items)
        demand = self._demand
        if not demand:
            return
        per_slot, in_flight = getattr(pool, "tasks_per_slot", 1), pool.in_flight
        room = limit * per_slot - in_flight
        busy_at = pool.num_workers * per_slot  # every worker has a slot of decodes
        batch: list[tuple[int, int, int, int, int]] = []
        try:
            while demand and len(batch) < room:
                key = demand[0][2]
                item = self.items.get(key)
                if item is None or item.state is not ItemState.WAITING:
                    heapq.heappop(demand)
                    continue
                if item.pins == 0:  # every job that wanted it left before it was decoded
                    heapq.heappop(demand)
                    del self.items[key]
                    self.waiters.pop(key, None)
                    self._unsettled -= 1
                    self.sizes.fitted(key)
                    self.decodes_cancelled += 1
                    continue
                how, nbytes, offset = self._place(item, busy=in_flight + len(batch) >= busy_at,
                                                  can_size_first=getattr(pool, "sizes_first", False))
                if offset is None:
                    return  # its size is coming while every worker is busy; or everything cached is pinned
                heapq.heappop(demand)
                self._move(item, ItemState.DECODING)
                item.offset = offset
                self._capacity[key] = nbytes
                if how == "exact":
                    self.decodes_exact += 1
                elif how == "sized_first":
                    self.decodes_sized_first += 1
                else:
                    self.decodes_at_bound += 1
                batch.append((key, source_index(item.source), item.item_id, max(offset, 0), nbytes))
        finally:
            if batch:
                submit_together(pool, batch)

    def _place(self, item: Item, *, busy: bool, can_size_first: bool) -> tuple[str, int, int | None]:
        """How a waiting item is decoded (`range_kind`): (how, bytes given, offset: -1 for
        none yet (size first), None if it cannot go now (its size is coming while every
        worker is busy; or every cached item is pinned))."""
        source = item.source
        known = self.sizes.known(source, item.item_id)
        how = range_kind(
            known=known, misfits=self.sizes.misfits(item.key),
            size_coming_while_busy=busy and self.sizes.probing(item.key),
            can_size_first=can_size_first and not known and not bound_is_nominal(source))
        if how == "exact":
            return how, known, self._allocate(known)
        if how == "wait":
            return how, 0, None
        if how == "sized_first":
            return how, 0, -1  # no range yet: the result says its size
        bound = source.max_item_bytes
        return how, bound, self._allocate(bound)

    # ----------------------------------------------------------------------------- sizes

    def known_size(self, source: Source, item_id: int) -> int:
        """The item's exact bytes if known, else 0 (`ItemSizes.known`)."""
        return self.sizes.known(source, item_id)

    def _allocate(self, nbytes: int) -> int | None:
        """A range of `nbytes`, evicting in RefCnt order until a hole fits; None when every
        cached item is pinned (or `nbytes` exceeds the whole arena)."""
        allocator = self.allocator
        offset = allocator.allocate(nbytes)
        while offset is None:
            victim = self.policy.victim(self.reuse_hazard)
            if victim is None:
                return None
            self._evict(victim)
            offset = allocator.allocate(nbytes)
        return offset

    def _evict(self, key: int) -> None:
        self.policy.remove(key)
        item = self.items.pop(key)
        self.ready_bytes -= item.nbytes
        self.recipients.evicted(key)  # the copy is gone: a new decode is a new copy
        item.source.cached_ids.discard(item.item_id)
        self.allocator.free(item.offset)
        item.offset = -1  # an entry of its source's array, which the item's next copy reads
        self.evictions += 1

    def file_result(self, key: int, ok: bool, error: str | None, decode_s: float,
                    refcount: Callable[[Item], int], *, shape: tuple[int, ...] = (),
                    dtype: str = "uint8", nbytes: int = 0, checksum: int = 0) -> Filed:
        """Files a finished decode; returns the item settled (none for a key nobody waits for,
        or an item that waits again: NOTE [ The filer dispatches ]).

        `refcount(item)` counts the jobs that still need it, for the policy; `shape`, `dtype`
        and `nbytes` describe what the worker wrote at the item's offset. A result that is not
        ok with `nbytes` larger than the item was given is a size (`file_size`), filed as such.
        """
        item = self.items.get(key)
        if item is None or item.state is not ItemState.DECODING:
            logger.warning("decode result for unknown item key %d ignored", key)
            return Filed()
        if not ok and nbytes > self._capacity[key]:  # a size, reported through the generic call
            return self.file_size(key, nbytes, error, decode_s)
        source = item.source
        self.decode_s += decode_s
        capacity = self._capacity.pop(key)
        self.sizes.fitted(key)
        watch = source.watch
        if watch is not None:
            if not ok and watch.park(key, error):
                self._hold(item, capacity)
                return Filed(dispatch=True)  # not settled: its waiters wait on; its worker is free
            watch.settled(key, item.item_id, ok)
        if ok and not capacity:  # cannot happen: a worker writes nothing without a range
            ok, error = False, f"the decode of item {item.item_id} reported bytes written without a range"
        if ok:  # once per decode (issue 37): `_move` and `item_id` inline
            item_id = key - source.key_base
            item.state = ItemState.READY  # DECODING -> READY: one item less not settled
            self._unsettled -= 1
            item.form = self._shared_values.get((nbytes, tuple(shape), dtype))
            item.due_s = NEVER_DUE
            checksums = source.checksums
            if checksums is None:
                checksums = source.checksums = np.zeros(source.num_items, np.uint32)
            checksums[item_id] = checksum
            self.ready_bytes += nbytes
            self.allocator.shrink(item.offset, max(nbytes, 1))
            self.sizes.remember(source, item_id, nbytes)
            self.policy.insert(key, refcount(item), pinned=item.pins)
            source.cached_ids.add(item_id)
            if source.failed and source.failed.pop(item_id, None) is not None:
                logger.info("source %s: item %d decodes again", source.name, item_id)
            self.items_decoded += 1
            self.decode_rate.add(self._clock(), 1)
        else:
            self.decode_failures += 1
            self._move(item, ItemState.FAILED)
            self.failed_at[key] = self._clock()  # (after `_move`, which keeps `failed_at` to FAILED items)
            if capacity:
                self.allocator.free(item.offset)
            item.offset = -1
            source.failed[item.item_id] = error or "unknown error"
            logger.warning(
                "source %s: item %d could not be prepared and is skipped (%s): %s", source.name, item.item_id,
                "quarantined until its file changes" if self.quarantined(item)
                else f"retried after {self.retry_failed_s:g} s", error,
            )
        return Filed(item)

    def file_size(self, key: int, nbytes: int, error: str | None, decode_s: float) -> Filed:
        """Files a decode that did not fit its range (the pool's `NeedsBytes`): size first, or it
        outgrew the exact size it was given (its file changed since). Nothing was written and
        its worker keeps the array; the item waits for a decode again, placed exactly
        (`joader.server.books.item_sizes`). Nothing settles: its waiters wait on, and the filer
        dispatches (NOTE [ The filer dispatches ])."""
        item = self.items.get(key)
        if item is None or item.state is not ItemState.DECODING:
            logger.warning("decode result for unknown item key %d ignored", key)
            return Filed()
        source = item.source
        self.decode_s += decode_s
        capacity = self._capacity.pop(key)
        if capacity:
            self.allocator.free(item.offset)
            self.sizes.misfit(key)
            self.decodes_refitted += 1
            logger.info("source %s: item %d outgrew its size (%s); placing it again",
                        source.name, item.item_id, error)
        item.offset = -1
        self.sizes.remember(source, item.item_id, nbytes)
        self._rewait(item)
        heapq.heappush(self._demand, (item.due_s, 0, key))
        return Filed(dispatch=True)

    def dispatch_again(self) -> None:
        """`dispatch` again, as the last call asked (the filer's, after a decode that settled
        nothing: NOTE [ The filer dispatches ]); nothing before any dispatch."""
        if self._dispatcher is not None:
            self.dispatch(*self._dispatcher)

    def _rewait(self, item: Item) -> None:
        """A decode that settled nothing (a size; a read held for its source's verdict): the item
        waits again, no failure counted or reported (DECODING -> WAITING)."""
        self._move(item, ItemState.WAITING)

    def resync(self, expected_pins: dict[int, int], planned: dict[int, int], needed: Callable[[Item], int]) -> int:
        """Rewrites every item's pins, the planned reads and every cached item's refcount from
        the jobs' own books; returns how many items were corrected (`cache_audit.resync`)."""
        return cache_audit.resync(self, expected_pins, planned, needed)

    # ----------------------------------------------------------------------------- sources

    def _hold(self, item: Item, capacity: int) -> None:
        """A read failed while its source is in question (joader.server.books.source_watch): the item
        waits again, outside the decode queue, until `requeue` (no failure counted or reported)."""
        if capacity:
            self.allocator.free(item.offset)
        item.offset = -1
        self._rewait(item)  # it waits for its source's verdict (the filer dispatches: its worker is free)

    def requeue(self, keys: Sequence[int]) -> None:
        """Held items (`_hold`) go back into the decode queue, at their due time; those nobody
        wants any more are cancelled there."""
        for key in keys:
            item = self.items.get(key)
            if item is not None and item.state is ItemState.WAITING:
                heapq.heappush(self._demand, (item.due_s, 0, key))
                self.sizes.want(item)

    def drop_source(self, source: Source) -> int:
        """Evicts every cached, unpinned item of `source` (its data changed on disk); returns
        how many. Decodes in flight land later, with no job to read them, and go first when
        space is needed (refcount 0)."""
        base = source.key_base
        dropped = 0
        for item_id in list(source.cached_ids):
            item = self.items.get(base + item_id)
            if item is not None and item.state is ItemState.READY and not item.pins:
                self._evict(item.key)
                dropped += 1
        return dropped

    # ----------------------------------------------------------------------------- figures

    def items_bytes(self) -> int:
        """Bytes of the cached items themselves (the allocator's `used_bytes` adds alignment
        and the bounds of decodes in flight)."""
        return self.ready_bytes

    @property
    def decodes_requested(self) -> int:
        """Every decode asked for: decoded + failed + cancelled + in flight."""
        return self.lookups.misses + self.lookahead.misses + self.retried_at_use

    def decodes_in_flight(self) -> int:
        """Items waiting for a decode worker or being decoded."""
        return self._unsettled

    def pinned_items(self) -> int:
        return self.num_pinned

    def pins(self) -> int:
        return self.num_pins

    @property
    def capacities(self) -> dict[int, int]:
        """Key -> the bytes each decode in flight was given (0: size first); read-only."""
        return self._capacity

    def check_invariants(self, expected_pins: dict[int, int] | None = None,
                         needed: Callable[[Item], int] | None = None,
                         planned: dict[int, int] | None = None) -> None:
        """Raises AssertionError if the cache's books disagree (`cache_audit.check`; tests call
        it after every step)."""
        cache_audit.check(self, expected_pins, needed, planned)
