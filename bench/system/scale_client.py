"""The scale bench's client side, one process for all its jobs (`python -m bench.system.scale --phase
P`): threads that attach, read and time `Next` calls against joaderd for one phase, and its figures."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import median
from bench.system.scale_data import Layout, check_batch

SOURCE = "imagenet"
IMAGE_SIZE = 16
BATCH = 64
RATE_JOBS = (1, 4, 8, 16)


# ----------------------------------------------------------------------------- joaderd's process


def main_cpu_s(pid: int) -> float:
    """User + system CPU of process `pid` alone (its reaped children are not in it)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def children_cpu_s(pid: int, leave_out: Sequence[int] = ()) -> float:
    """CPU of `pid`'s live descendants (the decode workers) but `leave_out` (its Next fronts)."""
    import psutil

    total = 0.0
    for child in psutil.Process(pid).children(recursive=True):
        if child.pid in leave_out:
            continue
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def processes_cpu_s(pids: Sequence[int]) -> float:
    """CPU of the live processes `pids` (joaderd's Next fronts)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def private_bytes(pid: int) -> int:
    """A process's private memory (Private_Clean + Private_Dirty of smaps_rollup; 0 if gone):
    what a forked decode worker copied of joaderd's pages, the listing's above all."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in text.splitlines()
               if line.startswith(("Private_Clean:", "Private_Dirty:")))


def memory(pid: int) -> dict[str, int]:
    """VmRSS and RssAnon of `pid` in bytes (RssAnon: private memory, not the shm arena)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Probe:
    """joaderd seen from the client process: its main CPU, its workers' CPU, its status."""

    def __init__(self, address: str, pid: int) -> None:
        self.address = address
        self.pid = pid

    def status(self) -> dict[str, Any]:
        from joader.client.tools.cli import fetch_status

        return fetch_status(self.address, timeout_s=120)

    def front_pids(self) -> list[int]:
        """joaderd's Next fronts (`--fronts`), known once: they live as long as joaderd."""
        if not hasattr(self, "_fronts"):
            self._fronts = [f["pid"] for f in self.status().get("fronts", []) if f.get("pid")]
        return self._fronts

    def sample(self, before: bool) -> dict[str, Any]:
        """joaderd's CPU, memory and counts at the start (`before`) or the end of an interval:
        the status call comes first at a start, last at an end, so its own cost (O(cached
        items) today) stays outside the interval."""
        status = self.status() if before else None
        fronts = self.front_pids()
        out: dict[str, Any] = {"t": time.perf_counter(), "main_cpu_s": main_cpu_s(self.pid),
                               "client_cpu_s": time.process_time(), "fronts_cpu_s": processes_cpu_s(fronts),
                               "workers_cpu_s": children_cpu_s(self.pid, fronts), **memory(self.pid)}
        status = status or self.status()
        out.update(decoded=status["items_decoded"], delivered=status["items_delivered"],
                   cached=status["cache"]["items"], workers=status["workers"]["alive"],
                   workers_private=[private_bytes(pid) for pid in status["workers"].get("pids", [])])
        return out


class Job:
    """One batched job in a thread: reads epochs, checks every batch, records its waits."""

    def __init__(self, name: str, address: str, layout: Layout, indices: np.ndarray | None) -> None:
        from joader.client.dataset import JoaderDataset

        self.layout = layout
        self.indices = indices
        started = time.perf_counter()
        self.ds = JoaderDataset(SOURCE, indices=None if indices is None else indices.astype(np.uint32),
                                address=address, batched=True, batch_size=BATCH, return_index=True,
                                name=name, timeout_s=900)
        self.attach_s = time.perf_counter() - started
        self.epochs: list[dict[str, Any]] = []
        self.error: BaseException | None = None

    def epoch(self, stop: Any = None) -> dict[str, Any]:
        """One pass: oracle on every batch, exactly-once (or at-most-once if stopped early)."""
        counts = np.zeros(self.layout.n, dtype=np.uint8)
        started = last = time.perf_counter()
        first_wait = max_wait = 0.0
        batches = bad = max_wait_batch = 0
        stopped = False
        for ids, images, labels in self.ds:
            now = time.perf_counter()
            wait, last = now - last, now
            first_wait = wait if batches == 0 else first_wait
            if wait > max_wait:
                max_wait, max_wait_batch = wait, batches
            ids_np = ids.numpy()
            bad += len(check_batch(self.layout, ids_np, labels.numpy(), images.numpy()))
            np.add.at(counts, ids_np, 1)
            batches += 1
            if stop is not None and stop.is_set():
                stopped = True
                break
            last = time.perf_counter()  # the wait excludes this thread's own oracle work
        delivered = int(counts.sum())
        mine = np.ones(self.layout.n, dtype=bool) if self.indices is None else np.isin(
            np.arange(self.layout.n), self.indices)
        if stopped:
            exact = bool(counts.max(initial=0) <= 1 and not counts[~mine].any())
        else:
            exact = bool((counts[mine] == 1).all() and not counts[~mine].any())
        result = {"delivered": delivered, "batches": batches, "oracle_failures": bad, "exactly_once": exact,
                  "partial": stopped, "first_wait_s": round(first_wait, 4), "max_wait_s": round(max_wait, 4),
                  "max_wait_batch": max_wait_batch, "wall_s": round(time.perf_counter() - started, 3)}
        self.epochs.append(result)
        return result


