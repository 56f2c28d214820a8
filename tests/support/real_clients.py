"""Training programs of the issue-8 tests (`test_real_jobs.py`), each run as its own process:

    python -m tests.support.real_clients CMD --address A --out REPORT.json ...

They are what real training scripts do: DDP under `torchrun` (gloo, CPU), checkpoints through
`ds.state_dict()` or torchdata's `StatefulDataLoader`, a crash right after a checkpoint, a fixed
seed. Each writes a JSON report (atomically, at its end) with the indices it consumed per epoch;
with `--progress FILE` it also appends one JSON line per batch (flushed and fsynced), so that what
a process consumed before it was killed is known exactly.

The pytest process never imports this module: it forks decode workers, and must never hold a gRPC
channel or torch.distributed state.

Commands:
  job          one job (or one rank of it with --rank/--world-size): epochs through a DataLoader
               (--loader plain|stateful), optional --save-after K (checkpoint after batch K of the
               first epoch, then SIGKILL itself) and --load-state (resume from a checkpoint);
               --linger-s S: after its epochs, stays attached S seconds reading nothing, then closes;
               --wait-for PATH: started before joaderd, it attaches the moment PATH (the socket)
               appears.
  ddp          one rank under torchrun: init_process_group("gloo"), an all_reduce per step, and
               the per-rank counts compared across ranks at each epoch's end.
  conventions  ds.targets, len(ds), len(DataLoader) against what the epochs really yield.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as out:
        json.dump(data, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


class _Progress:
    """One JSON line per event, flushed and fsynced before the program goes on."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a") if path else None

    def write(self, **event: Any) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({**event, "t": round(time.time(), 3)}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())


def _indices(spec: str | None) -> range | None:
    if not spec:
        return None
    return range(*map(int, spec.split(":")))


def _dataset(args: argparse.Namespace, **extra: Any) -> Any:
    from joader.client.dataset import JoaderDataset

    kwargs: dict[str, Any] = {}
    if args.rank is not None:
        kwargs["rank"] = args.rank
    if args.world_size is not None:
        kwargs["world_size"] = args.world_size
    if args.drop_last:
        kwargs["drop_last"] = True
    if args.seed is not None:
        kwargs["seed"] = args.seed
    if args.name:
        kwargs["name"] = args.name
    kwargs.update(extra)
    return JoaderDataset(args.source, indices=_indices(args.indices), address=args.address,
                         batch_size=args.batch_size, return_index=True, timeout_s=args.timeout_s, **kwargs)


def _loader(args: argparse.Namespace, ds: Any) -> Any:
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    from torch.utils.data import DataLoader

    return DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)


def _dataset_states(state: Any) -> list[dict[str, Any]]:
    """The JoaderDataset states inside a checkpoint (ds.state_dict(), or StatefulDataLoader's,
    which nests one per worker under private keys: found by shape, not by those keys)."""
    found = []
    if isinstance(state, dict):
        if "consumed" in state and "version" in state:
            return [state]
        for value in state.values():
            found.extend(_dataset_states(value))
    elif isinstance(state, list | tuple):
        for value in state:
            found.extend(_dataset_states(value))
    return found


def _describe_state(state: Any) -> list[dict[str, Any]]:
    from pyroaring import BitMap

    described = []
    for part in _dataset_states(state):
        plain = {k: v for k, v in part.items() if k != "consumed"}
        plain["consumed"] = list(BitMap.deserialize(part["consumed"])) if part["consumed"] else []
        described.append(plain)
    return described


def _save_and_die(args: argparse.Namespace, ds: Any, loader: Any, progress: _Progress) -> None:
    """Checkpoint (pickle, fsync, rename), record it, then die as a crash would."""
    state = loader.state_dict() if args.loader == "stateful" else ds.state_dict()
    tmp = f"{args.state}.tmp"
    with open(tmp, "wb") as out:
        pickle.dump(state, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, args.state)
    progress.write(event="saved", parts=_describe_state(state))
    os.kill(os.getpid(), signal.SIGKILL)


