"""What a worker the forker sent late becomes (joader.server.pool.spawning.adopt_as): pure."""

from __future__ import annotations

import pytest

from joader.server.pool.spawning import adopt_as


@pytest.mark.parametrize("asked_probation", [False, True])
def test_a_member_when_only_a_member_is_wanted(asked_probation: bool) -> None:
    assert adopt_as(asked_probation=asked_probation, member_wanted=True, probation_wanted=False) == "member"


@pytest.mark.parametrize("asked_probation", [False, True])
def test_the_probation_worker_when_only_it_is_wanted(asked_probation: bool) -> None:
    assert adopt_as(asked_probation=asked_probation, member_wanted=False, probation_wanted=True) == "probation"


def test_both_wanted_goes_to_the_need_it_was_asked_for() -> None:
    assert adopt_as(asked_probation=True, member_wanted=True, probation_wanted=True) == "probation"
    assert adopt_as(asked_probation=False, member_wanted=True, probation_wanted=True) == "member"


@pytest.mark.parametrize("asked_probation", [False, True])
def test_nothing_wanted_stops_it(asked_probation: bool) -> None:
    assert adopt_as(asked_probation=asked_probation, member_wanted=False, probation_wanted=False) is None
