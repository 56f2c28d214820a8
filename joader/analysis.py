"""The data-stall model behind `joader analyze` (DS-Analyzer's questions, for a shared joaderd).

Pure: it takes what was measured over a window and answers what-ifs; `joader.client.analyze`
does the measuring. The model and its assumptions (docs/analyze.md has the long form):

- Job j, left alone with data always ready, would consume `u_j = 1 / c_j` samples/s, where
  `c_j` is its measured step time per sample (the training loop's time between `next()` calls,
  reported by the client); a job that is compute-bound now keeps the little it still waits per
  sample (request latency, the copy), which more decoding would not remove. Its stall is `w / (w + c)`: with a delivered rate `x_j`, the stall is
  `1 - x_j * c_j`.
- Delivering `X` samples/s costs `X * m` decodes/s, where `m` is decodes per delivery (measured;
  sharing between jobs and copies kept across epochs make it < 1).
- Capacity. Each decode worker is one process: at most one core, so `k` workers decode at most
  `k / d` items/s (`d`: CPU seconds per decode, measured from the workers' CPU time). And the
  host has `C` cores: decodes (`m * d` per sample), joaderd's own work (`e` per sample) and the
  jobs' processes (`g` per sample: copies, collate, and any CPU their step uses) share what
  other processes (`C_rest`) leave. So `X <= k / (m d)` and `X <= (C - C_rest) / (m d + e + g)`.
- Sharing the capacity. joaderd decodes what is due soonest (deadline pacing), so a job that
  asks for less than its share gets all it asks for and the rest is split evenly: water-filling,
  `x_j = min(u_j, L)` with `sum_j x_j = X_cap`.
- Calibration. At the current setting the model's capacity is scaled to the measured total rate
  when the host is prep-bound (so systematic error cancels in the what-ifs); compute-bound, the
  capacity is not observed and is taken as modelled.
- Cache. Decodes per delivery for a cache of `S` bytes, with `B` the bytes of the jobs' data:
  `m(S) = m_fresh * (1 - min(1, S / B))`, where `m_fresh` is decodes per delivery without
  cross-epoch reuse (one over within-epoch sharing): the share `S / B` of an epoch's items is
  assumed to stay cached for the next epoch. Scaled to the measured `m` at the current size. A
  whole-dataset cache decodes nothing after the first epoch; the figures are for later epochs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREP_BOUND_STALL = 0.10  # a job waiting this share of its time or more is prep-bound


@dataclass(frozen=True)
class JobWindow:
    """One job, measured over the window."""

    name: str
    job_id: str
    epoch_items: int
    samples_per_s: float  # delivered
    stall: float | None  # measured wait / (wait + step); None: not measured (DataLoader workers)
    step_s_per_sample: float | None  # c_j
    wait_s_per_sample: float = 0.0  # w_j: what it waited per sample (for a compute-bound job:
    # the requests' latency, which more decoding does not remove)


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
    limit: str = ""  # "jobs" (compute-bound), "decode workers" or "host CPU"


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


def cache_factor(host: HostWindow, cache_bytes: int) -> float:
    """Decodes per delivery with a cache of `cache_bytes`, from the measured ones."""
    def kept(size: int) -> float:
        return min(1.0, size / host.data_bytes) if host.data_bytes > 0 else 1.0

    modelled_now = host.fresh_decodes_per_delivery * (1 - kept(host.cache_bytes))
    scale = host.decodes_per_delivery / modelled_now if modelled_now > 0 else 1.0
    return host.fresh_decodes_per_delivery * (1 - kept(cache_bytes)) * scale


def capacity(host: HostWindow, workers: int, decodes_per_delivery: float) -> tuple[float, str]:
    """Samples/s the host can deliver with `workers` decode workers, and what limits it."""
    per_sample = decodes_per_delivery * host.decode_cpu_s
    by_workers = workers / per_sample if per_sample > 0 else float("inf")
    cpu_per_sample = per_sample + host.server_cpu_per_sample + host.jobs_cpu_per_sample
    free = max(0.05, host.cores - host.rest_cores)
    by_cpu = free / cpu_per_sample if cpu_per_sample > 0 else float("inf")
    return (by_workers, "decode workers") if by_workers <= by_cpu else (by_cpu, "host CPU")


def predict(jobs: list[JobWindow], host: HostWindow, *, workers: int | None = None,
            cache_bytes: int | None = None) -> Prediction:
    """Each job's rate, stall and epoch time with `workers` decode workers and a cache of
    `cache_bytes` (default: as now), calibrated on the measured rates."""
    measured = [j for j in jobs if j.step_s_per_sample]
    demands = [1.0 / _per_sample_floor(j) for j in measured]
    m_now = host.decodes_per_delivery
    now_cap, _ = capacity(host, host.workers, m_now)
    delivered_now = sum(j.samples_per_s for j in measured)
    prep_bound_now = any(j.stall is not None and j.stall >= PREP_BOUND_STALL for j in measured)
    calibration = min(1.5, delivered_now / now_cap) if prep_bound_now and now_cap > 0 and delivered_now > 0 else 1.0
    m = cache_factor(host, cache_bytes) if cache_bytes is not None else m_now
    cap, limit = capacity(host, workers if workers is not None else host.workers, m)
    cap *= calibration
    rates = water_fill(demands, cap)
    result = Prediction(capacity=cap, limit=limit if sum(demands) > cap else "jobs")
    for job, rate in zip(measured, rates, strict=True):
        assert job.step_s_per_sample is not None
        result.samples_per_s[job.job_id] = rate
        result.stall[job.job_id] = max(0.0, 1.0 - rate * job.step_s_per_sample)  # the residual wait counts
        result.epoch_s[job.job_id] = job.epoch_items / rate if rate > 0 else None
    for job in jobs:
        if job not in measured:
            result.samples_per_s[job.job_id] = job.samples_per_s
            result.stall[job.job_id] = None
            result.epoch_s[job.job_id] = None
    return result


def _per_sample_floor(job: JobWindow) -> float:
    """Seconds per sample the job needs even with data always ready: its step, plus, when it is
    compute-bound now, the little it still waits (a request's round trip, the copy), which more
    decoding would not remove. A prep-bound job's wait is the stall itself: not counted."""
    assert job.step_s_per_sample is not None
    residual = job.wait_s_per_sample if classify(job) == "compute" else 0.0
    return job.step_s_per_sample + residual


def classify(job: JobWindow) -> str:
    """'prep' (waits for data), 'compute' (data keeps up) or 'unknown' (no stall measured)."""
    if job.stall is None:
        return "unknown"
    return "prep" if job.stall >= PREP_BOUND_STALL else "compute"
