"""Stamps of a source on disk and their verdicts (joader/sources/watch.py): the comparison is
pure; `take_stamp` reads the disk."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from joader.errors import DecodeError
from joader.sources.imagefolder import list_image_folder
from joader.sources.safe_open import open_in_root, root_identity
from joader.sources.watch import (
    Stamp,
    VerdictKind,
    compare,
    is_read_error,
    take_stamp,
    watch_targets,
)

pytestmark = pytest.mark.timeout(60)

LISTED = Stamp(root=(1, 10), folders=((1, 20, 5), (1, 21, 5)), files=((30, 100, 7), (31, 200, 7), (32, 300, 7)))


# ----------------------------------------------------------------------------- compare (pure)

def test_the_same_stamp_is_ok() -> None:
    assert compare(LISTED, LISTED).kind is VerdictKind.OK


def test_folder_mtimes_and_a_missing_file_are_not_a_change() -> None:
    """Files added or removed change a class folder's mtime; a removed file is a per-item
    failure, not another dataset."""
    now = Stamp(root=(1, 10), folders=((1, 20, 99), (1, 21, 5)), files=((30, 100, 7), None, (32, 300, 7)))
    assert compare(LISTED, now).kind is VerdictKind.OK


def test_a_root_gone_or_every_sampled_file_gone_is_away() -> None:
    assert compare(LISTED, Stamp(None, (None, None), (None, None, None))).kind is VerdictKind.AWAY
    empty_mount = Stamp((2, 99), (None, None), (None, None, None))
    assert compare(LISTED, empty_mount).kind is VerdictKind.AWAY


def test_another_folder_or_other_files_are_a_change() -> None:
    replaced = compare(LISTED, Stamp((1, 11), LISTED.folders, LISTED.files))
    assert replaced.kind is VerdictKind.CHANGED and replaced.root_replaced
    assert "another folder is at its path" in replaced.describe()
    resized = compare(LISTED, Stamp((1, 10), LISTED.folders, ((30, 100, 7), (31, 201, 7), (33, 300, 8))))
    assert resized.kind is VerdictKind.CHANGED and resized.files_differ == 2
    assert resized.describe() == "2 of 3 sampled files differ"
    folder = compare(LISTED, Stamp((1, 10), ((1, 20, 5), (1, 22, 5)), LISTED.files))
    assert folder.kind is VerdictKind.CHANGED and folder.folders_replaced == 1


def test_one_file_edited_or_a_broken_file_fixed_is_not_a_change() -> None:
    """One differing file is that file's business (as before); files whose item failed since
    the listing are left out (`ignore`): a broken file fixed on disk is served again."""
    one = compare(LISTED, Stamp((1, 10), LISTED.folders, ((30, 100, 7), (31, 201, 7), (32, 300, 7))))
    assert one.kind is VerdictKind.OK and one.differing == (1,)
    two = Stamp((1, 10), LISTED.folders, ((30, 100, 7), (31, 201, 7), (32, 301, 7)))
    assert compare(LISTED, two).kind is VerdictKind.CHANGED
    assert compare(LISTED, two, frozenset({2})).kind is VerdictKind.OK


def test_read_errors_are_told_from_stage_and_pool_failures() -> None:
    assert is_read_error("cannot read /d/a/1.jpg: it no longer exists; ...")
    assert not is_read_error("cannot prepare /d/a/1.jpg: truncated")
    assert not is_read_error("stage resize:8 failed on x: ValueError")
    assert not is_read_error(None)


# ----------------------------------------------------------------------------- stamps on disk

def _folder(root: Path, seed: int) -> Path:
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for i in range(5):
            (root / name / f"{i}.jpg").write_bytes(bytes([seed]) * (10 + i))
    return root


def test_targets_are_drawn_with_the_given_rng(tmp_path: Path) -> None:
    listing = list_image_folder(_folder(tmp_path / "d", 1))
    first = watch_targets(listing, random.Random(5), max_files=4)
    assert first == watch_targets(listing, random.Random(5), max_files=4)
    assert len(first.files) == 4 and len(first.folders) == 2
    assert all(path.startswith(str(listing.root)) for path in first.files)


def test_a_folder_renamed_away_then_back_and_one_replaced(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", 1)
    targets = watch_targets(list_image_folder(root), random.Random(0))
    listed = take_stamp(targets)
    root.rename(tmp_path / "away")
    assert compare(listed, take_stamp(targets)).kind is VerdictKind.AWAY
    (tmp_path / "away").rename(root)
    assert compare(listed, take_stamp(targets)).kind is VerdictKind.OK
    root.rename(tmp_path / "old")
    _folder(root, 2)  # the same layout, other bytes
    verdict = compare(listed, take_stamp(targets))
    assert verdict.kind is VerdictKind.CHANGED and verdict.root_replaced


def test_reads_refuse_a_root_replaced_since_listing(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", 1)
    listing = list_image_folder(root)
    assert listing.root_id == root_identity(root)
    assert listing.read(0) == bytes([1]) * 10
    root.rename(tmp_path / "away")
    with pytest.raises(DecodeError, match="is gone") as gone:
        listing.read(0)
    assert is_read_error(str(gone.value))
    _folder(root, 2)
    with pytest.raises(DecodeError, match="was replaced since joaderd listed it") as replaced:
        listing.read(0)
    assert is_read_error(str(replaced.value)) and "another name" in str(replaced.value)
    fd = open_in_root(root, "a/0.jpg")  # without the listed identity: reads what is there
    os.close(fd)
