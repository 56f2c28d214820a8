"""A training job that records every sample it receives, for the content checks of fault tests
and of the chaos soak (`bench/soak/chaos.py`).

    python -m joader.testing.integrity_job (--address A | --root DIR --image-size S) --records FILE [--workers N]
        [--batched] [--transform] [--reseed] [--epochs E] [--indices a:b[:c]] [--sleep S]
        [--state CHECKPOINT] [--setup-s S] [--stop-after-batches N] [--shm-full]
        [--order shared|independent] [--start-file FILE]

One JSON line per sample (flushed per batch): epoch, index, label, crc32 of its pixels, so a
job killed -9 leaves what it received. With `--reseed`, torch.manual_seed(0) before each
epoch (fresh DataLoader workers then repeat their base seed). With `--transform`, an identity
transform in the job stage (the path matters, not what it does). Lines of kind "epoch" mark
each epoch's end; the last line says "done".

`--state FILE` (num_workers=0): after every batch, a checkpoint (`ds.state_dict()`, the loop's
epoch, and how long the records file was) replaces FILE atomically. Started again with FILE
present, as a job restarted after a crash is, the job truncates its records to the checkpoint
(what it received after the checkpoint was never trained on: a lost step) and resumes there
with `load_state_dict`, so its records must still be each epoch exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
import zlib
from typing import Any


def _identity(image: Any) -> Any:
    return image.clone()


def _fill_shm(torch: Any) -> None:
    """/dev/shm as if full, for this process and its forks: torch's shared-memory allocation
    fails as it does then (the test machine's /dev/shm is shared: never fill it for real)."""
    def full(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_0_1_0>: "
                           "No space left on device (28)")

    torch.UntypedStorage._new_shared = staticmethod(full)


def _save(path: str, checkpoint: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as out:
        pickle.dump(checkpoint, out)
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", default=None)
    parser.add_argument("--root", default=None, help="JoaderDataset(root=): find or start joaderd for it")
    parser.add_argument("--image-size", type=int, default=None, help="JoaderDataset(image_size=)")
    parser.add_argument("--records", required=True)
    parser.add_argument("--source", default="demo")
    parser.add_argument("--name", default=f"integrity-{os.getpid()}")
    parser.add_argument("--indices", default=None)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batched", action="store_true")
    parser.add_argument("--transform", action="store_true")
    parser.add_argument("--reseed", action="store_true")
    parser.add_argument("--follow-loader", action="store_true",
                        help="no batch_size on the dataset: it asks in the DataLoader's")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--state", default=None, help="checkpoint file (num_workers=0 only)")
    parser.add_argument("--setup-s", type=float, default=0.0,
                        help="seconds between attaching and the first read (a model being built)")
    parser.add_argument("--stop-after-batches", type=int, default=0,
                        help="end early: close the dataset mid-epoch after this many batches (a trial "
                             "a scheduler stopped), and exit 0")
    parser.add_argument("--shm-full", action="store_true",
                        help="allocating shared memory fails as torch fails when /dev/shm is full")
    parser.add_argument("--order", default="shared", help="JoaderDataset(order=)")
    parser.add_argument("--go-file", default=None,
                        help="wait for this file before building the dataset (jobs attach at one instant)")
    parser.add_argument("--start-file", default=None,
                        help="attach, then wait for this file before the first read (jobs start together)")
    args = parser.parse_args()
    if args.state and args.workers:
        parser.error("--state checkpoints ds.state_dict(), which covers num_workers=0 only")

    import torch
    from torch.utils.data import DataLoader

    from joader.client.dataset import JoaderDataset

    if args.shm_full:  # the DataLoader workers, forked below, inherit it
        _fill_shm(torch)
    indices = range(*map(int, args.indices.split(":"))) if args.indices else None
    while args.go_file and not os.path.exists(args.go_file):
        time.sleep(0.002)
    auto = {"root": args.root, "image_size": args.image_size} if args.root else {}
    ds = JoaderDataset(args.source, indices=indices, address=args.address, name=args.name, **auto,
                       batch_size=None if args.follow_loader else args.batch_size,
                       batched=args.batched, return_index=True,
                       transform=_identity if args.transform else None, timeout_s=args.timeout_s,
                       order=args.order)  # JOADER_VERIFY=1 in the environment checks every crc32
    loader = DataLoader(ds, batch_size=None if args.batched else args.batch_size, num_workers=args.workers)
    first_epoch = 1
    if args.state and os.path.exists(args.state):
        with open(args.state, "rb") as saved:
            checkpoint = pickle.load(saved)
        with open(args.records, "r+") as records:
            records.truncate(checkpoint["offset"])
        ds.load_state_dict(checkpoint["state"])
        first_epoch = checkpoint["epoch"]
    if args.start_file:
        len(ds)  # attached: joaderd knows the job before it waits
        while not os.path.exists(args.start_file):
            time.sleep(0.01)
    if args.setup_s:  # attached (the dataset exists), not reading yet: as a script building its model
        time.sleep(args.setup_s)
    batches = 0
    with open(args.records, "a") as out:
        for epoch in range(first_epoch, args.epochs + 1):
            if args.reseed:
                torch.manual_seed(0)
            for indices_t, images, labels in loader:
                lines = [
                    json.dumps({"kind": "sample", "epoch": epoch, "index": int(i), "label": int(label),
                                "crc": zlib.crc32(image.contiguous().numpy().tobytes())})
                    for i, image, label in zip(indices_t, images, labels, strict=True)
                ]
                out.write("\n".join(lines) + "\n")
                out.flush()
                if args.state:
                    _save(args.state, {"epoch": epoch, "offset": out.tell(), "state": ds.state_dict()})
                if args.sleep:
                    time.sleep(args.sleep)
                batches += 1
                if batches == args.stop_after_batches:
                    break
            if batches == args.stop_after_batches:  # ends mid-epoch, its DataLoader iterator alive
                out.write(json.dumps({"kind": "stopped", "epoch": epoch}) + "\n")
                break
            out.write(json.dumps({"kind": "epoch", "epoch": epoch}) + "\n")
            out.flush()
            if args.state:  # the epoch is over: a restart goes on with the next one
                _save(args.state, {"epoch": epoch + 1, "offset": out.tell(), "state": ds.state_dict()})
        out.write(json.dumps({"kind": "done"}) + "\n")
    ds.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
