"""`joader.client.prefetch`: a thread reads ahead, the loop's thread decides what it was given."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from joader.client.prefetch import prefetched


class Source:
    """A generator that records how far it was read, in which thread, and its cleanup."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at
        self.produced = 0
        self.closed = threading.Event()
        self.threads: set[str] = set()

    def __iter__(self) -> Iterator[int]:
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise KeyError(f"item {i}")
                self.threads.add(threading.current_thread().name)
                self.produced += 1
                yield i
        finally:
            self.closed.set()


def wait_until(condition, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_values_arrive_in_order_from_the_thread_at_most_depth_ahead() -> None:
    source = Source(50)
    reader = prefetched(iter(source), depth=3, name="ahead")
    assert next(reader) == 0
    wait_until(lambda: source.produced >= 4)
    time.sleep(0.05)
    # the loop holds 0; 3 wait in the queue and the thread holds one more it cannot put
    assert source.produced == 5
    assert [next(reader) for _ in range(49)] == list(range(1, 50))
    with pytest.raises(StopIteration):
        next(reader)
    assert source.threads == {"ahead"} and source.closed.is_set()


def test_an_error_is_raised_in_the_loops_thread_after_the_values_before_it() -> None:
    reader = prefetched(iter(Source(10, fail_at=4)), depth=2, name="ahead")
    assert [next(reader) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="item 4"):
        next(reader)


def test_closing_early_stops_the_thread_and_closes_the_source() -> None:
    source = Source(1_000_000)
    reader = prefetched(iter(source), depth=2, name="ahead-close")
    assert next(reader) == 0
    reader.close()  # a `break` in the loop
    assert source.closed.is_set()  # joined: the source's cleanup ran before close() returned
    assert not any(t.name == "ahead-close" for t in threading.enumerate())
    assert source.produced <= 4


def test_a_reader_dropped_without_close_stops_its_thread() -> None:
    source = Source(1_000_000)
    reader = prefetched(iter(source), depth=2, name="ahead-dropped")
    next(reader)
    del reader  # generator finalization closes it
    wait_until(source.closed.is_set)
    wait_until(lambda: not any(t.name == "ahead-dropped" for t in threading.enumerate()))