def _epoch_orders(ds: Any, epochs: int) -> dict[str, Any]:
    """ds.epoch_order(e) for e around the epochs read: the list, or the error's class."""
    from joader.errors import JoaderError

    orders: dict[str, Any] = {}
    if not hasattr(ds, "epoch_order"):
        return orders
    for epoch in range(-1, epochs + 2):
        try:
            orders[str(epoch)] = {"order": [int(i) for i in ds.epoch_order(epoch)]}
        except JoaderError as error:
            orders[str(epoch)] = {"error": type(error).__name__, "joader_error": True}
        except Exception as error:  # noqa: BLE001  reported, the test decides
            orders[str(epoch)] = {"error": type(error).__name__, "joader_error": False}
    return orders


def _run_epochs(args: argparse.Namespace, ds: Any, loader: Any, progress: _Progress,
                on_step: Any = None, on_epoch_end: Any = None) -> dict[str, Any]:
    epochs: list[list[int]] = []
    batch_sizes: list[list[int]] = []
    labels: dict[int, int] = {}
    epoch_s: list[float] = []
    for epoch in range(args.epochs):
        started = time.monotonic()
        seen: list[int] = []
        sizes: list[int] = []
        for batch, (ids, _images, batch_labels) in enumerate(loader, start=1):
            ids = [int(i) for i in ids]
            for index, label in zip(ids, batch_labels.tolist(), strict=True):
                labels[index] = int(label)
            seen.extend(ids)
            sizes.append(len(ids))
            progress.write(event="batch", epoch=epoch, batch=batch, indices=ids)
            if on_step is not None:
                on_step()
            if args.sleep:
                time.sleep(args.sleep)
            if args.save_after and epoch == 0 and batch == args.save_after:
                _save_and_die(args, ds, loader, progress)
        epochs.append(seen)
        batch_sizes.append(sizes)
        epoch_s.append(time.monotonic() - started)
        progress.write(event="epoch_end", epoch=epoch, count=len(seen))
        if on_epoch_end is not None:
            on_epoch_end(epoch, len(seen))
    return {"epochs": epochs, "batch_sizes": batch_sizes, "labels": {str(k): v for k, v in labels.items()},
            "epoch_s": epoch_s}


def _describe(ds: Any) -> dict[str, Any]:
    return {"job_id": ds.job_id, "len": len(ds), "rank": getattr(ds, "rank", None),
            "world_size": getattr(ds, "world_size", None), "seed": getattr(ds, "seed", None)}


def job(args: argparse.Namespace) -> None:
    """One job (or one rank): epochs through a DataLoader, checkpointing or resuming."""
    if args.expect_name_required:
        _check_name_required(args)
    if args.wait_for:
        _wait_for(args)
    ds = _dataset(args)
    loader = _loader(args, ds)
    if args.load_state:
        with open(args.load_state, "rb") as source:
            state = pickle.load(source)
        if args.loader == "stateful":
            loader.load_state_dict(state)
        else:
            ds.load_state_dict(state)
    progress = _Progress(args.progress)
    progress.write(event="attached", job_id=ds.job_id, pid=os.getpid())
    result = _run_epochs(args, ds, loader, progress)
    report = {**_describe(ds), **result, "epoch_orders": _epoch_orders(ds, args.epochs)}
    if args.finish_barrier:
        _finish_barrier(args)
    if args.linger_s:  # attached (the keeper holds the lease), reading nothing: evaluation, a checkpoint
        progress.write(event="lingering", seconds=args.linger_s)
        time.sleep(args.linger_s)
    ds.close()
    _write_json(args.out, report)


def _wait_for(args: argparse.Namespace) -> None:
    """Imports the client, says it waits, then polls for `--wait-for` (joaderd's socket)."""
    from joader.client.dataset import JoaderDataset  # noqa: F401  imported before, not after, the wait

    _Progress(args.progress).write(event="waiting", path=args.wait_for)
    deadline = time.monotonic() + args.timeout_s
    while not os.path.exists(args.wait_for):
        if time.monotonic() > deadline:
            sys.exit(f"{args.wait_for} did not appear within {args.timeout_s:g} s")
        time.sleep(0.02)


def _finish_barrier(args: argparse.Namespace) -> None:
    """Ranks without torch.distributed wait for each other before closing, as DDP ranks do."""
    folder = Path(args.finish_barrier)
    (folder / f"rank{args.rank}.done").touch()
    deadline = time.monotonic() + 60
    while len(list(folder.glob("rank*.done"))) < args.world_size:
        if time.monotonic() > deadline:
            raise SystemExit("the other ranks did not finish within 60 s")
        time.sleep(0.05)


