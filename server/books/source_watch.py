"""A source that changes under a running joaderd: each source's health, and the checker thread.

joaderd lists a source once. Two things happen to folders meanwhile:
- the folder is renamed away and back (a sync tool, a remount): before, every decode in the
  gap failed, was reported to the jobs as a bad file and skipped, and stayed failed for
  `--retry-failed-s`: three epochs served only the cached 80 items of 400;
- another dataset of the same layout is put at the same path: before, new pixels were decoded
  and delivered beside the old cached ones, under the same indices, with no warning at all.

What joaderd does now. Each source has a `SourceWatch` (its health, under the registry's lock)
and one supervised thread, `joaderd-sources` (`SourceChecker.run`), compares a cheap stamp of
each source with the one taken right after listing (`joader.sources.watch`: the root's inode,
sampled class folders' inodes, sampled files' inode, size and mtime; a few dozen `stat`s, never
a re-listing, never on the scheduler thread or under the lock). It checks every
`CHECK_PERIOD_S`, at once when a read fails, and when a job starts an epoch (a new pass).

- A read that fails (`is_read_error`: not a stage's or a worker's failure) is *held*, not
  reported: the item goes back to WAITING, outside the decode queue, and a check is asked for.
  The jobs wait for it as for any decode.
- `AWAY` (the root, or every sampled file, is not there): held items stay held, and every
  failing read is held too. Cached items are still served. Logged once; `joader status` shows
  the source `away`; a job waiting on a held item gets the reason in its empty replies (its
  `TimeoutError`, after `timeout_s`, names the folder).
- `OK`: held items are decoded again. A folder that came back is served without a restart,
  and no job loses an item. A file that fails again after a check found its source in place is
  the file's own failure: reported (skipped or raised, as the job asked) as before.
- `CHANGED` (another folder at the path, or two or more sampled files that differ, leaving out
  files whose item failed since the listing: a broken file fixed on disk is served again, as
  `--retry-failed-s` promises, and one file edited is that file's business): final until joaderd
  restarts. Every job on the source is stopped with `SourceChangedError` naming the change and
  the fix; attaching to the source is refused with it; the source's cached items are dropped.
  The reads themselves refuse a root folder that is another inode than the listed one
  (`safe_open`), so the first decode after a swap fails and triggers this check: no new pixel
  is cached before the jobs stop.

# NOTE what happens to a job mid-epoch when its data is swapped
It fails with `SourceChangedError` at its next request (its lease ends too). There is no honest
way to finish its epoch: the rest is either old pixels (cached) or new ones. New jobs are
refused until joaderd is restarted, which lists the new data under a new fingerprint (lease
keepers of old jobs refuse that joaderd in turn). Re-listing inside a running joaderd would need
the decode workers (and the forker, which forks replacements) to receive the new listing; not
done: a restart takes seconds and is what the message says.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from joader.errors import SourceChangedError
from joader.sources.safe_open import display_path
from joader.sources.watch import (
    Stamp,
    Verdict,
    VerdictKind,
    WatchTargets,
    compare,
    is_read_error,
    take_stamp,
    watch_targets,
)

__all__ = ["CHECK_PERIOD_S", "Settlement", "SourceChecker", "SourceWatch", "file_stamp", "item_file", "stopped_error"]

logger = logging.getLogger(__name__)

CHECK_PERIOD_S = 2.0
_STOPPED_REMEMBERED = 4096  # job ids stopped by a change, to answer their late requests


@dataclass
class Settlement:
    """What the registry must do after a verdict: decode `release` (held item keys) again,
    stop `stop_jobs` (job id, reason), and drop the source's cached items if `drop`."""

    release: list[int] = field(default_factory=list)
    stop_jobs: list[tuple[str, str]] = field(default_factory=list)
    drop: bool = False


