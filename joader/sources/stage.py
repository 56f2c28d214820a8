"""The shared stage: read, decode, RGB, resize the shorter side to S, center-crop S x S, uint8 CHW.

This is the deterministic part of preparation, done once on the server and shared by every job.
It matches torchvision's `Resize(S)` + `CenterCrop(S)` on a PIL image (bilinear with antialias,
the same output sizes and crop offsets), except that JPEGs much larger than the target are
decoded at a reduced DCT scale first (`Image.draft`), which is deterministic and several times
faster on large photos; at ImageNet-like sizes (500x375 -> 256) no reduction is possible, so
those are decoded in full.

The output is planar CHW so a client turns it into a tensor with one contiguous copy.

Speed, 500x375 demo JPEGs (quality 90, about 97 KB) at S=256, Pillow 13, on this project's
2-core build machine: `bench_prepare` in one process 445-455 images/s; through `DecodePool`
430/s with 1 worker and 780/s with 2. (DESIGN.md's "about 300/s per core" was an older
machine; the ratio, decoding bound and about 2 ms per image, is what matters.)

Failures (a truncated JPEG fails late, at decode; a decompression bomb; not an image) raise
`DecodeError` naming the file. `ImageFile.LOAD_TRUNCATED_IMAGES` is deliberately left off and
Pillow's decompression-bomb limit kept: a broken file is reported, never silently half-gray.
"""

from __future__ import annotations

import os
import time

import numpy as np
from PIL import Image

from joader.errors import DecodeError, InvalidArgumentError

__all__ = ["bench_prepare", "item_nbytes", "item_shape", "prepare", "prepare_into"]


def item_shape(size: int) -> tuple[int, int, int]:
    return (3, size, size)


def item_nbytes(size: int) -> int:
    """Bytes of one prepared sample of side `size` (uint8 CHW)."""
    return 3 * size * size


def prepare(path: str | os.PathLike[str], size: int) -> np.ndarray:
    """The prepared sample of `path` as a new uint8 array of shape (3, size, size)."""
    out = np.empty(item_shape(size), dtype=np.uint8)
    prepare_into(path, size, out)
    return out


def prepare_into(path: str | os.PathLike[str], size: int, out: np.ndarray) -> None:
    """Prepare `path` into `out` (uint8, shape (3, size, size), for example an arena slot)."""
    if size <= 0:
        raise InvalidArgumentError(f"sample size must be positive, got {size}")
    if out.dtype != np.uint8 or out.shape != item_shape(size):
        raise InvalidArgumentError(
            f"output must be uint8 of shape {item_shape(size)}, got {out.dtype} {out.shape}"
        )
    try:
        with Image.open(path) as img:
            width, height = _resized_size(img.width, img.height, size)
            if img.format == "JPEG":
                # Decode at the smallest DCT scale that still covers the resize target.
                img.draft("RGB", (width, height))
            rgb = img.convert("RGB")  # forces the decode: truncated files fail here
        resized = rgb.resize((width, height), Image.Resampling.BILINEAR)
        left = round((width - size) / 2.0)  # torchvision center_crop offsets
        top = round((height - size) / 2.0)
        cropped = resized.crop((left, top, left + size, top + size))
        hwc = np.asarray(cropped)
    except DecodeError:
        raise
    except Exception as exc:  # includes Image.DecompressionBombError
        # Pillow raises OSError, SyntaxError, ValueError, EOFError, struct.error, ... by format,
        # and a server must survive any of them.
        raise DecodeError(
            f"cannot decode {os.fspath(path)}: {type(exc).__name__}: {exc}; the file is "
            "corrupt, truncated or not an image - replace or remove it"
        ) from exc
    out[...] = hwc.transpose(2, 0, 1)


def _resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """torchvision's Resize(size) output for a (width, height) image: shorter side = size."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def bench_prepare(path: str | os.PathLike[str], size: int = 256, seconds: float = 2.0) -> float:
    """Images per second of `prepare_into` on one file, one core (a benchmark helper)."""
    out = np.empty(item_shape(size), dtype=np.uint8)
    prepare_into(path, size, out)  # warm up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        prepare_into(path, size, out)
        count += 1
    return count / (time.perf_counter() - start)
