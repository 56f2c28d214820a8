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

`python -m joader.sources.demo DIR --items N` does the same from a shell.

`write_list_file` and `write_tar_shards` write the items of an ImageFolder as a list file or as
WebDataset tar shards, in the listing's order: item `i` is the same image bytes and label in all
three kinds of source (`joader.sources.open_source`).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from joader.errors import InvalidArgumentError
from joader.sources.imagefolder import SourceListing, list_image_folder

__all__ = ["corrupt_jpeg", "main", "make_demo_data", "write_list_file", "write_tar_shards"]

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


def corrupt_jpeg(path: str | os.PathLike[str]) -> None:
    """Truncate a file to about a third of its size: it still opens but fails at decode."""
    size = os.path.getsize(path)
    os.truncate(path, max(size // 3, 1))


def write_list_file(
    listing_root: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    sep: str = "\t",
    labels: str = "int",
    *,
    header: bool = True,
) -> Path:
    """Write the ImageFolder at `listing_root` as a list file; return its path.

    One `relative/path<sep>label` line per item, in the listing's order (item ids are equal),
    paths relative to `out_path`'s folder, which must be `listing_root` or a folder above it.
    `sep` is "\t" (for a .tsv) or "," (for a .csv, quoted as the csv module does); `labels`
    is "int" (the ImageFolder label) or "name" (the class folder's name; the ids are then equal
    to the ImageFolder's when every class folder holds images, as class names sort the same).
    With `header`, the first line is `path<sep>label`.
    """
    if sep not in ("\t", ","):
        raise InvalidArgumentError(f"sep must be a tab or a comma, got {sep!r}")
    if labels not in ("int", "name"):
        raise InvalidArgumentError(f"labels must be 'int' or 'name', got {labels!r}")
    out = Path(out_path).expanduser().absolute()
    wanted_suffix = ".tsv" if sep == "\t" else ".csv"
    if out.suffix.lower() != wanted_suffix:
        raise InvalidArgumentError(
            f"a list file separated by {'tabs' if sep == chr(9) else 'commas'} must be named "
            f"*{wanted_suffix}, got {out.name}; rename it"
        )
    listing = list_image_folder(listing_root)
    out_dir = out.parent.resolve()
    prefix = os.path.relpath(listing.root, out_dir)
    if prefix == ".." or prefix.startswith("../"):
        raise InvalidArgumentError(
            f"list file {out} would need paths leaving its folder to reach {listing.root}; "
            "write it into the image folder or a folder above it"
        )
    rows = (
        (
            p if prefix == "." else f"{prefix}/{p}",
            str(label) if labels == "int" else listing.classes[label],
        )
        for p, label in zip(listing.paths, listing.labels.tolist(), strict=True)
    )
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8", errors="surrogateescape", newline="") as file:
        if sep == ",":
            writer = csv.writer(file, lineterminator="\n")
            if header:
                writer.writerow(("path", "label"))
            writer.writerows(rows)
        else:
            if header:
                file.write("path\tlabel\n")
            for rel, text in rows:
                if any(c in rel or c in text for c in "\t\n\r"):
                    tmp.unlink()
                    raise InvalidArgumentError(
                        f"{rel!r} (label {text!r}) holds a tab or a line break, which a .tsv "
                        "cannot carry; write a .csv (sep=',') instead"
                    )
                file.write(f"{rel}\t{text}\n")
    os.replace(tmp, out)
    return out


def write_tar_shards(
    listing_root: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    items_per_shard: int,
    *,
    labels: str = "int",
) -> list[Path]:
    """Write the ImageFolder at `listing_root` as WebDataset tar shards; return their paths.

    Shards `shard-000000.tar`, ... hold `items_per_shard` samples each, in the listing's order
    (item ids are equal): members `<item id, 9 digits>.<image extension, lower case>` with the
    file's bytes and `<same key>.cls` with the label ("int": the ImageFolder label, "name": the
    class folder's name). `out_dir` is created; it must not hold .tar files already.
    """
    if items_per_shard <= 0:
        raise InvalidArgumentError(f"items_per_shard must be positive, got {items_per_shard}")
    if labels not in ("int", "name"):
        raise InvalidArgumentError(f"labels must be 'int' or 'name', got {labels!r}")
    listing = list_image_folder(listing_root)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in out.iterdir() if p.name.lower().endswith(".tar"))
    if existing:
        raise InvalidArgumentError(
            f"{out} already holds .tar files ({existing[0]}, ...); give a new or empty folder"
        )
    shards: list[Path] = []
    for first in range(0, len(listing), items_per_shard):
        shard = out / f"shard-{len(shards):06d}.tar"
        tmp = shard.with_name(f".{shard.name}.tmp")
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as archive:
            for item_id in range(first, min(first + items_per_shard, len(listing))):
                key = f"{item_id:09d}"
                ext = os.path.splitext(listing.paths[item_id])[1].lower()
                label = int(listing.labels[item_id])
                text = str(label) if labels == "int" else listing.classes[label]
                _add_member(archive, key + ext, listing.read(item_id))
                _add_member(archive, key + ".cls", text.encode("utf-8", "surrogateescape"))
        os.replace(tmp, shard)
        shards.append(shard)
    return shards


def _add_member(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0  # deterministic shards
    archive.addfile(info, io.BytesIO(data))


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
        prog="python -m joader.sources.demo",
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
