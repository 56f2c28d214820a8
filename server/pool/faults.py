"""Faults: dead and hung workers, suspects, the probation worker, quarantine, crash loops.

Faults are found by `get_result` (the one consumer thread) and handled here:

- a worker that dies (EOF on its socket: an OOM kill, a crash in a native decoder) is replaced,
  and the task it was running becomes a *suspect* (below). Tasks it had queued but not started
  go back to the head of the queue without counting an attempt.
- a task running longer than the decode timeout (a hung NFS read, a pathological file): its
  worker is killed and replaced, and the task becomes a suspect too. The timeout is
  `--decode-timeout-s S`, or by default "auto", fitted to the decode times measured here
  (`joader.server.pool.timeout`, NOTE [ A timeout that fits the data ]).
- replacements are never given up: in a crash loop (more than ten deaths that nothing explains
  within a minute) each next one waits longer, 1 s doubling to 30 s, until a minute passes
  without one (`joader.server.pool.replacement`, NOTE [ Crash loops slow down, never stop ]).
  Meanwhile tasks wait: a pool fault is not a file fault. Only when the forker itself is gone (no worker can ever be started again) do pending
  tasks fail.
- a slow forker is not a gone one (`joader.server.pool.spawning`).
- a dead worker is replaced only while the pool is below its target (`num_workers`), and a
  worker that was retiring (`joader.server.pool.resizing`) is not replaced at all: replacing
  keeps the size that was asked for, it never undoes a shrink.

Suspects. A decode fault is either a file's or the pool's, and each is treated as such (see
NOTE [ Suspects run alone ]):

- a task whose worker died (or timed out) while running it leaves the healthy queue for the
  *suspect lane*: it is retried alone, in a worker of its own (the *probation worker*, forked
  when a suspect waits and stopped when none does; not a member of the pool, never given a
  healthy task or a probe, one task at a time so that its death names exactly one file).
- a suspect that dies (or times out) there is quarantined: it fails with the reason, as a
  corrupt file does (`on_error="skip"` skips it, `"raise"` raises), after its second death. The
  pool remembers it until the file changes on disk (`joader.server.pool.quarantine`, NOTE
  [ Quarantined until the file changes ]): asked for again meanwhile, it fails at once, and the
  item cache does not ask (`is_quarantined`), whatever `--retry-failed-s` says. Once the file
  changed, its next use runs it in the lane again: a second chance only (one more death or
  timeout quarantines it again), never in a member.
- a suspect that decodes there was innocent: its first death was the pool's (an OOM kill, a
  signal from outside) and is charged to the replacement policy then.
- replacements for deaths a suspect explains (a member running a task, the probation worker
  running a suspect) start at once, without asking the policy: only deaths nothing explains (an
  idle worker, an innocent suspect) slow replacements down. While the pool is in such a crash
  loop, a new death is not presumed to be a file's: its replacement waits like the others, and
  its task still goes to the lane.
- suspects are not counted in `in_flight` (the registry's limit on decodes), so the healthy
  queue keeps every member busy whatever the lane holds: healthy items never wait behind
  suspects.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from itertools import count
from typing import TYPE_CHECKING

from joader.server.books.source_watch import file_stamp, item_file
from joader.server.pool.probes import Probing
from joader.server.pool.quarantine import Quarantine
from joader.server.pool.records import DecodeTask, Finished, Probe, Worker
from joader.server.pool.replacement import ReplacementPolicy
from joader.server.pool.roster import Roster
from joader.server.pool.spawning import NoWorker, WorkerSpawning
from joader.server.pool.timeout import AutoTimeout, DecodeTimes
from joader.sources.safe_open import display_path

if TYPE_CHECKING:
    from joader.server.pool.resizing import Resizing

__all__ = ["FaultHandling"]

logger = logging.getLogger("joader.server.pool.decode_pool")  # the pool's log, whichever part writes

# NOTE [ Suspects run alone ]
# A task whose worker died is retried in the probation worker, alone, and never first in line
# in the healthy queue. First in line, each fresh worker would take the file that killed the last
# one, and every death would count toward the crash-loop backoff: with 1% of 1,200 files crashing
# the stage, the first epoch took 153 s instead of 2.6 s (the pool at 0 of 2 workers most of the
# time), and with 5% and 10% the job died of TimeoutError. Alone, a death
# names exactly one file, and the deaths a file explains do not slow replacements down.


class FaultHandling:
    """The `DecodePool`'s part that handles dead and hung workers and runs the suspect lane (see
    the module docstring). State it owns: `suspects` (the lane's tasks not sent yet),
    `suspect_ids` (waiting or running), `quarantine` (`joader.server.pool.quarantine`: files that
    hung or crashed twice) and `lifted` (quarantined keys whose file changed since, not tried
    yet), `replacement` (the crash-loop policy), `timeouts` (the decode timeout in force) and the
    counts `replaced`, `retried`, `timed_out`. The probation worker is on the roster
    (`Roster.probation`). It calls on `spawning` (a probation worker, the forker's state),
    `probing` (the probes a dead worker had), `resizing` (replacements) and `dispatch`."""

    resizing: Resizing  # set by `DecodePool` once it exists (it refers to this part too)

    def __init__(self, roster: Roster, spawning: WorkerSpawning, probing: Probing,
                 dispatch: Callable[[], None]) -> None:
        config = roster.config
        self._roster = roster
        self._spawning = spawning
        self._probing = probing
        self._dispatch = dispatch
        self.replacement = ReplacementPolicy()
        self.suspects: deque[DecodeTask] = deque()  # the suspect lane's tasks not sent yet
        self.suspect_ids: set[int] = set()  # task ids in the lane, waiting or running
        self.quarantine = Quarantine()  # (source index, item id) that hung or crashed twice
        self.lifted: set[tuple[int, int]] = set()  # quarantined, then changed on disk: not tried yet
        self.timeouts = DecodeTimes(config.decode_timeout_s, AutoTimeout(ceiling_s=config.decode_timeout_ceiling_s))
        self.replaced = 0
        self.retried = 0
        self.timed_out = 0

    def measured(self, decode_s: float) -> None:
        """A decode's time, for the "auto" timeout (logged when its value moves)."""
        self.timeouts.add(decode_s)
        if self.timeouts.to_log() is not None:
            logger.info("decode pool: decode timeout now %s", self.timeouts.describe())

    def check_timeouts(self) -> None:
        roster = self._roster
        now = time.monotonic()
        limit = self.timeouts.limit_s
        for worker in list(roster.workers.values()):
            if worker.tasks and now - worker.started_s > limit:
                task = worker.tasks[0]
                self.timed_out += 1
                logger.error(
                    "decode pool: %sworker pid %d spent more than %.3g s (--decode-timeout-s%s) on %s; "
                    "killing it", "retiring " if worker.retiring else "", worker.pid, limit,
                    " auto" if self.timeouts.auto else "", roster.describe(task),
                )
                try:
                    os.kill(worker.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.worker_died(worker, "killed after the decode timeout", failure=(
                    f"decoding {display_path(roster.path(task))} took longer than {limit:.3g} s "
                    f"(--decode-timeout-s{' auto' if self.timeouts.auto else ''}) {roster.config.max_attempts} "
                    "times, the last time alone: the file or its storage hangs"
                ))

    def worker_died(self, worker: Worker, how: str, *, failure: str | None = None) -> None:
        """Replaces `worker` if the pool is below its target (never a retiring one); its running
        task is retried, or failed (with `failure` as the reason if given) once it was present at
        `max_attempts` deaths; its queued tasks go back to the queue."""
        roster = self._roster
        if roster.workers.get(worker.index) is not worker:
            return
        del roster.workers[worker.index]
        try:
            roster.selector.unregister(worker.sock)
        except (KeyError, ValueError):
            pass
        worker.sock.close()
        if failure is None:
            logger.error("decode pool: %sworker pid %d died (%s)",
                         "retiring " if worker.retiring else "", worker.pid, how)
        roster.forget_staged(worker)
        queued = list(worker.tasks)
        running = queued.pop(0) if queued else None
        if isinstance(running, Probe):
            self._probing.drop(running)  # not retried: the decodes will read those files themselves
        # the rest was never started: first in line again, in their order
        self._probing.queue.extendleft(reversed([t for t in queued if isinstance(t, Probe)]))
        tasks = [t for t in queued if isinstance(t, DecodeTask)]
        # Whether a file explains the death (module docstring, "Suspects"); not presumed while
        # the pool is in a crash loop of deaths nothing explains. See NOTE [ Only deaths nothing
        # explains count ] in replacement.py.
        explained = running is not None and not self.replacement.crash_loop
        if isinstance(running, DecodeTask):
            running.attempts += 1
            running.reason = failure or (
                f"the decode worker died {running.attempts} times while preparing "
                f"{display_path(roster.path(running))} ({how}), the last time alone: the file crashes "
                "the decoder or the stage"
            )
            if worker.probation and running.attempts >= roster.config.max_attempts:
                self._quarantine_task(running)
            elif worker.probation:  # not its last chance yet: again, still alone
                self.suspects.appendleft(running)
            else:
                self.retried += 1
                if running.task_id not in self.suspect_ids:
                    # never first in line again: see NOTE [ Suspects run alone ]
                    running.presumed = explained
                    self.to_lane(running)
                    logger.warning("decode pool: %s is a suspect now: retried alone, away from the "
                                   "other decodes", roster.describe(running))
                else:  # cannot happen: suspects run in the probation worker only
                    self.suspects.appendleft(running)
        elif worker.probation:  # idle: nothing explains it (a member's replacement asks the policy)
            self.replacement.charge(time.monotonic())
        if worker.probation:
            roster.probation = None
        roster.pending.extendleft(reversed(tasks))
        if not roster.closed and not worker.probation:
            # a no-op if it was retiring: the pool is at its target
            self.resizing.fill(replacing=True, explained=explained and not worker.retiring)
        self._dispatch()

    def _quarantine_task(self, task: DecodeTask) -> None:
        """A suspect that killed the probation worker: fails as a file, and is remembered until
        its file changes (joader.server.pool.quarantine)."""
        roster = self._roster
        reason = (f"{task.reason}; quarantined, not decoded again until the file changes on disk - "
                  "fix or replace it (joaderd tries it again once its size or modification time "
                  "changes), or remove it from the source")
        spec = roster.sources[task.source_index]
        self.quarantine.add(task.key, item_file(spec.source, task.item_id), reason, time.monotonic())
        logger.error("decode pool: quarantined %s: it hung or killed a decode worker %d times, the last "
                     "time alone; reported as a failed item, and not decoded again until the file "
                     "changes on disk (%d quarantined)", roster.describe(task), task.attempts,
                     len(self.quarantine))
        roster.fail(task, reason)

    def restamp(self, due: list[tuple[tuple[int, int], int, str]]) -> None:
        """Stats the quarantined files `due` (off the lock: a stat may block) and lifts those
        that changed on disk: their next use tries them again, alone."""
        stamps = [(key, generation, file_stamp(path)) for key, generation, path in due]
        with self._roster.lock:
            for key, generation, stamp in stamps:
                entry = self.quarantine.stamped(key, generation, stamp)
                if entry is not None:
                    self.lifted.add(key)
                    logger.warning("decode pool: %s changed on disk; no longer quarantined: tried "
                                   "again (alone) at its next use", display_path(entry.path))

    def to_lane(self, task: DecodeTask) -> None:
        """`task` is a suspect now: retried alone, in the probation worker (module docstring)."""
        self.suspects.append(task)
        self.suspect_ids.add(task.task_id)

    def run_suspect(self) -> None:
        """Sends the lane's next suspect to the probation worker (forked if there is none, at
        once unless the pool is in a crash loop), or stops that worker when the lane is empty."""
        roster, spawning = self._roster, self._spawning
        worker = roster.probation
        if not self.suspects:
            if worker is not None and not worker.tasks:
                roster.stop(worker)
            return
        if roster.closed or (worker is not None and worker.tasks):
            return
        if worker is None:
            if spawning.forker_gone or spawning.owed is not None:
                return  # gone; or the owed answer comes first (`WorkerSpawning._late_worker`)
            if self.replacement.crash_loop and not self.may_replace():
                return  # `replace_deferred` comes back when the policy allows
            try:
                worker = spawning.spawn(next(i for i in count() if i not in roster.workers), probation=True)
            except NoWorker:
                return  # logged; tried again later (`WorkerSpawning._late_worker`, `DecodePool._dispatch`)
            except OSError as error:
                spawning.forker_lost(f"cannot start a probation worker: {error}")
                return
        task = self.suspects.popleft()
        if not roster.send(worker, task):
            self.suspects.appendleft(task)
            self.worker_died(worker, "its socket closed")

    def settle_suspect(self, task: DecodeTask, result: Finished) -> None:
        """A suspect's result from the probation worker: it did not kill the worker this time
        (decoded, failed as a file, or did not fit its range), so its death was not its fault."""
        if task.presumed:
            task.presumed = False
            self.replacement.charge(time.monotonic())
            logger.warning("decode pool: %s did not kill the probation worker; the death while a "
                           "member ran it counts as one nothing explains", self._roster.describe(task))
        if result.ok and task.key in self.quarantine:  # cannot happen: a quarantined file is not run
            self.quarantine.discard(task.key)

    def may_replace(self) -> bool:
        """Whether a replacement may start now (`joader.server.pool.replacement`); entering a crash
        loop is logged once, with when the pool will try again."""
        was = self.replacement.crash_loop
        allowed = self.replacement.allow(time.monotonic())
        if not allowed and not was and self.replacement.crash_loop:
            logger.critical(
                "decode pool: %d workers replaced within %g s (a crash loop? see the deaths above); "
                "replacing the next ones more slowly, from %g s up to %g s apart. %d of %d workers "
                "left; decodes wait meanwhile", self.replacement.config.max_per_window,
                self.replacement.config.window_s, self.replacement.config.first_backoff_s,
                self.replacement.config.max_backoff_s, len(self._roster.members()), self._roster.num_workers)
        return allowed

    def replace_deferred(self) -> None:
        """Replacements (and a probation worker) a crash loop delayed, once their time has come
        (called every slice)."""
        roster, spawning = self._roster, self._spawning
        if self.replacement.update(time.monotonic()):
            logger.warning("decode pool: no worker died for %g s; the crash loop is over",
                           self.replacement.config.healthy_after_s)
        if roster.closed or spawning.forker_gone:
            return
        if spawning.owed is not None:  # nothing starts before its answer (`WorkerSpawning._late_worker`)
            spawning.remind_owed()
            return
        if time.monotonic() < self.replacement.retry_at():
            return
        if len(roster.members()) < roster.num_workers:
            self.resizing.fill(replacing=True)
            self._dispatch()
        elif self.suspects and roster.probation is None:
            self._dispatch()

    def fail_all(self, reason: str) -> None:
        roster = self._roster
        while self._probing.queue:
            self._probing.drop(self._probing.queue.popleft())
        while roster.pending:
            task = roster.pending.popleft()
            roster.fail(task, f"cannot decode {display_path(roster.path(task))}: {reason}")

    def fail_suspects(self, reason: str) -> None:
        roster = self._roster
        while self.suspects:
            task = self.suspects.popleft()
            roster.fail(task, f"cannot decode {display_path(roster.path(task))}: {reason}")
