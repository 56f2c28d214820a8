"""Resizing: the pool's target size, growing to it and retiring what is beyond it.

`resize` is called by joaderd's autoscaler every few seconds from a thread of its own
(`joader.server.autoscale`), while the consumer thread waits in `get_result`:

- the target, `num_workers`, changes at once, so the registry's in-flight limit (`num_workers`
  times its decodes per worker) follows at once too; every change goes into a short log shown by
  `stats()` (`joader status`), with the caller's reason.
- growing first takes back workers still retiring (they are running already: no fork, nothing
  to warm up), then asks the forker for new ones through the same path as a replacement
  (`fill`), under the smallest free indices. Growth does not count against the replacement
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
  calling thread, under the roster's lock (as `submit` already may, forking a replacement when a
  send finds a worker dead). A new worker's socket is registered in the selector, which epoll
  watches at once even while the consumer is blocked in it (other selectors see it at the next
  slice of at most `_SLICE_S`), and `DecodePool._dispatch` hands it queued tasks before `resize`
  returns. The one step left to the consumer, stopping a retiring worker after its last result,
  is triggered by that result, an event the consumer wakes up for anyway.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import count

from joader.errors import InvalidArgumentError, JoaderError
from joader.server.pool.faults import FaultHandling
from joader.server.pool.records import Worker
from joader.server.pool.roster import Roster
from joader.server.pool.spawning import NoWorker, WorkerSpawning

__all__ = ["RESIZE_LOG", "Resizing", "retire_order"]

logger = logging.getLogger("joader.server.pool.decode_pool")  # the pool's log, whichever part writes

RESIZE_LOG = 20  # entries of the resize log kept for `stats()`


def retire_order(members: Sequence[Worker], surplus: int) -> list[Worker]:
    """The `surplus` members to retire: the least loaded first (idle ones, then those that drain
    soonest), newest first among equals. Pure."""
    return sorted(members, key=lambda w: (len(w.tasks), -w.born))[:surplus]


class Resizing:
    """The `DecodePool`'s part that keeps its members at the target, the roster's `num_workers`
    (see the module docstring). State it owns: `_resizes` (the log for `stats()`). It asks
    `spawning` for new workers, and `faults` whether a replacement may start (and counts it)."""

    def __init__(self, roster: Roster, spawning: WorkerSpawning, faults: FaultHandling,
                 dispatch: Callable[[], None]) -> None:
        self._roster = roster
        self._spawning = spawning
        self._faults = faults
        self._dispatch = dispatch
        self._resizes: deque[str] = deque(maxlen=RESIZE_LOG)

    @property
    def log(self) -> tuple[str, ...]:
        """The most recent changes of the target, the last one last (`stats().resizes`)."""
        return tuple(self._resizes)

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
        roster = self._roster
        with roster.lock:
            if roster.closed:
                raise JoaderError("decode pool is closed")
            old = roster.num_workers
            if n == old:
                return
            roster.num_workers = n
            change = f"workers {old} -> {n}" + (f" ({reason})" if reason else "")
            self._resizes.append(f"{time.strftime('%H:%M:%S')} {change}")
            logger.info("decode pool: %s", change)
            if n > old:
                self.fill(replacing=False)
            else:
                self._retire_surplus()
            self._dispatch()

    def fill(self, *, replacing: bool, explained: bool = False) -> None:
        """Brings the members up to `num_workers`: takes back retiring workers first (oldest
        first), then starts new ones; rate-limited when `replacing` dead ones, except the first
        when a suspect `explained` its death (`joader.server.pool.faults`, "Suspects")."""
        roster, spawning = self._roster, self._spawning
        free = 1 if explained else 0
        while len(roster.members()) < roster.num_workers:
            retiring = [w for w in roster.workers.values() if w.retiring]
            if retiring:
                worker = min(retiring, key=lambda w: w.born)
                worker.retiring = False
                logger.info("decode pool: worker %d (pid %d) kept, no longer retiring", worker.index, worker.pid)
                continue
            if spawning.forker_gone:
                return
            if spawning.owed is not None:  # one request at a time: the rest once it is answered
                if not replacing:
                    logger.warning("decode pool: the forker has not answered an earlier request yet; "
                                   "%d of %d workers until it does", len(roster.members()), roster.num_workers)
                return
            if replacing and not free and not self._faults.may_replace():
                return
            free = 0
            try:
                spawning.spawn(next(i for i in count() if i not in roster.workers), replacing=replacing)
            except NoWorker:
                return  # logged; tried again later (`_late_worker`, `replace_deferred`)
            except OSError as error:
                spawning.forker_lost(f"cannot start a{' replacement' if replacing else ''} worker: {error}")
                return
            if replacing:
                self._faults.replaced += 1

    def _retire_surplus(self) -> None:
        """Retires the members beyond `num_workers`: idle ones first (and stops them at once),
        then the least loaded, newest first among equals."""
        members = self._roster.members()
        surplus = len(members) - self._roster.num_workers
        if surplus <= 0:
            return
        for worker in retire_order(members, surplus):
            worker.retiring = True
            if worker.tasks:
                logger.info("decode pool: worker %d (pid %d) retiring after its %d task(s)",
                            worker.index, worker.pid, len(worker.tasks))
            else:
                self._roster.stop(worker)
