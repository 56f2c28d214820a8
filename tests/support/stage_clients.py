"""Client programs for the stage and source tests: `python -m tests.support.stage_clients CMD`.

Each writes what it received to an `.npz` file (the test compares pixels in its own process,
which never opens a gRPC channel), and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from typing import Any

import numpy as np


def dump(args: argparse.Namespace) -> None:
    """One epoch of a source, every item as received, by index: `item_<i>` arrays and labels."""
    from joader.client.dataset import JoaderDataset

    ds = JoaderDataset(args.source, indices=range(args.items) if args.items else None, address=args.address,
                       batch_size=args.batch_size, return_index=True, timeout_s=60)
    arrays: dict[str, Any] = {}
    labels = {}
    for index, item, label in ds:
        arrays[f"item_{int(index)}"] = item.numpy()
        labels[int(index)] = int(label)
    arrays["labels"] = np.array([labels[i] for i in sorted(labels)], dtype=np.int64)
    arrays["indices"] = np.array(sorted(labels), dtype=np.int64)
    np.savez(args.out, **arrays)
    print(json.dumps({"items": len(labels), "stage": ds.stage, "item_shape": ds.item_shape,
                      "item_dtype": ds.item_dtype, "len": len(ds)}), flush=True)
    ds.close()


def random_resized_crop(image: Any, size: int = 224, rng: random.Random | None = None) -> Any:
    """torchvision's RandomResizedCrop(size) on a uint8 CHW tensor, written with torch only:
    a random area of 8%-100% and aspect ratio 3/4-4/3 of the whole image, resized to size."""
    import torch

    rng = rng or random.Random()
    _, height, width = image.shape
    area = height * width
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            top, left = rng.randint(0, height - h), rng.randint(0, width - w)
            break
    else:
        h, w, top, left = height, width, 0, 0
    crop = image[:, top:top + h, left:left + w].unsqueeze(0).float()
    out = torch.nn.functional.interpolate(crop, size=(size, size), mode="bilinear", antialias=True)
    return out.squeeze(0).round().clamp(0, 255).to(torch.uint8)


def train(args: argparse.Namespace) -> None:
    """RandomResizedCrop(224) as the job stage over whole images, in a DataLoader with workers."""
    import torch
    from torch.utils.data import DataLoader

    from joader.client.dataset import JoaderDataset

    torch.set_num_threads(1)
    ds = JoaderDataset(args.source, address=args.address, batch_size=args.batch_size,
                       transform=random_resized_crop, timeout_s=60)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=2)
    shapes, count = set(), 0
    for images, labels in loader:
        shapes.add(tuple(images.shape[1:]))
        count += len(labels)
    print(json.dumps({"items": count, "shapes": sorted(shapes), "batches": len(loader)}), flush=True)
    ds.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["dump", "train"])
    parser.add_argument("--address", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--out")
    parser.add_argument("--items", type=int, default=0, help="the first N items (default: all)")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    {"dump": dump, "train": train}[args.command](args)


if __name__ == "__main__":
    main()
