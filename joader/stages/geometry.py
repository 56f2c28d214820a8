"""Output geometry of the built-in image stages (pure arithmetic, shared by both decoders).

A `Plan` says, for an image of a given size, what to resize the whole image to (in the
torchvision sense, before any crop) and which square to cut out of that. The decoders carry it
out each in their own way (Pillow or simplejpeg + OpenCV), so both give the same output shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "EXACT_RESIZE_PIXELS",
    "MAX_RESIZE_FACTOR",
    "RESIZE_MAX_ASPECT",
    "Plan",
    "plan_center_crop",
    "plan_max_side",
    "plan_resize",
    "torchvision_resized_size",
]

MAX_RESIZE_FACTOR = 16  # center-crop resizes the full image up to 16 x S*S pixels ...
EXACT_RESIZE_PIXELS = 1 << 24  # ... or up to 16.7M pixels (50 MB RGB); beyond, the crop first
RESIZE_MAX_ASPECT = 8  # "resize" caps the long side at 8*S (a 1x10000 image would be 256 x 2.5M)

# NOTE [ Bounded work, and where pil stops being exact ]
# torchvision's Resize(S) of a 1x10000 strip at S=256 is a 256 x 2,560,000 image (8.6 s, 2.7 GB
# measured) of which CenterCrop keeps 256 x 256. Past a limit, only the source region under the
# crop is resized (Pillow's resize(box=...)): the same filter taps, but their positions are
# computed from the box in floating point and round differently, so the output can differ from
# the full resize by 1 grey level (measured on 40x3000, 7x999, 300x17 at S=64 and 224). So the
# limit is high: full resizes up to 16.7M pixels are done in full and are exact, i.e. every
# image with an aspect ratio up to about 330:1 at S=224 (4000:1 at S=64); beyond, pil is
# within 1 grey level of torchvision (docs/decoders.md).


@dataclass(frozen=True)
class Plan:
    """resize: (width, height) the whole image is resized to, or None (kept as it is).
    crop: (left, top, side) of a square in the resized image (the image when resize is None),
    or None (no crop). crop_first: the resize is too big to do in full; resize only the region
    under the crop (NOTE [ Bounded work, and where pil stops being exact ]).
    """

    resize: tuple[int, int] | None
    crop: tuple[int, int, int] | None = None
    crop_first: bool = False

    def out_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the output for an input of (width, height)."""
        if self.crop is not None:
            return self.crop[2], self.crop[2]
        return self.resize if self.resize is not None else (width, height)


def torchvision_resized_size(width: int, height: int, size: int) -> tuple[int, int]:
    """torchvision's Resize(size) output for a (width, height) image: shorter side = size."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def plan_center_crop(width: int, height: int, size: int, upscale: bool) -> Plan:
    """Resize(size) + CenterCrop(size) as torchvision; without upscale, a small image is only
    cropped: the largest centered square, of side min(width, height) < size."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    short = min(width, height)
    if not upscale and short < size:
        left, top = round((width - short) / 2.0), round((height - short) / 2.0)
        return Plan(resize=None, crop=(left, top, short))
    new_w, new_h = torchvision_resized_size(width, height, size)
    left = round((new_w - size) / 2.0)  # torchvision center_crop offsets, in resized pixels
    top = round((new_h - size) / 2.0)
    return Plan(
        resize=(new_w, new_h),
        crop=(left, top, size),
        crop_first=new_w * new_h > max(MAX_RESIZE_FACTOR * size * size, EXACT_RESIZE_PIXELS),
    )


def plan_resize(width: int, height: int, size: int, upscale: bool) -> Plan:
    """Shorter side to `size` (torchvision's Resize), the longer side capped at 8*size (then the
    shorter side shrinks to keep the aspect); without upscale, a small image keeps its size."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if upscale or min(width, height) >= size:
        new_w, new_h = torchvision_resized_size(width, height, size)
    else:
        new_w, new_h = width, height
    cap = RESIZE_MAX_ASPECT * size
    if max(new_w, new_h) > cap:
        new_w, new_h = _fit_long_side(width, height, cap)
    return Plan(resize=None if (new_w, new_h) == (width, height) else (new_w, new_h))


def plan_max_side(width: int, height: int, size: int) -> Plan:
    """The longer side capped at `size`, aspect kept; never upscales (a cap, not a size: the
    upscale setting does not apply)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if max(width, height) <= size:
        return Plan(resize=None)
    return Plan(resize=_fit_long_side(width, height, size))


def _fit_long_side(width: int, height: int, long_side: int) -> tuple[int, int]:
    """Longer side = long_side, the shorter scaled alike (truncated, as torchvision's max_size)."""
    if width >= height:
        return long_side, max(1, int(long_side * height / width))
    return max(1, int(long_side * width / height)), long_side