def run_threads(jobs: Sequence[Job], body: Any) -> None:
    """body(job) in one thread per job; re-raises the first error."""
    import threading

    def run(job: Job) -> None:
        try:
            body(job)
        except BaseException as error:  # noqa: BLE001  reported below
            job.error = error

    threads = [threading.Thread(target=run, args=(job,), daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for job in jobs:
        if job.error is not None:
            raise job.error


def phase_epochs(probe: Probe, layout: Layout, jobs_n: int, epochs: int) -> dict[str, Any]:
    """jobs_n jobs over all items, `epochs` epochs, started together; per-epoch CPU and waits."""
    start_mem = memory(probe.pid)
    jobs = [Job(f"scale-{k}", probe.address, layout, None) for k in range(jobs_n)]
    per_epoch = []
    for epoch in range(epochs):
        before = probe.sample(before=True)
        run_threads(jobs, lambda job: job.epoch())
        after = probe.sample(before=False)
        per_epoch.append(_epoch_figures(epoch, before, after, jobs, start_mem))
    status = phase_status(probe)  # the jobs still attached
    for job in jobs:
        job.ds.close()
    closed = probe.sample(before=False)
    anon_per_item = (closed["RssAnon"] - start_mem["RssAnon"]) / max(1, closed["cached"])
    return {"jobs": jobs_n, "epochs": per_epoch, "attach_s": [round(j.attach_s, 4) for j in jobs],
            "status_with_jobs": status,
            "rss_anon_per_cached_item_after_close": round(anon_per_item, 1)}


def _front_figures(before: dict[str, Any], after: dict[str, Any], wall: float, delivered: int,
                   main_cpu: float) -> dict[str, Any]:
    """The Next fronts' CPU (`--fronts`) beside the main process's, and the two together."""
    fronts = after["fronts_cpu_s"] - before["fronts_cpu_s"]
    return {"fronts_cores": round(fronts / wall, 3),
            "fronts_us_per_delivery": round(fronts / max(1, delivered) * 1e6, 2),
            "main_and_fronts_us_per_delivery": round((fronts + main_cpu) / max(1, delivered) * 1e6, 2)}


def _epoch_figures(epoch: int, before: dict[str, Any], after: dict[str, Any], jobs: Sequence[Job],
                   start_mem: dict[str, int]) -> dict[str, Any]:
    wall = after["t"] - before["t"]
    cpu = after["main_cpu_s"] - before["main_cpu_s"]
    decodes = after["decoded"] - before["decoded"]
    delivered = sum(job.epochs[-1]["delivered"] for job in jobs)
    return {
        "epoch": epoch + 1, "wall_s": round(wall, 2), "main_cpu_s": round(cpu, 3),
        "decodes": decodes, "deliveries": delivered,
        "main_us_per_decode": round(cpu / decodes * 1e6, 1) if decodes else None,
        "main_us_per_delivery": round(cpu / max(1, delivered) * 1e6, 2),
        "main_cores": round(cpu / wall, 3),
        "workers_cores": round((after["workers_cpu_s"] - before["workers_cpu_s"]) / wall, 3),
        **_front_figures(before, after, wall, delivered, cpu),
        "workers_alive": after["workers"],
        "client_us_per_delivery": round((after["client_cpu_s"] - before["client_cpu_s"]) / max(1, delivered) * 1e6, 2),
        "deliveries_per_s": round(delivered / wall, 1),
        "first_batch_wait_s": [job.epochs[-1]["first_wait_s"] for job in jobs],
        "max_batch_wait_s": [job.epochs[-1]["max_wait_s"] for job in jobs],
        "max_wait_at_batch": [job.epochs[-1]["max_wait_batch"] for job in jobs],
        "oracle_failures": sum(job.epochs[-1]["oracle_failures"] for job in jobs),
        "exactly_once": all(job.epochs[-1]["exactly_once"] for job in jobs),
        "cached_items": after["cached"],
        "rss_anon_per_cached_item": round((after["RssAnon"] - start_mem["RssAnon"]) / max(1, after["cached"]), 1),
        "rss_anon_mib": round(after["RssAnon"] / 2**20, 1),
        "workers_private_mib": [round(b / 2**20, 1) for b in after["workers_private"]],
    }


def phase_status(probe: Probe, calls: int = 5) -> dict[str, Any]:
    """Status call latency (in-process gRPC) and the main CPU each costs."""
    times, cpus = [], []
    for _ in range(calls):
        cpu = main_cpu_s(probe.pid)
        started = time.perf_counter()
        status = probe.status()
        times.append(time.perf_counter() - started)
        cpus.append(main_cpu_s(probe.pid) - cpu)
    return {"calls": calls, "cached_items": status["cache"]["items"], "latency_s": [round(t, 4) for t in times],
            "median_s": round(median(times), 4), "max_s": round(max(times), 4),
            "main_cpu_s_median": round(median(cpus), 4)}


def phase_attach(probe: Probe, layout: Layout, reps: int) -> dict[str, Any]:
    """A job over half the items: attach, first batch, close, gone from the status."""
    half = np.arange(layout.n // 2, dtype=np.int64)
    rows = []
    for rep in range(reps):
        cached = probe.status()["cache"]["items"]
        cpu0 = main_cpu_s(probe.pid)
        job = Job(f"scale-half-{rep}", probe.address, layout, half)
        cpu1 = main_cpu_s(probe.pid)
        started = time.perf_counter()
        ids, images, labels = next(iter(job.ds))
        first = time.perf_counter() - started
        bad = len(check_batch(layout, ids.numpy(), labels.numpy(), images.numpy()))
        cpu2 = main_cpu_s(probe.pid)
        started = time.perf_counter()
        job.ds.close()
        close = time.perf_counter() - started
        cpu3 = main_cpu_s(probe.pid)
        gone = _until_gone(probe, job.ds.job_id, started)
        rows.append({"cached_items": cached, "attach_s": round(job.attach_s, 4), "first_batch_s": round(first, 4),
                     "close_s": round(close, 4), "gone_s": gone, "oracle_failures": bad,
                     "attach_main_cpu_s": round(cpu1 - cpu0, 4), "first_batch_main_cpu_s": round(cpu2 - cpu1, 4),
                     "close_main_cpu_s": round(cpu3 - cpu2, 4)})
    keys = ("attach_s", "first_batch_s", "close_s", "gone_s", "attach_main_cpu_s", "close_main_cpu_s")
    return {"job_items": len(half), "reps": rows, **{f"median_{k}": round(median([r[k] for r in rows]), 4)
                                                     for k in keys}}


def _until_gone(probe: Probe, job_id: str, since: float, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(job["job_id"] != job_id for job in probe.status()["jobs"]):
            return round(time.perf_counter() - since, 4)
        time.sleep(0.01)
    return float("nan")


def windowed(probe: Probe, jobs: Sequence[Job], window_s: float) -> dict[str, Any]:
    """Jobs read epochs until `window_s` is over; CPU and counts over the window."""
    import threading

    stop = threading.Event()

    def body(job: Job) -> None:
        while not stop.is_set():
            job.epoch(stop)

    timer = threading.Timer(window_s, stop.set)
    before = probe.sample(before=True)
    timer.start()
    run_threads(jobs, body)
    after = probe.sample(before=False)
    wall = after["t"] - before["t"]
    cpu = after["main_cpu_s"] - before["main_cpu_s"]
    delivered = sum(e["delivered"] for job in jobs for e in job.epochs)
    decodes = after["decoded"] - before["decoded"]
    return {"jobs": len(jobs), "wall_s": round(wall, 2), "deliveries": delivered, "decodes": decodes,
            "deliveries_per_s": round(delivered / wall, 1), "main_cpu_s": round(cpu, 3),
            "main_us_per_delivery": round(cpu / max(1, delivered) * 1e6, 2),
            "deliveries_per_main_cpu_s": round(delivered / cpu) if cpu else None,
            "main_cores": round(cpu / wall, 3),
            "workers_cores": round((after["workers_cpu_s"] - before["workers_cpu_s"]) / wall, 3),
            **_front_figures(before, after, wall, delivered, cpu),
            "client_us_per_delivery": round((after["client_cpu_s"] - before["client_cpu_s"])
                                            / max(1, delivered) * 1e6, 2),
            "oracle_failures": sum(e["oracle_failures"] for job in jobs for e in job.epochs),
            "exactly_once": all(e["exactly_once"] for job in jobs for e in job.epochs),
            "epochs_whole": sum(not e["partial"] for job in jobs for e in job.epochs)}


def phase_decoding(probe: Probe, layout: Layout, jobs_n: int, window_s: float) -> dict[str, Any]:
    """jobs_n jobs over all items from a cold cache for a window (an epoch of the 1.28M tree
    takes tens of minutes today): main CPU per decode and per delivery while decoding."""
    jobs = [Job(f"scale-dec-{k}", probe.address, layout, None) for k in range(jobs_n)]
    row = windowed(probe, jobs, window_s)
    row["status_with_jobs"] = phase_status(probe)
    for job in jobs:
        job.ds.close()
    row["main_us_per_decode"] = round(row["main_cpu_s"] / row["decodes"] * 1e6, 1) if row["decodes"] else None
    return row


def phase_rates(probe: Probe, layout: Layout, window_s: float) -> dict[str, Any]:
    """Warm deliveries/s and main CPU per delivery for 1, 4, 8 and 16 jobs over all items."""
    rows = []
    for count in RATE_JOBS:
        jobs = [Job(f"scale-rate{count}-{k}", probe.address, layout, None) for k in range(count)]
        rows.append(windowed(probe, jobs, window_s))
        for job in jobs:
            job.ds.close()
    return {"window_s": window_s, "cases": rows}


def random_halves(n: int, jobs: int = 16, seed: int = 37) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(n, n // 2, replace=False)) for _ in range(jobs)]


def sampler_lockstep(halves: Sequence[np.ndarray], rounds: int, seed: int = 0) -> dict[str, Any]:
    """joader's DependentSampler alone on the same datasets, every job in every round (the
    best case: no cache, no pacing): per-pair shared rounds and deliveries per distinct item."""
    import array
    from itertools import combinations

    from pyroaring import BitMap

    from joader.sampling import make_sampler

    sampler = make_sampler("dependent", seed)
    names = [f"j{k}" for k in range(len(halves))]
    for name, half in zip(names, halves, strict=True):
        sampler.add_job(name, BitMap(array.array("I", half.astype(np.uint32).tobytes())))
    rows = (sampler.sample(names) for _ in range(rounds))
    picks = np.array([[row[name] for name in names] for row in rows])
    shared = [float((picks[:, a] == picks[:, b]).mean()) for a, b in combinations(range(len(names)), 2)]
    distinct = sum(len(set(row.tolist())) for row in picks)
    return {"rounds": rounds, "pair_rate_median": round(median(shared), 4),
            "deliveries_per_decode": round(picks.size / distinct, 3)}


def phase_halves(probe: Probe, layout: Layout, window_s: float) -> dict[str, Any]:
    """16 jobs, each over its own random half, for a window: rate and counted sharing."""
    halves = random_halves(layout.n)
    jobs = [Job(f"scale-halves-{k}", probe.address, layout, h) for k, h in enumerate(halves)]
    row = windowed(probe, jobs, window_s)
    status = probe.status()
    pairs = status.get("sharing_pairs", [])
    for job in jobs:
        job.ds.close()
    union = len(np.unique(np.concatenate(halves)))
    row.update(
        pairs=len(pairs),
        pair_rate_median=round(median([p["rate"] for p in pairs]), 4) if pairs else None,
        pair_bound_median=round(median([p["bound"] for p in pairs]), 4) if pairs else None,
        deliveries_per_decode=round(row["deliveries"] / row["decodes"], 3) if row["decodes"] else None,
        # an epoch of every job: 16 x n/2 deliveries, at least |union| decodes
        deliveries_per_decode_bound=round(16 * (layout.n // 2) / union, 3),
        cache_items=status["cache"]["items"], evictions=status["cache"]["evictions"])
    return row


def client_main(args: argparse.Namespace) -> None:
    """The client process: runs one phase against a running joaderd, writes its JSON."""
    import torch

    torch.set_num_threads(1)
    layout = Layout.of(args.items)
    probe = Probe(args.address, args.pid)
    if args.phase == "epochs":
        out = phase_epochs(probe, layout, args.jobs, args.epochs)
    elif args.phase == "decoding":
        out = phase_decoding(probe, layout, args.jobs, args.window_s)
    elif args.phase == "status":
        out = phase_status(probe)
    elif args.phase == "attach":
        out = phase_attach(probe, layout, args.reps)
    elif args.phase == "rates":
        out = phase_rates(probe, layout, args.window_s)
    else:
        out = phase_halves(probe, layout, args.window_s)
    Path(args.out).write_text(json.dumps(out))
