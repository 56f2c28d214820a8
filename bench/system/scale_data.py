"""The ImageNet-shaped tree of the scale bench (issue 37) and its pixel oracle.

`make_tree(root, n)` writes n tiny distinct JPEGs (24-40 px a side, sizes varied) in 1,000
class folders `c0000` .. `c0999`, files `NNNNN.JPEG`, so that joader's listing (classes sorted,
files sorted) gives item `i` = `offsets[c] + j` for file `j` of class `c`. Class sizes vary
around n / 1000 as ImageNet's do (1,281,167 items: 963 to 1,601 per class) and sum to n.

Each image is two flat colours: its top half encodes its class (three channels of ten levels,
10**3 = 1,000 classes), its bottom half its place in the class (three channels of twelve
levels, 12**3 = 1,728 > the largest class). Any two items differ by at least one level step
(>= 20 grey values) in at least one channel of one half, and the oracle allows +-TOLERANCE
(8) per channel mean, so a delivered sample matches exactly one item: the oracle checks every
delivered sample against its claimed index and label without decoding the file again. After
joaderd's center-crop stage (any S >= 8) the boundary between the halves lies on the crop's
middle row, so the oracle averages rows well away from it (`_rows`).

# NOTE [ why two halves, not one colour ]
One flat colour of 256**3 values cannot separate 1.28M items with a JPEG's error of a few grey
values per channel (at a step of 16, 16**3 = 4,096 colours). Two halves of 1,000 and 1,728
colours at steps of 24.8 and 20.3 give 1.73M items with a margin of 10 grey values per channel.

Generation runs in a process pool, one class per task, and is resumable: a class is done once
its marker `ROOT.done/cNNNN` exists (beside the root, not in it: every folder of the root is a
class to ImageFolder, a hidden one too); the manifest `ROOT/scale-manifest.json` (n, version,
class sizes) makes a second run with the same n reuse the tree.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing as mp
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

NUM_CLASSES = 1000
IMAGENET_ITEMS = 1_281_167
VERSION = 1
CLASS_LEVELS = 10  # per channel, top half: 10**3 classes
INDEX_LEVELS = 12  # per channel, bottom half: 12**3 items per class at most
LOW, HIGH = 16, 239  # colour range (away from JPEG's clipping at 0 and 255)
TOLERANCE = 8.0  # per channel mean, grey values; half the smallest step is 10.1
MIN_SIDE, MAX_SIDE = 24, 40
QUALITY = 95
MANIFEST = "scale-manifest.json"


def class_sizes(n: int, classes: int = NUM_CLASSES) -> np.ndarray:
    """Items per class: n // classes each (the first n % classes one more), then moved in pairs
    (class k and classes-1-k) by up to a quarter of the mean, so the sum stays n."""
    base, extra = divmod(n, classes)
    sizes = np.full(classes, base, dtype=np.int64)
    sizes[:extra] += 1
    amplitude = base // 4
    if amplitude:
        for k in range(classes // 2):
            delta = (k * 7919) % (2 * amplitude + 1) - amplitude
            sizes[k] += delta
            sizes[classes - 1 - k] -= delta
    if sizes.max() > INDEX_LEVELS**3 or sizes.min() < 1:
        raise ValueError(f"{n} items in {classes} classes: sizes {sizes.min()}..{sizes.max()} out of "
                         f"1..{INDEX_LEVELS**3}; pass between {classes} and about 1.38M items")
    return sizes


def _levels(value: int, levels: int) -> np.ndarray:
    """value in base `levels`, three digits, as colours."""
    digits = np.array([value // levels**2, value // levels % levels, value % levels], dtype=np.float64)
    return LOW + digits * (HIGH - LOW) / (levels - 1)


def item_colours(klass: int, j: int) -> tuple[np.ndarray, np.ndarray]:
    """(top, bottom) RGB of file j of class `klass`."""
    return _levels(klass, CLASS_LEVELS), _levels(j, INDEX_LEVELS)


def item_geometry(i: int) -> tuple[int, int]:
    """(width, height) of item i, 24..40 each, from a hash of i."""
    h = zlib.crc32(i.to_bytes(4, "little"))
    span = MAX_SIDE - MIN_SIDE + 1
    return MIN_SIDE + h % span, MIN_SIDE + (h >> 8) % span


def encode_item(klass: int, j: int, i: int) -> bytes:
    """The JPEG of item i (file j of class `klass`)."""
    from PIL import Image

    width, height = item_geometry(i)
    top, bottom = item_colours(klass, j)
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[: height // 2] = np.round(top).astype(np.uint8)
    pixels[height // 2:] = np.round(bottom).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=QUALITY, subsampling=0)
    return out.getvalue()


@dataclass(frozen=True)
class Layout:
    """Where each item is: class sizes, their first ids, and a class per id."""

    n: int
    sizes: np.ndarray
    offsets: np.ndarray  # first id of each class
    labels: np.ndarray  # class of each id (int16)

    @classmethod
    def of(cls, n: int) -> Layout:
        sizes = class_sizes(n)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        labels = np.repeat(np.arange(len(sizes), dtype=np.int16), sizes)
        return cls(n, sizes, offsets, labels)

    def expected(self, ids: np.ndarray) -> np.ndarray:
        """(B, 2, 3) expected (top, bottom) means of items `ids`."""
        klass = self.labels[ids].astype(np.int64)
        j = ids - self.offsets[klass]
        out = np.empty((len(ids), 2, 3))
        for half, (value, levels) in enumerate(((klass, CLASS_LEVELS), (j, INDEX_LEVELS))):
            digits = np.stack([value // levels**2, value // levels % levels, value % levels], axis=1)
            out[:, half] = LOW + digits * (HIGH - LOW) / (levels - 1)
        return out

    def decode(self, means: np.ndarray) -> np.ndarray:
        """The item each (B, 2, 3) measured mean names (-1 where no level is within TOLERANCE)."""
        found = np.empty(len(means), dtype=np.int64)
        values = []
        ok = np.ones(len(means), dtype=bool)
        for half, levels in ((0, CLASS_LEVELS), (1, INDEX_LEVELS)):
            step = (HIGH - LOW) / (levels - 1)
            digits = np.clip(np.round((means[:, half] - LOW) / step), 0, levels - 1)
            ok &= (np.abs(LOW + digits * step - means[:, half]) <= TOLERANCE).all(axis=1)
            d = digits.astype(np.int64)
            values.append(d[:, 0] * levels**2 + d[:, 1] * levels + d[:, 2])
        klass, j = values
        ok &= (klass < len(self.sizes))
        klass = np.minimum(klass, len(self.sizes) - 1)
        ok &= j < self.sizes[klass]
        found[:] = self.offsets[klass] + j
        found[~ok] = -1
        return found


def _rows(size: int) -> tuple[slice, slice]:
    """Rows of an S-row crop to average for the top and the bottom half: the outer 3/4 of each
    half, away from the boundary at S/2 (resampling and JPEG blocks blur about a row there)."""
    half = size // 2
    margin = max(1, size // 8)
    return slice(0, half - margin), slice(half + margin, size)


def sample_means(images: np.ndarray) -> np.ndarray:
    """(B, 2, 3) mean colours of the top and bottom halves of (B, 3, S, S) samples."""
    top, bottom = _rows(images.shape[-2])
    x = images.astype(np.float32)
    return np.stack([x[:, :, top, 1:-1].mean(axis=(2, 3)), x[:, :, bottom, 1:-1].mean(axis=(2, 3))], axis=1)


def check_batch(layout: Layout, ids: np.ndarray, labels: np.ndarray, images: np.ndarray) -> np.ndarray:
    """Positions in the batch whose pixels or label are not item ids[k]'s (empty when all pass)."""
    ids = np.asarray(ids, dtype=np.int64)
    means = sample_means(images)
    bad = np.abs(means - layout.expected(ids)).max(axis=(1, 2)) > TOLERANCE
    bad |= np.asarray(labels, dtype=np.int64) != layout.labels[ids]
    return np.flatnonzero(bad)


