"""When the decode pool may replace a dead worker: a crash loop is slowed down, never given up on.

Workers die for reasons that pass: an OOM burst, a native decoder crashing on a few files, a
user stage that calls `os._exit`, ten decode timeouts in a row. A pool fault is not a file
fault, so replacements go on (see NOTE [ Crash loops slow down, never stop ]), with a delay that
grows while the loop lasts (`first_backoff_s`, doubling up to `max_backoff_s`) and resets once no
replacement was needed for `healthy_after_s`; the tasks wait meanwhile.

Only deaths that nothing explains count. A worker killed by a file (a native decoder's crash, a
user stage's `os._exit`, a decode past its timeout) is the file's fault: the pool retries that
file away from the healthy queue and quarantines it after its second death
(`joader.server.pool.faults`, "Suspects"), and replaces the worker at once, without asking this
policy. When the file's retry succeeds after all, the death was not its fault after all: the
pool charges it here afterwards (`charge`), so that deaths with no file to blame (an OOM killer,
a broken environment) still slow replacements down however they are spread over the tasks
(see NOTE [ Only deaths nothing explains count ]).

Pure: the clock is an argument of every call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# NOTE [ Crash loops slow down, never stop ]
# A policy that stopped replacing after ten replacements in a minute, for good, left joaderd at
# zero workers forever: every decode failed, which `on_error="skip"` turned into epochs silently
# missing every uncached item. Replacements therefore never stop; a crash loop only spaces them.
#
# NOTE [ Only deaths nothing explains count ]
# Were every death counted here, files that crash the stage would put the pool in backoff for
# deaths they fully explain: with 1% of 1,200 files crashing the stage, 24 deaths a pass put the
# pool in backoff (up to 30 s), it sat at 0 of 2 workers, and with 5% and 10% jobs died of
# TimeoutError. The pool asks this policy only for deaths nothing explains,
# and charges (`charge`) a presumed file death whose file then decodes.


@dataclass(frozen=True)
class ReplacementConfig:
    window_s: float = 60.0
    max_per_window: int = 10  # replacements within `window_s` before backoff starts
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    healthy_after_s: float = 60.0  # no replacement for this long ends a crash loop


class ReplacementPolicy:
    """`allow(now)` says whether a replacement may start now (and records it if so);
    `retry_at` is when the next one may, while in a crash loop."""

    def __init__(self, config: ReplacementConfig = ReplacementConfig()) -> None:
        self.config = config
        self._recent: deque[float] = deque()
        self._backoff_s = 0.0  # 0: not in a crash loop
        self._last = float("-inf")

    @property
    def crash_loop(self) -> bool:
        return self._backoff_s > 0

    def retry_at(self) -> float:
        """When a replacement may start (-inf: at once)."""
        return self._last + self._backoff_s if self._backoff_s else float("-inf")

    def _expire(self, now: float) -> None:
        while self._recent and now - self._recent[0] > self.config.window_s:
            self._recent.popleft()
        if self._backoff_s and now - self._last > self.config.healthy_after_s:
            self._backoff_s = 0.0

    def update(self, now: float) -> bool:
        """Ages the record; True if a crash loop just ended (for the log)."""
        was = self.crash_loop
        self._expire(now)
        return was and not self.crash_loop

    def charge(self, now: float) -> None:
        """Records a death nothing explains whose replacement has already started (it was
        presumed the fault of a file that then proved innocent). It counts toward the window
        like an allowed replacement, and may start a crash loop: the next replacement waits."""
        self._expire(now)
        self._recent.append(now)
        if not self._backoff_s and len(self._recent) > self.config.max_per_window:
            self._backoff_s = self.config.first_backoff_s
        self._last = max(self._last, now)

    def allow(self, now: float) -> bool:
        """Whether a replacement may start now; records it if so. Never False for good: NOTE
        [ Crash loops slow down, never stop ]."""
        self._expire(now)
        if self._backoff_s:
            if now < self.retry_at():
                return False
            self._backoff_s = min(self._backoff_s * 2, self.config.max_backoff_s)
        elif len(self._recent) >= self.config.max_per_window:
            self._backoff_s = self.config.first_backoff_s
            self._last = now
            return False  # the first replacement of the loop waits first_backoff_s
        self._recent.append(now)
        self._last = now
        return True
