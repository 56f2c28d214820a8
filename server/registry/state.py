"""The registry's shared state, declared once: what its parts read and write under its lock.

`Registry` (registry.py) is one object made of parts, one concern to a module: `NextProtocol`
(next_protocol.py), `SchedulerThread` (scheduler_thread.py) and `ResultFiling` (filing.py).
Each part inherits `RegistryState`, so the type checker (`make lint`) checks every part's use of
an attribute or of another part's call against the one declaration here, and `Registry`'s
assignments and methods against it too.

Annotations only: nothing here is set or defined at run time (`Registry.__init__` sets the
attributes, and the calls are methods of `Registry` or of a part), so a part that used a name
nobody sets still fails as it would without this class.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from joader.server.books.item_cache import DecodeSubmitter, ItemCache
    from joader.server.books.records import Item, Job, Source
    from joader.server.registry.jobs import JobTable
    from joader.server.registry.passes import PassTable
    from joader.server.registry.registry import RegistryConfig
    from joader.server.scheduling.scheduler import Scheduler


class RegistryState:
    """The attributes and cross-part calls of `Registry`, guarded by its one lock (`_cond`)."""

    # ---- set by `Registry.__init__`
    config: RegistryConfig  # the registry's tunables
    cache: ItemCache  # item states, pins, arena bytes, eviction (server/books/item_cache.py)
    jobs: JobTable  # jobs, ranks and leases (jobs.py)
    passes: PassTable  # passes and the copies their readers hold (passes.py)
    _cond: threading.Condition  # the one lock, and the scheduler thread's wake-up
    _clock: Callable[[], float]  # monotonic seconds; tests pass a fake
    _scheduler: Scheduler  # DSA rounds dealt to the ranks' queues
    _stopped: bool  # `stop` was called: the scheduler thread returns
    _pool: DecodeSubmitter  # where decodes go (the decode pool)
    _sources: dict[str, Source]  # the sources served, by name
    _source_index: dict[str, int]  # each source's position in the order joaderd was given them
    items_delivered: int  # items handed to Next calls, for the status
    items_reused: int  # deliveries of a copy its job had already had (cross-epoch reuse)

    # ---- calls one part makes of another (methods of `Registry` unless named)
    _check_alive: Callable[[], None]  # raises once an internal error stopped joaderd
    _resize_queues: Callable[[], None]  # the ranks' queue capacities after jobs come or go
    _needed: Callable[[Item], int]  # a cached item's refcount
    _remove: Callable[[str, str], bool]  # ends a job (job id, reason)
    _contain: Callable[[Exception, Sequence[str], str], str]  # ends jobs after a bookkeeping error
    _dispatch: Callable[[], None]  # SchedulerThread's: hands decodes to the pool in order of need
    item_settled: Callable[[Job], None]  # NextProtocol's (NOTE [ Waking a Next when its batch is ready ])
