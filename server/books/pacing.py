"""Deadline-aware preparation: when each queued item will be consumed, from each job's speed.

Decoding in the order of the rounds that picked items makes a fast job wait, beside slow jobs,
behind decodes a slow job will not read for seconds (its queue is as long as the fast job's, but
it drains five times slower). So each decode is given a due time: the moment its job will reach it, `now + position in the rank's queue / the job's rate`,
and the decode pool is fed earliest-due first. An item several jobs queued takes the earliest of
their due times. A job whose rate is not known yet (its first seconds) is treated as fast.

Due times are absolute (seconds of the registry's clock), so an old entry eventually comes
first: a slow job is served late, never starved.

Rates come from deliveries (`RateMeter`): items handed to the job's readers per second over the
last few seconds. A job waiting for data is measured at the rate it was served, which only puts
its next items earlier. Pure logic: the clock is the caller's.
"""

from __future__ import annotations

from collections import deque

# Items/s assumed for a job whose rate is not measured yet: its first items are due at once.
UNKNOWN_RATE = 1e4


class RateMeter:
    """Items per second a job received over the last `window_s` seconds (None before
    `min_span_s` of history)."""

    __slots__ = ("_points", "min_span_s", "total", "window_s")

    def __init__(self, window_s: float = 5.0, min_span_s: float = 0.5) -> None:
        self.window_s = window_s
        self.min_span_s = min_span_s
        self.total = 0
        self._points: deque[tuple[float, int]] = deque()  # (time, total received by then)

    def add(self, now: float, count: int) -> None:
        self.total += count
        points = self._points
        if points and now <= points[-1][0]:
            points[-1] = (points[-1][0], self.total)
        else:
            points.append((now, self.total))
        while len(points) > 2 and now - points[1][0] >= self.window_s:
            points.popleft()

    def rate(self, now: float) -> float | None:
        """Items received after the window's first delivery, over the time since it."""
        if not self._points:
            return None
        start, received = self._points[0]
        span = now - start
        if span < self.min_span_s:
            return None
        return (self.total - received) / span


def due_time(now: float, position: int, rate: float | None) -> float:
    """When an item at `position` in a queue drained at `rate` items/s is consumed."""
    return now + position / (rate if rate else UNKNOWN_RATE)
