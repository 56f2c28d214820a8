"""Guarantee 1, exactly once: every epoch of every job is a permutation of its dataset.

The scenario (see sampling_scenarios.py) mixes overlapping datasets of different sizes, random
sitting out, jobs joining and leaving in the middle of epochs, and epoch resets. This property
is exact, not statistical: one repeated or missing item in any epoch fails the test.
"""

from __future__ import annotations

import pytest

from tests.support.sampling_scenarios import run_mixed

pytestmark = pytest.mark.timeout(60)

SEEDS = [0, 1, 2]


@pytest.mark.parametrize("sampler_name", ["dependent", "independent"])
@pytest.mark.parametrize("seed", SEEDS)
def test_every_epoch_is_a_permutation(seed: int, sampler_name: str) -> None:
    recorder = run_mixed(seed, sampler_name, num_rounds=20_000)
    assert set(recorder.datasets) == {"small", "medium", "large", "nested", "visitor1",
                                      "visitor2"}
    for job_id, dataset in recorder.datasets.items():
        assert recorder.exactly_once_problems(job_id) == []
        complete = recorder.complete_epochs(job_id)
        # enough complete epochs that the check means something, transient jobs included
        assert len(complete) >= 3, job_id
        for items in complete:
            assert sorted(items) == list(dataset)
