"""What a rank's `Next` needs of its queue's head, kept as items settle: never rescanned per poll.

A waiting `Next` is polled again each time one of its items settles, and each poll asked two
questions of the rank's queue (server/registry/next_protocol.py): how many entries at its head are ready
to hand out (`ready`), and whether a failed item among the next entries is due for a retry
(`retry_candidates`). Both walked the queue, up to 1,024 entries, on every poll: 60% of joaderd's
GIL in a decoding epoch (issue 37). `HeadBook` answers both from what it learnt before.

NOTE [ A rank's ready head, kept as items settle ]
The queue changes at its head only where the Next protocol hands out (`HeadBook.popped`), at its
tail where rounds deal (appends), and wholesale where a queue is dropped (`Scheduler.drop_queue`
builds a new deque; `JobTable.forget` clears it). An entry's item, while the entry is pinned,
cannot leave the cache (a pinned READY item is never evicted, a pinned WAITING one never
cancelled, a FAILED one never dropped), and moves only forward (WAITING -> DECODING -> READY or
FAILED) except for a retry (FAILED -> WAITING, counted in `ItemCache.items_retried`). So:

- *ready*: `pos` head entries were seen to be of an older epoch or settled items of `epoch`
  (`count` of the latter). They stay so until a retry (any retry, anywhere: rare), a dropped
  queue, or an entry among them unpinned (its item may be evicted and decoded again): the
  rank's `pinned_low` (records.py) is the lowest `pinned` has been since the last look. The
  next poll carries on from `pos`: each entry is looked at about once while it waits.
- *failures*: the pinned entries were scanned once (up to `scanned`, an absolute index: entries
  handed out count in `popped`) for items FAILED at the time, `candidates`, in queue order. An
  item turns FAILED only by a decode failing (`ItemCache.decode_failures`): a new failure
  anywhere rescans (a failure costs one walk of each rank's pinned head, not every poll).
  A candidate whose item is no longer FAILED (retried) is dropped: if it fails again, that is
  a new failure and a rescan. Candidates are few; a poll looks at them only.

Any doubt (another queue object, another head entry, an unpinned entry among those looked at, a
retry, another epoch) starts the books over from the head: never wrong, at worst one walk.
The exact rules these keep are the brute-force walks tests/unit/server/registry/test_queue_heads.py
keeps as its reference (the old `_count_ready` and `_recheck_failures`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from joader.server.books.records import Entry, Item, ItemState

if TYPE_CHECKING:
    from joader.server.books.records import Rank

_FAILED = ItemState.FAILED


class HeadBook:
    """One rank's books of its queue's head (NOTE [ A rank's ready head, kept as items settle ])."""

    __slots__ = ("candidates", "count", "epoch", "failures", "head", "popped", "pos", "queue", "retries",
                 "scanned")

    def __init__(self) -> None:
        self.queue: deque[Entry] | None = None  # the queue object these books describe
        self.head: Entry | None = None  # its first entry when last looked at (None: it was empty)
        self.popped = 0  # entries handed out (or skipped) off its head: absolute index base
        self.epoch = 0  # the epoch `pos` and `count` are of
        self.retries = -1  # `ItemCache.items_retried` when `pos` was last valid
        self.pos = 0  # head entries known older or settled of `epoch`
        self.count = 0  # of those, entries of `epoch`
        self.failures = -1  # `ItemCache.decode_failures` when the candidates were scanned
        self.scanned = 0  # absolute index up to which pinned entries were scanned for failures
        self.candidates: list[tuple[int, Entry]] = []  # (absolute index, entry): item FAILED when scanned

    # ----------------------------------------------------------------------------- validity

    def check(self, rank: Rank) -> None:
        """Starts over if the queue changed under the books (NOTE above); call before use."""
        queue = rank.queue
        extent = max(self.pos, self.scanned - self.popped)
        if (queue is not self.queue or (self.head is not None and (not queue or queue[0] is not self.head))
                or rank.pinned_low < extent):
            self.queue = queue
            self.pos = self.count = 0
            self.scanned = self.popped
            self.candidates = []
            self.failures = -1
        self.head = queue[0] if queue else None
        rank.pinned_low = rank.pinned

    def popped_head(self, entry: Entry) -> None:
        """The Next protocol took `entry` off the head of the queue (call after each popleft)."""
        self.popped += 1
        if self.pos:
            self.pos -= 1
            if entry.epoch == self.epoch:
                self.count -= 1

    def popped_many(self, count: int, epoch: int) -> None:
        """`popped_head` for `count` entries of `epoch` taken off the head at once."""
        self.popped += count
        passed = min(count, self.pos)
        self.pos -= passed
        if epoch == self.epoch:
            self.count -= passed

    def after_pops(self, rank: Rank) -> None:
        """The head after the Next protocol's pops (they lowered `pinned` with the books)."""
        self.scanned = max(self.scanned, self.popped)
        self.head = rank.queue[0] if rank.queue else None
        rank.pinned_low = rank.pinned

    # ----------------------------------------------------------------------------- ready

    def ready(self, rank: Rank, items: dict[int, Item], epoch: int, limit: int, retries: int) -> int:
        """Entries at the head of the queue (of `epoch`, up to `limit`) that can be taken:
        settled and pinned. Older entries before them (an abandoned epoch's) are passed over."""
        self.check(rank)
        if epoch != self.epoch or retries != self.retries:
            self.epoch, self.retries = epoch, retries
            self.pos = self.count = 0
        pos, count = self.pos, self.count
        if count < limit:
            queue, pinned = rank.queue, rank.pinned
            while pos < pinned:
                entry = queue[pos]
                if entry.epoch < epoch:
                    pos += 1
                    continue
                if entry.epoch != epoch or not entry.item.state.settled:  # type: ignore[union-attr]
                    break
                pos += 1
                count += 1
                if count >= limit:
                    break
            self.pos, self.count = pos, count
        return min(count, limit)

    # ----------------------------------------------------------------------------- failures

    def retry_candidates(self, rank: Rank, items: dict[int, Item], failures: int,
                         any_failed: bool = True) -> list[tuple[int, Entry]]:
        """The pinned entries, in queue order, whose item is FAILED and that were not rechecked
        (with their position now); scans only the entries pinned since the last call, unless a
        decode failed since (`failures`: `ItemCache.decode_failures`). `any_failed`: whether
        any item is FAILED at all (`ItemCache.num_failed`); if none is, the new entries are
        passed over unread (none of them can be, and a failure later rescans them all)."""
        self.check(rank)
        if failures != self.failures:
            self.failures = failures
            self.scanned = self.popped
            self.candidates = []
        popped, pinned, queue = self.popped, rank.pinned, rank.queue
        start = self.scanned - popped
        if not any_failed and start < pinned:
            self.scanned = popped + pinned
            start = pinned
        if start < pinned:
            for pos in range(start, pinned):
                entry = queue[pos]
                if not entry.rechecked and items[entry.key].state is _FAILED:
                    self.candidates.append((popped + pos, entry))
            self.scanned = popped + pinned
        if not self.candidates:
            return []
        kept = [(index, entry) for index, entry in self.candidates
                if index >= popped and not entry.rechecked and items[entry.key].state is _FAILED]
        self.candidates = kept
        return [(index - popped, entry) for index, entry in kept]


def heads(rank: Rank) -> HeadBook:
    """The rank's `HeadBook`, made at first use."""
    book = rank.heads
    if book is None:
        book = rank.heads = HeadBook()
    return book
