"""Deadline-aware preparation: rates from deliveries, due times, earliest-due decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from joader.server.books.item_cache import ItemCache
from joader.server.books.pacing import UNKNOWN_RATE, RateMeter, due_time
from joader.server.books.records import ItemState, Source

STAGE = SimpleNamespace(name="center-crop:8", size=8, spec=SimpleNamespace(shape=(3, 8, 8), dtype="uint8",
                                                                          max_nbytes=192))
LISTING = SimpleNamespace(paths=tuple(f"{i}.jpg" for i in range(100)), labels=[0] * 100)


class Pool:
    num_workers = 1

    def __init__(self) -> None:
        self.order: list[int] = []

    @property
    def in_flight(self) -> int:
        return 0  # take everything the cache dispatches

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        self.order.append(item_id)


def test_rate_meter_measures_the_recent_window() -> None:
    meter = RateMeter(window_s=5.0, min_span_s=0.5)
    assert meter.rate(0.0) is None
    meter.add(10.0, 32)
    assert meter.rate(10.2) is None  # not enough history
    for k in range(1, 11):
        meter.add(10.0 + k, 32)  # 32 items a second
    assert meter.rate(20.0) == pytest.approx(32.0, rel=0.05)
    for k in range(1, 11):
        meter.add(20.0 + k, 8)  # slows down to 8 a second: the old second fades out
    assert meter.rate(30.0) == pytest.approx(8.0, rel=0.3)
    assert meter.rate(60.0) < 2.0  # no deliveries for 30 s: the rate decays


def test_due_time_is_position_over_rate() -> None:
    assert due_time(100.0, 50, 25.0) == pytest.approx(102.0)
    assert due_time(100.0, 50, None) == pytest.approx(100.0 + 50 / UNKNOWN_RATE)


def test_decodes_run_earliest_due_first_and_an_earlier_want_moves_an_item_up() -> None:
    cache = ItemCache(100 * 192, retry_failed_s=60.0, clock=lambda: 0.0)
    source = Source("demo", LISTING, STAGE, 0, seed=1)
    # round 1 picks item 7 for a slow job (due in 4 s), round 2 item 3 for a fast one (0.1 s)
    cache.want(source, 7, 1, consumed=True, due_s=4.0)
    cache.want(source, 3, 2, consumed=True, due_s=0.1)
    cache.want(source, 5, 3, consumed=True, due_s=2.0)
    cache.want(source, 7, 4, consumed=True, due_s=1.0)  # the fast job queues 7 too: sooner
    pool = Pool()
    cache.dispatch(pool, 10, lambda s: 0)
    assert pool.order == [3, 7, 5]  # by due time, not by round; 7 only once
    assert all(cache.items[k].state is ItemState.DECODING for k in (3, 5, 7))


def test_round_order_breaks_ties_of_equal_due_times() -> None:
    cache = ItemCache(100 * 192, retry_failed_s=60.0, clock=lambda: 0.0)
    source = Source("demo", LISTING, STAGE, 0, seed=1)
    for seq, item_id in enumerate((9, 4, 6)):
        cache.want(source, item_id, seq, consumed=True, due_s=1.0)
    pool = Pool()
    cache.dispatch(pool, 10, lambda s: 0)
    assert pool.order == [9, 4, 6]


def test_reuse_hazard_sums_rate_over_items_left_of_the_jobs_that_need_the_item() -> None:
    from pyroaring import BitMap

    from tests.support.registry_driver import attach, make_registry

    registry, _, clock = make_registry()
    a = attach(registry, "demo", BitMap(range(0, 40)), "a", 4)
    b = attach(registry, "demo", BitMap(range(20, 60)), "b", 4)
    for k in range(11):  # a receives 40 items/s, b 4 items/s, for 10 s
        a.rate.add(clock.now + k, 40)
        b.rate.add(clock.now + k, 4)
    now = clock.now + 10
    scheduler, source, jobs = registry._scheduler, a.source, registry.jobs.jobs
    assert scheduler.reuse_hazard(source, 5, jobs, now) == pytest.approx(40 / 40)  # only a needs it
    assert scheduler.reuse_hazard(source, 50, jobs, now) == pytest.approx(4 / 40)  # only b
    assert scheduler.reuse_hazard(source, 25, jobs, now) == pytest.approx(40 / 40 + 4 / 40)  # both
