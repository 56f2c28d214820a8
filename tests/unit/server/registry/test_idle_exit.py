"""`--idle-exit-s`'s rule (server/registry/idle_exit.py) with a fake clock: idle since the start, since
the last job left, never while a job is attached, never with 0; and how often joaderd asks."""

from __future__ import annotations

import pytest

from joader.server.registry.idle_exit import IdleExit, check_period_s, exiting_message


def test_with_no_job_ever_idleness_counts_from_the_start() -> None:
    idle = IdleExit(2.0, now=100.0)
    assert idle.idle_s(100.0) == 0.0
    assert not idle.due(101.9)
    assert idle.idle_s(101.5) == 1.5
    assert idle.due(102.0)


def test_the_start_is_when_joaderd_serves_not_when_it_began_listing() -> None:
    idle = IdleExit(2.0, now=0.0)
    idle.serving(5.0)  # 5 s of listing, workers and imports on a busy host
    assert idle.idle_s(6.0) == 1.0 and not idle.due(6.9)
    assert idle.due(7.0)


def test_serving_leaves_a_job_already_attached_alone() -> None:
    idle = IdleExit(2.0, now=0.0)
    idle.jobs_now(1.0, attached=1)  # attached between the socket's bind and serving()
    idle.serving(1.1)
    assert idle.idle_s(10.0) is None


def test_it_counts_from_when_the_last_job_left() -> None:
    idle = IdleExit(2.0, now=0.0)
    idle.jobs_now(1.0, attached=1)
    idle.jobs_now(1.5, attached=2)
    idle.jobs_now(5.0, attached=1)  # one of two left: still attached
    assert idle.idle_s(6.0) is None and not idle.due(60.0)
    idle.jobs_now(10.0, attached=0)
    assert idle.idle_s(11.0) == 1.0
    assert not idle.due(11.9)
    assert idle.due(12.0)


def test_a_job_attached_but_idle_for_long_keeps_it_up() -> None:
    idle = IdleExit(2.0, now=0.0)
    idle.jobs_now(0.5, attached=1)
    assert not idle.due(3600.0)
    assert idle.idle_s(3600.0) is None


def test_a_second_report_of_no_job_does_not_restart_the_count() -> None:
    idle = IdleExit(2.0, now=0.0)
    idle.jobs_now(1.0, attached=1)
    idle.jobs_now(3.0, attached=0)
    idle.jobs_now(4.0, attached=0)  # another removal that found nothing (a job already gone)
    assert idle.idle_s(5.0) == 2.0 and idle.due(5.0)


def test_a_job_reattaching_after_a_restart_counts_once_it_attached() -> None:
    # A restarted joaderd starts idle; the lease keepers reattach a moment later.
    idle = IdleExit(2.0, now=0.0)
    assert not idle.due(1.9)
    idle.jobs_now(1.9, attached=1)
    assert not idle.due(30.0)
    idle.jobs_now(30.0, attached=0)
    assert idle.due(32.0)


def test_a_job_that_came_and_went_between_two_checks_restarts_the_count() -> None:
    idle = IdleExit(2.0, now=0.0)
    idle.jobs_now(1.2, attached=1)
    idle.jobs_now(1.4, attached=0)
    assert not idle.due(2.0)  # the check at 2.0 would have exited without the event
    assert idle.due(3.4)


def test_zero_never_exits_but_still_says_how_long() -> None:
    idle = IdleExit(0.0, now=0.0)
    assert not idle.due(1e9)
    assert idle.idle_s(50.0) == 50.0
    with pytest.raises(ValueError):
        IdleExit(-1.0, now=0.0)


def test_a_clock_read_before_the_start_is_not_negative_idleness() -> None:
    assert IdleExit(2.0, now=10.0).idle_s(9.0) == 0.0


@pytest.mark.parametrize(("setting", "period"), [(600.0, 1.0), (10.0, 1.0), (2.0, 0.2), (0.1, 0.05)])
def test_joaderd_asks_about_once_a_second_and_within_a_tenth_of_a_short_setting(setting: float,
                                                                                period: float) -> None:
    assert check_period_s(setting) == pytest.approx(period)


def test_the_refusal_names_the_setting_and_the_fix() -> None:
    message = exiting_message(2.0)
    assert "--idle-exit-s 2" in message and message.endswith("then the job")
