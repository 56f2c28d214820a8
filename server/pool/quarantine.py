"""The decode pool's quarantine: files that hung or killed a decode worker twice, kept out of the
decoders until they change on disk.

NOTE [ Quarantined until the file changes ]
A file that hangs the decoder (or kills it: a native crash, an allocation the kernel answers
with an OOM kill) was once failed and then retried at its next use after `--retry-failed-s`,
alone in the probation worker, where it hung again for a whole decode timeout, every epoch: at
10% such files and a 3 s timeout, epochs took 95 s against about 1 s clean. Such a file does the
same thing every time it is read, so retrying it tells nothing new until the file itself is
different. Now a file quarantined (`joader.server.pool.faults`) is stamped (inode, size, mtime:
`joader.server.books.source_watch.file_stamp`), fails at once whenever it is asked for, and the item
cache does not even ask (`DecodePool.is_quarantined`). The pool's consumer thread restamps
quarantined files every `CHECK_PERIOD_S` (at most `MAX_CHECKS` of them per period, the ones
checked longest ago first; the stats off the pool's lock), and a file whose stamp changed is
lifted: tried again at its next use, still alone (one more hang quarantines it again).
A corrupt file (a decode error, not a hang or a death) is not quarantined: it fails in
milliseconds, and is retried after `--retry-failed-s` as before.

Plain logic, no I/O and no clock of its own: the pool passes the time and the stamps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECK_PERIOD_S", "MAX_CHECKS", "Quarantine", "Quarantined"]

CHECK_PERIOD_S = 2.0
MAX_CHECKS = 256  # stats per period at most (a stat is microseconds, unless the storage hangs)
_NOT_STAMPED = object()  # its reference stamp is not taken yet


@dataclass
class Quarantined:
    """One quarantined file: where it is, why, since when, and its stamp when quarantined."""

    path: str  # the file to stat (for a tar member: its shard)
    reason: str  # the failure every request for it gets
    since_s: float
    generation: int  # tells a stale stamp (of an earlier quarantine of the same key) apart
    stamp: Any = _NOT_STAMPED  # a `file_stamp` (None: not there) once taken
    checked_s: float = float("-inf")


class Quarantine:
    """Quarantined files by key ((source index, item id)); see the module docstring."""

    def __init__(self, *, period_s: float = CHECK_PERIOD_S, max_checks: int = MAX_CHECKS) -> None:
        self.period_s = period_s
        self.max_checks = max_checks
        # checked longest ago first (a new one first of all: its reference stamp is due)
        self._files: OrderedDict[tuple[int, int], Quarantined] = OrderedDict()
        self._generations = 0
        self.unstamped = 0  # files whose reference stamp is not taken yet
        self.lifted = 0  # files tried again because they changed on disk

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def add(self, key: tuple[int, int], path: str, reason: str, now: float) -> None:
        self.discard(key)
        self._generations += 1
        self._files[key] = Quarantined(path, reason, now, self._generations)
        self.unstamped += 1
        self._files.move_to_end(key, last=False)

    def reason(self, key: tuple[int, int]) -> str:
        return self._files[key].reason

    def due(self, now: float) -> list[tuple[tuple[int, int], int, str]]:
        """(key, generation, path) of the files to stat now: every one not stamped yet, and
        those not checked for `period_s`, longest ago first, `max_checks` at most. Marked as
        checked now."""
        picked: list[tuple[tuple[int, int], int, str]] = []
        for key, entry in self._files.items():
            if len(picked) >= self.max_checks or (entry.stamp is not _NOT_STAMPED
                                                  and now - entry.checked_s < self.period_s):
                break
            picked.append((key, entry.generation, entry.path))
        for key, _, _ in picked:
            self._files[key].checked_s = now
            self._files.move_to_end(key)
        return picked

    def stamped(self, key: tuple[int, int], generation: int, stamp: Any) -> Quarantined | None:
        """Files a stamp taken for `due`; returns the entry if the file changed (it is lifted:
        no longer quarantined), else None. The first stamp is the reference."""
        entry = self._files.get(key)
        if entry is None or entry.generation != generation:
            return None  # lifted meanwhile, or quarantined again since
        if entry.stamp is _NOT_STAMPED:
            entry.stamp = stamp
            self.unstamped -= 1
            return None
        if stamp == entry.stamp:
            return None
        del self._files[key]
        self.lifted += 1
        return entry

    def discard(self, key: tuple[int, int]) -> None:
        entry = self._files.pop(key, None)
        if entry is not None and entry.stamp is _NOT_STAMPED:
            self.unstamped -= 1
