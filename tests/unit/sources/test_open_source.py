"""open_source: one ItemSource interface over ImageFolder, list files and tar shards.

Built from one demo folder, item i is the same bytes and label in all three kinds.
"""

from __future__ import annotations

import logging
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from joader.client.tools.demo_data import make_demo_data
from joader.errors import DecodeError, InvalidArgumentError
from joader.sources import (
    ItemSource,
    ListSource,
    SourceListing,
    TarSource,
    list_image_folder,
    open_source,
)
from tests.support.data import write_list_file, write_tar_shards

pytestmark = pytest.mark.timeout(120)

NUM_ITEMS, NUM_CLASSES = 11, 3


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("sources")
    make_demo_data(base / "images", NUM_ITEMS, num_classes=NUM_CLASSES, progress=False)
    return base


def test_item_i_is_the_same_in_every_kind(demo: Path) -> None:
    folder = open_source(demo / "images")
    tsv = write_list_file(demo / "images", demo / "train.tsv")
    csv_names = write_list_file(demo / "images", demo / "images" / "named.csv", ",", "name")
    shards = write_tar_shards(demo / "images", demo / "shards", 4)
    assert [p.name for p in shards] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    kinds = {
        "folder": folder,
        "tsv": open_source(tsv),
        "csv": open_source(csv_names),
        "shard dir": open_source(demo / "shards"),
        "shard glob": open_source(str(demo / "shards" / "shard-*.tar")),
    }
    assert isinstance(folder, SourceListing) and folder.kind == "imagefolder"
    assert isinstance(kinds["tsv"], ListSource) and kinds["tsv"].kind == "list"
    assert isinstance(kinds["shard dir"], TarSource) and kinds["shard dir"].kind == "tar"
    expected = [(folder.root / rel).read_bytes() for rel in folder.paths]
    for name, source in kinds.items():
        assert isinstance(source, ItemSource), name
        assert len(source) == NUM_ITEMS, name
        assert source.labels.dtype == np.int32, name
        assert source.labels.tolist() == folder.labels.tolist(), name
        assert [source.read(i) for i in range(NUM_ITEMS)] == expected, name
        assert pickle.loads(pickle.dumps(source)).read(NUM_ITEMS - 1) == expected[-1], name
    assert kinds["csv"].classes == folder.classes  # class names: the same classes, same order
    assert kinds["csv"].class_to_idx == folder.class_to_idx
    assert kinds["tsv"].classes == ("0", "1", "2")
    assert kinds["tsv"].paths[0] == "images/" + folder.paths[0]  # relative to the list's folder
    assert kinds["csv"].paths == folder.paths
    assert kinds["shard dir"].paths[5] == "shard-000001.tar/000000005.jpg"
    assert kinds["tsv"].root == tsv and kinds["shard dir"].root == (demo / "shards").resolve()


def test_imagefolder_ids_are_unchanged(demo: Path) -> None:
    listed, opened = list_image_folder(demo / "images"), open_source(demo / "images")
    assert opened.paths == listed.paths and opened.classes == listed.classes
    assert opened.labels.tolist() == listed.labels.tolist()
    assert opened.num_skipped == 0 and opened.root == (demo / "images").resolve()
    with pytest.raises(InvalidArgumentError, match="out of range"):
        opened.read(NUM_ITEMS)
    # A SourceListing built by hand (as tests and the server do) still works, with read().
    by_hand = SourceListing(
        root=listed.root, classes=listed.classes, class_to_idx=listed.class_to_idx,
        paths=listed.paths[:2], labels=listed.labels[:2],
    )  # fmt: skip
    assert (
        by_hand.kind == "imagefolder"
        and by_hand.read(1) == (listed.root / listed.paths[1]).read_bytes()
    )


def test_read_of_a_file_removed_after_listing(tmp_path: Path) -> None:
    listing = make_demo_data(tmp_path / "d", 4, num_classes=2, progress=False)
    tsv = write_list_file(tmp_path / "d", tmp_path / "l.tsv")
    sources = [open_source(tmp_path / "d"), open_source(tsv)]
    os.remove(listing.root / listing.paths[2])
    for source in sources:
        with pytest.raises(DecodeError) as info:
            source.read(2)
        message = str(info.value)
        assert listing.paths[2] in message and "it no longer exists" in message
        assert message.endswith("restart joaderd to re-list it")
        assert len(source.read(1)) > 1000


