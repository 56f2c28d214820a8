"""The scheduler thread: DSA rounds, decode dispatch and lease expiry, in bounded turns.

Each turn holds the registry's lock for at most `rounds_per_lock` rounds per source, so `Next`
calls and filed decodes get the lock between turns. A round that breaks a job's books ends
that job (`Registry.contain`), and the round goes on for the others.
"""

from __future__ import annotations

from collections.abc import Callable

from joader.server.books.containment import is_bookkeeping_error
from joader.server.registry.state import RegistryState


class SchedulerThread(RegistryState):
    """The `Registry`'s scheduling turns (a part of it: the registry's one lock guards them)."""

    # NOTE [ A turn wakes a Next as a settled item does ]
    # A round's pick of a cached item is ready at once, so a turn that ran rounds may change a
    # waiting `Next`'s answer. Waking every job's calls after every such turn (up to
    # `rounds_per_lock` rounds) polled each of them through the event loop once a turn, most
    # to find their batch still short (issue 37: the event loop was half of joaderd's main CPU
    # per warm delivery). The answer changes only as the ready count at the rank's head
    # reaches what the call waits for, the rule a settling decode already follows
    # (`NextProtocol.item_settled`, NOTE [ Waking a Next when its batch is ready ]); a call
    # held for another reason, or not yet polled, is still woken at every turn.

    def run_scheduler(self, after_work: Callable[[], None] = lambda: None) -> None:
        """The scheduler thread: `schedule_once` until `stop`, sleeping when there is no work.

        `after_work` is called, under the lock, after each turn that ran rounds (joaderd's fault
        tests raise there: server/fault_hooks.py)."""
        while True:
            with self._cond:
                if self._stopped:
                    return
                if self._schedule():
                    after_work()
                else:
                    self._cond.wait(0.25)

    def schedule_once(self) -> bool:
        """Runs a bounded number of rounds, dispatches decodes, expires leases.

        Returns whether any round ran (the caller loops at once if so).
        """
        with self._cond:
            return self._schedule()

    def _schedule(self) -> bool:
        progressed = False
        jobs = self.jobs.jobs
        for source in self._sources.values():
            budget = self.config.rounds_per_lock
            while budget > 0:
                scheduler = self._scheduler
                try:
                    ran = scheduler.run_round(source, jobs, max_rounds=budget)
                except Exception as error:
                    if not is_bookkeeping_error(error):
                        raise
                    ran = 1
                    self._contain(error, scheduler.acting or tuple(source.job_ids),
                                  f"a DSA round of source {source.name}")
                    scheduler.acting = ()
                while scheduler.broken:
                    job_id, broken = scheduler.broken.pop()
                    self._contain(broken, [job_id], f"dealing a DSA round of source {source.name}")
                if not ran:
                    break
                budget -= ran
                progressed = True
        self._dispatch()
        for job, reason in self.jobs.expire():
            self._remove(job.job_id, reason)
        if progressed:
            for job in jobs.values():  # cached picks are ready at once
                self.item_settled(job)  # NOTE [ A turn wakes a Next as a settled item does ]
        return progressed

    def _dispatch(self) -> None:
        limit = self._pool.num_workers * self.config.decodes_in_flight_per_worker
        self.cache.dispatch(self._pool, limit, lambda source: self._source_index[source.name])
