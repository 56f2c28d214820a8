"""Filing what the background threads found: finished decodes and sources' verdicts.

The results thread files the finished decodes it found queued into the cache, a batch under one
acquisition of the lock (`file_results`), and wakes the jobs waiting for them; the source checker files its verdicts on the sources on disk
(`source_checked`, server/books/source_watch.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from joader.server.books.cache_records import Filed
from joader.server.books.containment import contained, is_bookkeeping_error
from joader.server.books.records import Item, Job, Source
from joader.server.registry.state import RegistryState

logger = logging.getLogger(__name__)


class FinishedDecode(Protocol):
    """A finished decode as the pool reports it (`joader.server.pool.records.Finished`): a
    `DecodeResult`, or a `NeedsBytes` (`size_only`: the item's size, not a decode that settles it)."""

    @property
    def size_only(self) -> bool: ...
    @property
    def task_id(self) -> int: ...
    @property
    def ok(self) -> bool: ...
    @property
    def error(self) -> str | None: ...
    @property
    def decode_s(self) -> float: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def checksum(self) -> int: ...


class ResultFiling(RegistryState):
    """The `Registry`'s filing calls (a part of it: the registry's one lock guards them)."""

    @contained("filing a decode", lambda registry, key, *_, **__: registry.waiting_for(key), reraise=False)
    def file_result(self, key: int, ok: bool, error: str | None, decode_s: float, *,
                    shape: tuple[int, ...] = (), dtype: str = "uint8", nbytes: int = 0,
                    checksum: int = 0) -> None:
        """Files one finished decode (`file_results` files the results thread's batches)."""
        with self._cond:
            if self._file_one(key, ok, error, decode_s, shape, dtype, nbytes, checksum):
                self._dispatch()

    def file_results(self, results: Iterable[FinishedDecode]) -> None:
        """Files a batch of finished decodes (called by the results thread) under one
        acquisition of the lock, each exactly as `file_result` files it, in order.

        NOTE [ Filing a batch under one lock ]
        The results thread took the lock once per decode: with one message per item, the
        lock's hand-over to and from the scheduler and the RPC threads cost more than the
        item's books (issue 37). It now takes whatever results are queued and files them in
        one acquisition. Each item keeps its own containment (`@contained` on `file_result`):
        a bookkeeping error in one ends the jobs waiting for it and the rest of the batch is
        filed; an error raised on purpose goes to the caller, as from `file_result`. The cache
        dispatches more decodes once, after the batch, not after each item: the decodes a
        batch's items freed are handed to the pool together (and the ranges those items did
        not use are returned before new ones are allocated). The pool's results were all taken
        before filing began, so the first item's dispatch already saw every slot free: the
        later ones only repeated its scan of the waiting items."""
        with self._cond:
            settled = False
            woken: dict[int, Job] = {}  # the jobs to wake once the batch is filed, by id
            for result in results:
                try:
                    settled = self._file_finished(result, woken) or settled
                except Exception as error:
                    if not is_bookkeeping_error(error):
                        raise
                    try:
                        ids = self.waiting_for(result.task_id)
                    except Exception:  # noqa: BLE001  the ids are a best effort; nobody is ended
                        ids = []
                    self._contain(error, ids, "filing a decode")
            for job in woken.values():  # NOTE [ One wake per job and batch ]
                self.item_settled(job)
            if settled:
                self._dispatch_contained()

    def _dispatch_contained(self) -> None:
        """The dispatch after a batch (the lock is held): a bookkeeping error in it ends no job
        (none is known to be concerned) and the cache is recounted, as after `file_result`'s."""
        try:
            self._dispatch()
        except Exception as error:
            if not is_bookkeeping_error(error):
                raise
            self._contain(error, [], "filing a decode")

    def _file_finished(self, result: FinishedDecode, woken: dict[int, Job]) -> bool:
        """Files one result of a batch (the lock is held): a size (`ItemCache.file_size`, never
        settles) or a decode (`_file_one`); whether it settled. The jobs waiting for it go
        into `woken`, to be woken once the batch is filed."""
        if result.size_only:
            self._follow(self.cache.file_size(result.task_id, result.nbytes, result.error, result.decode_s))
            return False
        return self._file_one(result.task_id, result.ok, result.error, result.decode_s, result.shape, result.dtype,
                              result.nbytes, result.checksum, woken)

    # NOTE [ One wake per job and batch ]
    # Each filed decode woke every job that queued it (`item_settled`: a look at the waiting
    # `Next`s of the job and at its rank's ready head): 4 jobs sharing every item made that
    # four calls per decode, about as many as deliveries (issue 37). A batch's jobs are now
    # collected and each woken once, after the batch: the lock is held throughout, so no
    # `Next` could have looked in between anyway, and the ready counts it then sees are the
    # batch's.

    def _file_one(self, key: int, ok: bool, error: str | None, decode_s: float, shape: tuple[int, ...],
                  dtype: str, nbytes: int, checksum: int, woken: dict[int, Job] | None = None) -> bool:
        """Files one finished decode (the lock is held); whether it settled (the caller then
        dispatches: the cache may have room for more decodes). The jobs waiting for it are
        woken now, or added to `woken` (NOTE [ One wake per job and batch ])."""
        filed = self.cache.file_result(key, ok, error, decode_s, self._needed, shape=shape,
                                       dtype=dtype, nbytes=nbytes, checksum=checksum)
        if filed.dispatch:  # `_follow`, inline (once per decode)
            self.cache.dispatch_again()
        item = filed.item
        if item is None:
            return False
        if ok:
            self._note_size(item)
        waiters = self.cache.take_waiters(key)
        if woken is None:
            for job in waiters:
                self.item_settled(job)  # wakes its Next only when its batch may be ready (next_protocol.py)
        else:
            for job in waiters:
                woken[id(job)] = job
        return True

    def _follow(self, filed: Filed) -> None:
        """Does what filing a decode asks of the filer (the lock is held): a decode that settled
        nothing freed its worker, and its item waits again; the next decodes go out now, before
        the next result is filed (NOTE [ The filer dispatches ], server/books/item_cache.py)."""
        if filed.dispatch:
            self.cache.dispatch_again()

    def source_checked(self, source: Source, verdict: Any, seen_seq: int | None = None) -> None:
        """Files a verdict of the source checker (server/books/source_watch.py): held items are
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
        """Counts images smaller than the stage's size that a source with `upscale = false`
        serves at their own size, warning at the first and at every power of two. With upscale
        (the default) every image reaches the size; `max-side` is a cap, never an enlargement."""
        stage = item.source.stage
        if getattr(stage, "upscale", True) or getattr(stage, "kind", "") == "max-side":
            return
        size = getattr(stage, "size", None)
        if not size or len(item.shape) != 3 or min(item.shape[1:]) >= size:
            return
        source = item.source
        source.small_items += 1
        if source.small_items & (source.small_items - 1) == 0:
            logger.warning(
                "source %s: %d image(s) so far smaller than %d px (e.g. %s, %s): served at their "
                "own size (upscale = false); remove upscale = false or --no-upscale %s to upscale them",
                source.name, source.small_items, size, source.listing.paths[item.item_id],
                "x".join(map(str, item.shape)), source.name,
            )


    def waiting_for(self, key: int) -> list[str]:
        """The jobs waiting for the decode of `key` (to end if filing it breaks)."""
        return [job.job_id for job in self.cache.waiters.get(key, ())]

