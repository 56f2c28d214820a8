"""`ImageStage.item_nbytes`: an item's exact size from its file's header, equal to what
`prepare` returns, for every kind, mode, decoder, format and shape; None for a bad file."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from joader.client.tools.demo_data import make_demo_data
from joader.stages import build_stage
from joader.stages.user import UserStage
from tests.support.data import corrupt_jpeg

pytestmark = pytest.mark.timeout(120)

DECODERS = ("pil", "pil-draft", "turbo")
KINDS = [("center-crop", 64, False), ("center-crop", 64, True), ("resize", 64, False), ("resize", 64, True),
         ("max-side", 64, False), ("resize", 8, False)]
# (width, height): landscape, portrait, square, smaller than S, extreme strips (capped), 1 px
SIZES = [(500, 375), (375, 500), (300, 300), (40, 30), (3000, 100), (100, 3000), (10, 3000), (1, 1), (97, 61)]


def _encode(img: Image.Image, fmt: str, **options: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize(("kind", "size", "upscale"), KINDS)
def test_the_header_says_exactly_what_prepare_returns(kind: str, size: int, upscale: bool, mode: str,
                                                       decoder: str) -> None:
    stage = build_stage(kind, size=size, mode=mode, upscale=upscale, decoder=decoder)
    for width, height in SIZES:
        for fmt in ("JPEG", "PNG"):
            data = _encode(_image(width, height), fmt)
            assert stage.item_nbytes(data) == stage.prepare(data, "x").nbytes, (width, height, fmt)


@pytest.mark.parametrize("decoder", DECODERS)
def test_other_formats_and_modes(decoder: str) -> None:
    stage = build_stage("resize", size=32, decoder=decoder)
    rgb = _image(90, 70, seed=3)
    cases = [
        _encode(rgb.convert("L"), "JPEG"),
        _encode(rgb.convert("CMYK"), "JPEG"),  # Pillow decodes it under turbo too
        _encode(rgb, "JPEG", progressive=True),
        _encode(rgb.convert("P"), "GIF"),
        _encode(rgb.convert("RGBA"), "PNG"),
        _encode(Image.fromarray(np.full((70, 90), 30000, np.uint16)), "PNG"),
        _encode(rgb, "BMP"),
        _encode(rgb, "WEBP"),
        _encode(rgb, "TIFF"),
    ]
    for data in cases:
        assert stage.item_nbytes(data) == stage.prepare(data, "x").nbytes == 3 * 32 * 41


def test_demo_photos(tmp_path_factory: pytest.TempPathFactory) -> None:
    listing = make_demo_data(tmp_path_factory.mktemp("demo"), 4, progress=False)
    for decoder in DECODERS:
        stage = build_stage("resize", size=160, decoder=decoder)
        for item_id in range(4):
            data = listing.read(item_id)
            assert stage.item_nbytes(data) == stage.prepare(data, "x").nbytes == 3 * 160 * 213


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_header_that_cannot_be_read_is_none(tmp_path_factory: pytest.TempPathFactory, decoder: str) -> None:
    stage = build_stage("resize", size=32, decoder=decoder)
    for data in (b"", b"not an image", b"\xff\xd8\xff" + b"\0" * 50, _encode(_image(64, 48), "JPEG")[:20]):
        assert stage.item_nbytes(data) is None
    listing = make_demo_data(tmp_path_factory.mktemp("bad"), 1, progress=False)
    corrupt_jpeg(listing.root / listing.paths[0])  # truncated: its header is whole, its pixels not
    assert stage.item_nbytes(listing.read(0)) == 3 * 32 * 42  # the decode fails, with its message


def test_a_user_stage_cannot_say_its_size() -> None:
    """A user stage has no `item_nbytes`: joaderd places its items once prepared (size first)."""
    assert not hasattr(UserStage, "item_nbytes")
