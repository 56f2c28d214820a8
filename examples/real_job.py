"""A real training job on joader: DDP ranks, checkpoints that resume exactly, a seeded order.

Run it alone (`python examples/real_job.py`) or as DDP ranks
(`torchrun --nproc_per_node 2 examples/real_job.py`). With `--checkpoint PATH` it saves the model,
the optimizer and the loader's state every `--save-every` steps, and on start resumes from PATH
if it exists: kill it at any moment (even `kill -9`) and run the same command again, and the
interrupted epoch goes on with exactly the items it had not trained on. Each rank saves its own
state (`PATH.rank<R>`), since each rank reads its own share of the epoch.

The model is a toy (a linear classifier on 32x32 thumbnails); the data path is the real one. It
sizes itself from what the source serves (`ds.item_shape`, `ds.item_dtype`, `ds.classes`), so it
runs on an RGB source, a grayscale one (`mode = "L"`) and a user stage such as
examples/userstage.py (float32, one channel), and on integer labels that are not 0..K-1.
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from joader import JoaderDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="demo", help="the joaderd source to read")
    parser.add_argument("--address", default=None, help="joaderd's address (default: the per-user socket)")
    parser.add_argument("--name", default=None, help="the job's name (the ranks of one job share it)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--seed", type=int, default=None, help="the job's seed (a reproducible order)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="save here; resume from here")
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--step-s", type=float, default=0.0, help="extra time per step (a slower model)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")  # CPU here; use "nccl" on GPUs
    ds = JoaderDataset(args.source, address=args.address, name=args.name, seed=args.seed,
                       batch_size=args.batch_size, timeout_s=120)
    rank = ds.rank
    loader = StatefulDataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    # What the source serves: (C, H, W) items of one shape and dtype. C is 3 for RGB, 1 for
    # mode = "L" or the gray user stage; integer items are scaled to [0, 1], float ones (a user
    # stage that normalized already) are taken as they are.
    if ds.item_shape is None or len(ds.item_shape) != 3:
        ds.close()
        served = "items of varying size" if ds.item_shape is None else f"items of shape {ds.item_shape}"
        raise SystemExit(f"source {args.source!r} (stage {ds.stage!r}) serves {served}; this example "
                         "needs (C, H, W) items of one size: serve it with a fixed-size stage "
                         "(center-crop, or a user stage with a spec)")
    channels = ds.item_shape[0]
    dtype = np.dtype(ds.item_dtype)
    scale = float(np.iinfo(dtype).max) if np.issubdtype(dtype, np.integer) else 1.0
    # One output per class. Labels arrive as the source wrote them: class folders give 0..K-1,
    # integer labels (a list file's or a .cls's 15, 25, ...) stay themselves; the model's target
    # is the label's position among the source's classes.
    known_labels = torch.tensor(sorted(ds.class_to_idx.values()), dtype=torch.int64)
    model = torch.nn.Linear(channels * 32 * 32, len(known_labels))
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    path = args.checkpoint.with_name(f"{args.checkpoint.name}.rank{rank}") if args.checkpoint else None
    start_epoch, step = 0, 0
    if path is not None and path.exists():
        with open(path, "rb") as saved_file:
            saved = pickle.load(saved_file)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])
        start_epoch, step = saved["epoch"], saved["step"]
        print(f"rank {rank}: resumed from {path} in epoch {start_epoch + 1} at step {step}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        seen, started, loss = 0, time.monotonic(), None
        for images, labels in loader:
            x = torch.nn.functional.interpolate(images.float() / scale, size=(32, 32)).flatten(1)
            targets = torch.searchsorted(known_labels, labels.long())
            loss = torch.nn.functional.cross_entropy(model(x), targets)
            optimizer.zero_grad()
            loss.backward()  # DDP all-reduces here: ranks with unequal step counts would hang
            optimizer.step()
            seen += len(labels)
            step += 1
            if args.step_s:
                time.sleep(args.step_s)
            if path is not None and step % args.save_every == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "loader": loader.state_dict(), "epoch": epoch, "step": step}
                tmp = path.with_name(path.name + ".tmp")
                with open(tmp, "wb") as out:
                    pickle.dump(state, out)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
        # (a checkpoint saved after an epoch's last step resumes an empty rest of it)
        last = f", loss {loss.item():.3f}" if loss is not None else ""
        print(f"rank {rank}: epoch {epoch + 1}: {seen} samples in {time.monotonic() - started:.1f} s{last}",
              flush=True)
    ds.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
