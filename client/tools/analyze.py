"""`joader analyze`: per job, its data stall, what bounds it, and what more CPU or cache would buy.

It watches a running joaderd for `--interval` seconds (two status snapshots, and the CPU time
of joaderd, its decode workers, the jobs' processes and the whole host, from psutil), then runs
the model of `joader.analysis` for k more or fewer decode workers and for caches of 1/2x, 2x and
the whole dataset. `--json` prints the same for scripts. The model, its assumptions and its
measured error are in docs/analyze.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import psutil

from joader.analysis import (
    STATED_ERROR,
    HostWindow,
    JobWindow,
    Prediction,
    classify,
    per_sample,
    predict,
)
from joader.client.tools.cli import fetch_status, format_bytes


def _cpu_seconds(pids: list[int]) -> dict[int, float]:
    seconds = {}
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        seconds[pid] = times.user + times.system
    return seconds


def _host_busy() -> float:
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def _pids(status: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """joaderd's own processes (its main one and its Next fronts), its decode workers, the jobs'."""
    workers = list(status.get("workers", {}).get("pids", []))
    jobs = sorted({pid for job in status["jobs"] for pid in job.get("pids", [])})
    fronts = [f["pid"] for f in status.get("fronts", []) if f.get("pid")]
    return [int(status.get("pid", 0)), *fronts], workers, jobs


def measure(address: str | None, interval_s: float) -> tuple[list[JobWindow], HostWindow, dict[str, Any]]:
    """Watches joaderd for `interval_s`; the jobs' and the host's figures over that window."""
    before = fetch_status(address)
    server_pids, worker_pids, job_pids = _pids(before)
    cpu_before = _cpu_seconds([*server_pids, *worker_pids, *job_pids])
    busy_before, started = _host_busy(), time.monotonic()
    time.sleep(interval_s)
    after = fetch_status(address)
    cpu_after = _cpu_seconds([*server_pids, *worker_pids, *job_pids])
    busy_after, elapsed = _host_busy(), time.monotonic() - started

    def used(pids: list[int]) -> float:
        return sum(cpu_after[p] - cpu_before[p] for p in pids if p in cpu_before and p in cpu_after)

    workers_cpu, server_cpu, jobs_cpu = used(worker_pids), used(server_pids), used(job_pids)
    decoded = after["items_decoded"] - before["items_decoded"]
    delivered = after["items_delivered"] - before["items_delivered"]
    reused = after["sharing"]["items_reused"] - before["sharing"]["items_reused"]
    old = {j["job_id"]: j for j in before["jobs"]}
    jobs = []
    for job in after["jobs"]:
        prior = old.get(job["job_id"])
        items = job["items_delivered"] - (prior["items_delivered"] if prior else 0)
        wait = job["stall_total"]["wait_s"] - (prior["stall_total"]["wait_s"] if prior else 0.0)
        step = job["stall_total"]["step_s"] - (prior["stall_total"]["step_s"] if prior else 0.0)
        # per sample the loop got (the client's count; joaderd's deliveries run a few batches ahead)
        consumed = job["stall_total"]["items"] - (prior["stall_total"]["items"] if prior else 0)
        measured = consumed > 0 and wait + step > 0
        jobs.append(JobWindow(
            name=job["name"], job_id=job["job_id"], epoch_items=job["epoch_items"],
            samples_per_s=items / elapsed,
            stall=wait / (wait + step) if measured else None,
            step_s_per_sample=step / consumed if measured and step > 0 else None,
            wait_s_per_sample=wait / consumed if measured else 0.0,
        ))
    cache = after["cache"]
    item_bytes = cache["items_bytes"] / cache["items"] if cache["items"] else 0
    source_items = {s["name"]: s["num_items"] for s in after["sources"]}
    data_items = sum(source_items.get(name, 0) for name in {j["source"] for j in after["jobs"]})
    first = max(1, delivered - reused)
    host = HostWindow(
        cores=float(psutil.cpu_count() or 1),
        workers=int(after.get("workers", {}).get("configured", 1)),
        decode_cpu_s=workers_cpu / decoded if decoded else _since_start(after)[0],
        decodes_per_delivery=decoded / delivered if delivered else 1.0,
        fresh_decodes_per_delivery=min(1.0, decoded / first) if decoded else _since_start(after)[1],
        server_cpu_per_sample=server_cpu / delivered if delivered else 0.0,
        jobs_cpu_per_sample=jobs_cpu / delivered if delivered else 0.0,
        rest_cores=max(0.0, (busy_after - busy_before - workers_cpu - server_cpu - jobs_cpu) / elapsed),
        cache_bytes=int(cache["capacity_bytes"]),
        data_bytes=int(item_bytes * data_items),
    )
    window = {"interval_s": round(elapsed, 3), "decoded": decoded, "delivered": delivered,
              "workers_cpu_s": round(workers_cpu, 3), "joaderd_cpu_s": round(server_cpu, 3),
              "jobs_cpu_s": round(jobs_cpu, 3), "decode_figures": "window" if decoded else "since start"}
    return jobs, host, window


def _since_start(status: dict[str, Any]) -> tuple[float, float]:
    """(seconds per decode, decodes per first delivery) since joaderd started: for a window in
    which nothing was decoded (a whole-dataset cache after its first epoch), so that a smaller
    cache's what-if still costs its decodes. The workers' busy time, not their CPU time."""
    decoded = status.get("items_decoded", 0)
    busy_s = status.get("decodes", {}).get("decode_s", 0.0)
    within = status.get("sharing", {}).get("within_epoch")
    return (busy_s / decoded if decoded else 0.0), (min(1.0, 1.0 / within) if within else 1.0)


def analyze(jobs: list[JobWindow], host: HostWindow, extra_workers: int = 2) -> dict[str, Any]:
    """The report: per job, measured figures, what-ifs and a recommendation."""
    worker_counts = sorted({k for k in range(host.workers - 1, host.workers + extra_workers + 1) if k >= 1})
    caches = [("1/2x", host.cache_bytes // 2), ("2x", host.cache_bytes * 2)]
    if host.data_bytes > 0:
        caches.append(("whole dataset", max(host.data_bytes, 1)))
    by_workers = {k: predict(jobs, host, workers=k) for k in worker_counts}
    by_cache = [(label, size, predict(jobs, host, cache_bytes=size)) for label, size in caches]
    now = by_workers.get(host.workers) or predict(jobs, host)

    def figures(prediction: Prediction, job_id: str) -> dict[str, Any]:
        epoch_s, stall = prediction.epoch_s[job_id], prediction.stall[job_id]
        return {"samples_per_s": round(prediction.samples_per_s[job_id], 1),
                "stall": None if stall is None else round(stall, 4),
                "epoch_s": None if epoch_s is None else round(epoch_s, 2)}

    report_jobs = []
    for job in jobs:
        bound = classify(job)
        entry: dict[str, Any] = {
            "name": job.name, "job_id": job.job_id, "bound": bound,
            "measured": {"samples_per_s": round(job.samples_per_s, 1),
                         "stall": None if job.stall is None else round(job.stall, 4),
                         "epoch_s": round(job.epoch_items / job.samples_per_s, 2) if job.samples_per_s > 0 else None,
                         "step_s_per_sample": None if job.stall is None else round(per_sample(job)[0], 6)},
            "model_now": figures(now, job.job_id),
            "model_check": _check(job, now),
            "workers": [{"workers": k, **figures(p, job.job_id)} for k, p in by_workers.items()],
            "cache": [{"cache": label, "cache_bytes": size, **figures(p, job.job_id)} for label, size, p in by_cache],
        }
        entry["recommendation"] = _recommend(job, bound, host, by_workers, by_cache)
        report_jobs.append(entry)
    return {
        "jobs": report_jobs,
        "host": {"cores": host.cores, "decode_workers": host.workers,
                 "decode_cpu_ms_per_item": round(1000 * host.decode_cpu_s, 3),
                 "decodes_per_delivery": round(host.decodes_per_delivery, 4),
                 "joaderd_cpu_ms_per_sample": round(1000 * host.server_cpu_per_sample, 4),
                 "jobs_cpu_ms_per_sample": round(1000 * host.jobs_cpu_per_sample, 4),
                 "other_cores_busy": round(host.rest_cores, 2),
                 "cache_bytes": host.cache_bytes, "data_bytes": host.data_bytes,
                 "limit_now": now.limit, "capacity_samples_per_s": round(now.capacity, 1)},
        "model": "joader.analysis (docs/analyze.md)",
        "stated_error": STATED_ERROR,
    }


def _check(job: JobWindow, now: Prediction) -> dict[str, Any] | None:
    """The model's stall for the setting measured against the measured stall of the same window:
    off by more than STATED_ERROR, the window was not steady and the what-ifs are not to be
    trusted."""
    predicted = now.stall.get(job.job_id)
    if job.stall is None or predicted is None:
        return None
    error = predicted - job.stall
    return {"predicted_stall": round(predicted, 4), "error": round(error, 4),
            "within_stated_error": abs(error) <= STATED_ERROR}


def _recommend(job: JobWindow, bound: str, host: HostWindow, by_workers: dict[int, Prediction],
               by_cache: list[tuple[str, int, Prediction]]) -> str:
    if bound == "unknown":
        return ("no stall measured: the job reads through DataLoader workers, which cannot see its "
                "training loop; read with num_workers=0 to have it measured")
    stall = job.stall or 0.0
    more = by_workers.get(host.workers + 1)
    if bound == "compute":
        fewer = by_workers.get(host.workers - 1)
        if fewer is not None and (fewer.stall[job.job_id] or 0.0) < 0.05:
            return (f"compute-bound (stall {stall:.0%}): data keeps up; {host.workers - 1} decode "
                    f"worker(s) would still keep its stall under 5%, leaving a core to training")
        return f"compute-bound (stall {stall:.0%}): data keeps up; nothing to change"
    # ranked by the rate each setting gives this job: a job with almost no step stalls ~all the
    # time whatever the setting, and what changes is how fast its epochs go
    options = []
    if more is not None:
        options.append((more.samples_per_s[job.job_id], f"{host.workers + 1} decode workers "
                        f"({_what_if(job, more)}; limited by {more.limit})"))
    for label, size, prediction in by_cache:
        options.append((prediction.samples_per_s[job.job_id], f"a {label} cache ({format_bytes(size)}, "
                        f"{_what_if(job, prediction)} after the first epoch)"))
    best = max(options, default=None)
    if best is None or best[0] < 1.1 * job.samples_per_s:
        return (f"prep-bound (stall {stall:.0%}): the host's CPU is the limit; no setting here makes "
                f"it 10% faster")
    return f"prep-bound (stall {stall:.0%}): try {best[1]}"


def _what_if(job: JobWindow, prediction: Prediction) -> str:
    rate, stall = prediction.samples_per_s[job.job_id], prediction.stall[job.job_id] or 0.0
    epoch_s = prediction.epoch_s[job.job_id]
    now_s = job.epoch_items / job.samples_per_s if job.samples_per_s > 0 else None
    epoch = f", epoch {epoch_s:.1f} s instead of {now_s:.1f} s" if epoch_s and now_s else ""
    return f"predicted {rate:.0f} samples/s{epoch}, stall {stall:.0%}"


_LIMITS = {"jobs": "the jobs' own steps (data keeps up)", "decode workers": "the decode workers",
           "joaderd": "joaderd's main process (one core)", "host CPU": "the host's cores"}


def format_report(report: dict[str, Any]) -> str:
    host, error = report["host"], report["stated_error"]
    workers = f"{host['decode_workers']} decode worker{'' if host['decode_workers'] == 1 else 's'}"
    lines = [f"host: {host['cores']:.0f} cores, {workers}, "
             f"{host['decode_cpu_ms_per_item']:.2f} ms CPU per decode, {host['decodes_per_delivery']:.2f} "
             f"decodes per delivery, other processes {host['other_cores_busy']:.2f} cores; "
             f"limit now: {_LIMITS.get(host['limit_now'], host['limit_now'])}",
             f"model: fit on this window; for the setting measured it gives the measured stall within "
             f"{100 * error:.0f} percentage points, or says so (what-ifs: measured error in docs/analyze.md)", ""]
    for job in report["jobs"]:
        lines.extend(_job_lines(job, host["decode_workers"], error))
    return "\n".join(lines)


def _job_lines(job: dict[str, Any], workers_now: int, error: float) -> list[str]:
    measured, check = job["measured"], job.get("model_check")
    stall = "-" if measured["stall"] is None else f"{measured['stall']:.0%}"
    model = "" if check is None else f" (model for this setting: {check['predicted_stall']:.0%})"
    lines = [f"{job['name']}: {job['bound']}-bound, stall {stall}{model}, {measured['samples_per_s']:.0f} samples/s"]
    if job["bound"] != "unknown":
        lines.append("  what if     decode workers: " + ", ".join(
            f"{w['workers']}{' (now)' if w['workers'] == workers_now else ''}: stall {w['stall']:.0%} "
            f"epoch {w['epoch_s']:.1f} s" for w in job["workers"] if w["stall"] is not None and w["epoch_s"] is not None))
        lines.append("              cache: " + ", ".join(
            f"{c['cache']}: stall {c['stall']:.0%} epoch {c['epoch_s']:.1f} s" for c in job["cache"]
            if c["stall"] is not None and c["epoch_s"] is not None))
    if check is not None and not check["within_stated_error"]:
        lines.append(f"  !  the model misses this window's stall by {abs(check['error']):.0%} (more than "
                     f"{error:.0%}): the jobs' mix or speed changed while it watched; run again with a "
                     f"longer --interval before trusting these what-ifs")
    lines.append(f"  -> {job['recommendation']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    from joader.client.tools.cli import add_server_options, find_address

    parser = argparse.ArgumentParser(prog="joader analyze", description=__doc__.split("\n")[0])
    add_server_options(parser)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds to watch (default 5)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be > 0")
    jobs, host, window = measure(find_address(args.address, args.source, command="analyze"), args.interval)
    report = analyze(jobs, host)
    report["window"] = window
    if args.json:
        print(json.dumps(report, indent=2))
    elif not jobs:
        print("no jobs attached: nothing to analyze")
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
