"""Client programs the fault tests run as their own processes: `python -m tests.support.trust_clients CMD`.

Each prints one JSON line with what it saw, so the test (which never opens a gRPC channel itself:
its unit tests fork) can check it. Some are ordinary training scripts doing ordinary things
(re-seeding, two iterators); others speak the raw protocol as a hostile or buggy local process
would (another job's id, a 242 MB request, hundreds of jobs from one process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any


def _emit(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)


def _dataset(args: argparse.Namespace, **kwargs: Any) -> Any:
    from joader.client.dataset import JoaderDataset

    return JoaderDataset(args.source, address=args.address, batch_size=args.batch_size,
                         return_index=True, timeout_s=args.timeout_s, **kwargs)


def reseed(args: argparse.Namespace) -> None:
    """`torch.manual_seed` before every epoch (or a seeded generator), DataLoader workers."""
    import torch
    from torch.utils.data import DataLoader

    ds = _dataset(args)
    epochs = []
    for _ in range(args.epochs):
        torch.manual_seed(1234)
        generator = torch.Generator().manual_seed(7) if args.generator else None
        loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers, generator=generator)
        epochs.append([int(i) for ids, _, _ in loader for i in ids])
    ds.close()
    _emit({"epochs": epochs, "len": len(ds)})


def two_iterators(args: argparse.Namespace) -> None:
    """A second iter() over one dataset while the first is unfinished."""
    from joader.errors import JoaderError

    ds = _dataset(args)
    first = iter(ds)
    head = [int(next(first)[0]) for _ in range(args.head)]
    second = [int(i) for i, _, _ in ds]
    try:
        next(first)
        error = None
    except JoaderError as caught:
        error = {"type": type(caught).__name__, "message": str(caught)}
    ds.close()
    _emit({"head": head, "second": second, "first_error": error, "len": len(ds)})


def read(args: argparse.Namespace) -> None:
    """Plain epochs; with --pause, waits for a line on stdin before each epoch after the first."""
    from joader.errors import JoaderError

    indices = None if not args.indices else range(*map(int, args.indices.split(":")))
    ds = _dataset(args, indices=indices, on_error=args.on_error, name=args.name)
    _emit({"job_id": ds.job_id, "keeper_pid": ds._keeper.pid, "classes": ds.classes})
    epochs: list[list[int]] = []
    epoch_s: list[float] = []
    try:
        for epoch in range(args.epochs):
            if args.pause and epoch:
                sys.stdin.readline()
            started = time.monotonic()
            epochs.append([int(i) for i, _, _ in ds])
            epoch_s.append(time.monotonic() - started)
            _emit({"epoch": epoch + 1, "count": len(epochs[-1]), "epoch_s": epoch_s[-1]})
    except (JoaderError, ConnectionError, TimeoutError) as error:
        _emit({"epochs": epochs, "error": {"type": type(error).__name__, "message": str(error)}})
        return
    ds.close()
    _emit({"epochs": epochs, "epoch_s": epoch_s})


def raise_then_hold(args: argparse.Namespace) -> None:
    """on_error='raise': after the DecodeError, the job stays attached until stdin closes."""
    from joader.errors import DecodeError

    ds = _dataset(args, on_error="raise")
    try:
        for _ in ds:
            pass
        error = None
    except DecodeError as caught:
        error = str(caught)
    _emit({"job_id": ds.job_id, "error": error})
    sys.stdin.read()
    ds.close()


def next_then_exit(args: argparse.Namespace) -> None:
    """One item, then the interpreter exits with the iterator still open."""
    ds = _dataset(args)
    it = iter(ds)
    first = next(it)
    _emit({"first": int(first[0])})
    # no close, no del: interpreter shutdown finalizes the generator


def _stub(address: str) -> Any:
    import grpc

    from joader.proto import GRPC_OPTIONS, joader_pb2_grpc

    return joader_pb2_grpc.JoaderStub(grpc.insecure_channel(address, options=GRPC_OPTIONS))


def _error(error: Any) -> dict[str, Any]:
    from joader.proto import ERROR_METADATA_KEY

    metadata = dict(error.trailing_metadata() or ())
    return {"code": error.code().name, "class": metadata.get(ERROR_METADATA_KEY), "details": error.details()}


def hijack(args: argparse.Namespace) -> None:
    """Another local process sends Next for a job id it read from Status."""
    import grpc

    from joader.proto import joader_pb2

    stub = _stub(args.address)
    status = json.loads(stub.Status(joader_pb2.StatusRequest(), timeout=10).json)
    results = []
    for job in status["jobs"]:
        for secret in (b"", b"0" * 16):
            try:
                stub.Next(joader_pb2.NextRequest(job_id=job["job_id"], token=12345, max_items=8,
                                                 job_secret=secret), timeout=10)
                results.append({"job_id": job["job_id"], "ok": True})
            except grpc.RpcError as error:
                results.append({"job_id": job["job_id"], "ok": False, **_error(error)})
    _emit({"results": results, "status_text": json.dumps(status)})


def big_indices(args: argparse.Namespace) -> None:
    """An Attach whose indices field is `--mb` megabytes."""
    import grpc

    from joader.proto import joader_pb2

    stub = _stub(args.address)
    payload = os.urandom(1 << 20) * args.mb
    started = time.monotonic()
    try:
        responses = stub.Attach(iter([joader_pb2.AttachRequest(source=args.source, indices=payload, name="big")]),
                                timeout=60)
        next(responses)
        result: dict[str, Any] = {"ok": True}
    except grpc.RpcError as error:
        result = {"ok": False, **_error(error)}
    result["elapsed_s"] = time.monotonic() - started
    _emit(result)


def many_jobs(args: argparse.Namespace) -> None:
    """`--jobs` jobs attached at once from this one process, each reading one batch."""
    asyncio.run(_many_jobs(args))


async def _many_jobs(args: argparse.Namespace) -> None:
    import grpc

    from joader.proto import GRPC_OPTIONS, joader_pb2, joader_pb2_grpc

    async with grpc.aio.insecure_channel(args.address, options=GRPC_OPTIONS) as channel:
        stub = joader_pb2_grpc.JoaderStub(channel)
        all_attached = asyncio.Event()
        attached = 0
        release = asyncio.Event()

        async def heartbeats(first: Any) -> Any:
            yield first
            while not release.is_set():
                await asyncio.sleep(0.5)
                yield joader_pb2.AttachRequest(heartbeat=True)

        async def attach(index: int) -> tuple[Any, Any]:
            for attempt in range(2):
                call = stub.Attach(heartbeats(joader_pb2.AttachRequest(
                    source=args.source, name=f"many-{index}", batch_size=args.batch_size)))
                try:
                    return call, await call.read()
                except grpc.aio.AioRpcError as error:
                    # The aio client itself, not joaderd, rarely fails a stream's write with
                    # this (grpc/grpc#36066); joaderd's own errors carry other details.
                    if attempt or error.code() != grpc.StatusCode.INTERNAL or error.details() != "Internal error from Core":
                        raise
            raise AssertionError("unreachable")

        async def job(index: int) -> dict[str, Any]:
            nonlocal attached
            try:
                call, reply = await attach(index)
            except grpc.aio.AioRpcError as error:
                attached += 1
                if attached == args.jobs:
                    all_attached.set()
                return {"attached": False, "code": error.code().name, "details": error.details(),
                        "class": dict(error.trailing_metadata() or ()).get("joader-error")}
            # As a JoaderDataset's lease keeper does: a request at once, or joaderd removes a job
            # whose client sent none within its lease (attaching 256 jobs may take that long).
            await stub.Next(joader_pb2.NextRequest(job_id=reply.job_id, job_secret=reply.job_secret,
                                                   max_items=0, pid=os.getpid()), timeout=60)
            attached += 1
            if attached == args.jobs:
                all_attached.set()
            await all_attached.wait()  # every job is attached at once before any reads
            # A Next waits at most joaderd's next_wait_s (1 s) and then answers empty, for the
            # client to ask again, as JoaderDataset does: 256 first batches from 2 decode workers
            # on a loaded machine took longer than one wait (a job then read 0 items here).
            deadline = time.monotonic() + 120
            while True:
                response = await stub.Next(joader_pb2.NextRequest(
                    job_id=reply.job_id, job_secret=reply.job_secret, token=index + 1,
                    max_items=args.batch_size, pid=os.getpid()), timeout=120)
                if response.item_ids or response.end_of_epoch or time.monotonic() > deadline:
                    break
            await stub.Next(joader_pb2.NextRequest(
                job_id=reply.job_id, job_secret=reply.job_secret, token=index + 1, max_items=0,
                acks=list(response.item_ids), pid=os.getpid()), timeout=60)
            return {"attached": True, "items": len(response.item_ids), "call": call}

        results = await asyncio.gather(*(job(i) for i in range(args.jobs)))
        status = json.loads((await stub.Status(joader_pb2.StatusRequest(), timeout=30)).json)
        release.set()
        for result in results:
            call = result.pop("call", None)
            if call is not None:
                call.cancel()
    _emit({"results": results, "jobs_in_status": len(status["jobs"])})


def other_user(args: argparse.Namespace) -> None:
    """A training script of another user over TCP (a notebook: it keeps its datasets, and goes
    on after an error). Another uid is simulated: the tests run as root, who may read any file,
    and another account cannot run this checkout's interpreter."""
    os.getuid = lambda: 65534  # type: ignore[assignment]  # what ArenaReader checks the arena against
    kept, results = [], []
    for _ in range(args.jobs):
        try:
            kept.append(_dataset(args))
            results.append({"ok": True})
        except Exception as error:  # noqa: BLE001  reported to the test
            results.append({"ok": False, "class": type(error).__name__, "message": str(error)})
    _emit({"results": results})
    sys.stdin.read()


