"""A folder of photos as a `JoaderDataset(root=...)` user has them (issue 38).

Images of any size: a 10x10 and a 40x3000 photo among 64 px ones. By default every image is
served at S, as torchvision's Resize + CenterCrop would, and an epoch trains through a real
DataLoader; with `upscale=False` the batch that mixes sizes fails with an error naming the file
and the option, not torch's "stack expects each tensor to be equal size" naming none.

A file that does not decode: each epoch yields one item fewer than the folder holds, and once
an epoch has reached the file `len(ds)` (and `len(loader)`) says so, also when DataLoader
workers read."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from joader.client.autostart import stop_servers
from joader.errors import InvalidArgumentError
from joader.sources.base import open_source
from joader.stages import build_stage
from tests.support.data import corrupt_jpeg

pytestmark = pytest.mark.timeout(180)

S = 64
ODD = {("cat", "tiny.jpg"): (10, 10), ("dog", "tall.jpg"): (40, 3000)}  # (width, height)


@pytest.fixture
def base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder for the photos and a private XDG_RUNTIME_DIR, whose auto-started servers are
    stopped afterwards."""
    path = Path(tempfile.mkdtemp(prefix="jis-", dir="/tmp"))  # short: sun_path is 108 bytes
    os.chmod(path, 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    monkeypatch.delenv("JOADER_ADDRESS", raising=False)
    try:
        yield path
    finally:
        stop_servers(timeout_s=20)
        shutil.rmtree(path, ignore_errors=True)


def _photos(root: Path, sizes: dict[tuple[str, str], tuple[int, int]]) -> Path:
    rng = np.random.default_rng(38)
    for (cls, name), size in sizes.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / cls / name, quality=90)
    return root


@pytest.fixture
def odd_tree(base: Path) -> Path:
    """Thirty 64-176 px photos and the two odd ones."""
    sizes = {(cls, f"{cls}{i}.jpg"): (64 + 8 * i, 64 + 4 * i) for cls in ("cat", "dog") for i in range(15)}
    return _photos(base / "photos", {**sizes, **ODD})


def test_every_image_is_served_at_S_by_default_and_an_epoch_trains(odd_tree: Path) -> None:
    from torch.utils.data import DataLoader

    from joader import JoaderDataset

    listing = open_source(odd_tree)
    stage = build_stage("center-crop", size=S)  # joaderd's default decoder, upscaling as it does by default
    with JoaderDataset("odd", root=odd_tree, image_size=S, return_index=True, threads=None, timeout_s=60) as ds:
        seen = {}
        for indices, images, labels in DataLoader(ds, batch_size=4):
            assert images.shape[1:] == (3, S, S)
            for index, image, label in zip(indices.tolist(), images, labels.tolist(), strict=True):
                expected = stage.prepare(listing.read(index), listing.paths[index])
                assert np.array_equal(image.numpy(), expected), listing.paths[index]
                assert label == int(listing.labels[index])
                seen[index] = True
        assert sorted(seen) == list(range(len(listing))) and len(listing) == 32


def test_upscale_false_keeps_small_images_small_and_names_the_file_a_batch_cannot_hold(odd_tree: Path) -> None:
    from torch.utils.data import DataLoader

    from joader import JoaderDataset
    from joader.client.batch_shapes import BatchShapeError

    with JoaderDataset("odd", root=odd_tree, image_size=S, upscale=False, threads=None, timeout_s=60, seed=1) as ds:
        with pytest.raises(BatchShapeError) as raised:
            for _ in DataLoader(ds, batch_size=8):
                pass
        # A job that names that server by address says what it expects, as image_size= does.
        with pytest.raises(InvalidArgumentError, match=r"images smaller than S served small, and this job expects "
                                                       r"upscale=True\. Start joaderd with --upscale odd"):
            JoaderDataset("odd", address=ds.address, upscale=True, threads=None)
        JoaderDataset("odd", address=ds.address, upscale=False, image_size=S, threads=None).close()
    text = str(raised.value)
    named = re.findall(rf"item \d+ \(class '\w+', {re.escape(str(odd_tree))}/(\w+/[\w.]+)\): (\d+x\d+x\d+)", text)
    assert named and all(tuple(path.split("/")) in ODD and shape != "3x64x64" for path, shape in named), text
    assert "(joaderd serves an image smaller than S at its own size when upscale is off)" in text
    assert text.startswith("a batch of 'odd' cannot be formed: its items must have one shape (3x64x64), but item ")
    assert "pass upscale=True to JoaderDataset(root=...) (the default: every image is served at S" in text
    assert "stack expects each tensor to be equal size" in str(raised.value.__cause__)


def _check_epoch(loader: Any, listing: Any, stage: Any) -> list[int]:
    """One epoch's indices, each sample checked against the stage run here on the file."""
    indices = []
    for batch_indices, images, _labels in loader:
        for index, image in zip(batch_indices.tolist(), images, strict=True):
            assert np.array_equal(image.numpy(), stage.prepare(listing.read(index), listing.paths[index]))
            indices.append(index)
    return indices


def test_len_leaves_out_a_file_that_does_not_decode_once_an_epoch_reached_it(base: Path) -> None:
    from torch.utils.data import DataLoader

    from joader import JoaderDataset

    root = _photos(base / "photos", {(cls, f"{cls}{i}.jpg"): (72, 64) for cls in ("cat", "dog") for i in range(12)})
    (root / "dog" / "broken.jpg").write_bytes((root / "dog" / "dog0.jpg").read_bytes())
    corrupt_jpeg(root / "dog" / "broken.jpg")
    listing = open_source(root)
    broken = list(listing.paths).index("dog/broken.jpg")
    stage = build_stage("center-crop", size=S)
    with JoaderDataset("photos", root=root, image_size=S, return_index=True, threads=None, timeout_s=60) as ds:
        assert len(ds) == 25  # nothing is known of the file before an epoch reaches it
        for workers in (2, 0):  # DataLoader workers note it where the training process counts
            loader = DataLoader(ds, batch_size=4, num_workers=workers)
            indices = _check_epoch(loader, listing, stage)
            assert sorted(indices) == [i for i in range(25) if i != broken]
            assert len(indices) == len(ds) == 24 and len(loader) == 6, workers


def test_exif_transpose_turns_photos_upright_when_asked(base: Path) -> None:
    from joader import JoaderDataset

    root = _photos(base / "photos", {("cat", "a.jpg"): (96, 64), ("dog", "b.jpg"): (64, 80)})
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: the camera was turned; the photo is upright rotated 90 degrees
    with Image.open(root / "cat" / "a.jpg") as photo:
        photo.save(root / "cat" / "turned.jpg", exif=exif.tobytes(), quality=90)
    listing = open_source(root)
    turned = list(listing.paths).index("cat/turned.jpg")
    served = {}
    for upright in (False, True):
        with JoaderDataset("photos", root=root, image_size=S, stage="resize", exif_transpose=upright,
                           return_index=True, threads=None, timeout_s=60) as ds:
            served[upright] = {index: image.numpy() for index, image, _ in ds}
    for upright, images in served.items():
        stage = build_stage("resize", size=S, exif_transpose=upright)
        assert np.array_equal(images[turned], stage.prepare(listing.read(turned), listing.paths[turned]))
    assert served[False][turned].shape == (3, S, S * 3 // 2) and served[True][turned].shape == (3, S * 3 // 2, S)
