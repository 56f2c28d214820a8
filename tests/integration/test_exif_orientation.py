"""`joaderd --exif-transpose NAME` through a real joaderd: a phone photo stored sideways (EXIF
orientation 6) is served upright, pixel for pixel the stage's output; without the flag it is
served as stored, as torchvision's ImageFolder would (issue 38, item 8)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from joader.stages import build_stage
from joader.testing.torchvision_reference import encode
from tests.integration.test_stages_sources import dump

pytestmark = pytest.mark.timeout(180)


def _phone_photos(root: Path) -> list[bytes]:
    """Two 120x80 JPEGs stored sideways (orientation 6: upright they are 80x120 portraits)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    blobs = []
    for i in range(2):
        data = encode("JPEG", 120, 80, seed=i, exif=exif.tobytes())
        (root / "phone").mkdir(parents=True, exist_ok=True)
        (root / "phone" / f"img{i}.jpg").write_bytes(data)
        with Image.open(io.BytesIO(data)) as img:
            assert img.getexif()[0x0112] == 6
        blobs.append(data)
    return blobs


def test_exif_transpose_flag_serves_photos_upright(tmp_path: Path, start_joaderd: Any) -> None:
    blobs = _phone_photos(tmp_path / "photos")
    server = start_joaderd({"upright": tmp_path / "photos", "stored": tmp_path / "photos"}, cache_items=8,
                           extra=["--stage", "resize:64", "--exif-transpose", "upright"])
    _, upright = dump(server, "upright", tmp_path / "upright.npz")
    _, stored = dump(server, "stored", tmp_path / "stored.npz")
    turned = build_stage("resize", size=64, exif_transpose=True)
    plain = build_stage("resize", size=64)
    for i, data in enumerate(blobs):
        assert stored[f"item_{i}"].shape == (3, 64, 96)  # as stored: landscape
        assert np.array_equal(stored[f"item_{i}"], plain.prepare(data, "x.jpg"))
        assert upright[f"item_{i}"].shape == (3, 96, 64)  # upright: portrait
        assert np.array_equal(upright[f"item_{i}"], turned.prepare(data, "x.jpg"))