class SourceWatch:
    """One source's health as last checked, and the items held while it is in question.

    No lock of its own: the registry calls it under its lock (`park`, `settled`, `settle`, the
    checks of requests); the checker thread reads `targets` and `listed` (which never change),
    `hold_seq` and `ignore` (each replaced whole).
    """

    def __init__(self, name: str, targets: WatchTargets, listed: Stamp, *,
                 poke: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.targets = targets
        self.listed = listed
        self.state = VerdictKind.OK
        self.since_s = clock()
        self.message = ""
        self.checks = 0
        self.last_check_s: float | None = None
        # key -> `hold_seq` when its read failed: items held, not yet decoded again. A verdict
        # releases only the items held before its stamp was taken (a later failure may be the
        # very change that stamp did not see yet).
        self.held: dict[int, int] = {}
        self.hold_seq = 0
        self._parks: dict[int, int] = {}  # key -> times held since it last settled
        self._stopped: OrderedDict[str, str] = OrderedDict()  # job id -> its SourceChangedError text
        self._poke = poke
        self.items_held = 0  # reads held in all (status)
        # item id -> its position among the sampled files; positions `compare` ignores (read
        # by the checker thread: replaced whole, never changed in place)
        self._sampled = {item: i for i, item in enumerate(targets.file_items) if item is not None}
        self._failed_sampled: set[int] = set()
        self.ignore: frozenset[int] = frozenset()

    @property
    def root(self) -> str:
        return display_path(self.targets.root)

    # ----------------------------------------------------------------------------- failures

    def park(self, key: int, error: str | None) -> bool:
        """Whether a failed decode of `key` is held instead of reported (module docstring).

        Held: a read failure while the source is away, or the first read failure of the item
        since it last settled (a check is asked for). Not held: stage and worker failures, a
        second read failure after a check found the source in place, anything once CHANGED.
        """
        if self.state is VerdictKind.CHANGED or not is_read_error(error):
            return False
        if self.state is VerdictKind.OK:
            if self._parks.get(key, 0) >= 1:
                return False
            self._poke()
        self._parks[key] = self._parks.get(key, 0) + 1
        self.hold_seq += 1
        self.held[key] = self.hold_seq
        self.items_held += 1
        return True

    def settled(self, key: int, item_id: int, ok: bool) -> None:
        """The item settled (decoded, or its failure reported): a later failure is new. A
        sampled file whose item failed is left out of the comparison from now on: a broken
        file fixed on disk is served again (`--retry-failed-s`), not a changed dataset."""
        self._parks.pop(key, None)
        if not ok and item_id in self._sampled and item_id not in self._failed_sampled:
            self._failed_sampled.add(item_id)
            self.ignore = frozenset(self._sampled[i] for i in self._failed_sampled)

    def poke(self) -> None:
        """Asks the checker for a check now (never blocks)."""
        self._poke()

    # ----------------------------------------------------------------------------- verdicts

    def settle(self, verdict: Verdict, now: float, job_ids: Sequence[str], seen_seq: int | None = None) -> Settlement:
        """Files a check's verdict; says what the registry must do (module docstring).
        `seen_seq`: `hold_seq` when the stamp was taken (None: now); items held after it stay
        held for the next check, which their hold asked for."""
        self.checks += 1
        self.last_check_s = now
        if self.state is VerdictKind.CHANGED:
            return Settlement()  # final: the cache no longer holds its items
        if verdict.kind is VerdictKind.CHANGED:
            self.state, self.since_s = VerdictKind.CHANGED, now
            self.message = changed_message(self.name, self.targets.root, verdict)
            logger.error("%s; %d jobs on it stop", self.message, len(job_ids))
            stop = [(job_id, f"job {job_id}: {self.message}") for job_id in job_ids]
            for job_id, text in stop:
                self._stopped[job_id] = text
            while len(self._stopped) > _STOPPED_REMEMBERED:
                self._stopped.popitem(last=False)
            release = sorted(self.held)  # nobody needs them now: their decodes are cancelled
            self.held.clear()
            return Settlement(release, stop, drop=True)
        if verdict.kind is VerdictKind.AWAY:
            if self.state is VerdictKind.OK:
                self.state, self.since_s = VerdictKind.AWAY, now
                logger.warning(
                    "source %s: its folder %s is gone (renamed, moved or unmounted?); cached items "
                    "are still served, the others wait for it, and joaderd serves them as soon as "
                    "it is back at that path. Put it back, or restart joaderd with the source's "
                    "new path", self.name, self.root)
            return Settlement()
        seen = self.hold_seq if seen_seq is None else seen_seq
        release = sorted(key for key, seq in self.held.items() if seq <= seen)
        for key in release:
            del self.held[key]
        if self.state is VerdictKind.AWAY:
            logger.warning("source %s: its folder %s is back after %.1f s; decoding the %d items "
                           "that waited for it", self.name, self.root, now - self.since_s, len(release))
            self.state, self.since_s = VerdictKind.OK, now
        return Settlement(release)

    # ----------------------------------------------------------------------------- requests

    def check_attach(self) -> None:
        """Raises SourceChangedError for a new job on a changed source."""
        if self.state is VerdictKind.CHANGED:
            raise SourceChangedError(self.message)

    def stopped(self, job_id: str) -> str | None:
        """The SourceChangedError text of a job stopped by a change, else None."""
        return self._stopped.get(job_id)

    def waiting_reason(self, now: float) -> str:
        """Why a job on this source may get no item, or "" (for empty replies)."""
        if self.state is VerdictKind.AWAY:
            return (f"source {self.name!r}: its folder {self.root} is gone since {now - self.since_s:.0f} s "
                    f"(renamed, moved or unmounted?); {len(self.held)} items wait for it and are served "
                    "as soon as it is back at that path. Put it back, or restart joaderd with the "
                    "source's new path and then the job")
        return ""

    def status(self, now: float) -> dict[str, Any]:
        """The source's `health` in `joader status` (docs/status.md)."""
        return {
            "state": self.state.value,
            "since_s": round(now - self.since_s, 3),
            "message": self.message or self.waiting_reason(now),
            "held_items": len(self.held),
            "reads_held": self.items_held,
            "checks": self.checks,
            "last_check_s": None if self.last_check_s is None else round(now - self.last_check_s, 3),
        }


def changed_message(name: str, root: str, verdict: Verdict) -> str:
    """The one text of a changed source: the problem, then the fix."""
    return (
        f"source {name!r} changed under joaderd ({verdict.describe()}, at {display_path(root)}): "
        "the items joaderd cached are from the old data, and serving them beside the new would "
        "mix two datasets under the same indices. Restart joaderd (`joaderd --source "
        f"{name}={display_path(root)}`) to serve the new data, or give the new data another name "
        f"(`--source {name}-new=PATH`); then start the jobs again"
    )


def stopped_error(sources: Any, job_id: str) -> SourceChangedError | None:
    """The error for a request of a job stopped by a change of its source, else None."""
    for source in sources:
        watch = getattr(source, "watch", None)
        text = watch.stopped(job_id) if watch is not None else None
        if text is not None:
            return SourceChangedError(text)
    return None


class SourceChecker:
    """The `joaderd-sources` thread: stamps each source off the registry's lock and files the
    verdicts (`Registry.source_checked`). Creating it gives each source its `SourceWatch`, with
    the stamp taken now (right after listing) as the reference."""

    def __init__(self, sources: Sequence[Any], *, seed: int, period_s: float = CHECK_PERIOD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sources = list(sources)
        self.period_s = period_s
        self._wake = threading.Event()
        for index, source in enumerate(self.sources):
            targets = watch_targets(source.listing, random.Random(seed + index))
            source.watch = SourceWatch(source.name, targets, take_stamp(targets), poke=self._wake.set,
                                       clock=clock)

    def poke(self) -> None:
        self._wake.set()

    def run(self, file_verdict: Callable[[Any, Verdict, int], None], stop: threading.Event) -> None:
        """Checks every source each period or when poked, until `stop` is set (and poked)."""
        while not stop.is_set():
            self._wake.wait(self.period_s)
            self._wake.clear()
            if stop.is_set():
                return
            for source in self.sources:
                watch = source.watch
                seen_seq = watch.hold_seq  # read before the stamp (an int: no lock needed)
                file_verdict(source, compare(watch.listed, take_stamp(watch.targets), watch.ignore), seen_seq)


def item_file(listing: Any, item_id: int) -> str:
    """The file on disk an item is read from (an `ItemSource`'s item): for a tar member, its
    shard. What `file_stamp` stamps for the decode pool's quarantine (joader.server.pool.quarantine)."""
    kind = getattr(listing, "kind", "imagefolder")
    if kind == "tar":
        return os.path.join(listing.root, listing.shards[int(listing.shard_ids[item_id])])
    folder = listing.folder if kind == "list" else listing.root
    return os.path.join(folder, listing.paths[item_id])


def file_stamp(path: str) -> tuple[int, int, int, int] | None:
    """(st_dev, st_ino, st_size, st_mtime_ns) of `path`, None if it cannot be stat'ed: the same
    kind of stamp as the sources' (joader.sources.watch), one file at a time. One `stat`, which
    may block on a hung mount: never call it under the registry's or the pool's lock."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns
