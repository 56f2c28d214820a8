"""Resizing: the pool's target size, growing to it and retiring what is beyond it.

`resize` is called by joaderd's autoscaler every few seconds from a thread of its own
(`joader.server.autoscale`), while the consumer thread waits in `get_result`:

- the target, `num_workers`, changes at once, so the registry's in-flight limit (`num_workers`
  times its decodes per worker) follows at once too; every change goes into a short log shown by
  `stats()` (`joader status`), with the caller's reason.
- growing first takes back workers still retiring (they are running already: no fork, nothing
  to warm up), then asks the forker for new ones through the same path as a replacement
  (`_fill`), under the smallest free indices. Growth does not count against the replacement
  rate limit: it is a decision, not a crash loop.
- shrinking retires the surplus (`retire_order`): idle workers first (they are stopped at once,
  nothing can be lost), then the least loaded (they drain soonest), newest first among equals
  (the one a recent grow added is the one to give back). A retiring worker gets no new task but
  keeps its socket: the tasks already sent to it (at most `tasks_per_worker`) finish there and
  their results are delivered as usual. Taking them back would throw away work done, and taking
  back a task a worker may already be running would run it twice. When its last result has been
  read, it is sent the stop message, its socket is closed, and the forker reaps it (the exit
  notice is logged). The stop message is sent only then, not at once behind its queued tasks
  (which the worker would also finish first), so that a grow while it drains can still take it
  back.
- a retiring worker is not a member of the pool: it is not counted as alive, and when it dies or
  times out its unfinished tasks go back to the queue as for any dead worker (the running one
  counting an attempt), but it is not replaced.
- no wake-up of the consumer is needed, so none is sent: `resize` does all its work on the
  calling thread, under `_lock` (as `submit` already may, forking a replacement when a send
  finds a worker dead). A new worker's socket is registered in the selector, which epoll watches
  at once even while the consumer is blocked in it (other selectors see it at the next slice of
  at most `_SLICE_S`), and `_dispatch` hands it queued tasks before `resize` returns. The one
  step left to the consumer, stopping a retiring worker after its last result, is triggered by
  that result, an event the consumer wakes up for anyway.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Sequence
from itertools import count

from joader.errors import InvalidArgumentError, JoaderError
from joader.server.pool.records import Worker
from joader.server.pool.spawning import NoWorker

__all__ = ["RESIZE_LOG", "Resizing", "retire_order"]

logger = logging.getLogger("joader.server.pool.decode_pool")  # the pool's log, whichever part writes

RESIZE_LOG = 20  # entries of the resize log kept for `stats()`


def retire_order(members: Sequence[Worker], surplus: int) -> list[Worker]:
    """The `surplus` members to retire: the least loaded first (idle ones, then those that drain
    soonest), newest first among equals. Pure."""
    return sorted(members, key=lambda w: (len(w.tasks), -w.born))[:surplus]


class Resizing:
    """The `DecodePool`'s part that keeps its members at the target `num_workers` (see the
    module docstring). State it owns: `num_workers` and `_resizes` (the log for `stats()`)."""

    def resize(self, n: int, reason: str = "") -> None:
        """Sets the number of workers to `n` (at least 1), while the pool serves.

        Safe from any thread, also while another one waits in `get_result`. `num_workers` is `n`
        when this returns; new workers have started (unless the forker fails, which is logged),
        surplus idle ones have stopped, and surplus busy ones are retiring: they finish the tasks
        they have, then stop. `reason` goes into the log line and `stats().resizes`. See the
        module docstring for why it works this way.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(f"decode pool: the number of workers must be a whole number of at least 1, got {n!r}")
        with self._lock:
            if self._closed:
                raise JoaderError("decode pool is closed")
            old = self.num_workers
            if n == old:
                return
            self.num_workers = n
            change = f"workers {old} -> {n}" + (f" ({reason})" if reason else "")
            self._resizes.append(f"{time.strftime('%H:%M:%S')} {change}")
            logger.info("decode pool: %s", change)
            if n > old:
                self._fill(replacing=False)
            else:
                self._retire_surplus()
            self._dispatch()

    def _fill(self, *, replacing: bool, explained: bool = False) -> None:
        """Brings the members up to `num_workers`: takes back retiring workers first (oldest
        first), then starts new ones; rate-limited when `replacing` dead ones, except the first
        when a suspect `explained` its death (`joader.server.pool.faults`, "Suspects")."""
        free = 1 if explained else 0
        while len(self._members()) < self.num_workers:
            retiring = [w for w in self._workers.values() if w.retiring]
            if retiring:
                worker = min(retiring, key=lambda w: w.born)
                worker.retiring = False
                logger.info("decode pool: worker %d (pid %d) kept, no longer retiring", worker.index, worker.pid)
                continue
            if self._forker_gone:
                return
            if self._owed is not None:  # one request at a time: the rest once it is answered
                if not replacing:
                    logger.warning("decode pool: the forker has not answered an earlier request yet; "
                                   "%d of %d workers until it does", len(self._members()), self.num_workers)
                return
            if replacing and not free and not self._may_replace():
                return
            free = 0
            try:
                self._spawn(next(i for i in count() if i not in self._workers), replacing=replacing)
            except NoWorker:
                return  # logged; tried again later (`_late_worker`, `_replace_deferred`)
            except OSError as error:
                self._forker_lost(f"cannot start a{' replacement' if replacing else ''} worker: {error}")
                return
            if replacing:
                self._replaced += 1

    def _retire_surplus(self) -> None:
        """Retires the members beyond `num_workers`: idle ones first (and stops them at once),
        then the least loaded, newest first among equals."""
        members = self._members()
        surplus = len(members) - self.num_workers
        if surplus <= 0:
            return
        for worker in retire_order(members, surplus):
            worker.retiring = True
            if worker.tasks:
                logger.info("decode pool: worker %d (pid %d) retiring after its %d task(s)",
                            worker.index, worker.pid, len(worker.tasks))
            else:
                self._stop(worker)

    def _stop(self, worker: Worker) -> None:
        """Stops a retiring worker (or the probation worker) that has no task left; the forker
        reaps it."""
        del self._workers[worker.index]
        if worker is self._probation:
            self._probation = None
        self._forget_staged(worker)
        try:
            self._selector.unregister(worker.sock)
        except (KeyError, ValueError):
            pass
        try:
            worker.sock.send(pickle.dumps(None))  # it exits on this, or on the EOF just after
        except OSError:
            pass  # already gone
        worker.sock.close()
        logger.info("decode pool: %s %d (pid %d) %s", "probation worker" if worker.probation else "worker",
                    worker.index, worker.pid, "stopped, no suspect left" if worker.probation else "retired")
