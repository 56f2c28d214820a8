"""Probes: the exact sizes of items the cache will decode soon, read from their files' headers.

Besides decodes, the cache asks for the exact sizes of items it will decode soon (`probe`;
`joader.server.books.item_sizes`); a worker reads their files' headers (`run_probe` in
`joader.server.pool.worker`, no pixel decoded) and the sizes wait in the pool until the cache
takes them (`take_sizes`, under the registry's lock, when it next dispatches), so that each
decode can be given exactly its bytes. Probes go to the workers before queued decodes (a probe
of 16 files costs well under a millisecond, and the decodes behind it wait for its answer), are
never counted in `in_flight` (the registry's limit on decodes), and never fail: a probe whose
worker dies or times out, or that the pool cannot send any more, reports its items' sizes as 0
(unknown), and their decodes go size first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import count

from joader.errors import InvalidArgumentError
from joader.server.pool.records import Probe
from joader.server.pool.roster import Roster

__all__ = ["PROBE_BATCH", "Probing"]

PROBE_BATCH = 16  # items per probe message: small, so that the first sizes come back soon


class Probing:
    """The `DecodePool`'s part that takes probes and holds their answers (see the module
    docstring). State it owns: `queue` (probes not sent to a worker yet; sent before decodes),
    `_probe_ids`, `_sizes` ((source index, item id, bytes or 0), not taken yet). It works on the
    roster (`joader.server.pool.roster`) and asks the pool to `dispatch` what it queued."""

    def __init__(self, roster: Roster, dispatch: Callable[[], None]) -> None:
        self._roster = roster
        self._dispatch = dispatch
        self.queue: deque[Probe] = deque()  # not sent to a worker yet (sent before the roster's `pending`)
        self._probe_ids = count()
        self._sizes: list[tuple[int, int, int]] = []  # (source index, item id, bytes or 0), not taken yet

    def probe(self, source_index: int, item_ids: Sequence[int]) -> None:
        """Asks for the exact sizes of `item_ids` (read from their files' headers by a worker);
        they come back through `take_sizes`, 0 where not known. Never blocks; ignored once closed."""
        roster = self._roster
        if not 0 <= source_index < len(roster.sources):
            raise InvalidArgumentError(f"decode pool: no source with index {source_index}")
        num_items = len(roster.sources[source_index].source.paths)
        ids = tuple(int(i) for i in item_ids)
        if any(not 0 <= i < num_items for i in ids):
            raise InvalidArgumentError(f"decode pool: a probed item id is out of range 0..{num_items - 1}")
        with roster.lock:
            if roster.closed:
                return
            for start in range(0, len(ids), PROBE_BATCH):
                self.queue.append(Probe(next(self._probe_ids), source_index, ids[start:start + PROBE_BATCH]))
            self._dispatch()

    def take_sizes(self) -> list[tuple[int, int, int]]:
        """The probes' answers since the last call: (source index, item id, exact bytes or 0)."""
        with self._roster.lock:
            sizes, self._sizes = self._sizes, []
            return sizes

    def answered(self, probe: Probe, sizes: tuple[tuple[int, int], ...]) -> None:
        """A worker's answer to `probe`: (item id, bytes or 0) for each of its items."""
        self._sizes.extend((probe.source_index, item_id, nbytes) for item_id, nbytes in sizes)

    def drop(self, probe: Probe) -> None:
        """Its items' sizes are not known (0): their decodes get the stage's bound."""
        self._sizes.extend((probe.source_index, item_id, 0) for item_id in probe.item_ids)
