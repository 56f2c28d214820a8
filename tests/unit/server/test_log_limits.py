"""Repeated log lines are counted, not logged (server/log_limits.py), with a fake clock: the
burst per window, one count per window after it ends, kinds apart, and the handler's filter
writing the counts at the next line and at exit."""

from __future__ import annotations

import io
import logging

import pytest

from joader.server.log_limits import (
    PeerGoneFilter,
    RepeatFilter,
    RepeatLimiter,
    Summary,
    summary_text,
)


def test_the_first_lines_of_a_kind_pass_and_the_rest_are_counted() -> None:
    limiter = RepeatLimiter(burst=2, interval_s=60.0)
    decisions = [limiter.admit("bad", 100.0 + i * 0.01, "bad message") for i in range(200)]
    assert decisions[:2] == [True, True] and not any(decisions[2:])
    assert limiter.due(159.9) == []  # the window is still open
    assert limiter.due(160.0) == [Summary("bad", 198, 60.0, "bad message", logging.INFO)]
    assert limiter.due(200.0) == []  # each count once


def test_a_window_that_counted_nothing_says_nothing_and_a_new_one_opens_after_it() -> None:
    limiter = RepeatLimiter(burst=1, interval_s=10.0)
    assert limiter.admit("k", 0.0, "first")
    assert limiter.due(10.0) == []
    assert limiter.admit("k", 10.0, "second")  # a new window: its first line is logged
    assert not limiter.admit("k", 11.0)
    [summary] = limiter.due(20.0)
    assert (summary.count, summary.example) == (1, "second")


def test_kinds_are_limited_apart() -> None:
    limiter = RepeatLimiter(burst=1, interval_s=60.0)
    assert limiter.admit("a", 0.0) and limiter.admit("b", 0.0)
    assert not limiter.admit("a", 1.0)
    assert limiter.admit("c", 30.0)
    assert [s.key for s in limiter.due(60.0)] == ["a"]  # b counted nothing; c's window is open
    assert not limiter.admit("c", 61.0)
    assert [(s.key, s.count) for s in limiter.flush()] == [("c", 1)]


def test_a_flood_of_a_long_time_logs_two_lines_a_window() -> None:
    limiter = RepeatLimiter(burst=1, interval_s=60.0)
    logged = summaries = 0
    for i in range(600_000):  # 1,000 lines a second for 10 minutes
        now_s = i / 1000
        summaries += len(limiter.due(now_s))
        logged += limiter.admit("flood", now_s)
    assert (logged, summaries) == (10, 9)
    [last] = limiter.flush()
    assert last.count == 59_999


@pytest.mark.parametrize(("burst", "interval_s"), [(0, 60.0), (1, 0.0)])
def test_a_limiter_that_would_log_nothing_is_refused(burst: int, interval_s: float) -> None:
    with pytest.raises(ValueError, match="burst"):
        RepeatLimiter(burst, interval_s)


def test_the_summary_names_the_count_the_window_and_the_first_line() -> None:
    text = summary_text(Summary("k", 199, 60.0, "malformed NextRequest on Next", logging.WARNING))
    assert text == "... repeated 199 more times in the 60 s after: malformed NextRequest on Next"


def _logger(name: str, clock: list[float]) -> tuple[logging.Logger, io.StringIO, RepeatFilter]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    repeat = RepeatFilter(handler, RepeatLimiter(burst=1, interval_s=60.0), clock=lambda: clock[0])
    handler.addFilter(repeat)
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return logger, out, repeat


def test_the_filter_keys_on_the_template_and_writes_the_count_before_the_next_line() -> None:
    clock = [0.0]
    logger, out, _ = _logger("test_log_limits.template", clock)
    try:
        for i in range(50):
            logger.warning("job %s: attached", f"j{i}")
        logger.info("job %s: attached", "other level")  # another level: another kind
        clock[0] = 61.0
        logger.info("something else")
        lines = out.getvalue().splitlines()
        assert lines == [
            "WARNING test_log_limits.template: job j0: attached",
            "INFO test_log_limits.template: job other level: attached",
            "WARNING test_log_limits.template: ... repeated 49 more times in the 60 s after: job j0: attached",
            "INFO test_log_limits.template: something else",
        ]
    finally:
        logger.handlers.clear()


def test_the_filter_flushes_what_it_counted_at_exit() -> None:
    clock = [0.0]
    logger, out, repeat = _logger("test_log_limits.flush", clock)
    try:
        for _ in range(3):
            logger.error("internal error in %s", "Next")
        repeat.flush()
        assert out.getvalue().splitlines()[-1] == (
            "ERROR test_log_limits.flush: ... repeated 2 more times in the 60 s after: internal error in Next")
    finally:
        logger.handlers.clear()


def test_a_line_can_name_its_kind_and_burst() -> None:
    clock = [0.0]
    logger, out, repeat = _logger("test_log_limits.extra", clock)
    repeat._limiter.burst = 10  # the default burst; the lines below ask for 1
    try:
        for problem in ("corrupt", "bad UTF-8"):
            for _ in range(20):
                logger.warning("refused a malformed message: %s", problem,
                               extra={"repeat_key": ("malformed", problem), "repeat_burst": 1})
        repeat.flush()
        assert out.getvalue().splitlines() == [
            "WARNING test_log_limits.extra: refused a malformed message: corrupt",
            "WARNING test_log_limits.extra: refused a malformed message: bad UTF-8",
            "WARNING test_log_limits.extra: ... repeated 19 more times in the 60 s after: "
            "refused a malformed message: corrupt",
            "WARNING test_log_limits.extra: ... repeated 19 more times in the 60 s after: "
            "refused a malformed message: bad UTF-8",
        ]
    finally:
        logger.handlers.clear()


def test_a_client_gone_before_its_status_is_one_info_line_without_a_traceback() -> None:
    """grpc.aio's ERROR and core traceback when the status of a call whose client went away
    cannot be sent (seen under attach/cancel loops, NOTE [ A client gone before its status ])."""
    try:
        raise RuntimeError('Failed "execute_batch"')
    except RuntimeError:
        import sys
        exc_info = sys.exc_info()
    record = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, __file__, 1,
                               "ExecuteBatchError raised in core by servicer method [/joader.Joader/Attach]",
                               None, exc_info)
    assert PeerGoneFilter().filter(record)
    assert record.levelno == logging.INFO and record.levelname == "INFO" and record.exc_info is None
    assert record.getMessage() == ("a client went away before joaderd's reply to /joader.Joader/Attach could be "
                                   "sent (nothing lost)")
    other = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, __file__, 1, "Unexpected error", None, None)
    assert PeerGoneFilter().filter(other) and other.levelno == logging.ERROR
