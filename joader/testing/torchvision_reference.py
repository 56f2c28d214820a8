"""torchvision's ImageFolder + Resize(S) + CenterCrop(S), written from its documented behaviour, and
generated images of every format: the reference decoder "pil" must equal bit for bit.

torchvision cannot be imported here, so `torchvision_reference` is written from its documented
behaviour (torchvision 0.15+; `datasets.folder.pil_loader`, `transforms.functional.resize` and
`center_crop` on a PIL image):
- pil_loader: `Image.open(f)` then `img.convert("RGB")` (a grey dataset's loader: "L");
- Resize(S): `_compute_resized_output_size`: short, long = (w, h) if w <= h else (h, w);
  new_short, new_long = S, int(S * long / short); unchanged size -> the image itself; else
  `F_pil.resize`: `img.resize((new_w, new_h), Image.BILINEAR)` (Pillow's antialiased bilinear);
- CenterCrop(S): the same size -> the image itself; else crop_top = int(round((h - S) / 2.0)),
  crop_left = int(round((w - S) / 2.0)), `img.crop((left, top, left + S, top + S))` (Python's
  round: halves to even).

tests/unit/stages/test_torchvision_parity.py checks the decoders against it; bench.micro.decoders
measures how far each one is, per format.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps

__all__ = ["FORMATS", "encode", "photo", "torchvision_reference"]

FORMATS = ["JPEG", "PNG", "L", "L-JPEG", "P", "RGBA", "CMYK", "I;16"]


def torchvision_reference(data: bytes, size: int, mode: str = "RGB", exif: bool = False) -> np.ndarray:
    """torchvision's ImageFolder sample + Resize(size) + CenterCrop(size), as uint8 CHW."""
    with Image.open(io.BytesIO(data)) as opened:
        img: Image.Image = ImageOps.exif_transpose(opened) if exif else opened
        pic = img.convert(mode)
    w, h = pic.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if (new_w, new_h) != (w, h):
        pic = pic.resize((new_w, new_h), Image.Resampling.BILINEAR)
    if (new_w, new_h) != (size, size):
        top = int(round((new_h - size) / 2.0))
        left = int(round((new_w - size) / 2.0))
        pic = pic.crop((left, top, left + size, top + size))
    arr = np.asarray(pic)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A "photo": smooth gradients, noise and a sharp-edged block, uint8 HWC."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack([xx * 255 / max(width, 1), yy * 255 / max(height, 1),
                     128 + 100 * np.sin((xx + 2 * yy) / 9)], axis=-1)  # fmt: skip
    base[height // 3 : 2 * height // 3, width // 4 : width // 2] = (250, 30, 60)
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def encode(fmt: str, width: int, height: int, seed: int = 0, **save: object) -> bytes:
    """An image of `fmt` (a file format, or a Pillow mode saved as PNG / JPEG)."""
    rgb = Image.fromarray(photo(width, height, seed))
    img, file_format = {
        "JPEG": (rgb, "JPEG"),
        "PNG": (rgb, "PNG"),
        "L": (rgb.convert("L"), "PNG"),
        "L-JPEG": (rgb.convert("L"), "JPEG"),
        "P": (rgb.convert("P"), "PNG"),
        "RGBA": (_with_alpha(rgb), "PNG"),
        "CMYK": (rgb.convert("CMYK"), "JPEG"),
        "I;16": (_sixteen_bit(rgb), "PNG"),
    }[fmt]
    buf = io.BytesIO()
    img.save(buf, file_format, **({"quality": 90} if file_format == "JPEG" else {}), **save)
    return buf.getvalue()


def _with_alpha(rgb: Image.Image) -> Image.Image:
    rgba = rgb.convert("RGBA")
    rgba.putalpha(Image.fromarray(photo(*rgb.size, seed=9)[..., 0]))
    return rgba


def _sixteen_bit(rgb: Image.Image) -> Image.Image:
    """A 16-bit grey image using its whole range (most values above 255)."""
    img = Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 257)
    assert img.mode == "I;16"
    return img
