"""The Next call's records: its arguments (`NextArgs`), the call in progress (`NextCall`), and
what it returns (`Batch`).

Plain data, as the other records (`joader.server.books.records`): the service builds `NextArgs`
from a request and a reply from a `Batch`; `NextProtocol` (next_protocol.py) runs the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pyroaring import BitMap

from joader.server.books.records import Job, PassBook, Rank, RestShare


@dataclass(frozen=True)
class Batch:
    """What one `Next` returns: ready items of one epoch, or the end of that epoch."""

    epoch: int
    end_of_epoch: bool
    item_ids: list[int]
    labels: list[int]
    offsets: list[int]
    failed: list[tuple[int, str, str]]  # (item id, relative path, reason)
    # each item's (bytes, shape, dtype name): `Item.form`, shared by the items of one form
    forms: list[tuple[int, tuple[int, ...], str]] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)  # zlib.crc32 of each item's bytes
    # The rank holds more handed-out, unacknowledged copies than its share allows: its reader
    # must copy these items out and acknowledge them at once, not hand them on (NextResponse).
    copy_now: bool = False
    # An empty reply: what holds the job up (`Registry.waiting_note`), and whether it is a rank
    # that never asked for items, for how long.
    waiting: str = ""
    rank_never_read: bool = False
    waiting_s: float = 0.0

    @property
    def lengths(self) -> list[int]:
        """Each item's size in bytes."""
        return [form[0] for form in self.forms]


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
    rank: int = 0
    resume_epoch: int = 0  # > 0: this pass resumes that epoch, minus `resume_consumed`
    resume_consumed: BitMap | None = None
    resume_parts: int = 1  # how many readers of this rank report a part of the resume
    max_batches: int = 1  # whole batches of `max_items` one reply may carry, if ready at once
    stall: tuple[int, float, float, int] | None = None  # (epoch, wait s, step s, items) the reader measured
    num_workers: int = 0  # the DataLoader workers reading the pass (0 or 1: no turns to keep)
    # > 0: the pass was reading this epoch when joaderd restarted (some reader of it received
    # items of it from the dead server): a pass this request creates reads it, not the next.
    continue_epoch: int = 0
    # With `resume_epoch`: this rank's share of an elastic resume's rest (NOTE [ An elastic
    # resume ] in server/registry/resumes.py); None: its whole-epoch share less what it consumed.
    resume_rest: RestShare | None = None


@dataclass
class NextCall:
    """A `Next` in progress: `Registry.begin_next`, then `poll_next` until a batch, `end_next`."""

    job: Job
    rank: Rank
    pass_: PassBook
    max_items: int
    started_s: float
    deadline_s: float
    waker: Callable[[], None]
    linger_until_s: float | None = None
    max_batches: int = 1
    worker_id: int = 0
