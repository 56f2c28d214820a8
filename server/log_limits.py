"""Logs an outsider cannot flood: lines that repeat are counted, and a count is logged instead.

A client that sends joaderd malformed messages, or attaches and cancels in a loop, makes joaderd
log a line (once a traceback) per request: thousands a second, which fills the disk, buries the
line that matters and costs the event loop its time. Here a *kind* of line (a key: the logger,
the level and the message's template, or whatever the caller names) gets `burst` lines per
window of `interval_s`; the rest of the window's lines of that kind are counted, not logged, and
when the window has ended one line says how many there were:

    ... repeated 199 more times in the 60 s after: malformed NextRequest (13 bytes) on Next ...

`RepeatLimiter` is the rule, pure: the clock is an argument of every call. `RepeatFilter` puts it
on a `logging.Handler` (joaderd's entry point installs it on its handlers, server/main.py), so it
bounds every logger's lines, gRPC's own included, without a change where they are logged.

NOTE [ A count is logged with the next line, not by a timer ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A window's count is written when the first line of any kind arrives after the window ended,
and at exit (`RepeatFilter.flush`, from `atexit`), not by a thread of its own: logging stays
passive (no thread to supervise, stop, or have forked with the decode pool's forker). So a count
can come late, never wrong: it names its window by the window's first line, which the log shows
with its time, and by the window's length.

The keys are templates, so their number is bounded by the code, not by what clients send; a
caller that keys on data must bound it itself.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

__all__ = ["PeerGoneFilter", "RepeatFilter", "RepeatLimiter", "Summary", "install", "summary_text"]

DEFAULT_BURST = 10  # lines of one kind per window before they are counted instead
DEFAULT_INTERVAL_S = 60.0
EXAMPLE_CHARS = 300  # of the window's first line, quoted in its count


@dataclass
class _Window:
    start_s: float
    example: str
    level: int
    logged: int = 1
    suppressed: int = 0


@dataclass(frozen=True)
class Summary:
    """The lines of one kind that one window counted instead of logging."""

    key: Hashable
    count: int
    interval_s: float
    example: str  # the window's first line, as logged
    level: int


def summary_text(summary: Summary) -> str:
    return f"... repeated {summary.count} more times in the {summary.interval_s:g} s after: {summary.example}"


class RepeatLimiter:
    """`burst` lines per key per window of `interval_s` (a window opens with its key's first line)."""

    def __init__(self, burst: int = DEFAULT_BURST, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if burst < 1 or interval_s <= 0:
            raise ValueError(f"RepeatLimiter needs burst >= 1 and interval_s > 0, not {burst}, {interval_s}")
        self.burst = burst
        self.interval_s = interval_s
        self._windows: dict[Hashable, _Window] = {}
        self._next_end_s = float("inf")  # the earliest end of an open window

    def admit(self, key: Hashable, now_s: float, example: str = "", level: int = logging.INFO,
              burst: int | None = None) -> bool:
        """Whether to log a line of kind `key` now; False means it was counted instead. `burst`:
        this kind's, if not the limiter's. Call `due(now_s)` first, or a window that ended keeps
        counting."""
        window = self._windows.get(key)
        if window is None:
            self._windows[key] = _Window(now_s, example[:EXAMPLE_CHARS], level)
            self._next_end_s = min(self._next_end_s, now_s + self.interval_s)
            return True
        if window.logged < (burst or self.burst):
            window.logged += 1
            return True
        window.suppressed += 1
        return False

    def due(self, now_s: float) -> list[Summary]:
        """Closes every window that has ended by `now_s`; the counts of those that counted lines."""
        if now_s < self._next_end_s:
            return []
        ended = [key for key, w in self._windows.items() if now_s >= w.start_s + self.interval_s]
        summaries = self._close(ended)
        self._next_end_s = min((w.start_s + self.interval_s for w in self._windows.values()), default=float("inf"))
        return summaries

    def flush(self) -> list[Summary]:
        """Closes every window (at exit): the counts not logged yet."""
        summaries = self._close(list(self._windows))
        self._next_end_s = float("inf")
        return summaries

    def _close(self, keys: Iterable[Hashable]) -> list[Summary]:
        summaries = []
        for key in keys:
            window = self._windows.pop(key)
            if window.suppressed:
                summaries.append(Summary(key, window.suppressed, self.interval_s, window.example, window.level))
        return summaries


class RepeatFilter(logging.Filter):
    """A handler's filter: lines of one kind (logger, level, template) beyond `burst` per
    `interval_s` are counted, and each window's count is written through `handler`.

    A line may name its kind and burst itself, through `extra`: `repeat_key` (a hashable, e.g.
    the method and the problem of a malformed message, which share a template) and
    `repeat_burst` (e.g. 1 for what an outsider can repeat at will)."""

    def __init__(self, handler: logging.Handler, limiter: RepeatLimiter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._handler = handler
        self._limiter = limiter or RepeatLimiter()
        self._clock = clock
        self._lock = threading.Lock()  # held for dictionary work only, never while writing

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "joader_summary", False):
            return True
        key = (record.name, record.levelno, getattr(record, "repeat_key", None) or str(record.msg))
        burst = getattr(record, "repeat_burst", None)
        now_s = self._clock()
        with self._lock:
            summaries = self._limiter.due(now_s)
            keep = self._limiter.admit(key, now_s, _message(record), record.levelno, burst)
        self._write(summaries)
        return keep

    def flush(self) -> None:
        with self._lock:
            summaries = self._limiter.flush()
        self._write(summaries)

    def _write(self, summaries: list[Summary]) -> None:
        for summary in summaries:
            name = summary.key[0] if isinstance(summary.key, tuple) else "joader.server"
            record = logging.LogRecord(str(name), summary.level, __file__, 0, "%s", (summary_text(summary),), None)
            record.joader_summary = True
            self._handler.handle(record)


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # a bad format is logging's to report, when the handler formats it
        return str(record.msg)


def install(logger: logging.Logger, limiter_factory: Callable[[], RepeatLimiter] = RepeatLimiter) -> list[RepeatFilter]:
    """Puts a `RepeatFilter` on each of `logger`'s handlers, flushed at exit; returns them."""
    filters = []
    for handler in logger.handlers:
        repeat = RepeatFilter(handler, limiter_factory())
        handler.addFilter(repeat)
        atexit.register(repeat.flush)
        filters.append(repeat)
    return filters


class PeerGoneFilter(logging.Filter):
    """gRPC's "ExecuteBatchError raised in core by servicer method [M]" (an ERROR and a core
    traceback) made one INFO line without the traceback.

    NOTE [ A client gone before its status ]
    grpc.aio logs that error when joaderd's handler has finished and the status cannot be sent
    because the client already went away (grpc/grpc#32551: it is logged instead of raised). A
    client that attaches and cancels in a loop made it now and then, an ERROR with a traceback of
    gRPC's Cython frames that says nothing joaderd could act on: the call had ended on both sides
    and nothing is lost. Put on the `grpc._cython.cygrpc` logger, before the `RepeatFilter`s of
    the handlers, which then count it like any line."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        message = _message(record)
        if message.startswith(self.PREFIX):
            method = message[len(self.PREFIX):].strip().strip("[]")
            record.msg = "a client went away before joaderd's reply to %s could be sent (nothing lost)"
            record.args = (method,)
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.exc_info, record.exc_text = None, None
        return True