def test_read_refuses_a_file_swapped_for_a_link_outside(tmp_path: Path) -> None:
    listing = make_demo_data(tmp_path / "d", 2, num_classes=1, progress=False)
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(b"secret")
    target = listing.root / listing.paths[0]
    os.remove(target)
    os.symlink(secret, target)
    with pytest.raises(DecodeError, match="resolves outside the source root"):
        listing.read(0)
    os.remove(target)
    os.mkfifo(target)  # would block a plain open() forever
    with pytest.raises(DecodeError, match="not a regular file"):
        listing.read(0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_read_of_an_unreadable_file_says_permission(tmp_path: Path) -> None:
    listing = make_demo_data(tmp_path / "d", 2, num_classes=1, progress=False)
    os.chmod(listing.root / listing.paths[1], 0)
    with pytest.raises(DecodeError, match="permission denied"):
        listing.read(1)


def test_dispatch_errors_list_the_kinds(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "broken")
    cases = [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "neither class subfolders nor .tar shards"),
        (tmp_path / "notes.txt", "neither a list .* nor a tar shard"),
        (tmp_path / "broken", "neither a folder nor a regular file"),
        ("", "source path is empty"),
    ]
    for path, match in cases:
        with pytest.raises(InvalidArgumentError, match=match) as info:
            open_source(path)
        assert "a .tsv or .csv file" in str(info.value)
        assert str(info.value).endswith("e.g. '/data/shards/train-*.tar')")
    with pytest.raises(InvalidArgumentError, match="matches no file"):
        open_source(tmp_path / "empty" / "train-*.tar")


def test_a_folder_with_classes_and_tars_stays_an_imagefolder(
    demo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "mixed"
    (root / "cls").mkdir(parents=True)
    (root / "cls" / "a.jpg").write_bytes(
        (demo / "images" / open_source(demo / "images").paths[0]).read_bytes()
    )
    with tarfile.open(root / "ILSVRC2012_img_train.tar", "w"):
        pass
    with caplog.at_level(logging.WARNING):
        source = open_source(root)
    assert source.kind == "imagefolder" and source.paths == ("cls/a.jpg",)
    assert "to serve the shards, give" in caplog.text


def test_writer_errors(demo: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"must be named \*\.csv"):
        write_list_file(demo / "images", tmp_path / "l.tsv", ",")
    with pytest.raises(InvalidArgumentError, match="sep must be"):
        write_list_file(demo / "images", tmp_path / "l.tsv", ";")
    with pytest.raises(InvalidArgumentError, match="labels must be"):
        write_list_file(demo / "images", tmp_path / "l.tsv", labels="onehot")
    with pytest.raises(
        InvalidArgumentError, match="write it into the image folder or a folder above"
    ):
        write_list_file(demo / "images", tmp_path / "l.tsv")
    out = tmp_path / "shards"
    write_tar_shards(demo / "images", out, 100)
    assert [p.name for p in out.iterdir()] == ["shard-000000.tar"]
    with pytest.raises(InvalidArgumentError, match="already holds .tar files"):
        write_tar_shards(demo / "images", out, 100)
    with pytest.raises(InvalidArgumentError, match="items_per_shard must be positive"):
        write_tar_shards(demo / "images", tmp_path / "other", 0)


def test_tar_shards_with_class_names(demo: Path, tmp_path: Path) -> None:
    folder = open_source(demo / "images")
    write_tar_shards(demo / "images", tmp_path / "named", 5, labels="name")
    source = open_source(tmp_path / "named")
    assert source.classes == folder.classes
    assert source.labels.tolist() == folder.labels.tolist()
    with open(tmp_path / "l.tsv", "w") as file:
        file.write("path\tlabel\n")
    with pytest.raises(InvalidArgumentError, match="lists no items"):
        open_source(tmp_path / "l.tsv")


def test_a_nul_byte_in_a_path_is_an_error_naming_it_never_a_valueerror(tmp_path: Path) -> None:
    """os calls raise ValueError on a NUL byte: a read escaped as a traceback blaming the stage,
    and a source path was said not to exist, printed with the raw NUL."""
    from joader.sources.safe_open import open_in_root

    (tmp_path / "a").write_bytes(b"x")
    with pytest.raises(DecodeError, match=r"a<NUL>b: the path holds a NUL byte, which no file name can; fix"):
        open_in_root(tmp_path, "a\0b")
    with pytest.raises(InvalidArgumentError, match=r"source path '.*/a<NUL>b' holds a NUL byte, which no path can"):
        open_source(tmp_path / "a\0b")
