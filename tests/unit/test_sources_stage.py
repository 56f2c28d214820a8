"""The shared stage: torchvision-equivalent resize + center crop, CHW output, clear failures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from joader.errors import DecodeError, InvalidArgumentError
from joader.sources.demo import corrupt_jpeg
from joader.sources.stage import item_nbytes, prepare, prepare_into

pytestmark = pytest.mark.timeout(60)


def _photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / width, yy * 255 / height, (xx + yy) % 256], axis=-1)
    return np.clip(base + rng.normal(0, 10, base.shape), 0, 255).astype(np.uint8)


def _reference(path: Path, size: int) -> np.ndarray:
    """torchvision Resize(size) + CenterCrop(size) on a PIL image, then CHW."""
    with Image.open(path) as img:
        rgb = img.convert("RGB")
    w, h = rgb.size
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    resized = rgb.resize((new_w, new_h), Image.Resampling.BILINEAR)
    left, top = round((new_w - size) / 2.0), round((new_h - size) / 2.0)
    crop = resized.crop((left, top, left + size, top + size))
    return np.asarray(crop).transpose(2, 0, 1)


@pytest.mark.parametrize(("width", "height"), [(500, 375), (375, 500), (300, 300), (100, 80)])
def test_matches_torchvision_resize_and_center_crop(
    tmp_path: Path, width: int, height: int
) -> None:
    path = tmp_path / "img.jpg"
    Image.fromarray(_photo(width, height)).save(path, quality=90)
    out = prepare(path, 256)
    assert out.shape == (3, 256, 256) and out.dtype == np.uint8 and out.flags.c_contiguous
    assert np.array_equal(out, _reference(path, 256))
    assert item_nbytes(256) == out.nbytes


def test_large_jpeg_uses_reduced_decode_close_to_full(tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    Image.fromarray(_photo(2400, 1800)).save(path, quality=90)
    out = prepare(path, 128)
    assert np.array_equal(out, prepare(path, 128))  # deterministic
    diff = np.abs(out.astype(np.int16) - _reference(path, 128).astype(np.int16))
    assert diff.mean() < 4


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "CMYK"])
def test_any_mode_becomes_rgb(tmp_path: Path, mode: str) -> None:
    path = tmp_path / ("img.jpg" if mode in ("L", "CMYK") else "img.png")
    Image.fromarray(_photo(64, 48)).convert(mode).save(path)
    out = prepare(path, 32)
    assert out.shape == (3, 32, 32)
    assert np.array_equal(out, _reference(path, 32))


def test_writes_into_a_view(tmp_path: Path) -> None:
    path = tmp_path / "img.png"
    Image.fromarray(_photo(40, 40)).save(path)
    backing = np.zeros(3 * 16 * 16 + 10, np.uint8)
    prepare_into(path, 16, backing[: 3 * 16 * 16].reshape(3, 16, 16))
    assert np.array_equal(backing[:768].reshape(3, 16, 16), prepare(path, 16))
    assert not backing[768:].any()
    with pytest.raises(InvalidArgumentError, match="shape"):
        prepare_into(path, 16, np.zeros((16, 16, 3), np.uint8))


def test_truncated_jpeg_raises_decode_error_with_path(tmp_path: Path) -> None:
    path = tmp_path / "broken.jpg"
    Image.fromarray(_photo(500, 375)).save(path, quality=90)
    corrupt_jpeg(path)
    with pytest.raises(DecodeError, match="broken.jpg"):
        prepare(path, 64)


@pytest.mark.parametrize("content", [b"", b"not an image at all", b"\xff\xd8\xff" + b"\0" * 50])
def test_garbage_raises_decode_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.jpg"
    path.write_bytes(content)
    with pytest.raises(DecodeError, match="junk.jpg"):
        prepare(path, 32)


def test_missing_file_raises_decode_error(tmp_path: Path) -> None:
    with pytest.raises(DecodeError, match="gone.jpg"):
        prepare(tmp_path / "gone.jpg", 32)


def test_decompression_bomb_limit_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "bomb.png"
    Image.fromarray(_photo(100, 100)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 10000 px > 2 * limit: an error
    with pytest.raises(DecodeError, match="DecompressionBomb"):
        prepare(path, 32)
