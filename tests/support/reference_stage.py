"""The reference the `pil-draft` decoder must equal: joader's first shared stage, kept as a test oracle.

It was `joader.sources.stage` until the stages became `joader.stages` (issue 9); the built-in
`center-crop` stage with decoder "pil-draft" (the `pil` of before issue 38) reproduces it bit for
bit (tests/unit/stages/test_image.py). Decoder `pil` is now exactly torchvision, with no DCT
reduction: joader/testing/torchvision_reference.py is its reference
(tests/unit/stages/test_torchvision_parity.py).

Read, decode, RGB, resize the shorter side to S, center-crop S x S, uint8 CHW.

This is the deterministic part of preparation, done once on the server and shared by every job.
It matches torchvision's `Resize(S)` + `CenterCrop(S)` on a PIL image (bilinear with antialias,
the same output sizes and crop offsets), except that JPEGs much larger than the target are
decoded at a reduced DCT scale first (`Image.draft`), which is deterministic and several times
faster on large photos; at ImageNet-like sizes (500x375 -> 256) no reduction is possible, so
those are decoded in full.

The output is planar CHW so a client turns it into a tensor with one contiguous copy.

Speed, 500x375 demo JPEGs (quality 90, about 97 KB) at S=256, Pillow 13, on this project's
2-core build machine: `bench_prepare` in one process 445-455 images/s; through `DecodePool`
430/s with 1 worker and 780/s with 2.

Bounded work: "shorter side to S" of a 1x10000 image is a 256 x 2,560,000 resize (8.6 s and
2.7 GB measured). When the full resize would exceed `_MAX_RESIZE_FACTOR` times S*S pixels, only
the source region under the center crop is resized (Pillow's `resize(box=...)`), which costs
O(S*S); ordinary photos (4:3, 16:9, panoramas up to 4:1) take the exact resize-then-crop path.

Files are opened with `safe_open.open_in_root` when the root is known: never outside the source
root, even through a symlink swapped in after the listing, and never a FIFO or device.

Failures (a truncated JPEG fails late, at decode; a decompression bomb; not an image; a file
that vanished or cannot be read) raise `DecodeError` naming the file and the actual reason. `ImageFile.LOAD_TRUNCATED_IMAGES` is deliberately left off and
Pillow's decompression-bomb limit kept: a broken file is reported, never silently half-gray.
"""

from __future__ import annotations

import os
import time

import numpy as np
from PIL import Image

from joader.errors import DecodeError, InvalidArgumentError
from joader.sources.safe_open import display_path, open_in_root

__all__ = ["bench_prepare", "item_nbytes", "item_shape", "prepare", "prepare_into"]

_MAX_RESIZE_FACTOR = 16  # full resize up to 16 x S*S pixels; beyond, crop first


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


def prepare_into(
    path: str | os.PathLike[str], size: int, out: np.ndarray, *, root: str | None = None
) -> None:
    """Prepare `path` into `out` (uint8, shape (3, size, size), for example an arena slot).

    With `root`, the file is opened only if it really lies inside `root` (see `safe_open`).
    """
    if size <= 0:
        raise InvalidArgumentError(f"sample size must be positive, got {size}")
    if out.dtype != np.uint8 or out.shape != item_shape(size):
        raise InvalidArgumentError(
            f"output must be uint8 of shape {item_shape(size)}, got {out.dtype} {out.shape}"
        )
    name = display_path(os.fspath(path))
    if root is not None:
        relative = os.path.relpath(os.fspath(path), root)
        source: object = os.fdopen(open_in_root(root, relative), "rb")  # DecodeError if unsafe
    else:
        source = os.fspath(path)
    try:
        with Image.open(source) as img:  # type: ignore[arg-type]
            width, height = _resized_size(img.width, img.height, size)
            if img.format == "JPEG":
                # Decode at the smallest DCT scale that still covers the resize target.
                img.draft("RGB", (width, height))
            rgb = img.convert("RGB")  # forces the decode: truncated files fail here
        hwc = np.asarray(_resize_and_crop(rgb, width, height, size))
    except DecodeError:
        raise
    except FileNotFoundError as exc:
        raise DecodeError(
            f"cannot read {name}: it no longer exists (removed or renamed since joaderd listed "
            "the source); restart joaderd to list the source again"
        ) from exc
    except PermissionError as exc:
        raise DecodeError(
            f"cannot read {name}: permission denied for joaderd's user; fix the file's permissions"
        ) from exc
    except Exception as exc:  # includes Image.DecompressionBombError
        # Pillow raises OSError, SyntaxError, ValueError, EOFError, struct.error, ... by format,
        # and a server must survive any of them.
        raise DecodeError(
            f"cannot decode {name}: {type(exc).__name__}: {display_path(str(exc))}; the file is "
            "corrupt, truncated or not an image - replace or remove it"
        ) from exc
    finally:
        if not isinstance(source, str):
            source.close()  # type: ignore[attr-defined]
    out[...] = hwc.transpose(2, 0, 1)


def _resize_and_crop(rgb: Image.Image, width: int, height: int, size: int) -> Image.Image:
    """torchvision's Resize(size) then CenterCrop(size), in bounded work for extreme shapes."""
    left = round((width - size) / 2.0)  # torchvision center_crop offsets, in resized pixels
    top = round((height - size) / 2.0)
    if width * height <= _MAX_RESIZE_FACTOR * size * size:
        resized = rgb.resize((width, height), Image.Resampling.BILINEAR)
        return resized.crop((left, top, left + size, top + size))
    # Only the source region under the crop: scale the crop box back to source coordinates.
    scale_x, scale_y = rgb.width / width, rgb.height / height
    box = (left * scale_x, top * scale_y, (left + size) * scale_x, (top + size) * scale_y)
    return rgb.resize((size, size), Image.Resampling.BILINEAR, box=box)


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
