"""The built-in image stages: center-crop, resize, max-side; modes RGB and L; decoders pil,
pil-draft, turbo.

decoder "pil" is exactly torchvision's ImageFolder + Resize(S) + CenterCrop(S), bit for bit, for
every format: `Image.open(f).convert("RGB")` (or "L"), the shorter side resized to S with Pillow's
BILINEAR (antialiased; the longer side `int(S * long / short)`), then the center S x S square at
top = int(round((h - S) / 2.0)), left = int(round((w - S) / 2.0)) (joader/testing/
torchvision_reference.py holds a reference written from torchvision's documented behaviour).

decoder "pil-draft" is "pil" with `Image.draft` before a JPEG's decode: libjpeg decodes at the
smallest DCT scale (1/2, 1/4, 1/8) that still covers the resize target, much faster on large
photos, but not torchvision's pixels (bench/micro/decoders.py measures how far; docs/decoders.md).

decoder "turbo" decodes JPEGs with simplejpeg (libjpeg-turbo straight into a numpy array; a
reduced DCT scale, 1/2, 1/4 or 1/8, whenever it still covers the resize target; the exact DCT
by default, the fast one with option fastdct) and resizes with OpenCV: upscaling with INTER_LINEAR (Pillow's bilinear),
downscaling with a small antialiasing prefilter fitted to Pillow's filter then INTER_LINEAR (see
`_cv_resize`; INTER_AREA was measured both slower and further from pil). Other formats are
prepared exactly as by pil (their decode dominates; Pillow's resize is exact and costs little
more); CMYK JPEGs, JPEGs past Pillow's decompression-bomb limit and any JPEG simplejpeg refuses
(libjpeg warnings that Pillow tolerates) as by pil-draft. So all decoders accept and refuse the
same files with the same messages, and give the same output shapes (`geometry`).

Mode conversion is Pillow's `convert` (alpha dropped, palette applied, CMYK inverted), as
torchvision's loader does, 16-bit modes included: Pillow clips I;16 values at 255, so an
ordinary 16-bit PNG comes out nearly white, under torchvision and here alike (a pair Pillow
cannot convert directly, LAB -> L, goes through RGB).

EXIF orientation is not applied (neither is it by torchvision's ImageFolder) unless the stage
is built with exif_transpose=True: then every decoder turns the image upright first, as
`ImageOps.exif_transpose` does, and sizes and crops the upright image.

Failures (truncated, corrupt, not an image, a decompression bomb) raise `DecodeError` naming
the item and the reason.
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections.abc import Callable

import numpy as np
from PIL import Image

from joader.errors import DecodeError
from joader.sources.safe_open import display_path
from joader.stages.base import ItemSpec
from joader.stages.geometry import (
    RESIZE_MAX_ASPECT,
    Plan,
    plan_center_crop,
    plan_max_side,
    plan_resize,
)

__all__ = ["DECODERS", "IMAGE_KINDS", "MODES", "TURBO_OPTIONS", "ImageStage"]

IMAGE_KINDS = ("center-crop", "resize", "max-side")
MODES = {"RGB": 3, "L": 1}
DECODERS = ("pil", "pil-draft", "turbo")
# turbo: about 1.8x joaderd's decode capacity of pil on ImageNet-sized JPEGs, within about one
# grey level of it on average (bench/micro/stage.py, bench/micro/decoders.py); pil stays for exact parity.
DEFAULT_DECODER = "turbo"
# Options of decoder turbo and their defaults. fastdct (libjpeg's fast integer IDCT) measured no
# faster here (bench/micro/stage.py: within +-5%, noise) and 0.4 grey levels further from pil, so the
# exact DCT is the default; fastupsample costs up to 20 grey levels on colour edges.
TURBO_OPTIONS = {"fastdct": False, "fastupsample": False}

_JPEG_MAGIC = b"\xff\xd8\xff"
_TURBO_COLORSPACES = ("YCbCr", "Gray", "RGB")  # CMYK and YCCK go to Pillow
_BYTESIO_REPR = re.compile(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>")
_ORIENTATION_TAG = 0x0112  # EXIF Orientation: 1 upright, 2-8 flips and turns
_SWAPS_SIDES = (5, 6, 7, 8)  # orientations whose upright image is the stored one turned 90 degrees


class ImageStage:
    """One built-in image stage. Build it with `joader.stages.build_stage`."""

    def __init__(
        self,
        kind: str,
        size: int,
        mode: str = "RGB",
        upscale: bool = True,
        decoder: str = DEFAULT_DECODER,
        *,
        exif_transpose: bool = False,
        fastdct: bool = TURBO_OPTIONS["fastdct"],
        fastupsample: bool = TURBO_OPTIONS["fastupsample"],
    ) -> None:
        if kind not in IMAGE_KINDS or mode not in MODES or decoder not in DECODERS:
            raise ValueError(f"bad image stage {kind!r} {mode!r} {decoder!r}")  # build_stage checks
        self.kind, self.size, self.mode, self.decoder = kind, size, mode, decoder
        self.upscale = upscale and kind != "max-side"  # max-side never enlarges
        self.exif_transpose = exif_transpose
        self.channels = MODES[mode]
        self.fastdct, self.fastupsample = fastdct, fastupsample
        self.name = _stage_name(kind, size, mode, decoder, self.upscale, exif_transpose)
        self.spec = self._spec()
        # The shape items have but for images smaller than S (center-crop without upscale),
        # which a batched client refuses one by one, naming the item and the fix.
        self.nominal_shape = (self.channels, size, size) if kind == "center-crop" else None
        self._plan: Callable[[int, int], Plan] = self._planner()
        if decoder == "turbo":
            _init_turbo()

    def __repr__(self) -> str:
        return f"<ImageStage {self.name} {self.spec}>"

    def _spec(self) -> ItemSpec:
        c, s = self.channels, self.size
        if self.kind == "center-crop":
            if self.upscale:  # always S x S
                return ItemSpec.fixed((c, s, s), "uint8")
            return ItemSpec.variable(c * s * s, "uint8", 3)  # small images: a smaller square
        if self.kind == "resize":
            return ItemSpec.variable(c * s * RESIZE_MAX_ASPECT * s, "uint8", 3)
        return ItemSpec.variable(c * s * s, "uint8", 3)  # max-side

    def _planner(self) -> Callable[[int, int], Plan]:
        size, upscale = self.size, self.upscale
        if self.kind == "center-crop":
            return lambda w, h: plan_center_crop(w, h, size, upscale)
        if self.kind == "resize":
            return lambda w, h: plan_resize(w, h, size, upscale)
        return lambda w, h: plan_max_side(w, h, size)

    def item_nbytes(self, data: bytes) -> int | None:
        """The exact bytes `prepare(data)` returns, read from the image's header, or None.

        The output's shape follows from the image's width and height alone (`geometry`: the
        same plan every decoder carries out), and every image format states those in its header:
        simplejpeg reads a JPEG's in about 1 us, Pillow's lazy `Image.open` any other format's
        in about 30 us, neither decoding a pixel. joaderd's decode workers call this ahead of
        the decode (a *probe*, `joader.server.pool.worker`) so that the cache can give the
        decode exactly its bytes instead of the stage's bound (3 x S x 8S for resize), whose
        freed tails were holes too small for the next bound (`joader.server.books.item_sizes`).
        EXIF orientation (exif_transpose) need not be read: every plan is symmetric in width
        and height, so a turned image has the same number of bytes.

        None when the header cannot be read (a corrupt or truncated file, not an image, a
        decompression bomb): the decode then goes size first (placed once prepared), and fails
        with its message if the file is bad. A header that disagrees with the decode (the file
        changed since) is handled by the cache too: a smaller item is shrunk, a larger one
        placed again.
        """
        try:
            width, height = _header_size(data)
            out_w, out_h = self._plan(width, height).out_size(width, height)
        except Exception:
            return None
        return max(1, out_w * out_h * self.channels)

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        """The prepared image of `data`: uint8 (C, H, W), C-contiguous. DecodeError on bad data."""
        try:
            if self.decoder == "turbo":
                hwc = self._decode_turbo(data)
            else:
                hwc = self._decode_pil(data, draft=self.decoder == "pil-draft")
        except DecodeError:
            raise
        except Exception as exc:  # includes Image.DecompressionBombError
            # Pillow raises OSError, SyntaxError, ValueError, EOFError, struct.error, ... by
            # format, and a server must survive any of them.
            reason = _BYTESIO_REPR.sub("", str(exc))
            raise DecodeError(
                f"cannot decode {display_path(path)}: {type(exc).__name__}: "
                f"{display_path(reason)}; the file is corrupt, truncated or not an image - "
                "replace or remove it"
            ) from exc
        chw = np.ascontiguousarray(hwc[None] if hwc.ndim == 2 else hwc.transpose(2, 0, 1))
        return chw if chw.flags.writeable else chw.copy()  # np.asarray(pil image) is read-only

    # -- decoders "pil" and "pil-draft": Pillow --------------------------------------------

    def _open_pil(self, data: bytes, *, draft: bool) -> tuple[Image.Image, Plan]:
        """The decoded image in the stage's mode, upright if asked, and its plan."""
        with Image.open(io.BytesIO(data)) as img:
            orientation = _orientation(img) if self.exif_transpose else 1
            plan = self._plan(*_upright_size(img.width, img.height, orientation))
            if draft and img.format == "JPEG" and plan.resize is not None:
                # Decode at the smallest DCT scale that still covers the resize target.
                img.draft("RGB", _upright_size(*plan.resize, orientation))
            pic = _convert(img, self.mode)  # forces the decode: truncated files fail here
        return _transpose_pil(pic, orientation), plan

    def _decode_pil(self, data: bytes, *, draft: bool) -> np.ndarray:
        pic, plan = self._open_pil(data, draft=draft)
        if plan.resize is None:
            if plan.crop is not None:
                left, top, side = plan.crop
                pic = pic.crop((left, top, left + side, top + side))
        elif plan.crop is not None:
            pic = _pil_resize_and_crop(pic, plan)
        elif pic.size != plan.resize:
            pic = pic.resize(plan.resize, Image.Resampling.BILINEAR)
        return np.asarray(pic)

    # -- decoder "turbo": simplejpeg + OpenCV ----------------------------------------------

    def _decode_turbo(self, data: bytes) -> np.ndarray:
        decoded = self._simplejpeg(data) if data[:3] == _JPEG_MAGIC else None
        if decoded is None:
            # Not a JPEG (exactly pil: the decode dominates, Pillow's resize costs little more
            # than OpenCV's and is exact), or a JPEG simplejpeg leaves to Pillow (pil-draft).
            return self._decode_pil(data, draft=True)
        arr, plan = decoded
        return _cv_apply(arr, plan)

    def _simplejpeg(self, data: bytes) -> tuple[np.ndarray, Plan] | None:
        """(decoded HWC array, upright if asked, and its plan), or None when Pillow should
        decode this JPEG."""
        import simplejpeg

        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except Exception:
            return None  # corrupt or unusual: Pillow decides, with its message
        limit = Image.MAX_IMAGE_PIXELS
        if colorspace not in _TURBO_COLORSPACES or (limit and width * height > limit):
            return None  # CMYK/YCCK; or Pillow's decompression-bomb warning or error
        orientation = _jpeg_orientation(data) if self.exif_transpose else 1
        plan = self._plan(*_upright_size(width, height, orientation))
        scaled = {}
        if plan.resize is not None:  # a reduced DCT scale (1/2, 1/4, 1/8) still covering it
            min_w, min_h = _upright_size(*plan.resize, orientation)  # in stored orientation
            scaled = {"min_width": min_w, "min_height": min_h, "min_factor": 2}
        try:
            arr = simplejpeg.decode_jpeg(
                data,
                colorspace="GRAY" if self.mode == "L" else "RGB",
                fastdct=self.fastdct,
                fastupsample=self.fastupsample,
                strict=True,
                **scaled,
            )
        except Exception:
            return None  # truncated, corrupt, or a libjpeg warning Pillow tolerates
        return _transpose_array(arr, orientation), plan


