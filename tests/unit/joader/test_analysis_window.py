"""`joader analyze`'s model against windows measured on real runs (issue 38): its prediction for
the setting that was measured reproduces the measured stall, and its what-ifs move with the
decode workers only when data is the limit."""

from __future__ import annotations

import pytest

from joader.analysis import STATED_ERROR, HostWindow, JobWindow, predict

# 4 jobs whose step is CPU work, 1 decode worker, a whole-dataset cache (nothing decoded in the
# window), 2 cores of which other processes used 0.42: the host is full. The client's clocks
# (step + wait per sample) miss the time between epochs and overstate each job's rate by 5%.
FULL_HOST = HostWindow(cores=2.0, workers=1, decode_cpu_s=0.0, decodes_per_delivery=0.0,
                       fresh_decodes_per_delivery=0.25, server_cpu_per_sample=0.0000806,
                       jobs_cpu_per_sample=0.0017986, rest_cores=0.42, cache_bytes=71565312,
                       data_bytes=58982400)
CPU_STEP_JOBS = [JobWindow("j0", "j0", 300, 237.3, 0.031, 0.003877, 0.000124),
                 JobWindow("j1", "j1", 300, 207.7, 0.0222, 0.004111, 0.0000933),
                 JobWindow("j2", "j2", 300, 199.0, 0.0186, 0.004711, 0.0000893),
                 JobWindow("j3", "j3", 300, 199.0, 0.0184, 0.004698, 0.0000881)]

# 2 jobs with no step on 1 decode worker, a quarter cache; other processes used 0.83 of 2 cores.
BUSY_HOST = HostWindow(cores=2.0, workers=1, decode_cpu_s=0.001778, decodes_per_delivery=0.3998,
                       fresh_decodes_per_delivery=0.5, server_cpu_per_sample=0.0001972,
                       jobs_cpu_per_sample=0.000152, rest_cores=0.83, cache_bytes=14745600,
                       data_bytes=58982400)
STEPLESS_JOBS = [JobWindow("a", "a", 300, 552.5, 0.9772, 0.00004, 0.0017),
                 JobWindow("b", "b", 300, 552.5, 0.979, 0.000037, 0.0017)]


def test_the_current_setting_reproduces_a_compute_bound_window_on_a_full_host() -> None:
    """The issue's case: measured 2-3%, predicted 12-17% for the very setting measured."""
    for workers in (1, 2, 3):
        prediction = predict(CPU_STEP_JOBS, FULL_HOST, workers=workers)
        for job in CPU_STEP_JOBS:
            assert job.stall is not None
            assert abs((prediction.stall[job.job_id] or 0.0) - job.stall) <= STATED_ERROR / 5, (workers, job)
            assert prediction.samples_per_s[job.job_id] == pytest.approx(job.samples_per_s, rel=0.01)


def test_data_bound_what_ifs_move_with_the_workers_on_a_host_others_keep_busy() -> None:
    """Other processes used 0.83 of the 2 cores: a second worker still gets a fair share of
    them, so it helps (the model that let others keep theirs first predicted 1, 2, 3 alike)."""
    now = predict(STEPLESS_JOBS, BUSY_HOST)
    for job in STEPLESS_JOBS:
        assert job.stall is not None
        assert abs((now.stall[job.job_id] or 0.0) - job.stall) <= STATED_ERROR / 5
        assert now.samples_per_s[job.job_id] == pytest.approx(job.samples_per_s, rel=0.01)
    one, two, three = (predict(STEPLESS_JOBS, BUSY_HOST, workers=k) for k in (1, 2, 3))
    assert one.samples_per_s["a"] < two.samples_per_s["a"] / 1.15 < three.samples_per_s["a"] / 1.15
    assert (two.stall["a"] or 0.0) < (one.stall["a"] or 0.0)
    assert (two.epoch_s["a"] or 0.0) < (one.epoch_s["a"] or 0.0)
