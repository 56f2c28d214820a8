"""The bounds the field bench compares measured sharing with: the timeline bound (what the jobs'
reading times allowed), the in-step bound of a schedule, and the first reader's start lead."""

from __future__ import annotations


def timeline_bound(timelines: list[list[tuple[float, float]]], bin_s: float) -> dict[str, float]:
    """The timeline bound (module docstring): `timelines` holds each job's batches as (arrival
    time, items), any common clock. Returns deliveries, the fewest decodes perfect sharing
    without reuse across bins needs (sum over bins of the largest delivery count of any job in
    the bin; each job's count piecewise linear between its batch arrivals, the first batch
    spread over the job's median gap) and their ratio."""
    import numpy as np

    curves = []
    for batches in timelines:
        if not batches:
            continue
        times = np.array([t for t, _ in batches], dtype=float)
        counts = np.array([c for _, c in batches], dtype=float)
        gaps = np.diff(times)
        first_gap = float(np.median(gaps)) if len(gaps) else bin_s
        xs = np.concatenate([[times[0] - max(first_gap, 1e-6)], times])
        ys = np.concatenate([[0.0], np.cumsum(counts)])
        curves.append((xs, ys))
    if not curves:
        return {"deliveries": 0.0, "min_decodes": 0.0, "bound": 0.0}
    start = min(xs[0] for xs, _ in curves)
    end = max(xs[-1] for xs, _ in curves)
    edges = np.arange(start, end + bin_s, bin_s)
    per_bin = np.stack([np.diff(np.interp(edges, xs, ys, left=0.0, right=ys[-1])) for xs, ys in curves])
    deliveries = float(sum(ys[-1] for _, ys in curves))
    min_decodes = float(per_bin.max(axis=0).sum())
    return {"deliveries": deliveries, "min_decodes": round(min_decodes, 1),
            "bound": round(deliveries / min_decodes, 4) if min_decodes else 0.0}


def start_lead(timelines: list[list[tuple[float, float]]]) -> int:
    """How far ahead the first reader was when the last one got its first batch: items the first
    reader had received by then. Jobs launched together with no barrier start this far apart in
    their epochs, and a lead beyond the cache is lost to sharing for good (the late job's last
    items of each epoch are ones the others read a lead ago: docs/decisions.md, "Epoch
    alignment")."""
    started = [batches for batches in timelines if batches]
    if len(started) < 2:
        return 0
    last_first = max(batches[0][0] for batches in started)
    first = min(started, key=lambda batches: batches[0][0])
    return int(sum(c for t, c in first if t < last_first))


def in_step_bound(schedule: str, n: int, jobs: int, epochs: int) -> float | None:
    """sweep_trace's in-step bound for together (arrivals 0) and staggered (half an epoch apart)."""
    from bench.field.sweep_trace import JobSpec, schedule_bound

    if schedule in ("together", "together-nb"):
        arrivals = [0] * jobs
    elif schedule == "staggered":
        arrivals = [i * (n // 2) for i in range(jobs)]
    else:
        return None
    return schedule_bound([JobSpec(n)] * jobs, arrivals, epochs)
