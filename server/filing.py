"""Filing what the background threads found: finished decodes and sources' verdicts.

The results thread files each finished decode into the cache (`file_result`) and wakes the jobs
waiting for it; the source checker files its verdicts on the sources on disk
(`source_checked`, server/source_watch.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from joader.server.containment import contained
from joader.server.records import Item, Job, Source

if TYPE_CHECKING:
    from joader.server.item_cache import ItemCache
    from joader.server.jobs import JobTable
    from joader.server.registry import RegistryConfig
    from joader.server.scheduler import Scheduler

logger = logging.getLogger(__name__)


class ResultFiling:
    """The `Registry`'s filing calls (a part of it: the registry's one lock guards them)."""

    # Set by `Registry.__init__` (server/registry.py) and guarded by its lock, `_cond`:
    config: RegistryConfig
    cache: ItemCache
    jobs: JobTable
    _cond: threading.Condition
    _clock: Callable[[], float]
    _scheduler: Scheduler
    _stopped: bool
    _needed: Callable[[Item], int]
    _remove: Callable[[str, str], bool]
    _dispatch: Callable[[], None]
    item_settled: Callable[[Job], None]  # NextProtocol's (NOTE [ Waking a Next when its batch is ready ])

    @contained("filing a decode", lambda registry, key, *_, **__: registry.waiting_for(key), reraise=False)
    def file_result(self, key: int, ok: bool, error: str | None, decode_s: float, *,
                    shape: tuple[int, ...] = (), dtype: str = "uint8", nbytes: int = 0,
                    checksum: int = 0) -> None:
        """Files one finished decode (called by the results thread)."""
        with self._cond:
            item = self.cache.file_result(key, ok, error, decode_s, self._needed, shape=shape,
                                          dtype=dtype, nbytes=nbytes, checksum=checksum)
            if item is None:
                return
            if ok:
                self._note_size(item)
            for job in item.waiters:
                self.item_settled(job)  # wakes its Next only when its batch may be ready (next_protocol.py)
            item.waiters = []
            self._dispatch()

    def source_checked(self, source: Source, verdict: Any, seen_seq: int | None = None) -> None:
        """Files a verdict of the source checker (server/source_watch.py): held items are
        decoded again, or, for a source changed on disk, its jobs stop and its items go."""
        with self._cond:
            settlement = source.watch.settle(verdict, self._clock(), list(source.job_ids), seen_seq)
            for job_id, reason in settlement.stop_jobs:
                self._remove(job_id, reason)
            if settlement.drop:
                dropped = self.cache.drop_source(source)
                logger.info("source %s: dropped its %d cached items", source.name, dropped)
            if settlement.release or settlement.stop_jobs:
                self.cache.requeue(settlement.release)
                self._dispatch()
                self._cond.notify_all()

    def _note_size(self, item: Item) -> None:
        """Counts images smaller than the stage's size (served as they are: never upscaled
        unless the source asks), warning at the first and at every power of two."""
        size = getattr(item.source.stage, "size", None)
        if not size or len(item.shape) != 3 or min(item.shape[1:]) >= size:
            return
        source = item.source
        source.small_items += 1
        if source.small_items & (source.small_items - 1) == 0:
            logger.warning(
                "source %s: %d image(s) so far smaller than %d px (e.g. %s, %s): served at their "
                "own size, not upscaled; set upscale = true for the source to upscale them",
                source.name, source.small_items, size, source.listing.paths[item.item_id],
                "x".join(map(str, item.shape)),
            )


    def waiting_for(self, key: int) -> list[str]:
        """The jobs waiting for the decode of `key` (to end if filing it breaks)."""
        item = self.cache.items.get(key)
        return [job.job_id for job in item.waiters] if item is not None else []