def _stage_name(kind: str, size: int, mode: str, decoder: str, upscale: bool, exif: bool) -> str:
    """"center-crop:224", with what differs from the defaults: "/L", "/pil", "/no-upscale",
    "/exif-transpose"."""
    parts = [f"{kind}:{size}"]
    parts += [mode] if mode != "RGB" else []
    parts += [decoder] if decoder != DEFAULT_DECODER else []
    parts += ["no-upscale"] if not upscale and kind != "max-side" else []
    parts += ["exif-transpose"] if exif else []
    return "/".join(parts)


# -- EXIF orientation (ImageOps.exif_transpose's meaning) ----------------------------------

_PIL_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation of an opened image, as `ImageOps.exif_transpose` reads it (1 when
    absent or not one of 1-8)."""
    value = img.getexif().get(_ORIENTATION_TAG, 1)
    return value if value in _PIL_TRANSPOSE else 1


def _jpeg_orientation(data: bytes) -> int:
    """The EXIF orientation of a JPEG's bytes: Pillow's lazy open reads the markers before the
    scan (APP1 among them), no pixel."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return _orientation(img)
    except Exception:
        return 1  # the decode reports what is wrong with the file


def _upright_size(width: int, height: int, orientation: int) -> tuple[int, int]:
    """(width, height) turned by `orientation`; turning back is the same swap."""
    return (height, width) if orientation in _SWAPS_SIDES else (width, height)


