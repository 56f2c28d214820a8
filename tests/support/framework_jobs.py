"""Training scripts written the way each framework's users write them, for `test_frameworks`.

    python -m tests.support.framework_jobs lightning  --address A --source S --out DIR ...
    torchrun ... -m tests.support.framework_jobs accelerate --address A ... [--unprepared]
    torchrun ... -m tests.support.framework_jobs stateful   --address A ... [--checkpoint F]

Each rank records every sample its training step receives (epoch, index, label, crc32 of the
pixels), one JSON line per sample in `DIR/records-<rank>.jsonl`, flushed per step, so that the
test checks content and exactly-once over the union of the ranks (`integrity.check_records`).
A checkpoint also writes each rank's record count at that step (`DIR/mark-<rank>-<step>.json`);
a resumed run first truncates each rank's records to the checkpoint it resumes (what a killed
run received after it was never trained on). `--kill-at E:S` makes rank 0 kill the whole run
(every rank, SIGKILL) when epoch E reaches step S.

The dataset is built at the top of the script, before any process group exists: the usual way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from joader.client.dataset import JoaderDataset


class Records:
    """This rank's sample records, and the marks that let a resume truncate them."""

    def __init__(self, directory: str, rank: int) -> None:
        self.dir = Path(directory)
        self.rank = rank
        self.path = self.dir / f"records-{rank}.jsonl"
        self.count = sum(1 for _ in self.path.open()) if self.path.exists() else 0
        self.out = self.path.open("a")

    def samples(self, epoch: int, indices: Any, images: torch.Tensor, labels: Any) -> None:
        for index, image, label in zip(indices.tolist(), images, labels.tolist(), strict=True):
            self.out.write(json.dumps({"kind": "sample", "epoch": epoch, "index": index, "label": label,
                                       "crc": zlib.crc32(image.contiguous().numpy().tobytes()),
                                       "rank": self.rank}) + "\n")
            self.count += 1
        self.out.flush()

    def mark(self, step: int) -> None:
        (self.dir / f"mark-{self.rank}-{step}.json").write_text(json.dumps({"lines": self.count}))

    def truncate_to(self, step: int) -> None:
        """Keeps the records up to checkpoint `step` (a resumed run's first act)."""
        lines = json.loads((self.dir / f"mark-{self.rank}-{step}.json").read_text())["lines"]
        self.out.close()
        kept = self.path.read_text().splitlines(keepends=True)[:lines]
        self.path.write_text("".join(kept))
        self.count = lines
        self.out = self.path.open("a")


def _kill_everything() -> None:
    """SIGKILL to every process of the run, this one last: the test tags each run's processes
    in their environment (torchrun's ranks each have a session of their own, so a process
    group is not the run)."""
    from tests.support.processes import TAG_VAR, tagged_pids

    for pid in tagged_pids(os.environ[TAG_VAR]):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
    os.kill(os.getpid(), signal.SIGKILL)


def _dataset(args: argparse.Namespace) -> JoaderDataset:
    return JoaderDataset(args.source, address=args.address, return_index=True, timeout_s=60.0,
                         **({"seed": args.seed} if args.seed is not None else {}),
                         **({"indices": range(args.items)} if args.items else {}))


def _model(ds: JoaderDataset) -> torch.nn.Module:
    channels = ds.item_shape[0] if ds.item_shape else 3
    return torch.nn.Linear(channels, max(2, len(ds.classes)))


def _features(images: torch.Tensor) -> torch.Tensor:
    return images.float().mean(dim=(2, 3)) / 255.0


def _loader(args: argparse.Namespace, ds: JoaderDataset) -> Any:
    if args.loader == "plain":
        return torch.utils.data.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    from joader.client.loader import JoaderDataLoader

    return JoaderDataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)


# ------------------------------------------------------------------------------ Lightning

def lightning(args: argparse.Namespace) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    ds = _dataset(args)  # before trainer.fit: no process group, no RANK yet
    kill_epoch, kill_step = (int(x) for x in args.kill_at.split(":")) if args.kill_at else (-1, -1)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(ds)
            self.records: Records | None = None

        def on_fit_start(self) -> None:
            self.records = Records(args.out, self.global_rank)
            if args.resume:
                self.records.truncate_to(int(torch.load(args.resume, weights_only=False)["global_step"]))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            indices, images, labels = batch
            if self.current_epoch == kill_epoch and batch_idx == kill_step and self.global_rank == 0:
                _kill_everything()
            assert self.records is not None
            self.records.samples(self.current_epoch + 1, indices, images, labels)
            return torch.nn.functional.cross_entropy(self.net(_features(images)), labels)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            assert self.records is not None
            self.records.mark(self.global_step)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = _loader(args, ds)
    callbacks = [ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.every, save_top_k=-1,
                                 filename="{epoch}-{step}")] if args.every else []
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.epochs,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(args.every), callbacks=callbacks,
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(Net(), loader, ckpt_path=args.resume)
    if trainer.global_rank == 0:
        Path(args.out, "done.json").write_text(json.dumps({
            "len_loader": len(loader), "global_step": trainer.global_step,
            "batches_per_epoch": trainer.num_training_batches}))


# ------------------------------------------------------------------------------ accelerate