def attach_only(args: argparse.Namespace) -> None:
    """Attaches a job and keeps its lease with heartbeats, but never sends a request: a client
    that cannot, or does not, read."""
    from joader.proto import joader_pb2

    stop = time.monotonic() + 600

    def requests() -> Any:
        yield joader_pb2.AttachRequest(source=args.source, name="attach-only", batch_size=args.batch_size)
        while time.monotonic() < stop:
            time.sleep(0.2)
            yield joader_pb2.AttachRequest(heartbeat=True)

    responses = _stub(args.address).Attach(requests())
    first = next(responses)
    _emit({"job_id": first.job_id})
    try:
        for _ in responses:
            pass
        _emit({"ended": "stream closed"})
    except Exception as error:  # noqa: BLE001  reported to the test
        details = getattr(error, "details", None)
        _emit({"ended": details() if callable(details) else str(error)})
    sys.stdin.read()


# NOTE [ Raw clients import no torch ]
# These commands speak the protocol through grpc alone, as a hostile or buggy process would:
# importing torch for them (1.5-2 CPU-s each, five runs in the trust tests) showed nothing.
RAW = frozenset({"hijack", "big-indices", "many-jobs", "attach-only"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("--address", required=True)
    parser.add_argument("--source", default="demo")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--generator", action="store_true")
    parser.add_argument("--head", type=int, default=32)
    parser.add_argument("--indices")
    parser.add_argument("--name", default="trust")
    parser.add_argument("--on-error", default="skip")
    parser.add_argument("--pause", action="store_true")
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--mb", type=int, default=242)
    args = parser.parse_args()
    if args.command not in RAW:  # NOTE [ Raw clients import no torch ]
        import torch

        torch.set_num_threads(1)
    commands = {
        "reseed": reseed, "two-iterators": two_iterators, "read": read, "hijack": hijack,
        "big-indices": big_indices, "many-jobs": many_jobs, "next-then-exit": next_then_exit,
        "raise-then-hold": raise_then_hold, "other-user": other_user, "attach-only": attach_only,
    }
    commands[args.command](args)


if __name__ == "__main__":
    main()