# ----------------------------------------------------------------------------- generation

def _write_class(task: tuple[str, int, int, int]) -> int:
    root, klass, first, size = task
    folder = Path(root) / f"c{klass:04d}"
    folder.mkdir(parents=True, exist_ok=True)
    for j in range(size):
        (folder / f"{j:05d}.JPEG").write_bytes(encode_item(klass, j, first + j))
    (_markers(Path(root)) / f"c{klass:04d}").touch()
    return size


def _markers(root: Path) -> Path:
    return root.with_name(root.name + ".done")


def make_tree(root: Path, n: int, processes: int = 2) -> dict[str, object]:
    """The tree of n items under `root` (reused when its manifest says it is complete)."""
    root = Path(root)
    layout = Layout.of(n)
    manifest_path = root / MANIFEST
    wanted = {"version": VERSION, "items": n, "classes": NUM_CLASSES,
              "sizes_crc32": zlib.crc32(layout.sizes.tobytes())}
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if {k: manifest.get(k) for k in wanted} == wanted and manifest.get("complete"):
            return {**manifest, "reused": True}
    root.mkdir(parents=True, exist_ok=True)
    _markers(root).mkdir(exist_ok=True)
    manifest_path.write_text(json.dumps({**wanted, "complete": False}))
    todo = [(str(root), c, int(layout.offsets[c]), int(layout.sizes[c])) for c in range(NUM_CLASSES)
            if not (_markers(root) / f"c{c:04d}").exists()]
    started = time.perf_counter()
    written = 0
    with mp.get_context("fork").Pool(processes) as pool:
        for count in pool.imap_unordered(_write_class, todo, chunksize=4):
            written += count
            if written // 100_000 != (written - count) // 100_000:
                print(f"  {written} of {n} items written ({time.perf_counter() - started:.0f} s)", flush=True)
    seconds = time.perf_counter() - started
    manifest = {**wanted, "complete": True, "generated_items": written, "generation_s": round(seconds, 1),
                "processes": processes, "class_sizes": [int(layout.sizes.min()), int(layout.sizes.max())]}
    manifest_path.write_text(json.dumps(manifest))
    return {**manifest, "reused": False}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="write the scale bench's tree")
    parser.add_argument("--items", type=int, default=IMAGENET_ITEMS)
    parser.add_argument("--data", type=Path, default=Path("/tmp/joader-scale-data"))
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    print(make_tree(args.data / f"imagenet-{args.items}", args.items, args.processes))


if __name__ == "__main__":
    main()
