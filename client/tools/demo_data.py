"""Demo data: an ImageNet-like folder of 500x375 photo-like JPEGs (about 100 KB each).

`make_demo_data(root, num_items)` writes `root/<class>/img_<id>.jpg`, item `i` in class
`i % num_classes`. Content is deterministic in `seed`: a few smooth "scenes" (gradients, soft
blobs, mid-frequency texture) are made once; each image is a random window of one of them under
its class's colour transform, with per-image gain and sensor-like noise, so the JPEGs are about
as large and as slow to decode as real photos. Generation is cheap (about 200 files/s on one
core here, dominated by JPEG encoding).

Re-running is idempotent: existing files are kept (they would be byte-identical), missing ones
are written, and a manifest (`.joader-demo.json`) records what the folder holds. A folder that
is not empty and has no manifest is refused, so a real dataset is never written into.

`python -m joader.client.tools.demo_data DIR --items N` (or `joader make-demo-data DIR --items N`)
does the same from a shell. `make demo` (`joader.client.tools.demo`), the benches and the tests use it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from joader.errors import InvalidArgumentError
from joader.sources.imagefolder import SourceListing, list_image_folder

__all__ = ["main", "make_demo_data"]

WIDTH, HEIGHT = 500, 375
JPEG_QUALITY = 90
MANIFEST = ".joader-demo.json"
_NUM_SCENES = 8
_MARGIN_Y, _MARGIN_X = 150, 200  # scenes are larger than an image: windows vary per item
_NOISE_SIGMA = 14.0  # with the texture, this puts files at about 100 KB at quality 90
_CLASS_NAMES = (
    "aurora", "basalt", "coral", "dune", "ember", "fjord", "glacier", "heath", "indigo", "jungle",
)  # fmt: skip


def class_names(num_classes: int) -> list[str]:
    """Sorted-order class folder names: `c00_aurora`, ... then `c10`, `c11`, ..."""
    width = max(2, len(str(num_classes - 1)))
    return [
        f"c{k:0{width}d}_{_CLASS_NAMES[k]}" if k < len(_CLASS_NAMES) else f"c{k:0{width}d}"
        for k in range(num_classes)
    ]


def make_demo_data(
    root: str | os.PathLike[str],
    num_items: int,
    *,
    num_classes: int = 10,
    seed: int = 0,
    progress: bool = True,
) -> SourceListing:
    """Write (or complete) a demo ImageFolder at `root` and return its listing."""
    if num_items <= 0 or num_classes <= 0:
        raise InvalidArgumentError(
            f"need num_items > 0 and num_classes > 0, got {num_items} and {num_classes}"
        )
    root = Path(root).expanduser()
    wanted = {"num_items": num_items, "num_classes": num_classes, "seed": seed,
              "width": WIDTH, "height": HEIGHT, "quality": JPEG_QUALITY}  # fmt: skip
    _check_folder(root, wanted)
    names = class_names(num_classes)
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
    # Manifest first: an interrupted run is then recognised and completed by the next one.
    (root / MANIFEST).write_text(json.dumps(wanted, indent=1) + "\n")

    generator = _Generator(seed, num_classes)
    todo = [i for i in range(num_items) if not _item_path(root, names, i).exists()]
    start = last_report = time.perf_counter()
    for done, item_id in enumerate(todo, 1):
        _write_jpeg(_item_path(root, names, item_id), generator.image(item_id))
        now = time.perf_counter()
        if progress and (now - last_report > 0.5 or done == len(todo)):
            last_report = now
            rate = done / max(now - start, 1e-9)
            print(f"\rdemo data: {done}/{len(todo)} new images ({rate:.0f}/s)", end="",
                  file=sys.stderr, flush=True)  # fmt: skip
    if progress:
        kept = num_items - len(todo)
        print(("\n" if todo else "") + f"demo data: {num_items} images in {root} "
              f"({kept} already there)", file=sys.stderr)  # fmt: skip
    return list_image_folder(root)


def _check_folder(root: Path, wanted: dict[str, int]) -> None:
    manifest = root / MANIFEST
    if manifest.exists():
        try:
            old = json.loads(manifest.read_text())
        except ValueError:
            old = {}
        same_set = {k: v for k, v in old.items() if k != "num_items"} == {
            k: v for k, v in wanted.items() if k != "num_items"
        }
        if not same_set or old.get("num_items", 0) > wanted["num_items"]:
            raise InvalidArgumentError(
                f"{root} holds different demo data ({old}); asked for {wanted}. Use a new "
                f"folder, or delete {root} to regenerate"
            )
    elif root.exists() and any(root.iterdir()):
        raise InvalidArgumentError(
            f"{root} is not empty and is not a joader demo folder; give a new or empty folder"
        )


def _item_path(root: Path, names: Sequence[str], item_id: int) -> Path:
    return root / names[item_id % len(names)] / f"img_{item_id:07d}.jpg"


def _write_jpeg(path: Path, pixels: np.ndarray) -> None:
    # Write then rename: an interrupted run never leaves a half file that "exists".
    tmp = path.with_name(f".{path.name}.tmp")
    Image.fromarray(pixels).save(tmp, "JPEG", quality=JPEG_QUALITY)
    os.replace(tmp, path)


class _Generator:
    """Photo-like images, deterministic in (seed, item id), cheap per image."""

    def __init__(self, seed: int, num_classes: int) -> None:
        self.seed = seed
        rng = np.random.default_rng([seed, 1])
        self.scenes = [_make_scene(rng) for _ in range(_NUM_SCENES)]
        self.noise = (rng.standard_normal((2 * HEIGHT, 2 * WIDTH, 3)) * _NOISE_SIGMA).astype(
            np.float32
        )
        # A class is a colour transform (channel mixing + offset) and a preferred scene pair.
        self.mix = []
        self.offset = []
        self.class_scenes = []
        for _ in range(num_classes):
            mix = np.eye(3, dtype=np.float32) * 0.6 + rng.uniform(0, 0.4, (3, 3)).astype(np.float32)
            self.mix.append(mix / mix.sum(axis=0, keepdims=True))
            self.offset.append(rng.uniform(-40, 40, 3).astype(np.float32))
            self.class_scenes.append(rng.choice(_NUM_SCENES, 2, replace=False))

    def image(self, item_id: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 2, item_id])
        label = item_id % len(self.mix)
        scene = self.scenes[self.class_scenes[label][rng.integers(2)]]
        y, x = rng.integers(0, _MARGIN_Y), rng.integers(0, _MARGIN_X)
        window = scene[y : y + HEIGHT, x : x + WIDTH]
        if rng.random() < 0.5:
            window = window[:, ::-1]
        img = window.astype(np.float32) @ self.mix[label]
        img *= np.float32(rng.uniform(0.75, 1.15))
        img += self.offset[label]
        ny, nx = rng.integers(0, HEIGHT), rng.integers(0, WIDTH)
        img += self.noise[ny : ny + HEIGHT, nx : nx + WIDTH]
        return np.clip(img, 0, 255).astype(np.uint8)


def _make_scene(rng: np.random.Generator) -> np.ndarray:
    """A smooth colour field with soft blobs and mid-frequency texture, uint8 HxWx3."""
    height, width = HEIGHT + _MARGIN_Y, WIDTH + _MARGIN_X
    coarse = (rng.random((6, 8, 3)) * 255).astype(np.uint8)
    img = np.asarray(
        Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32
    )
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    for _ in range(6):
        cy, cx, radius = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(20, 120)
        weight = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * radius * radius))[..., None]
        img = img * (1 - weight) + rng.uniform(0, 255, 3).astype(np.float32) * weight
    texture = (rng.random((height // 2, width // 2)) * 255).astype(np.uint8)
    texture = np.asarray(
        Image.fromarray(texture).resize((width, height), Image.Resampling.BILINEAR), np.float32
    )
    img += (texture[..., None] - 128) * 0.4
    return np.clip(img, 0, 255).astype(np.uint8)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m joader.client.tools.demo_data",
        description="Write an ImageNet-like demo folder of 500x375 JPEGs (about 100 KB each).",
    )
    parser.add_argument("dir", help="folder to write (created; re-running completes it)")
    parser.add_argument("--items", type=int, default=1200, help="number of images (default 1200)")
    parser.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    try:
        make_demo_data(
            args.dir, args.items, num_classes=args.classes, seed=args.seed, progress=not args.quiet
        )
    except InvalidArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
