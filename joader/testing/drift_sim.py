"""Jobs that drift, simulated against joaderd's real registry: how much sharing survives?

The registry, the scheduler, the sampler and the cache are joaderd's own (`Registry` with a fake
clock and a fake decode pool, as tests/support/registry_driver.py drives it); only time is
simulated. A discrete-event loop runs K jobs, each reading batches through the `Next` protocol
(`begin_next` / `poll_next` / `end_next`, acknowledging each batch with the next request) and
"training" for its step time between batches, with jitter; the pool decodes with W workers,
`decode_s` each. So a job that misses the cache waits for its decode, as a real one does, and a
job's speed is its own: nothing here keeps the jobs in step but joaderd.

Reported: jobs served per decode (items delivered / items decoded) against the schedule's
in-step bound, each job's time, and the rounds each pair shared. Deterministic for a seed: a
design can be compared with another on the same drift, without the noise of a shared machine
(the real jobs are in bench/field/field.py).

Usage: python -m bench.micro.drift_sim --table          (every scenario x rule set, 3 seeds; ~10 minutes)
       python -m bench.micro.drift_sim [--jobs 3] [--items 1437] [--epochs 5] [--stagger]
       [--steps 0.027,0.054] [--jitter 0.3] [--cores 2] [--cache 0.25] [--server-arg key=value]

`--cores C`: steps and decodes share C cores (processor sharing), so a job that waits gives its
CPU to the others, as on a CPU-bound host; joaderd's CPU meter then reads "busy" whenever C or
more tasks run, and every job as CPU-bound.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np

from joader.server.registry.next_call import Batch
from joader.server.registry.next_protocol import NextArgs, NextCall
from joader.server.registry.registry import Registry, RegistryConfig, Source
from joader.sources.imagefolder import SourceListing

ITEM_BYTES = 64
STAGE = SimpleNamespace(name="center-crop:8", size=8,
                        spec=SimpleNamespace(shape=(1, 8, 8), dtype="uint8", max_nbytes=ITEM_BYTES))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cpu:
    """`cores` shared by every task that computes (training steps, decodes), processor
    sharing: n tasks each progress at min(1, cores / n) seconds of work per second. None: every
    task runs at full speed (a GPU step, decoders on cores of their own)."""

    def __init__(self, sim: Simulation, cores: float | None) -> None:
        self.sim = sim
        self.cores = cores
        self.tasks: dict[tuple[Any, ...], float] = {}  # done-event -> work left (s)
        self.updated = 0.0
        self.version = 0
        self.busy_s = 0.0

    def run(self, work_s: float, done: tuple[Any, ...]) -> None:
        if self.cores is None:
            self.sim.at(self.sim.clock.now + work_s, done)
            return
        self._advance()
        self.tasks[done] = work_s
        self._schedule()

    def _speed(self) -> float:
        assert self.cores is not None  # tasks are only queued with cores (`run`)
        return min(1.0, self.cores / len(self.tasks)) if self.tasks else 1.0

    def _advance(self) -> None:
        now = self.sim.clock.now
        progress = (now - self.updated) * self._speed()
        for key in self.tasks:
            self.tasks[key] -= progress
        self.busy_s += (now - self.updated) * min(len(self.tasks), self.cores or 0)
        self.updated = now

    def _schedule(self) -> None:
        self.version += 1
        if self.tasks:
            key = min(self.tasks, key=self.tasks.__getitem__)
            at = self.sim.clock.now + max(0.0, self.tasks[key]) / self._speed()
            self.sim.at(at, ("cpu", self.version))

    def tick(self, version: int) -> None:
        if version != self.version:
            return
        self._advance()
        done = [key for key, left in self.tasks.items() if left <= 1e-9]
        for key in done:
            del self.tasks[key]
        self._schedule()
        for key in done:
            self.sim.handle(key)


class Pool:
    """W workers, each decode `decode_s`; finished decodes are filed by the event loop."""

    def __init__(self, sim: Simulation, workers: int, decode_s: float) -> None:
        self.sim = sim
        self.num_workers = workers
        self.decode_s = decode_s
        self.waiting: list[tuple[int, int]] = []
        self.running = 0
        self.decodes = 0

    @property
    def in_flight(self) -> int:
        return self.running + len(self.waiting)

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        self.waiting.append((task_id, item_id))
        self.start()

    def start(self) -> None:
        while self.waiting and self.running < self.num_workers:
            task_id, _ = self.waiting.pop(0)
            self.running += 1
            self.decodes += 1
            self.sim.cpu.run(self.decode_s, ("decoded", task_id))


@dataclass
class SimJob:
    index: int
    step_s: float
    epochs: int
    arrive_s: float | None = None  # None: arrives when the previous job read half an epoch
    job_id: str = ""
    epoch: int = 0
    token: int = 1
    received: list[int] = field(default_factory=list)  # this batch so far
    acks: list[int] = field(default_factory=list)
    call: NextCall | None = None
    orders: list[list[int]] = field(default_factory=list)
    started_s: float = 0.0
    ended_s: float | None = None
    read: int = 0
    wake_s: float | None = None  # the pending poll event's time
    epoch_ends: list[float] = field(default_factory=list)


class Simulation:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.clock = Clock()
        self.events: list[tuple[float, int, tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.rng = random.Random(args.seed)
        n = args.items
        listing = SourceListing(
            root=Path("/nonexistent"), classes=("a", "b"), class_to_idx={"a": 0, "b": 1},
            paths=cast(Any, tuple(f"{'ab'[i % 2]}/{i:05d}.png" for i in range(n))),  # never read: a tuple serves
            labels=np.array([i % 2 for i in range(n)], dtype=np.int32))
        self.cpu = Cpu(self, args.cores)
        self.pool = Pool(self, args.workers, args.decode_s)
        config: dict[str, Any] = {"start_grace_s": 0.2, "next_wait_s": 1.0, "linger_s": 0.05}
        for pair in args.server_arg:
            key, _, value = pair.partition("=")
            config[key] = type(getattr(RegistryConfig, key))(value) if hasattr(RegistryConfig, key) else value
        self.registry = Registry([Source("sim", listing, STAGE, 0, seed=args.seed)],
                                 max(1, int(n * args.cache)) * ITEM_BYTES, self.pool,
                                 RegistryConfig(**config), self.clock)
        steps = [float(s) for s in args.steps.split(",")]
        steps = (steps * args.jobs)[: args.jobs]
        arrivals = [float(a) for a in args.arrivals.split(",")] if args.arrivals else []
        self.jobs = [SimJob(i, steps[i], args.epochs,
                            arrive_s=(arrivals[i] if i < len(arrivals) else 0.0) if i == 0 or not args.stagger else None)
                     for i in range(args.jobs)]
        self.waiting: set[int] = set()

    def at(self, t: float, event: tuple[Any, ...]) -> None:
        heapq.heappush(self.events, (t, next(self.seq), event))

    # ------------------------------------------------------------------------- jobs

    def arrive(self, job: SimJob) -> None:
        registry = self.registry
        attached = registry.attach("sim", None, f"job{job.index}", self.args.batch,
                                   seed=self.args.seed * 100 + job.index)
        job.job_id = attached.job_id
        attached.cpu_bound = self.args.cores is not None  # its steps compute on the shared cores
        job.secret = attached.secret  # type: ignore[attr-defined]
        job.started_s = self.clock.now
        job.orders.append([])
        self.request(job)

    def request(self, job: SimJob) -> None:
        want = self.args.batch - len(job.received)
        args = NextArgs(job.job_id, job.secret, job.token, want, tuple(job.acks), 0, 0, 0,  # type: ignore[attr-defined]
                        0, None, 1, 1, None, 0, 0)
        job.acks = []
        call = self.registry.begin_next(args, lambda: None)
        assert not isinstance(call, Batch)
        job.call = call
        self.waiting.add(job.index)
        self.poll(job)

    def poll(self, job: SimJob) -> None:
        call = job.call
        assert call is not None  # polled only while a call is open
        result = self.registry.poll_next(call)
        if not isinstance(result, Batch):
            wake = self.clock.now + result + 1e-9
            if job.wake_s is None or wake < job.wake_s - 1e-12 or job.wake_s <= self.clock.now:
                job.wake_s = wake
                self.at(wake, ("poll", job.index, wake))
            return
        self.registry.end_next(call)
        job.call = None
        self.waiting.discard(job.index)
        job.received += result.item_ids
        job.orders[-1] += result.item_ids
        job.acks = list(result.item_ids)
        job.read += len(result.item_ids)
        args = self.args
        if self.args.stagger and job.index + 1 < len(self.jobs):
            nxt = self.jobs[job.index + 1]
            if nxt.arrive_s is None and job.read * 2 >= args.items:
                nxt.arrive_s = self.clock.now
                self.at(self.clock.now, ("arrive", nxt.index))
        if result.end_of_epoch or len(job.received) >= args.batch:
            count = len(job.received)
            job.received = []
            if count:
                step = job.step_s * count / args.batch
                if args.jitter:
                    step *= self.rng.lognormvariate(0.0, args.jitter)
                self.cpu.run(step, ("stepped", job.index, result.end_of_epoch))
            else:
                self.stepped(job, result.end_of_epoch)
        else:
            self.request(job)

    def stepped(self, job: SimJob, end_of_epoch: bool) -> None:
        if end_of_epoch:
            job.epoch += 1
            job.epoch_ends.append(round(self.clock.now, 3))
            # the last batch is acknowledged on its own pass's token (a new pass ignores them)
            self.registry.begin_next(NextArgs(job.job_id, job.secret, job.token, 0, tuple(job.acks),  # type: ignore[attr-defined]
                                              0, 0, 0, 0, None, 1, 1, None, 0, 0), lambda: None)
            job.acks = []
            if job.epoch >= job.epochs:
                self.registry.close_rank(job.job_id, 0)
                job.ended_s = self.clock.now
                return
            job.token += 1
            job.orders.append([])
        self.request(job)

    # ------------------------------------------------------------------------- loop

    def run(self) -> dict[str, Any]:
        for job in self.jobs:
            if job.arrive_s is not None:
                self.at(job.arrive_s, ("arrive", job.index))
        registry = self.registry
        while self.events:
            t, _, event = heapq.heappop(self.events)
            self.clock.now = max(self.clock.now, t)
            if event[0] == "cpu":
                self.cpu.tick(event[1])
            else:
                self.handle(event)
            if self.args.cores is not None:  # what joaderd's CPU meter would read
                registry._scheduler.host_busy = len(self.cpu.tasks) >= self.args.cores
            while registry.schedule_once():
                pass
            self.pool.start()
            for index in sorted(self.waiting):
                job = self.jobs[index]
                if job.call is not None:
                    self.poll(job)
            if all(job.ended_s is not None for job in self.jobs):
                break
        return self.report()

    def handle(self, event: tuple[Any, ...]) -> None:
        """One event (a "poll" only wakes the loop: every waiting job is polled after each)."""
        kind = event[0]
        if kind == "arrive":
            self.arrive(self.jobs[event[1]])
        elif kind == "decoded":
            self.pool.running -= 1
            self.registry.file_result(event[1], True, None, self.pool.decode_s, shape=(1, 8, 8), dtype="uint8",
                                      nbytes=ITEM_BYTES)
            self.pool.start()
        elif kind == "stepped":
            self.stepped(self.jobs[event[1]], event[2])

    def report(self) -> dict[str, Any]:
        status = self.registry.status()
        delivered = sum(job.read for job in self.jobs)
        decoded = self.pool.decodes
        exact = all(sorted(order) == list(range(self.args.items)) for job in self.jobs for order in job.orders)
        arrivals = [job.started_s for job in self.jobs]
        ends = [job.ended_s or 0.0 for job in self.jobs]
        pairs = status.get("sharing_pairs", [])
        return {
            "served_per_decode": round(delivered / max(1, decoded), 3),
            "delivered": delivered, "decoded": decoded, "exact": exact,
            "arrivals": [round(a, 2) for a in arrivals], "ends": [round(e, 2) for e in ends],
            "times": [round(e - a, 2) for a, e in zip(arrivals, ends, strict=True)],
            "pairs": pairs, "epoch_ends": [job.epoch_ends for job in self.jobs],
        }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", action="store_true", help="every scenario under every rule set (3 seeds)")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--items", type=int, default=1437)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", default="0.02", help="step seconds per job, comma-separated (cycled)")
    parser.add_argument("--jitter", type=float, default=0.3, help="lognormal sigma of each step")
    parser.add_argument("--stagger", action="store_true", help="each job arrives when the previous read half an epoch")
    parser.add_argument("--arrivals", default="", help="seconds each job arrives at, comma-separated (a sweep with no start barrier)")
    parser.add_argument("--cache", type=float, default=0.25, help="the cache's share of the items")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--decode-s", type=float, default=0.002)
    parser.add_argument("--cores", type=float, help="steps and decodes share this many cores (default: no contention)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--server-arg", action="append", default=[], metavar="KEY=VALUE")
    return parser.parse_args(argv)
