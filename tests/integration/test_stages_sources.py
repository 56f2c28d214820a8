"""Stages and sources through a real joaderd (issue 9): whole images (`resize`), grayscale,
a user stage returning float32, list-file and tar-shard sources equal to the ImageFolder item by
item, and two sources of different item sizes in one cache of bytes.

Clients run as `python -m tests.support.stage_clients CMD` and write what they received to
`.npz` files; this process compares pixels without ever opening a gRPC channel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from joader.sources.imagefolder import list_image_folder
from tests.support.data import write_list_file, write_tar_shards

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]


def run_client(server: Any, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.stage_clients", *args, "--address", server.address],
        capture_output=True, text=True, timeout=150, cwd=ROOT, env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, f"client failed:\n{result.stderr[-4000:]}\njoaderd log:\n{server.log()[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def dump(server: Any, source: str, out: Path, items: int = 0) -> tuple[dict[str, Any], Any]:
    info = run_client(server, "dump", "--source", source, "--out", str(out), "--items", str(items))
    return info, np.load(out)


def test_resize_serves_whole_images_that_match_pillow(demo_root: Path, start_joaderd: Any, tmp_path: Path) -> None:
    """`resize:256` of a 500x375 JPEG is (3, 256, 341), within one grey level of Pillow's
    shorter-side resize (decoder pil); RandomResizedCrop runs over them in a DataLoader."""
    server = start_joaderd({"demo": demo_root}, cache_items=1000, extra=["--stage", "demo=resize:256", "--decoder", "pil"])
    info, data = dump(server, "demo", tmp_path / "resize.npz", items=12)
    assert info["stage"].startswith("resize:256") and info["item_shape"] is None
    listing = list_image_folder(demo_root)
    for i in range(12):
        item = data[f"item_{i}"]
        assert item.shape == (3, 256, 341) and item.dtype == np.uint8
        with Image.open(demo_root / listing.paths[i]) as image:
            reference = np.asarray(image.convert("RGB").resize((341, 256), Image.Resampling.BILINEAR))
        difference = np.abs(item.transpose(1, 2, 0).astype(int) - reference.astype(int))
        assert difference.max() <= 1, f"item {i}: differs from Pillow by {difference.max()} grey levels"
    trained = run_client(server, "train", "--source", "demo", "--batch-size", "8")
    assert trained["items"] == 160 and trained["shapes"] == [[3, 224, 224]]
    assert trained["batches"] == 20


def test_grayscale_and_a_user_stage_returning_float32(demo_root: Path, start_joaderd: Any, tmp_path: Path) -> None:
    config = tmp_path / "joaderd.toml"
    config.write_text(
        f'[sources.gray]\npath = "{demo_root}"\nmode = "L"\nimage_size = 48\n'
        f'[sources.floats]\npath = "{demo_root}"\nstage = "examples.userstage:factory"\n'
        'options = { size = 40 }\n'
    )
    server = start_joaderd({}, cache_items=200, extra=["--config", str(config)],
                           env={"PYTHONPATH": str(ROOT)})
    info, gray = dump(server, "gray", tmp_path / "gray.npz", items=10)
    assert info["item_shape"] == [1, 48, 48]  # center-crop's nominal shape
    assert all(gray[f"item_{i}"].shape == (1, 48, 48) and gray[f"item_{i}"].dtype == np.uint8 for i in range(10))
    info, floats = dump(server, "floats", tmp_path / "floats.npz", items=10)
    assert info["item_shape"] == [1, 40, 40] and info["item_dtype"] == "float32"
    for i in range(10):
        item = floats[f"item_{i}"]
        assert item.shape == (1, 40, 40) and item.dtype == np.float32
        assert abs(float(item.mean())) < 1e-3 and abs(float(item.std()) - 1) < 1e-2  # normalized


def test_list_and_tar_sources_equal_the_image_folder_item_by_item(demo_root: Path, start_joaderd: Any,
                                                                  tmp_path: Path) -> None:
    list_file = write_list_file(demo_root, demo_root.parent / "train.tsv", labels="name")
    try:
        shards = tmp_path / "shards"
        write_tar_shards(demo_root, shards, items_per_shard=50)
        server = start_joaderd({"folder": demo_root, "listed": list_file, "sharded": shards}, cache_items=600)
        dumps = {name: dump(server, name, tmp_path / f"{name}.npz")[1] for name in ("folder", "listed", "sharded")}
    finally:
        list_file.unlink()
    folder = dumps["folder"]
    assert len(folder["indices"]) == 160
    for name in ("listed", "sharded"):
        other = dumps[name]
        assert np.array_equal(other["indices"], folder["indices"]) and np.array_equal(other["labels"], folder["labels"])
        for i in folder["indices"]:
            assert np.array_equal(other[f"item_{i}"], folder[f"item_{i}"]), f"{name}: item {i} differs"
    status = server.status()
    assert {s["name"]: s["kind"] for s in status["sources"]} == {"folder": "imagefolder", "listed": "list", "sharded": "tar"}


def test_two_sources_of_different_sizes_share_one_cache_of_bytes(demo_root: Path, start_joaderd: Any,
                                                                 tmp_path: Path) -> None:
    """A 64-px RGB source (12,288 B per item) and a 32-px grayscale one (1,024 B) in one cache
    smaller than both: the bytes in use stay within 10% of the bytes of the items held."""
    server = start_joaderd({"big": demo_root, "small": demo_root}, cache_items=60,
                           extra=["--image-size", "small=32", "--mode", "small=L"])
    dump(server, "big", tmp_path / "big.npz")
    _, small = dump(server, "small", tmp_path / "small.npz")
    assert small["item_0"].shape == (1, 32, 32)
    cache = server.status()["cache"]
    assert cache["evictions"] > 0 and cache["items"] > 0
    assert cache["used_bytes"] <= cache["capacity_bytes"]
    print(f"two sources in one cache: {cache['used_bytes']} bytes used, {cache['items_bytes']} bytes of {cache['items']} items held, capacity {cache['capacity_bytes']}")
    assert cache["items_bytes"] <= cache["used_bytes"] <= 1.1 * cache["items_bytes"], cache
