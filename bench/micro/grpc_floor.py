"""The gRPC floor (issue 37): what one `Next` call costs joaderd's main process before any books.

Question: joaderd serves each `Next` through grpc.aio in its main process. What does a call cost
that process when the handler does nothing but return a prepared reply, i.e. the least any
design with a per-call gRPC reply in the main process pays per delivered item?

A bare grpc.aio server (the real `Joader` service, the real `NextResponse` of B items: ids,
labels, offsets, lengths, shapes, dtypes, checksums) answers `Next` at once, or after one wake
through a future (as a `Next` that waited for its batch: NOTE [ A Next waits on a bare future ]
in server/service.py). Clients: T threads of one client process with the sync stub, each call
acknowledging B items, over a Unix socket. The figure is the server process's CPU (psutil, user
+ system) per call, over a fixed number of calls, and per item at B items per reply: with the
default batch of 64 and one batch per reply (what a warm job gets beside other jobs), it is a
floor under joaderd's main CPU per delivery. Medians of --reps runs; the machine is shared, so
CPU per call is the figure, not calls/s.

Usage: python -m bench.micro.grpc_floor [--reps 3] [--calls 3000] [--threads 4]
Writes bench/results/grpc-floor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench.common import machine, median, print_table, write_json
from joader.proto import joader_pb2, joader_pb2_grpc

BATCHES = (16, 64, 256)
EDGE = 16  # the items' side: (3, 16, 16) uint8, as bench.system.scale serves


def _reply(items: int) -> Any:
    nbytes = 3 * EDGE * EDGE
    return joader_pb2.NextResponse(
        epoch=1, item_ids=list(range(items)), labels=[7] * items,
        offsets=list(range(0, items * nbytes, nbytes)), lengths=[nbytes] * items, ndims=[3] * items,
        dims=[3, EDGE, EDGE] * items, dtypes=[1] * items, arena="joader-floor",
        checksums=[0x9E3779B9] * items)


class _Servicer(joader_pb2_grpc.JoaderServicer):
    def __init__(self, wake: bool) -> None:
        self._replies = {items: _reply(items) for items in BATCHES}
        self._wake = wake

    async def Next(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
        if self._wake:  # one wait, as a Next that waits for its batch
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            loop.call_soon(future.set_result, None)
            await future
        return self._replies[request.max_items]


def _serve(address: str, wake: bool, ready: Any) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        joader_pb2_grpc.add_JoaderServicer_to_server(_Servicer(wake), server)
        server.add_insecure_port(address)
        await server.start()
        ready.put(os.getpid())
        await server.wait_for_termination()

    asyncio.run(main())


class _FrontServicer:
    """What a front's relay asks of joaderd's servicer (`start_next`), answering at once."""

    def __init__(self) -> None:
        self._replies = {items: _reply(items) for items in BATCHES}

    def start_next(self, request: Any) -> Any:
        return self._replies[request.max_items]


def _front_failed(why: str) -> None:
    print(f"grpc_floor: the front failed: {why}", file=sys.stderr, flush=True)
    os._exit(1)


def _serve_via_front(sock: Path, ready: Any) -> None:
    """joaderd's side of one Next front (server/fronts/) with a servicer that does nothing:
    the relay's cost in the main process, the front's in its own."""
    from joader.server.fronts.fronts import Fronts

    async def main() -> None:
        fronts = Fronts(1, sock, 1 << 20, _FrontServicer(), _front_failed)  # type: ignore[arg-type]
        await fronts.start()
        while not fronts.next_address():
            await asyncio.sleep(0.01)
        ready.put((os.getpid(), fronts.pids()[0], fronts.next_address()))
        await asyncio.Event().wait()

    asyncio.run(main())


def _calls(address: str, items: int, calls: int, threads: int) -> float:
    """Runs `calls` calls on each of `threads` threads; returns the wall seconds."""
    channel = grpc.insecure_channel(address)
    stub = joader_pb2_grpc.JoaderStub(channel)
    request = joader_pb2.NextRequest(job_id="floor", token=1, max_items=items, acks=list(range(items)))

    def run() -> None:
        for _ in range(calls):
            stub.Next(request)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    channel.close()
    return time.perf_counter() - started


def one_case(address: str, server_pid: int, items: int, calls: int, threads: int,
             front_pid: int | None = None) -> dict[str, float]:
    """`server_pid`'s CPU per call (the main process: grpc.aio itself, or a front's relay);
    with `front_pid`, the front's beside it."""
    _calls(address, items, max(50, calls // 20), threads)  # warm up the channel and the server
    process = psutil.Process(server_pid)
    front = psutil.Process(front_pid) if front_pid else None
    before = sum(process.cpu_times()[:2])
    front_before = sum(front.cpu_times()[:2]) if front else 0.0
    wall_s = _calls(address, items, calls, threads)
    cpu_s = sum(process.cpu_times()[:2]) - before
    front_s = sum(front.cpu_times()[:2]) - front_before if front else 0.0
    total = calls * threads
    return {"calls": total, "wall_s": round(wall_s, 3), "server_cpu_s": round(cpu_s, 3),
            "us_per_call": round(1e6 * cpu_s / total, 1), "us_per_item": round(1e6 * cpu_s / total / items, 2),
            "front_us_per_call": round(1e6 * front_s / total, 1), "calls_per_s": round(total / wall_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3000, help="calls per client thread per case")
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    rows, cases = [], {}
    with tempfile.TemporaryDirectory(prefix="jgf-") as tmp:
        address = f"unix:{Path(tmp) / 'floor.sock'}"
        for wake in (False, True):
            ready = context.Queue()
            server = context.Process(target=_serve, args=(address, wake, ready), daemon=True)
            server.start()
            try:
                pid = ready.get(timeout=60)
                for items in BATCHES:
                    reps = [one_case(address, pid, items, args.calls, args.threads) for _ in range(args.reps)]
                    name = f"{'one wake' if wake else 'at once'}, {items} items"
                    cases[name] = {"wake": wake, "items": items, "reps": reps,
                                   "us_per_call": median([r["us_per_call"] for r in reps]),
                                   "us_per_item": median([r["us_per_item"] for r in reps]),
                                   "calls_per_s": median([r["calls_per_s"] for r in reps])}
                    case = cases[name]
                    rows.append([name, case["us_per_call"], case["us_per_item"], case["calls_per_s"]])
                    print(f"  {name}: {case['us_per_call']} us per call, {case['us_per_item']} us per item",
                          flush=True)
            finally:
                server.terminate()
                server.join(10)
        ready = context.Queue()
        server = context.Process(target=_serve_via_front, args=(Path(tmp) / "joaderd.sock", ready), daemon=True)
        server.start()
        try:
            pid, front_pid, front_address = ready.get(timeout=60)
            for items in BATCHES:
                reps = [one_case(front_address, pid, items, args.calls, args.threads, front_pid)
                        for _ in range(args.reps)]
                name = f"through a front, {items} items"
                cases[name] = {"wake": False, "items": items, "reps": reps, "front": True,
                               "us_per_call": median([r["us_per_call"] for r in reps]),
                               "us_per_item": median([r["us_per_item"] for r in reps]),
                               "front_us_per_call": median([r["front_us_per_call"] for r in reps]),
                               "calls_per_s": median([r["calls_per_s"] for r in reps])}
                case = cases[name]
                rows.append([name, case["us_per_call"], case["us_per_item"], case["calls_per_s"],
                             case["front_us_per_call"]])
                print(f"  {name}: {case['us_per_call']} us per call in joaderd's process, "
                      f"{case['front_us_per_call']} in the front", flush=True)
        finally:
            server.terminate()
            server.join(10)
    print_table(["reply", "server CPU us/call", "us/item", "calls/s", "front CPU us/call"],
                [row + [""] * (5 - len(row)) for row in rows])
    path = write_json("grpc-floor", {
        "question": "grpc.aio's own CPU per Next call in the serving process (issue 37's floor)",
        "command": " ".join(["python -m bench.micro.grpc_floor", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(), "grpc": grpc.__version__, "threads": args.threads, "calls": args.calls,
        "cases": cases})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