def _transpose_pil(pic: Image.Image, orientation: int) -> Image.Image:
    method = _PIL_TRANSPOSE.get(orientation)
    return pic if method is None else pic.transpose(method)


def _transpose_array(arr: np.ndarray, orientation: int) -> np.ndarray:
    """`_transpose_pil` of an HW(C) array (tests/unit/stages test the two against each other)."""
    turn = _ARRAY_TRANSPOSE.get(orientation)
    return arr if turn is None else np.ascontiguousarray(turn(arr))


_ARRAY_TRANSPOSE: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.swapaxes(0, 1),
    6: lambda a: np.rot90(a, -1),  # Pillow's ROTATE_270: a quarter turn clockwise
    7: lambda a: a[::-1, ::-1].swapaxes(0, 1),
    8: lambda a: np.rot90(a, 1),
}


def _header_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an image's header, as the decoders will see it; raises if unreadable.

    A JPEG's from simplejpeg (what decoder turbo reads; Pillow reads the same frame header),
    any other's from Pillow's `Image.open`, which parses the header only."""
    if data[:3] == _JPEG_MAGIC:
        import simplejpeg

        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return width, height
        except Exception:
            pass  # Pillow decides
    with Image.open(io.BytesIO(data)) as img:
        return img.width, img.height


def _convert(img: Image.Image, mode: str) -> Image.Image:
    """`img` in `mode` ("RGB" or "L") as Pillow converts it (torchvision's loader): 16-bit
    values clipped at 255, as there (NOTE [ 16-bit images ] in docs/decoders.md)."""
    try:
        return img.convert(mode)
    except ValueError:  # a pair Pillow cannot convert directly (LAB -> L): through RGB
        return img.convert("RGB").convert(mode)


def _pil_resize_and_crop(pic: Image.Image, plan: Plan) -> Image.Image:
    """torchvision's Resize then CenterCrop (exactly, `img.resize((new_w, new_h), BILINEAR)` then
    `crop`), in bounded work for extreme shapes (NOTE [ Bounded work, and where pil stops being
    exact ] in `geometry`)."""
    assert plan.resize is not None and plan.crop is not None
    width, height = plan.resize
    left, top, size = plan.crop
    if not plan.crop_first:
        resized = pic.resize((width, height), Image.Resampling.BILINEAR)
        return resized.crop((left, top, left + size, top + size))
    # Only the source region under the crop: scale the crop box back to source coordinates.
    scale_x, scale_y = pic.width / width, pic.height / height
    box = (left * scale_x, top * scale_y, (left + size) * scale_x, (top + size) * scale_y)
    return pic.resize((size, size), Image.Resampling.BILINEAR, box=box)


def _cv_apply(arr: np.ndarray, plan: Plan) -> np.ndarray:
    """Carry out `plan` on a decoded HWC array (maybe decoded at a reduced scale) with OpenCV."""
    if plan.resize is None:
        if plan.crop is None:
            return arr
        left, top, side = plan.crop
        return arr[top : top + side, left : left + side]
    if plan.crop is None:
        return _cv_resize(arr, *plan.resize)
    width, height = plan.resize
    left, top, size = plan.crop
    if not plan.crop_first:
        return _cv_resize(arr, width, height)[top : top + size, left : left + size]
    # Bounded work: resize only the decoded region under the crop (to the nearest pixel).
    scale_x, scale_y = arr.shape[1] / width, arr.shape[0] / height
    x0 = min(round(left * scale_x), arr.shape[1] - 1)
    y0 = min(round(top * scale_y), arr.shape[0] - 1)
    x1 = max(x0 + 1, round((left + size) * scale_x))
    y1 = max(y0 + 1, round((top + size) * scale_y))
    return _cv_resize(arr[y0:y1, x0:x1], size, size)


def _cv_resize(arr: np.ndarray, width: int, height: int) -> np.ndarray:
    """`arr` resized to (width, height) close to Pillow's antialiased BILINEAR, in OpenCV.

    Pillow's filter for a downscale by s is a triangle of half-width s (in source pixels);
    INTER_LINEAR alone is a triangle of half-width 1 and aliases. So the source is first
    filtered with a small separable kernel g fitted (least squares) so that g * triangle(1)
    ~= triangle(s), then sampled with INTER_LINEAR: about 3x faster than INTER_AREA (which in
    OpenCV 5 is as slow as Pillow for non-integer factors) and closer to Pillow's output.
    Downscales by 3 or more first reduce by an integer factor with INTER_AREA's fast path.
    """
    import cv2

    src_h, src_w = arr.shape[:2]
    if (src_w, src_h) == (width, height):
        return arr
    channels = arr.ndim == 3
    reduce = int(min(src_w / width, src_h / height) / 1.5)
    if reduce >= 2:  # trims at most reduce-1 edge pixels so that the fast path applies
        rows, cols = src_h // reduce * reduce, src_w // reduce * reduce
        arr = _axis(
            cv2.resize(
                arr[:rows, :cols], (cols // reduce, rows // reduce), interpolation=cv2.INTER_AREA
            ),
            channels,
        )
        src_h, src_w = arr.shape[:2]
    kx = _antialias_kernel(round(src_w / width, 3))
    ky = _antialias_kernel(round(src_h / height, 3))
    if kx is not None or ky is not None:
        arr = _axis(
            cv2.sepFilter2D(
                arr, -1, _IDENTITY if kx is None else kx, _IDENTITY if ky is None else ky,
                borderType=cv2.BORDER_REPLICATE,
            ),
            channels,
        )  # fmt: skip
    return _axis(cv2.resize(arr, (width, height), interpolation=cv2.INTER_LINEAR), channels)


_IDENTITY = np.ones(1, np.float32)


def _axis(out: np.ndarray, channels: bool) -> np.ndarray:
    """OpenCV drops a single channel axis; put it back."""
    return out[:, :, None] if channels and out.ndim == 2 else out


@functools.lru_cache(maxsize=1024)
def _antialias_kernel(scale: float) -> np.ndarray | None:
    """Taps g[-R..R] with sum(g[m] * tri(x - m)) ~= tri(x / scale) / scale for every x, where
    tri is the unit triangle; None when scale <= 1 (upscaling: INTER_LINEAR is Pillow's)."""
    if scale <= 1.0:
        return None
    radius = math.ceil(scale)
    xs = np.linspace(-scale - 1.5, scale + 1.5, 2001)
    taps = np.arange(-radius, radius + 1)
    basis = np.clip(1 - np.abs(xs[:, None] - taps[None, :]), 0, None)
    target = np.clip(1 - np.abs(xs / scale), 0, None) / scale
    weight = 1e3  # the taps sum to 1: flat areas keep their value
    basis = np.vstack([basis, np.full((1, taps.size), weight)])
    target = np.concatenate([target, [weight]])
    kernel, *_ = np.linalg.lstsq(basis, target, rcond=None)
    return kernel.astype(np.float32)


_turbo_ready = False


def _init_turbo() -> None:
    """Import simplejpeg and OpenCV; one OpenCV thread (joaderd runs one decode worker per core,
    and OpenCV's thread pool would oversubscribe them)."""
    global _turbo_ready
    if _turbo_ready:
        return
    import cv2
    import simplejpeg  # noqa: F401

    cv2.setNumThreads(1)
    _turbo_ready = True
