"""decoder "pil" is torchvision's ImageFolder + Resize(S) + CenterCrop(S), bit for bit, for every
format; EXIF orientation is applied only when asked, alike by every decoder.

The reference, `joader.testing.torchvision_reference`, is written from torchvision's documented
behaviour (torchvision cannot be imported here); its crop offsets round halves to even, which the
97/99-wide images below exercise.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from joader.stages import build_stage
from joader.testing.torchvision_reference import FORMATS, encode, photo, torchvision_reference

pytestmark = pytest.mark.timeout(120)

# (width, height): landscape, portrait, odd sides, crop offsets at .5 (16.5 -> 16, 17.5 -> 18 at
# S=64; 16.5, 17.5 at S=224), smaller than S (upscaled), thin strips (40x3000: 224 x 16800 resized
# in full), a square exactly S.
SIZES = {
    64: [(500, 375), (375, 500), (301, 199), (97, 64), (99, 64), (64, 99), (33, 21), (10, 10),
         (40, 3000), (3000, 40), (64, 64)],
    224: [(640, 427), (427, 640), (301, 199), (257, 224), (259, 224), (97, 61), (40, 3000),
          (224, 224)],
}  # fmt: skip


@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("size", [64, 224])
@pytest.mark.parametrize("fmt", FORMATS)
def test_pil_is_torchvision_bit_for_bit(fmt: str, size: int, mode: str) -> None:
    stage = build_stage("center-crop", size=size, mode=mode, decoder="pil")
    for i, (width, height) in enumerate(SIZES[size]):
        data = encode(fmt, width, height, seed=i)
        out = stage.prepare(data, f"x.{fmt}")
        ref = torchvision_reference(data, size, mode)
        assert out.shape == ref.shape == (len(mode), size, size)
        diff = np.abs(out.astype(np.int16) - ref).max()
        assert diff == 0, (fmt, width, height, size, mode, diff)


def test_sixteen_bit_is_clipped_as_torchvision_clips() -> None:
    """Pillow's convert clips I;16 at 255, so torchvision sees a nearly white image; joader
    does the same (with every decoder) rather than a different image than the baseline's."""
    wide = np.full((8, 8), 32896, np.uint16)  # mid-grey in 16 bits
    data = io.BytesIO()
    Image.fromarray(wide).save(data, "PNG")
    for decoder in ("pil", "pil-draft", "turbo"):
        out = build_stage("max-side", size=8, mode="L", decoder=decoder).prepare(data.getvalue(), "x")
        assert (out == 255).all(), decoder


@pytest.mark.parametrize("decoder", ["pil", "pil-draft", "turbo"])
def test_every_image_comes_out_s_by_s_by_default(decoder: str) -> None:
    """torchvision's Resize + CenterCrop enlarge small images and crop strips: so does the
    default center-crop (the old default served a 10x10 image as 10x10)."""
    stage = build_stage("center-crop", size=64, decoder=decoder)
    assert stage.spec.shape == (3, 64, 64)
    for width, height in [(10, 10), (40, 3000), (3000, 40), (1, 1), (63, 200)]:
        data = encode("JPEG", width, height)
        out = stage.prepare(data, "x.jpg")
        assert out.shape == (3, 64, 64), (width, height)
        if decoder == "pil":
            assert np.array_equal(out, torchvision_reference(data, 64)), (width, height)


# -- EXIF orientation --------------------------------------------------------------------------


def _oriented_jpeg(orientation: int, width: int = 120, height: int = 80) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode("JPEG", width, height, seed=orientation, exif=exif.tobytes())


@pytest.mark.parametrize("orientation", [3, 6])
@pytest.mark.parametrize("decoder", ["pil", "pil-draft", "turbo"])
def test_exif_orientation_is_applied_only_when_asked(decoder: str, orientation: int) -> None:
    data = _oriented_jpeg(orientation)
    with Image.open(io.BytesIO(data)) as img:
        assert img.getexif()[0x0112] == orientation
    upright = torchvision_reference(data, 64, exif=True)
    stored = torchvision_reference(data, 64)
    assert np.abs(upright.astype(np.int16) - stored).mean() > 20  # the two differ plainly
    turned = build_stage("center-crop", size=64, decoder=decoder, exif_transpose=True)
    plain = build_stage("center-crop", size=64, decoder=decoder)
    for stage, want in ((turned, upright), (plain, stored)):
        out = stage.prepare(data, "x.jpg")
        diff = np.abs(out.astype(np.int16) - want)
        if decoder == "pil":
            assert diff.max() == 0, stage.name
        else:
            assert diff.mean() < 2, (stage.name, diff.mean())
    resized = build_stage("resize", size=64, decoder=decoder, exif_transpose=True)
    want_hw = (96, 64) if orientation == 6 else (64, 96)  # 6: a portrait once upright
    assert resized.prepare(data, "x.jpg").shape == (3, *want_hw)
    assert resized.item_nbytes(data) == 3 * 96 * 64


def test_exif_transpose_of_a_png_and_of_every_orientation() -> None:
    rgb = Image.fromarray(photo(50, 30))
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        buf = io.BytesIO()
        rgb.save(buf, "PNG", exif=exif.tobytes())
        want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue()))))
        for decoder in ("pil", "turbo"):
            stage = build_stage("max-side", size=64, decoder=decoder, exif_transpose=True)
            out = stage.prepare(buf.getvalue(), "x.png")
            assert np.array_equal(out, want.transpose(2, 0, 1)), (orientation, decoder)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_turbo_turns_a_jpeg_as_pillow_does(orientation: int) -> None:
    """The JPEG path of turbo (simplejpeg, then numpy) against ImageOps.exif_transpose."""
    data = _oriented_jpeg(orientation, 48, 32)
    stage = build_stage("max-side", size=64, decoder="turbo", exif_transpose=True)
    with Image.open(io.BytesIO(data)) as img:
        want = np.asarray(ImageOps.exif_transpose(img).convert("RGB")).transpose(2, 0, 1)
    out = stage.prepare(data, "x.jpg")
    assert out.shape == want.shape
    assert np.abs(out.astype(np.int16) - want).mean() < 1.5  # libjpeg-turbo vs Pillow's libjpeg


@pytest.mark.parametrize("decoder", ["pil", "turbo"])
def test_past_the_exact_limit_only_the_crop_is_resized_within_one_grey_level(
    monkeypatch: pytest.MonkeyPatch, decoder: str
) -> None:
    """Beyond EXACT_RESIZE_PIXELS (16.7M, a 1x10000 strip at S=256 would be 655M) only the region
    under the crop is resized: pil stays within 1 grey level of torchvision (geometry's NOTE).
    The limit is lowered here so that the reference stays cheap to compute."""
    from joader.stages import geometry

    monkeypatch.setattr(geometry, "EXACT_RESIZE_PIXELS", 0)
    assert geometry.plan_center_crop(40, 3000, 64, True).crop_first
    data = encode("PNG", 40, 3000)
    out = build_stage("center-crop", size=64, decoder=decoder).prepare(data, "strip.png")
    diff = np.abs(out.astype(np.int16) - torchvision_reference(data, 64))
    assert diff.max() <= (1 if decoder == "pil" else 40) and diff.mean() < 1, (diff.max(), diff.mean())
