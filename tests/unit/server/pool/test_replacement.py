"""The decode pool's replacement policy (joader.server.pool.replacement), with an injected clock."""

from __future__ import annotations

import random

from joader.server.pool.replacement import ReplacementConfig, ReplacementPolicy


def test_ten_replacements_a_minute_then_slower_never_none() -> None:
    policy = ReplacementPolicy()
    assert all(policy.allow(now=float(i)) for i in range(10))
    assert not policy.allow(10.0) and policy.crash_loop  # the 11th waits first_backoff_s
    assert policy.retry_at() == 11.0
    assert not policy.allow(10.5) and policy.allow(11.0)
    assert policy.retry_at() == 13.0  # then 2 s, 4 s, ... up to 30 s apart
    waits = []
    now = 13.0
    for _ in range(8):
        assert policy.allow(now)
        waits.append(policy.retry_at() - now)
        now = policy.retry_at()
    assert waits == [4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0, 30.0]


def test_a_quiet_minute_ends_the_crash_loop() -> None:
    policy = ReplacementPolicy()
    for i in range(11):
        policy.allow(float(i))
    assert policy.crash_loop
    assert not policy.update(60.0) and policy.crash_loop
    assert policy.update(71.5) and not policy.crash_loop
    assert policy.allow(71.6)  # at once again


def test_against_a_model_the_policy_never_refuses_forever() -> None:
    """Random deaths: every refusal is followed by an allowed replacement within max_backoff_s,
    and replacements are never closer than the backoff in force."""
    rng = random.Random(5)
    config = ReplacementConfig()
    for _ in range(50):
        policy = ReplacementPolicy(config)
        now = 0.0
        for _ in range(200):
            now += rng.expovariate(1.0)
            if policy.allow(now):
                continue
            retry = policy.retry_at()
            assert now < retry <= now + config.max_backoff_s
            assert policy.allow(retry)
            now = retry


def test_a_charged_death_counts_toward_the_window_and_can_start_a_crash_loop() -> None:
    """`charge` records a death nothing explains whose replacement already started (a suspect
    that proved innocent): ten of them are a full window, the eleventh starts the backoff."""
    policy = ReplacementPolicy()
    for i in range(10):
        policy.charge(float(i))
    assert not policy.crash_loop and policy.retry_at() == float("-inf")
    policy.charge(10.0)
    assert policy.crash_loop and policy.retry_at() == 11.0
    assert not policy.allow(10.5) and policy.allow(11.0)
    assert policy.update(72.0) and not policy.crash_loop  # a quiet minute still ends it


def test_charges_age_out_of_the_window() -> None:
    policy = ReplacementPolicy()
    for i in range(10):
        policy.charge(float(i))
    assert policy.allow(61.5)  # the first charges are older than a minute by now
    assert not policy.crash_loop
