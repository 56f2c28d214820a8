"""The decode timeout in force (joader.server.pool.timeout): "auto" by default, fitted to the
measured decode times; an explicit --decode-timeout-s as given."""

from __future__ import annotations

import random

import pytest

from joader.server.pool.timeout import (
    FLOOR_S,
    MIN_SAMPLES,
    START_S,
    AutoTimeout,
    DecodeTimes,
    auto_timeout_s,
)

pytestmark = pytest.mark.timeout(30)


def test_auto_is_the_start_value_until_enough_decodes_were_measured() -> None:
    assert auto_timeout_s([]) == START_S
    assert auto_timeout_s([0.004] * (MIN_SAMPLES - 1)) == START_S
    assert auto_timeout_s([], AutoTimeout(ceiling_s=4.0)) == 4.0  # never above the ceiling


def test_auto_is_the_floor_for_photos_and_a_multiple_of_the_tail_for_slow_data() -> None:
    rng = random.Random(5)
    photos = [rng.uniform(0.002, 0.008) for _ in range(1000)]
    assert auto_timeout_s(photos) == FLOOR_S  # 20 x 8 ms is below the floor
    slow = [0.05] * 985 + [0.5] * 15  # a tail of big images: 1.5% at 0.5 s
    assert auto_timeout_s(slow) == pytest.approx(20 * 0.5)
    huge = [3.0] * 100  # every decode takes seconds: capped by the ceiling
    assert auto_timeout_s(huge) == 60.0
    assert auto_timeout_s(huge, AutoTimeout(ceiling_s=90.0)) == 60.0


def test_the_p99_ignores_the_slowest_percent() -> None:
    times = [0.2] * 99 + [30.0]  # one decode hung for 30 s before it finished
    assert auto_timeout_s(times) == pytest.approx(20 * 0.2)


def test_decode_times_follow_the_latest_window_and_say_when_to_log() -> None:
    times = DecodeTimes(None)
    assert times.auto and times.limit_s == START_S and times.to_log() == START_S
    for _ in range(MIN_SAMPLES):
        times.add(0.005)
    assert times.limit_s == FLOOR_S and times.to_log() == FLOOR_S
    assert times.to_log() is None  # logged once
    assert "auto" in times.describe() and "p99" in times.describe()
    for _ in range(2000):  # the data turns slow: the window follows
        times.add(0.25)
    assert times.limit_s == pytest.approx(5.0) and times.to_log() == pytest.approx(5.0)


def test_an_explicit_timeout_is_kept_whatever_is_measured() -> None:
    times = DecodeTimes(0.3)
    for _ in range(100):
        times.add(1.0)
    assert not times.auto and times.limit_s == 0.3 and "--decode-timeout-s" in times.describe()
