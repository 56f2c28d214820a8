"""Seeded job mixes shared by the statistical tests of joader.sampling.

`run_mixed` drives a sampler the way the server will: overlapping datasets of different sizes,
every job sitting out rounds at random (each at its own rate), two jobs joining mid-run and
leaving in the middle of their own and the others' epochs, and one job whose epoch is reset now
and then. Everything each job receives goes through an `EpochRecorder`.
"""

from __future__ import annotations

import random

from pyroaring import BitMap

from joader.sampling import make_sampler
from joader.sampling.checks import EpochRecorder

ID_SPACE = 48


def random_subset(rng: random.Random, size: int) -> BitMap:
    return BitMap(rng.sample(range(ID_SPACE), size))


def run_mixed(seed: int, sampler_name: str = "dependent", num_rounds: int = 6000) -> EpochRecorder:
    """Run the mixed scenario; returns the recorder (datasets and per-epoch streams)."""
    rng = random.Random(seed)
    sampler = make_sampler(sampler_name, seed)
    recorder = EpochRecorder()
    # long-lived jobs: sizes 12..30 over a 48-id space, so they overlap partially; "nested" is
    # a subset of "large", the tuning-run-on-a-subset case
    large = random_subset(rng, 30)
    datasets = {
        "small": random_subset(rng, 12),
        "medium": random_subset(rng, 20),
        "large": large,
        "nested": BitMap(rng.sample(sorted(large), 16)),
    }
    rates = {job_id: rng.uniform(0.6, 1.0) for job_id in datasets}
    for job_id, dataset in datasets.items():
        sampler.add_job(job_id, dataset)
    active = list(datasets)
    # transient jobs: (join round, leave round, dataset)
    transient = {
        "visitor1": (rng.randrange(200, 1500), rng.randrange(2500, 4000), random_subset(rng, 25)),
        "visitor2": (rng.randrange(1000, 3000), rng.randrange(4500, 5900), random_subset(rng, 9)),
    }
    for round_index in range(num_rounds):
        for job_id, (join, leave, dataset) in transient.items():
            if round_index == join:
                sampler.add_job(job_id, dataset)
                rates[job_id] = rng.uniform(0.5, 1.0)
                active.append(job_id)
            elif round_index == leave:
                recorder.abandon(sampler, job_id)
                sampler.remove_job(job_id)
                active.remove(job_id)
        if round_index % 997 == 500:  # now and then a job abandons its epoch midway
            recorder.abandon(sampler, "medium")
            sampler.reset_epoch("medium")
        participants = [job_id for job_id in active if rng.random() < rates[job_id]]
        rng.shuffle(participants)  # the participant order must not matter
        recorder.record(sampler, sampler.sample(participants))
    return recorder
