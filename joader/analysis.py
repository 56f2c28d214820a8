"""The data-stall model behind `joader analyze` (DS-Analyzer's questions, for a shared joaderd).

Pure: it takes what was measured over a window and answers what-ifs; `joader.client.tools.analyze`
does the measuring. The model and its assumptions (docs/analyze.md has the long form):

- Time per sample. Job j's wall time per delivered sample is `1 / x_j`; its measured stall `s_j`
  of that is waiting for data, the rest `c_j = (1 - s_j) / x_j` is its step (with whatever the
  loop does between epochs). With data always ready it would consume `u_j = 1 / c_j` samples/s;
  a job that is compute-bound now keeps the little it still waits per sample (`w_j = s_j / x_j`:
  a request's round trip, the copy), which more decoding would not remove. With a delivered rate
  `x_j`, its stall is `1 - x_j c_j`.
- Delivering `X` samples/s costs `X m` decodes/s, where `m` is decodes per delivery (measured;
  sharing between jobs and copies kept across epochs make it < 1).
- Capacity: the largest `X` whose CPU needs the host's `C` cores can meet when shared fairly
  (max-min, as the kernel shares them between busy processes). Needs at rate `X`: each of the
  `k` decode workers `X m d / k` (`d`: CPU seconds per decode), joaderd's main process `X e`,
  each job's process `X g / n`; none can use more than one core. Other processes are taken to
  want the cores they used in the window (`C_rest`), in entities of at most one core, and to
  give way to joader's processes only down to a fair share. So a worker more adds a core's
  fair share, not a whole core, on a busy host, and none on a host that is full.
- Sharing it. joaderd decodes what is due soonest (deadline pacing), so a job that asks for less
  than its share gets all it asks for and the rest is split evenly: water-filling,
  `x_j = min(u_j, L)` with `sum_j x_j = X_cap`.
- Calibration. What was delivered, `X_now`, was possible: the capacity at the current setting is
  at least `X_now`, and when a job waits for data (prep-bound) it is `X_now`. The model's capacity
  is scaled to that, and the what-ifs keep the factor. So the prediction for the current setting
  reproduces the window it was fit on, up to how water-filling splits the rate between jobs.
- Cache. Decodes per delivery for a cache of `S` bytes, with `B` the bytes of the jobs' data:
  `m(S) = m_fresh * (1 - min(1, S / B))`, where `m_fresh` is decodes per delivery without
  cross-epoch reuse (one over within-epoch sharing): the share `S / B` of an epoch's items is
  assumed to stay cached for the next epoch. Scaled to the measured `m` at the current size. A
  whole-dataset cache decodes nothing after the first epoch; the figures are for later epochs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PREP_BOUND_STALL = 0.10  # a job waiting this share of its time or more is prep-bound
# How far the prediction for the current setting may be from the measured stall (docs/analyze.md).
STATED_ERROR = 0.05
_CALIBRATION_RANGE = (0.5, 1.5)  # a prep-bound window further off than this is not trusted


@dataclass(frozen=True)
class JobWindow:
    """One job, measured over the window."""

    name: str
    job_id: str
    epoch_items: int
    samples_per_s: float  # x_j, delivered
    stall: float | None  # measured wait / (wait + step); None: not measured (DataLoader workers)
    step_s_per_sample: float | None  # the client's step seconds per sample (used when x_j is 0)
    wait_s_per_sample: float = 0.0  # the client's wait seconds per sample (idem)


@dataclass(frozen=True)
class HostWindow:
    """joaderd and the host, measured over the same window."""

    cores: float  # C
    workers: int  # decode workers now
    decode_cpu_s: float  # d: CPU seconds per decode
    decodes_per_delivery: float  # m
    fresh_decodes_per_delivery: float  # m without cross-epoch reuse (1 / within-epoch sharing)
    server_cpu_per_sample: float  # e
    jobs_cpu_per_sample: float  # g
    rest_cores: float  # C_rest: what other processes use
    cache_bytes: int  # S now
    data_bytes: int  # B


@dataclass
class Prediction:
    samples_per_s: dict[str, float] = field(default_factory=dict)  # job id -> x_j
    stall: dict[str, float | None] = field(default_factory=dict)
    epoch_s: dict[str, float | None] = field(default_factory=dict)
    capacity: float = 0.0  # samples/s the host could deliver in total
    limit: str = ""  # "jobs" (compute-bound), "decode workers", "joaderd" or "host CPU"


def water_fill(demands: list[float], capacity: float) -> list[float]:
    """Rates `min(d_i, L)` whose sum is `capacity` (or every demand, if they fit)."""
    if sum(demands) <= capacity:
        return list(demands)
    order = sorted(range(len(demands)), key=lambda i: demands[i])
    rates = [0.0] * len(demands)
    left, remaining = capacity, len(demands)
    for i in order:
        level = left / remaining
        rates[i] = min(demands[i], level)
        left -= rates[i]
        remaining -= 1
    return rates


def per_sample(job: JobWindow) -> tuple[float, float]:
    """(step, wait) seconds per delivered sample, in the job's wall time.

    NOTE [ Wall time, not the loop's clock ]
    The client times `next()` (wait) and the time between calls (step), but not what the loop
    does between epochs (a new iterator, an evaluation, a checkpoint, the epoch's stall report).
    Taking `1 / (step + wait)` from those clocks as the job's rate overstated it by 5% with
    epochs of a second, and a compute-bound mix on a full host was then predicted to stall 11-17%
    where it measured 2-4%. Split the wall time per sample by the measured stall instead: the
    time between epochs counts as step, and the prediction at the measured rate is the measured
    stall."""
    assert job.stall is not None
    if job.samples_per_s > 0:
        return (1.0 - job.stall) / job.samples_per_s, job.stall / job.samples_per_s
    return job.step_s_per_sample or 0.0, job.wait_s_per_sample


def cache_factor(host: HostWindow, cache_bytes: int) -> float:
    """Decodes per delivery with a cache of `cache_bytes`, from the measured ones."""
    def kept(size: int) -> float:
        return min(1.0, size / host.data_bytes) if host.data_bytes > 0 else 1.0

    modelled_now = host.fresh_decodes_per_delivery * (1 - kept(host.cache_bytes))
    scale = host.decodes_per_delivery / modelled_now if modelled_now > 0 else 1.0
    return host.fresh_decodes_per_delivery * (1 - kept(cache_bytes)) * scale


def fair_shares(wants: list[float], cores: float) -> list[float]:
    """Max-min fair shares of `cores` between processes that want `wants` cores (each <= 1)."""
    return water_fill(wants, cores)


def _others(host: HostWindow) -> list[float]:
    """Other processes as entities of at most one core each, wanting what they used."""
    count = math.ceil(host.rest_cores - 1e-9)
    return [host.rest_cores / count] * count if count > 0 else []


def _fits(host: HostWindow, workers: int, num_jobs: int, m: float, rate: float) -> bool:
    """Whether the host's cores, shared fairly, meet joader's needs at `rate` samples/s."""
    needs = [rate * m * host.decode_cpu_s / workers] * workers
    needs += [rate * host.server_cpu_per_sample]
    needs += [rate * host.jobs_cpu_per_sample / num_jobs] * num_jobs
    if any(need > 1.0 for need in needs):  # one process, one core
        return False
    shares = fair_shares(needs + _others(host), host.cores)
    return all(share >= need * (1 - 1e-9) for share, need in zip(shares, needs, strict=False))


def capacity(host: HostWindow, workers: int, decodes_per_delivery: float,
             num_jobs: int = 1) -> tuple[float, str]:
    """Samples/s the host can deliver with `workers` decode workers, and what limits it."""
    workers, num_jobs = max(1, workers), max(1, num_jobs)
    bounds = {"host CPU": host.cores / max(1e-12, decodes_per_delivery * host.decode_cpu_s
                                           + host.server_cpu_per_sample + host.jobs_cpu_per_sample)}
    if decodes_per_delivery * host.decode_cpu_s > 0:
        bounds["decode workers"] = workers / (decodes_per_delivery * host.decode_cpu_s)
    if host.server_cpu_per_sample > 0:
        bounds["joaderd"] = 1.0 / host.server_cpu_per_sample
    high = min(bounds.values())
    if math.isinf(high) or high > 1e12:
        return float("inf"), "host CPU"
    low = 0.0
    for _ in range(60):
        middle = (low + high) / 2
        if _fits(host, workers, num_jobs, decodes_per_delivery, middle):
            low = middle
        else:
            high = middle
    # a process bound within 1% of the capacity is the limit; otherwise the host's cores are
    limit = min(bounds, key=bounds.__getitem__)
    if limit != "host CPU" and bounds[limit] > low * 1.01:
        limit = "host CPU"
    return low, limit


def predict(jobs: list[JobWindow], host: HostWindow, *, workers: int | None = None,
            cache_bytes: int | None = None) -> Prediction:
    """Each job's rate, stall and epoch time with `workers` decode workers and a cache of
    `cache_bytes` (default: as now), calibrated on the measured rates."""
    measured = [j for j in jobs if j.stall is not None and (j.samples_per_s > 0 or j.step_s_per_sample)]
    demands = [1.0 / max(1e-9, _per_sample_floor(j)) for j in measured]
    calibration = _calibration(jobs, measured, host)
    m = cache_factor(host, cache_bytes) if cache_bytes is not None else host.decodes_per_delivery
    cap, limit = capacity(host, workers if workers is not None else host.workers, m, len(jobs))
    cap *= calibration
    # a job whose loop is not measured (DataLoader workers) is taken to keep its rate
    unmeasured = sum(j.samples_per_s for j in jobs if j not in measured)
    rates = water_fill(demands, max(0.0, cap - unmeasured))
    result = Prediction(capacity=cap, limit=limit if sum(demands) + unmeasured > cap * (1 + 1e-9) else "jobs")
    for job, rate in zip(measured, rates, strict=True):
        step, _ = per_sample(job)
        result.samples_per_s[job.job_id] = rate
        result.stall[job.job_id] = min(1.0, max(0.0, 1.0 - rate * step))  # the residual wait counts
        result.epoch_s[job.job_id] = job.epoch_items / rate if rate > 0 else None
    for job in jobs:
        if job not in measured:
            result.samples_per_s[job.job_id] = job.samples_per_s
            result.stall[job.job_id] = None
            result.epoch_s[job.job_id] = None
    return result


def _calibration(jobs: list[JobWindow], measured: list[JobWindow], host: HostWindow) -> float:
    """The factor that makes the model's capacity at the current setting agree with the window:
    equal to what was delivered when a job waited for data, at least that when none did."""
    delivered = sum(j.samples_per_s for j in jobs)
    modelled, _ = capacity(host, host.workers, host.decodes_per_delivery, len(jobs))
    if delivered <= 0 or modelled <= 0 or math.isinf(modelled):
        return 1.0
    if any(classify(j) == "prep" for j in measured):
        low, high = _CALIBRATION_RANGE
        return min(high, max(low, delivered / modelled))
    return max(1.0, delivered / modelled)


def _per_sample_floor(job: JobWindow) -> float:
    """Seconds per sample the job needs even with data always ready: its step, plus, when it is
    compute-bound now, the little it still waits (a request's round trip, the copy), which more
    decoding would not remove. A prep-bound job's wait is the stall itself: not counted."""
    step, wait = per_sample(job)
    return step + (wait if classify(job) == "compute" else 0.0)


def classify(job: JobWindow) -> str:
    """'prep' (waits for data), 'compute' (data keeps up) or 'unknown' (no stall measured)."""
    if job.stall is None:
        return "unknown"
    return "prep" if job.stall >= PREP_BOUND_STALL else "compute"
