"""The data-stall model behind `joader analyze` (joader.analysis)."""

from __future__ import annotations

import dataclasses

import pytest

from joader.analysis import (
    HostWindow,
    JobWindow,
    capacity,
    classify,
    fair_shares,
    per_sample,
    predict,
    water_fill,
)

HOST = HostWindow(cores=2.0, workers=1, decode_cpu_s=0.004, decodes_per_delivery=0.5,
                  fresh_decodes_per_delivery=0.5, server_cpu_per_sample=0.0001, jobs_cpu_per_sample=0.0002,
                  rest_cores=0.1, cache_bytes=100, data_bytes=400)


def job(name: str, rate: float, step: float | None, stall: float | None, items: int = 1000) -> JobWindow:
    return JobWindow(name, name, items, rate, stall, step)


def test_water_filling_serves_small_demands_whole_and_splits_the_rest_evenly() -> None:
    assert water_fill([10, 20], 100) == [10, 20]
    assert water_fill([10, 100, 100], 110) == [10, 50, 50]
    assert sum(water_fill([5, 7, 300], 12.5)) == pytest.approx(12.5)


def test_capacity_is_bound_by_the_workers_or_by_the_hosts_free_cores() -> None:
    # one worker: 1 / (0.5 * 0.004) = 500/s; the cores allow 1.9 / 0.0023 = 826/s
    assert capacity(HOST, 1, 0.5) == (pytest.approx(500.0), "decode workers")
    by_cpu, limit = capacity(HOST, 4, 0.5)
    assert limit == "host CPU" and by_cpu == pytest.approx(1.9 / 0.0023)


def test_a_compute_bound_mix_is_predicted_without_stall_and_unchanged_by_workers() -> None:
    jobs = [job("a", 100, 0.01, 0.01), job("b", 50, 0.02, 0.0)]  # 150/s wanted, 500/s possible
    for workers in (1, 2, 3):
        prediction = predict(jobs, HOST, workers=workers)
        assert prediction.limit == "jobs"
        assert prediction.samples_per_s == {"a": pytest.approx(100), "b": pytest.approx(50)}
        assert prediction.stall == {"a": pytest.approx(0.01), "b": pytest.approx(0.0)}  # as measured
        assert prediction.epoch_s["a"] == pytest.approx(10.0)
    assert [classify(j) for j in jobs] == ["compute", "compute"]


def test_a_prep_bound_mix_is_calibrated_on_what_was_measured_and_gains_from_a_worker() -> None:
    # each job wants 1000/s; one worker measured 400/s in total (the model says 500: calibrated)
    jobs = [job("a", 200, 0.001, 0.8), job("b", 200, 0.001, 0.8)]
    now = predict(jobs, HOST)
    assert now.samples_per_s == {"a": pytest.approx(200), "b": pytest.approx(200)}
    assert now.stall["a"] == pytest.approx(0.8) and now.limit == "decode workers"
    roomy = dataclasses.replace(HOST, cores=8.0)
    two = predict(jobs, roomy, workers=2)
    assert two.samples_per_s["a"] == pytest.approx(400)  # twice the workers, same calibration
    assert two.stall["a"] == pytest.approx(0.6) and two.limit == "decode workers"
    # on two cores the second worker shares them with joaderd and the jobs: less than twice
    tight = predict(jobs, HOST, workers=2)
    assert tight.limit == "host CPU"
    assert tight.samples_per_s["a"] == pytest.approx(1.9 / 0.0023 * 0.8 / 2)
    assert classify(jobs[0]) == "prep"


def test_a_larger_cache_means_fewer_decodes_and_a_whole_one_none() -> None:
    jobs = [job("a", 200, 0.001, 0.8)]
    half, double, whole = (predict(jobs, HOST, cache_bytes=size) for size in (50, 200, 400))
    assert half.samples_per_s["a"] < predict(jobs, HOST).samples_per_s["a"] < double.samples_per_s["a"]
    assert whole.samples_per_s["a"] == pytest.approx(1000)  # nothing to decode: as fast as its step
    assert whole.stall["a"] == pytest.approx(0.0)


