"""ImageFolder listing: torchvision's order and labels, never leaving the root, clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from joader.errors import InvalidArgumentError
from joader.sources.imagefolder import full_path, list_image_folder

pytestmark = pytest.mark.timeout(60)


def _touch(root: Path, *relative: str) -> None:
    for rel in relative:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


def test_order_and_labels_match_torchvision(tmp_path: Path) -> None:
    _touch(
        tmp_path,
        "dog/b.jpg", "dog/a.PNG", "dog/sub/c.jpeg", "dog/sub-x/d.jpg", "dog/notes.txt",
        "cat/z.webp", "cat/y.bmp", "bird/x.tif",
    )  # fmt: skip
    (tmp_path / "empty").mkdir()
    (tmp_path / "loose.jpg").write_bytes(b"")
    listing = list_image_folder(tmp_path)
    assert listing.classes == ("bird", "cat", "dog", "empty")
    assert listing.class_to_idx == {"bird": 0, "cat": 1, "dog": 2, "empty": 3}
    # sorted(os.walk) sorts by folder path: "dog/sub" < "dog/sub-x" (a prefix sorts first).
    assert listing.paths == (
        "bird/x.tif", "cat/y.bmp", "cat/z.webp", "dog/a.PNG", "dog/b.jpg", "dog/sub/c.jpeg",
        "dog/sub-x/d.jpg",
    )  # fmt: skip
    assert listing.labels.dtype == np.int32
    assert listing.labels.tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert listing.root == tmp_path.resolve()
    assert full_path(listing, 0) == tmp_path.resolve() / "bird/x.tif"
    with pytest.raises(InvalidArgumentError, match="out of range"):
        full_path(listing, 7)


def test_order_equals_torchvision_make_dataset(tmp_path: Path) -> None:
    torchvision_folder = pytest.importorskip("torchvision.datasets.folder")
    _touch(
        tmp_path,
        "dog/b.jpg", "dog/a.PNG", "dog/sub/c.jpeg", "dog/sub-x/d.jpg", "dog/sub/deeper/e.jpg",
        "cat/z.webp", "cat/Y.bmp", "bird/x.tif", "bird/.hidden.jpg",
    )  # fmt: skip
    _classes, class_to_idx = torchvision_folder.find_classes(str(tmp_path))
    expected = torchvision_folder.make_dataset(
        str(tmp_path), class_to_idx, torchvision_folder.IMG_EXTENSIONS
    )
    listing = list_image_folder(tmp_path)
    got = [(str(tmp_path / p), int(label)) for p, label in zip(listing.paths, listing.labels, strict=True)]
    assert got == expected


def test_sorted_walk_order_without_torchvision(tmp_path: Path) -> None:
    _touch(tmp_path, "dog/sub/c.jpeg", "dog/sub-x/d.jpg", "dog/sub/deeper/e.jpg", "dog/a.jpg")
    expected = []
    for root, _, files in sorted(os.walk(tmp_path / "dog")):
        expected += [os.path.relpath(os.path.join(root, f), tmp_path) for f in sorted(files)]
    assert list(list_image_folder(tmp_path).paths) == expected


def test_symlinks_outside_the_root_are_skipped(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    _touch(root, "cls/in.jpg")
    _touch(outside, "secret.jpg", "dir/other.jpg")
    os.symlink(outside / "secret.jpg", root / "cls/leak.jpg")
    os.symlink(outside / "dir", root / "cls/leakdir")
    os.symlink(outside, root / "leakclass")
    os.symlink(root / "cls/in.jpg", root / "cls/alias.jpg")  # inside: fine
    os.symlink(root / "cls", root / "cls/loop")  # a loop
    os.symlink(root / "cls/missing.jpg", root / "cls/broken.jpg")
    listing = list_image_folder(root)
    assert listing.paths == ("cls/alias.jpg", "cls/in.jpg")
    assert "leakclass" in listing.classes  # labels stay as torchvision numbers them
    assert listing.num_skipped == 5


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "does not exist"),
        ("file", "is not a folder"),
        ("flat", "no class subfolders"),
        ("no_images", "holds no images"),
    ],
)
def test_errors_explain_the_layout(tmp_path: Path, setup: str, message: str) -> None:
    root = tmp_path / "src"
    if setup == "file":
        root.write_bytes(b"")
    elif setup == "flat":
        _touch(root, "a.jpg")
    elif setup == "no_images":
        _touch(root, "cls/readme.txt")
    with pytest.raises(InvalidArgumentError, match=message) as info:
        list_image_folder(root)
    assert "ImageFolder layout" in str(info.value)
