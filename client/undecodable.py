"""The job's items known to be undecodable now, so that `len(ds)` counts what an epoch yields.

joaderd skips a file that fails to decode (`on_error="skip"`): it reports the item in the
reply (`NextResponse.failed`) and the epoch yields one item fewer than the job has. `len(ds)`
counted it all the same (25 items, 24 each epoch), and a user's exactly-once check against
`len(ds)` failed. So every reader notes, per reply, the items that failed and the items that
were delivered, one byte per item of the source (`Undecodable`), and `len(ds)` leaves out the
items whose byte is set.

NOTE [ What len(ds) knows of undecodable files ]
An item is set when a reply reports it failed and cleared when a reply delivers it (its file
was fixed, and joaderd decoded it again after --retry-failed-s). Each epoch reaches every item
once, so once an epoch has ended the bytes hold exactly that epoch's failures, and `len(ds)`
is what it yielded; during the next epoch an item stays set until it is delivered. Before the
first reply that reports a file, nothing is known: `len(ds)` counts it (joaderd tries a file
only when a job's epoch reaches it). The bytes live in an anonymous shared mapping made before
any DataLoader worker forks, so the workers' readers write where the training process counts
(a byte per item: two workers never write the same byte, and no byte is read-modify-written).
Only a job of one process (or rank 0 under accelerate's dispatcher) uses it: the ranks of a DDP
job get other items each epoch, and a rank's count would be wrong in the next one.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["Undecodable"]


class Undecodable:
    """One byte per source item, 1 while the item is known to fail; byte 0 says whether any
    item ever failed (until then, a reply costs one byte's read)."""

    def __init__(self, num_items: int) -> None:
        self.num_items = num_items
        self._map = mmap.mmap(-1, num_items + 1)  # MAP_SHARED | MAP_ANONYMOUS: forked workers share it
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    def note(self, failed: Iterable[int], delivered: Iterable[int]) -> None:
        """A reply's failed and delivered items."""
        failed_ids = [i for i in failed if i < self.num_items]
        if failed_ids:
            self._bytes[np.asarray(failed_ids, dtype=np.int64) + 1] = 1
            self._bytes[0] = 1
        if self._bytes[0]:
            ids = np.fromiter(delivered, dtype=np.int64)
            ids = ids[ids < self.num_items]
            self._bytes[ids + 1] = 0

    def count(self) -> int:
        """Items known to fail now."""
        return int(np.count_nonzero(self._bytes[1:])) if self._bytes[0] else 0

    def __getstate__(self) -> dict[str, Any]:
        # A spawned DataLoader worker (pickled dataset) gets a mapping of its own: what it
        # learns stays there (NOTE [ What len(ds) knows of undecodable files ]).
        return {"num_items": self.num_items}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["num_items"])  # type: ignore[misc]
