"""The item cache's small records (`joader.server.books.item_cache`): what it needs of the
decode pool (`DecodeSubmitter`), what filing one decode did and asks of the filer (`Filed`),
and what queue entries found when a job's queue took an item (`Lookups`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from joader.server.books.records import Item

__all__ = ["DecodeSubmitter", "Filed", "Lookups", "submit_together"]


class DecodeSubmitter(Protocol):
    """What the registry needs of the decode pool (the real one is `DecodePool`)."""

    num_workers: int

    @property
    def in_flight(self) -> int: ...

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None: ...

    # Optional (a pool without them gets no probes and no size-first tasks: an item's first
    # decode is then given its stage's bound):
    # sizes_first: bool   (submit takes capacity 0: the result says the size, `joader.server.books.item_sizes`)
    # def probe(self, source_index: int, item_ids: Sequence[int]) -> None
    # def take_sizes(self) -> list[tuple[int, int, int]]   (source index, item id, bytes or 0)
    # Optional too (a pool without them gets its decodes one `submit` each, one per slot):
    # tasks_per_slot: int   (decodes one slot of the registry's limit holds: NOTE [ Decode tasks
    #                        in batches ] in joader.server.pool.batching)
    # def submit_many(self, tasks: Sequence[tuple[int, int, int, int, int]]) -> None   (`submit`'s arguments)


def submit_together(pool: DecodeSubmitter, tasks: list[tuple[int, int, int, int, int]]) -> None:
    """The decodes of one dispatch (`submit`'s arguments each), to the pool together (one by
    one to a pool without `submit_many`)."""
    submit_many = getattr(pool, "submit_many", None)
    if submit_many is not None:
        submit_many(tasks)
        return
    for task in tasks:
        pool.submit(*task)


class Filed(NamedTuple):
    """What filing one decode did (`ItemCache.file_result`, `file_size`), and what the filer
    must do next (server/registry/filing.py).

    NOTE [ The filer dispatches ]
    A decode that settles nothing (a size to place; a read held for its source's verdict)
    leaves its item waiting again and its worker free: the next decode must go out at once
    (for a size, to the worker that keeps the array). The cache did that itself, calling the
    pool from inside `file_result`, a back-edge nothing at the filer's level showed. It now
    says so (`dispatch`), and the filer dispatches (`ItemCache.dispatch_again`) at the same
    point, before the next result of its batch."""

    item: Item | None = None  # the item settled (ready or failed); None: nothing settled
    dispatch: bool = False  # the item waits for a decode again and its worker is free: dispatch now


@dataclass
class Lookups:
    """What queue entries found when a job's queue took an item (one entry per item a job
    will read): a cached copy, a decode already waiting or running for another entry (the
    decode is shared), nothing (a decode is requested: a miss), or a failure not yet due for a
    retry (the job will skip it)."""

    hits: int = 0
    joined: int = 0
    misses: int = 0
    failed: int = 0

    @property
    def total(self) -> int:
        return self.hits + self.joined + self.misses + self.failed

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "joined_decode": self.joined, "misses": self.misses,
                "failed": self.failed}
