"""How far each decoder is from torchvision's output, per format, at S = 64 and S = 224.

The reference is torchvision's ImageFolder + Resize(S) + CenterCrop(S) as written from its
documented behaviour in joader/testing/torchvision_reference.py (`torchvision_reference`;
torchvision itself is not installed here). The images are generated "photos" (smooth gradients,
a sine pattern, noise and a sharp-edged block), 400-640 px on each side, seeded; JPEGs at
quality 90. Formats: RGB JPEG, RGB PNG, grey PNG (L), grey JPEG, palette PNG (P), RGBA PNG, CMYK
JPEG, 16-bit grey PNG (I;16). Each image goes through the default stage (center-crop:S, RGB)
with decoders pil, pil-draft and turbo; per format and S, over every value of every image:
max |diff|, mean |diff|, and the share of values off by more than 2 grey levels (speed:
bench/micro/stage.py).

Usage: python -m bench.micro.decoders [--photos N] [--out PATH]. Prints a table per S and writes JSON
(default bench/results/decoders.json). About a minute with the default 5 photos.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, machine, print_table
from joader.stages import build_stage
from joader.testing.torchvision_reference import FORMATS, encode, torchvision_reference

DECODERS = ("pil", "pil-draft", "turbo")
SIZES = (64, 224)


def photo_sizes(count: int, seed: int = 38) -> list[tuple[int, int]]:
    """`count` (width, height) pairs, each side 400-640 px."""
    rng = np.random.default_rng(seed)
    return [(int(w), int(h)) for w, h in rng.integers(400, 641, (count, 2))]


def measure(fmt: str, size: int, shapes: list[tuple[int, int]]) -> dict[str, dict[str, float]]:
    """Per decoder: max, mean and share > 2 of |decoder - torchvision|."""
    stages = {d: build_stage("center-crop", size=size, decoder=d) for d in DECODERS}
    diffs: dict[str, list[np.ndarray]] = {d: [] for d in DECODERS}
    for i, (width, height) in enumerate(shapes):
        data = encode(fmt, width, height, seed=100 + i)
        ref = torchvision_reference(data, size).astype(np.int16)
        for decoder, stage in stages.items():
            out = stage.prepare(data, f"photo{i}.{fmt}")
            diffs[decoder].append(np.abs(out.astype(np.int16) - ref).ravel())
    result = {}
    for decoder in DECODERS:
        diff = np.concatenate(diffs[decoder])
        result[decoder] = {
            "max": int(diff.max()),
            "mean": round(float(diff.mean()), 3),
            "share_over_2": round(float((diff > 2).mean()), 4),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", type=int, default=5, help="photos per format (default 5)")
    parser.add_argument("--out", type=Path, default=RESULTS / "decoders.json")
    args = parser.parse_args()
    shapes = photo_sizes(args.photos)
    print(f"{args.photos} photos per format: {', '.join(f'{w}x{h}' for w, h in shapes)}")
    results: dict[str, Any] = {}
    for size in SIZES:
        rows = []
        for fmt in FORMATS:
            figures = measure(fmt, size, shapes)
            results[f"{fmt}@{size}"] = figures
            row = [fmt]
            for decoder in DECODERS:
                f = figures[decoder]
                row += [f"{f['max']}", f"{f['mean']:.3f}", f"{100 * f['share_over_2']:.1f}%"]
            rows.append(row)
        header = ["format"] + [f"{d} {col}" for d in DECODERS for col in ("max", "mean", ">2")]
        print(f"\nS = {size}: |decoder - torchvision's ImageFolder + Resize + CenterCrop| in grey levels")
        print_table(header, rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "photos": shapes, "results": results}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
