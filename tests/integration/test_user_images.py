"""Images of any size through `JoaderDataset(root=...)` (issue 38): a 10x10 and a 40x3000 photo
among 64 px ones. By default every image is served at S, as torchvision's Resize + CenterCrop
would, and an epoch trains through a real DataLoader; with `upscale=False` the batch that mixes
sizes fails with an error naming the file and the option, not torch's "stack expects each
tensor to be equal size" naming none."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from joader.client.autostart import stop_servers
from joader.sources.base import open_source
from joader.stages import build_stage

pytestmark = pytest.mark.timeout(180)

S = 64
ODD = {("cat", "tiny.jpg"): (10, 10), ("dog", "tall.jpg"): (40, 3000)}  # (width, height)


@pytest.fixture
def odd_tree(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Eight 64-96 px photos and the two odd ones, under a private XDG_RUNTIME_DIR whose
    auto-started servers are stopped afterwards."""
    base = Path(tempfile.mkdtemp(prefix="jis-", dir="/tmp"))  # short: sun_path is 108 bytes
    os.chmod(base, 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.delenv("JOADER_ADDRESS", raising=False)
    rng = np.random.default_rng(38)
    root = base / "photos"
    sizes = {(cls, f"{cls}{i}.jpg"): (64 + 8 * i, 64 + 4 * i) for cls in ("cat", "dog") for i in range(4)}
    for (cls, name), size in {**sizes, **ODD}.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / cls / name, quality=90)
    try:
        yield root
    finally:
        stop_servers(timeout_s=20)
        shutil.rmtree(base, ignore_errors=True)


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
        assert sorted(seen) == list(range(len(listing))) and len(listing) == 10
