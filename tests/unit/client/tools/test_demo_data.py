"""Demo data: ImageFolder layout, ~100 KB photo-like JPEGs, deterministic, idempotent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from joader.client.tools.demo_data import main, make_demo_data
from joader.errors import DecodeError, InvalidArgumentError
from joader.stages import build_stage
from tests.support.data import corrupt_jpeg

STAGE = build_stage("center-crop", size=64)

pytestmark = pytest.mark.timeout(120)


def test_layout_sizes_and_listing(tmp_path: Path) -> None:
    listing = make_demo_data(tmp_path / "d", 12, num_classes=3, progress=False)
    assert len(listing) == 12 and len(listing.classes) == 3
    assert listing.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    for rel in listing.paths:
        path = listing.root / rel
        with Image.open(path) as img:
            assert img.format == "JPEG" and img.size == (500, 375) and img.mode == "RGB"
        assert 60_000 < path.stat().st_size < 150_000
    assert STAGE.prepare(listing.read(0), listing.paths[0]).shape == (3, 64, 64)


def test_deterministic_and_idempotent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = make_demo_data(tmp_path / "a", 6, num_classes=2, seed=3, progress=False)
    b = make_demo_data(tmp_path / "b", 6, num_classes=2, seed=3, progress=True)
    assert "6 images" in capsys.readouterr().err
    for rel in a.paths:
        assert (a.root / rel).read_bytes() == (b.root / rel).read_bytes()
    first = a.root / a.paths[0]
    mtime = first.stat().st_mtime_ns
    os.remove(a.root / a.paths[-1])
    again = make_demo_data(tmp_path / "a", 6, num_classes=2, seed=3, progress=False)
    assert again.paths == a.paths and first.stat().st_mtime_ns == mtime
    assert (a.root / a.paths[-1]).read_bytes() == (b.root / b.paths[-1]).read_bytes()
    grown = make_demo_data(tmp_path / "a", 8, num_classes=2, seed=3, progress=False)
    assert len(grown) == 8
    with pytest.raises(InvalidArgumentError, match="different demo data"):
        make_demo_data(tmp_path / "a", 8, num_classes=2, seed=4, progress=False)
    c = make_demo_data(tmp_path / "c", 6, num_classes=2, seed=4, progress=False)
    assert (c.root / c.paths[0]).read_bytes() != first.read_bytes()


def test_refuses_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(InvalidArgumentError, match="not a joader demo folder"):
        make_demo_data(tmp_path, 3, progress=False)


def test_corrupt_jpeg_fails_at_decode(tmp_path: Path) -> None:
    listing = make_demo_data(tmp_path / "d", 2, num_classes=1, progress=False)
    path = listing.root / listing.paths[1]
    size = path.stat().st_size
    corrupt_jpeg(path)
    assert path.stat().st_size == size // 3
    with pytest.raises(DecodeError, match=listing.paths[1].split("/")[-1]):
        STAGE.prepare(listing.read(1), listing.paths[1])


def test_cli(tmp_path: Path) -> None:
    assert main([str(tmp_path / "cli"), "--items", "3", "--classes", "2", "--quiet"]) == 0
    assert len(list((tmp_path / "cli").glob("*/*.jpg"))) == 3
    assert main([str(tmp_path / "cli"), "--items", "3", "--classes", "3", "--quiet"]) == 2