def accelerate_job(args: argparse.Namespace) -> None:
    """Under torchrun (or `accelerate launch`): the loader prepared as accelerate's examples do
    (`prepare(model, optimizer, loader)`: its default dispatches batches from rank 0), or with
    `--unprepared` left out of prepare (each rank reads its own share)."""
    from accelerate import Accelerator

    ds = _dataset(args)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    if args.no_dispatch:
        from accelerate import DataLoaderConfiguration

        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    else:
        accelerator = Accelerator(cpu=True)
    model = _model(ds)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.unprepared:
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    records = Records(args.out, accelerator.process_index)
    counts = []
    for epoch in range(args.epochs):
        batches = 0
        for indices, images, labels in loader:
            records.samples(epoch + 1, indices, images, labels)
            loss = torch.nn.functional.cross_entropy(model(_features(images)), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            batches += 1
        counts.append(batches)
    Path(args.out, f"done-{accelerator.process_index}.json").write_text(json.dumps({
        "len_loader": len(loader), "batches": counts}))
    accelerator.wait_for_everyone()
    # What accelerate's docs end a script with: it destroys the process group. Without it, gloo's
    # worker threads may still hold work at interpreter exit and abort the process (SIGABRT,
    # "terminate called without an active exception"; pytorch/pytorch#190489), 1 run in ~30 here.
    accelerator.end_training()


# ------------------------------------------------------------------------------ torchrun

def stateful(args: argparse.Namespace) -> None:
    """Under torchrun: JoaderDataLoader, an all_reduce per step, a checkpoint every `--every`
    steps written by rank 0 only (the usual code; the loader's state gathers every rank's),
    and with `--resume`, the run picks up where that checkpoint was."""
    import torch.distributed as dist

    from joader.client.loader import JoaderDataLoader

    ds = _dataset(args)  # before init_process_group: torchrun's RANK and WORLD_SIZE say where
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = JoaderDataLoader(ds, batch_size=args.batch_size, num_workers=args.workers)
    records = Records(args.out, rank)
    checkpoint_path = Path(args.out, "checkpoint.pt")
    epoch0, step = 0, 0
    if args.resume:
        checkpoint = torch.load(checkpoint_path, weights_only=False)
        loader.load_state_dict(checkpoint["loader"])
        epoch0, step = checkpoint["epoch"], checkpoint["step"]
        records.truncate_to(step)
    kill_epoch, kill_step = (int(x) for x in args.kill_at.split(":")) if args.kill_at else (-1, -1)
    counts = []
    for epoch in range(epoch0, args.epochs):
        batches = 0
        for batch_idx, (indices, images, labels) in enumerate(loader):
            if epoch == kill_epoch and batch_idx == kill_step and rank == 0 and not args.resume:
                _kill_everything()
            records.samples(epoch + 1, indices, images, labels)
            if args.step_s:
                time.sleep(args.step_s)  # an emulated GPU step
            reduced = torch.ones(1)
            dist.all_reduce(reduced)  # what DDP's gradient all-reduce does: every rank steps
            step += 1
            batches += 1
            if args.every and step % args.every == 0:
                state = loader.state_dict()  # a collective: every rank, here
                records.mark(step)
                if rank == 0:
                    torch.save({"loader": state, "epoch": epoch, "step": step}, f"{checkpoint_path}.tmp")
                    os.replace(f"{checkpoint_path}.tmp", checkpoint_path)
                dist.barrier()
        counts.append(batches)
    Path(args.out, f"done-{rank}.json").write_text(json.dumps({
        "len_loader": len(loader), "batches": counts, "job_id": ds.job_id,
        "hosts": ds.hosts.as_dict() if ds.hosts is not None else None}))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ len()

def lengths(args: argparse.Namespace) -> None:
    """One epoch in each delivery mode: `len(loader)` against the batches and items received."""
    from torch.utils.data import DataLoader

    size = args.batch_size
    modes: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("items", {}, {"batch_size": size}),
        ("items, 2 workers", {}, {"batch_size": size, "num_workers": 2}),
        ("items, 2 workers, drop_last", {}, {"batch_size": size, "num_workers": 2, "drop_last": True}),
        ("items, 2 workers, a transform", {"transform": _flip}, {"batch_size": size, "num_workers": 2}),
        ("batched", {"batched": True, "batch_size": size}, {"batch_size": None}),
        ("batched, 2 workers (hand-off)", {"batched": True, "batch_size": size}, {"batch_size": None, "num_workers": 2}),
    ]
    results = []
    for mode, dataset_args, loader_args in modes:
        with JoaderDataset(args.source, address=args.address, timeout_s=60.0, **dataset_args) as ds:
            loader = DataLoader(ds, **loader_args)
            batches = items = 0
            for images, _labels in loader:
                batches += 1
                items += len(images)
            results.append({"mode": mode, "len_loader": len(loader), "batches": batches, "items": items,
                            "len_dataset": len(ds)})
    Path(args.out, "lengths.json").write_text(json.dumps(results))


def _flip(image: torch.Tensor) -> torch.Tensor:
    return image.flip(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["lightning", "accelerate", "stateful", "lengths"])
    parser.add_argument("--address", required=True)
    parser.add_argument("--source", default="demo")
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--loader", choices=["joader", "plain"], default="joader")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--step-s", type=float, default=0.0, help="stateful: sleep per step")
    parser.add_argument("--items", type=int, default=0, help="indices=range(N) (0: the whole source)")
    parser.add_argument("--every", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--kill-at", default="", help="E:S: kill the run at epoch E (0-based), step S")
    parser.add_argument("--resume", help="Lightning: a checkpoint to resume; stateful: any value resumes")
    parser.add_argument("--unprepared", action="store_true", help="accelerate: do not prepare the loader")
    parser.add_argument("--no-dispatch", action="store_true", help="accelerate: dispatch_batches=False")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    {"lightning": lightning, "accelerate": accelerate_job, "stateful": stateful,
     "lengths": lengths}[args.command](args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
