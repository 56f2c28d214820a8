"""One training job of the field bench, its own process (`python -m bench.field.field job ...`): the
small CNN it trains, the folder its baseline side reads through joaderd's stage, and its loop."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

SIDES = ("joader", "baseline")
BATCH_SIZE = 32


def small_cnn(channels: int, size: int) -> Any:
    from torch import nn

    layers: list[Any] = [] if size == 32 else [nn.AdaptiveAvgPool2d(32)]
    return nn.Sequential(*layers, nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(32 * 8 * 8, 10))


class StageFolder:
    """The baseline's dataset: an ImageFolder running joaderd's shared stage in the DataLoader
    worker (the same `joader.stages` code and parameters), yielding (index, image, label)."""

    def __init__(self, root: str, size: int, mode: str, upscale: bool, decoder: str) -> None:
        from joader.sources.imagefolder import list_image_folder

        self.listing = list_image_folder(root)
        self.params = {"size": size, "mode": mode, "upscale": upscale, "decoder": decoder}
        self._stage: Any = None

    def __len__(self) -> int:
        return len(self.listing.paths)

    def __getitem__(self, i: int) -> tuple[int, Any, int]:
        import torch

        if self._stage is None:  # built in the worker
            from joader.stages import build_stage

            self._stage = build_stage("center-crop", **self.params)
        image = torch.from_numpy(self._stage.prepare(self.listing.read(i), self.listing.paths[i]))
        return i, image, int(self.listing.labels[i])


def job_main(args: argparse.Namespace) -> int:
    import psutil

    process_start = psutil.Process().create_time()
    import torch
    from torch.utils.data import DataLoader

    from joader.sources.imagefolder import list_image_folder
    from joader.testing.simjob import tree_cpu_s

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    expected_labels = list_image_folder(args.root).labels
    n = args.n

    def make() -> tuple[Any, Any]:
        if args.side == "joader":
            from joader import JoaderDataset

            dataset: Any = JoaderDataset(args.source, indices=range(n), return_index=True, address=args.address)
            return dataset, DataLoader(dataset, batch_size=args.batch_size)
        dataset = StageFolder(args.root, args.size, args.mode, args.upscale, args.decoder)
        generator = torch.Generator().manual_seed(args.seed)
        return dataset, DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=1,
                                   persistent_workers=True, generator=generator)

    model = small_cnn(args.channels, args.size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    cost = args.cost

    def step(images: Any, labels: Any) -> tuple[float, int]:
        x = images.float().div_(255)
        optimizer.zero_grad()
        loss_sum = 0.0
        correct = 0
        for k in range(cost):  # K forward/backward passes, one optimizer step
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, labels)
            (loss / cost).backward()
            if k == 0:
                loss_sum = float(loss) * len(labels)
                correct = int((logits.argmax(1) == labels).sum())
        optimizer.step()
        return loss_sum, correct

    # warm up (the first call's allocations), then restore the initial weights
    state = {k: v.clone() for k, v in model.state_dict().items()}
    step(torch.zeros((args.batch_size, args.channels, args.size, args.size), dtype=torch.uint8),
         torch.zeros(args.batch_size, dtype=torch.long))
    model.load_state_dict(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    dataset = loader = None
    if args.attach_first:
        dataset, loader = make()
    built_at = time.time()
    if args.ready_file:
        args.ready_file.touch()
    if args.go_file:
        deadline = time.monotonic() + 900
        while not args.go_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {args.go_file} after 900 s")
            time.sleep(0.005)
    go_at = time.time()
    if dataset is None:
        dataset, loader = make()
    torch.set_num_threads(1)
    cpu_at_go = tree_cpu_s(os.getpid())

    batches: list[list[float]] = []  # [arrival time - go_at, items]
    epochs = []
    half_written = False
    first_count = 0
    for _ in range(args.epochs):
        ids: list[int] = []
        loss_total = 0.0
        correct_total = 0
        wrong_labels = 0
        for index, images, labels in loader:
            t = time.time()
            batches.append([round(t - go_at, 5), len(labels)])
            ids.extend(index.tolist())
            wrong_labels += int((labels != torch.from_numpy(expected_labels[index.numpy()]).long()).sum())
            loss_sum, correct = step(images, labels.long())
            loss_total += loss_sum
            correct_total += correct
            if not half_written and args.half_file and len(ids) * 2 >= n:
                args.half_file.touch()
                half_written = True
        seen = set(ids)
        epochs.append({
            "ended_at": time.time(), "items": len(ids),
            "duplicates": len(ids) - len(seen), "missing": n - len(seen & set(range(n))),
            "foreign": len(seen - set(range(n))), "wrong_labels": wrong_labels,
            "exactly_once": sorted(ids) == list(range(n)),
            "train_loss": round(loss_total / max(1, len(ids)), 4),
            "train_acc": round(correct_total / max(1, len(ids)), 4),
        })
        if not first_count and batches:
            first_count = int(batches[0][1])
    ended_at = time.time()
    job_id = getattr(dataset, "job_id", None)
    if args.side == "joader":
        dataset.close()
    del loader  # the baseline's persistent worker is shut down and reaped here
    cpu = tree_cpu_s(os.getpid())
    samples = sum(e["items"] for e in epochs)
    first_t, last_t = batches[0][0], batches[-1][0]
    report = {
        "side": args.side, "job_id": job_id, "lr": args.lr, "cost": cost, "epochs_asked": args.epochs,
        "seed": args.seed, "launched_at": args.launched_at, "process_start": process_start,
        "built_at": built_at, "go_at": go_at, "first_batch_at": go_at + first_t, "last_batch_at": go_at + last_t,
        "ended_at": ended_at, "samples": samples,
        "samples_per_s": round((samples - first_count) / (last_t - first_t), 2) if last_t > first_t else None,
        "epochs": epochs, "batches": batches,
        "exactly_once": all(e["exactly_once"] and e["wrong_labels"] == 0 for e in epochs) and len(epochs) == args.epochs,
        "final_train_loss": epochs[-1]["train_loss"], "final_train_acc": epochs[-1]["train_acc"],
        "first_train_loss": epochs[0]["train_loss"],
        "cpu_s": round(cpu, 3), "cpu_loop_s": round(cpu - cpu_at_go, 3), "torch_threads": torch.get_num_threads(),
    }
    args.out.write_text(json.dumps(report))
    return 0


def job_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.field.field job")
    parser.add_argument("--side", choices=SIDES, required=True)
    parser.add_argument("--address")
    parser.add_argument("--source", default="digits")
    parser.add_argument("--root", required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--channels", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--upscale", action="store_true")
    parser.add_argument("--decoder", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--cost", type=int, default=1, help="forward/backward passes per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attach-first", action="store_true", help="build the loader before waiting for --go-file")
    parser.add_argument("--ready-file", type=Path)
    parser.add_argument("--go-file", type=Path)
    parser.add_argument("--half-file", type=Path)
    parser.add_argument("--launched-at", type=float, default=0.0)
    parser.add_argument("--out", type=Path, required=True)
    return parser