def _check_name_required(args: argparse.Namespace) -> None:
    """world_size > 1, no name, no TORCHELASTIC_RUN_ID nor MASTER_PORT: InvalidArgumentError."""
    from joader.client.dataset import JoaderDataset
    from joader.errors import InvalidArgumentError

    env = {k: os.environ.pop(k) for k in ("TORCHELASTIC_RUN_ID", "MASTER_PORT") if k in os.environ}
    try:
        JoaderDataset(args.source, indices=_indices(args.indices), address=args.address,
                      rank=args.rank, world_size=args.world_size, batch_size=args.batch_size)
    except InvalidArgumentError as error:
        if "name" not in str(error):
            raise SystemExit(f"InvalidArgumentError without 'name' in it: {error}") from None
    else:
        raise SystemExit("world_size=2 without a name (and no torchrun env) was accepted")
    finally:
        os.environ.update(env)


def ddp(args: argparse.Namespace) -> None:
    """One rank under torchrun: the dataset takes rank and world size from torch.distributed."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.dist_timeout_s))
    ds = _dataset(args)
    loader = _loader(args, ds)
    progress = _Progress(args.progress)
    steps = [0]
    gathered: list[dict[str, int]] = []

    def on_step() -> None:  # what DDP's gradient all-reduce does: every rank must take this step
        dist.all_reduce(torch.ones(1))
        steps[0] += 1

    def on_epoch_end(epoch: int, count: int) -> None:
        counts = torch.tensor([count, -count], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        gathered.append({"epoch": epoch, "max": int(counts[0]), "min": int(-counts[1])})
        dist.barrier()

    result = _run_epochs(args, ds, loader, progress, on_step=on_step, on_epoch_end=on_epoch_end)
    report = {**_describe(ds), **result, "dist_rank": dist.get_rank(), "dist_world_size": dist.get_world_size(),
              "steps": steps[0], "counts_across_ranks": gathered}
    ds.close()
    dist.barrier()
    dist.destroy_process_group()
    out = args.out.replace("{rank}", str(report["dist_rank"]))
    _write_json(out, report)


def conventions(args: argparse.Namespace) -> None:
    """ds.targets, len(ds) and len(DataLoader) beside what the epochs yield (2 workers)."""
    ds = _dataset(args)
    loader = _loader(args, ds)
    try:
        len_loader: int | None = len(loader)
    except TypeError:
        len_loader = None
    result = _run_epochs(args, ds, loader, _Progress(args.progress))
    report = {**_describe(ds), **result, "targets": [int(t) for t in ds.targets], "len_loader": len_loader,
              "classes": list(ds.classes)}
    ds.close()
    _write_json(args.out, report)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["job", "ddp", "conventions"])
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", required=True, help="the JSON report; '{rank}' is replaced by the rank (ddp)")
    parser.add_argument("--source", default="demo")
    parser.add_argument("--indices", help="start:stop[:step] of the source's ids (default: all)")
    parser.add_argument("--name")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--loader", choices=["plain", "stateful"], default="plain")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--progress", help="append one fsynced JSON line per batch here")
    parser.add_argument("--state", help="where --save-after writes the pickled checkpoint")
    parser.add_argument("--save-after", type=int, default=0,
                        help="checkpoint after this batch of the first epoch, then SIGKILL this process")
    parser.add_argument("--load-state", help="resume from this pickled checkpoint")
    parser.add_argument("--expect-name-required", action="store_true")
    parser.add_argument("--finish-barrier", help="a folder where ranks (--rank) meet before closing")
    parser.add_argument("--dist-timeout-s", type=float, default=40.0)
    parser.add_argument("--linger-s", type=float, default=0.0, help="job: stay attached this long, reading nothing, before closing")
    parser.add_argument("--wait-for", help="job: wait for this path (joaderd's socket) before attaching")
    args = parser.parse_args()
    if args.save_after and not args.state:
        parser.error("--save-after needs --state")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s")
    import torch

    torch.set_num_threads(1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    {"job": job, "ddp": ddp, "conventions": conventions}[args.command](args)


if __name__ == "__main__":
    main()
