"""The decode timeout in force: `--decode-timeout-s S` as given, or "auto" (the default), fitted
to the decode times the pool measures.

NOTE [ A timeout that fits the data ]
A decode that runs longer than the timeout kills its worker (`joader.server.pool.faults`), and a
file that does it twice is quarantined until it changes on disk. Each such file costs two
timeouts of wall time, the second in the probation worker, which runs suspects one at a time:
with a fixed 60 s, 5% hanging files of a few hundred made the first epoch about 15 minutes,
against about a second clean. A decode of a photo takes milliseconds here, of the largest image
Pillow opens without refusing it (a 12000x12000 PNG) about 3 s. So "auto" is

    max(FLOOR_S, MULTIPLE x the p99 of the last WINDOW successful decodes), at most the ceiling

(`AutoTimeout.ceiling_s`, 60 s: the old fixed default), and `START_S` until `MIN_SAMPLES` decodes
were measured (a worker's first decodes import and warm up; a wrong kill there would quarantine
a good file). A dataset whose rare images decode far slower than the rest (over MULTIPLE times
the p99 and over FLOOR_S) must set `--decode-timeout-s` to more than their decode time, or those
images are quarantined as hanging. Pure: no clock, no I/O; the pool feeds it and reads it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FLOOR_S", "MIN_SAMPLES", "MULTIPLE", "START_S", "WINDOW", "AutoTimeout", "DecodeTimes", "auto_timeout_s"]

FLOOR_S = 2.0  # never below this: hundreds of times a photo's decode, whatever the tail
MULTIPLE = 20.0  # times the measured p99
QUANTILE = 0.99
START_S = 10.0  # until MIN_SAMPLES decodes were measured
MIN_SAMPLES = 20
WINDOW = 1024  # the latest successful decodes the tail is measured on
# samples between two computations of the quantile: often while the window fills, then rarely
# (a sort of the 1,024-sample window every 16 decodes cost 4.4 us per decode on the results thread)
_RECOMPUTE_EVERY = 16
_RECOMPUTE_EVERY_FULL = 256
LOG_CHANGE = 0.25  # a new value is logged when it differs from the logged one by this share


@dataclass(frozen=True)
class AutoTimeout:
    """The "auto" rule's constants (the module docstring)."""

    ceiling_s: float = 60.0
    floor_s: float = FLOOR_S
    multiple: float = MULTIPLE
    quantile: float = QUANTILE
    start_s: float = START_S
    min_samples: int = MIN_SAMPLES


def auto_timeout_s(decode_times: Sequence[float], rule: AutoTimeout = AutoTimeout()) -> float:
    """The "auto" timeout for these measured decode times (seconds, any order); pure."""
    if len(decode_times) < rule.min_samples:
        return min(rule.start_s, rule.ceiling_s)
    ordered = sorted(decode_times)
    tail = ordered[min(len(ordered) - 1, math.ceil(rule.quantile * len(ordered)) - 1)]
    return min(rule.ceiling_s, max(rule.floor_s, rule.multiple * tail))


class DecodeTimes:
    """The timeout in force: `explicit_s` if given (`--decode-timeout-s S`), else "auto" over the
    latest `WINDOW` successful decode times (`add`)."""

    def __init__(self, explicit_s: float | None, rule: AutoTimeout = AutoTimeout()) -> None:
        self.explicit_s = explicit_s
        self.rule = rule
        self._times: deque[float] = deque(maxlen=WINDOW)
        self._since = 0  # samples added since `_limit_s` was computed
        self._limit_s = explicit_s if explicit_s is not None else auto_timeout_s((), rule)
        self._logged_s: float | None = None

    @property
    def auto(self) -> bool:
        return self.explicit_s is None

    @property
    def limit_s(self) -> float:
        return self._limit_s

    def add(self, decode_s: float) -> None:
        """One successful decode's time (as its worker measured it)."""
        if self.explicit_s is not None:
            return
        self._times.append(decode_s)
        self._since += 1
        every = _RECOMPUTE_EVERY_FULL if len(self._times) == WINDOW else _RECOMPUTE_EVERY
        if self._since >= every or len(self._times) == self.rule.min_samples:
            self._since = 0
            self._limit_s = auto_timeout_s(self._times, self.rule)

    def to_log(self) -> float | None:
        """The value in force if it should be logged now (the first one, and each that differs
        by `LOG_CHANGE` or more from the last logged), else None."""
        logged = self._logged_s
        if logged is not None and abs(self._limit_s - logged) < LOG_CHANGE * logged:
            return None
        self._logged_s = self._limit_s
        return self._limit_s

    def describe(self) -> str:
        """How the value in force came about, for the log."""
        if self.explicit_s is not None:
            return f"{self.explicit_s:g} s (--decode-timeout-s)"
        rule = self.rule
        if len(self._times) < rule.min_samples:
            return (f"{self._limit_s:g} s (--decode-timeout-s auto: {len(self._times)} of {rule.min_samples} "
                    "decodes measured so far)")
        return (f"{self._limit_s:.3g} s (--decode-timeout-s auto: max({rule.floor_s:g} s, {rule.multiple:g} x "
                f"the p{rule.quantile * 100:g} of the last {len(self._times)} decodes), at most {rule.ceiling_s:g} s)")