def test_a_job_without_a_measured_stall_is_reported_as_is() -> None:
    jobs = [job("w", 300, None, None), job("a", 100, 0.01, 0.0)]
    prediction = predict(jobs, HOST, workers=2)
    assert prediction.samples_per_s["w"] == 300 and prediction.stall["w"] is None
    assert classify(jobs[0]) == "unknown"


def test_a_compute_bound_job_keeps_its_small_residual_wait_in_the_what_ifs() -> None:
    # 100/s, 5% of it waiting: 0.0095 s of step and 0.0005 s of wait per sample of wall time
    jobs = [JobWindow("a", "a", 1000, 100.0, 0.05, 0.0095, wait_s_per_sample=0.0005)]
    prediction = predict(jobs, HOST, workers=3)
    assert prediction.samples_per_s["a"] == pytest.approx(100.0)
    assert prediction.stall["a"] == pytest.approx(0.05) and prediction.epoch_s["a"] == pytest.approx(10.0)


def test_the_step_is_the_wall_time_per_sample_less_the_stall_not_the_clients_clock() -> None:
    """The client's clocks miss the time between epochs: its step + wait per sample say 125/s
    where 100/s were delivered. The job's demand is what the window shows, 100/s."""
    jobs = [JobWindow("a", "a", 1000, 100.0, 0.02, 0.0078, wait_s_per_sample=0.0002)]
    assert per_sample(jobs[0]) == (pytest.approx(0.0098), pytest.approx(0.0002))
    tight = dataclasses.replace(HOST, rest_cores=2.0 - 100 * 0.0023)  # the host exactly full at 100/s
    prediction = predict(jobs, tight)
    assert prediction.samples_per_s["a"] == pytest.approx(100.0, rel=1e-6)
    assert prediction.stall["a"] == pytest.approx(0.02, abs=1e-6)


def test_cores_are_shared_fairly_so_a_worker_more_gains_a_share_of_a_busy_host() -> None:
    assert fair_shares([0.2, 1.0, 1.0], 2.0) == [pytest.approx(0.2), pytest.approx(0.9), pytest.approx(0.9)]
    # others use 1.5 cores (two processes of 0.75): the 0.5 core left is not the limit, the
    # kernel shares: one worker gets a third of the 2 cores, two workers half a core each
    busy = dataclasses.replace(HOST, rest_cores=1.5, server_cpu_per_sample=0.0, jobs_cpu_per_sample=0.0)
    one, limit_one = capacity(busy, 1, 0.5)
    two, limit_two = capacity(busy, 2, 0.5)
    assert one == pytest.approx((2 / 3) / 0.002, rel=1e-6) and limit_one == "host CPU"
    assert two == pytest.approx(1.0 / 0.002, rel=1e-6) and limit_two == "host CPU"


def test_joaderds_one_process_is_named_when_it_is_the_limit() -> None:
    heavy = dataclasses.replace(HOST, cores=8.0, rest_cores=0.0, server_cpu_per_sample=0.001)
    rate, limit = capacity(heavy, 4, 0.5)  # the workers could do 2,000/s, joaderd's core 1,000/s
    assert rate == pytest.approx(1000.0, rel=1e-6) and limit == "joaderd"


def test_a_job_read_through_dataloader_workers_keeps_its_rate_and_its_share_of_the_capacity() -> None:
    # one worker does 500/s (calibrated: 400/s were delivered); 150 of them go to the unmeasured job
    jobs = [job("w", 150, None, None), job("a", 250, 0.001, 0.75)]
    now = predict(jobs, HOST)
    assert now.samples_per_s == {"w": 150, "a": pytest.approx(250)}
    assert now.stall["a"] == pytest.approx(0.75) and now.limit == "decode workers"
    # two workers: the cores allow 826/s, calibrated 661/s, of which 150 stay with "w"
    two = predict(jobs, HOST, workers=2)
    assert two.samples_per_s["a"] == pytest.approx(1.9 / 0.0023 * 0.8 - 150)
