"""List-file sources: .tsv/.csv lines of path and label, line order, errors naming the line."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from joader.errors import DecodeError, InvalidArgumentError
from joader.sources import ItemSource, ListSource, read_list_file
from joader.sources.base import PackedPaths

pytestmark = pytest.mark.timeout(120)


def _files(root: Path, *relative: str) -> None:
    for rel in relative:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"bytes of {rel}".encode())


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_tsv_with_integer_labels(tmp_path: Path) -> None:
    _files(tmp_path, "img/b.jpg", "img/a.png", "other/c.jpeg")
    listed = _write(
        tmp_path / "train.tsv", "path\tlabel\nimg/b.jpg\t2\n\nimg/a.png\t0\nother/c.jpeg\t 5 \n"
    )
    source = read_list_file(listed)
    assert isinstance(source, ListSource) and isinstance(source, ItemSource)
    assert source.kind == "list"
    assert source.root == listed.resolve() and source.folder == tmp_path.resolve()
    assert source.paths == ("img/b.jpg", "img/a.png", "other/c.jpeg")  # line order, not sorted
    assert source.labels.dtype == np.int32 and source.labels.tolist() == [2, 0, 5]
    assert source.classes == ("0", "2", "5")  # the labels that occur, delivered as written
    assert source.class_to_idx == {"0": 0, "2": 2, "5": 5}
    assert len(source) == source.num_items == 3 and source.num_skipped == 0
    for item_id, rel in enumerate(source.paths):
        assert source.read(item_id) == (tmp_path / rel).read_bytes()
    with pytest.raises(InvalidArgumentError, match="out of range"):
        source.read(3)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        source.read(-1)


def test_class_names_are_sorted_like_imagefolder(tmp_path: Path) -> None:
    _files(tmp_path, "x/1.jpg", "x/2.jpg", "x/3.jpg")
    listed = _write(tmp_path / "l.tsv", "x/1.jpg\tzebra\nx/2.jpg\tant\nx/3.jpg\tzebra\n")
    source = read_list_file(listed)
    assert source.classes == ("ant", "zebra")
    assert source.class_to_idx == {"ant": 0, "zebra": 1}
    assert source.labels.tolist() == [1, 0, 1]


def test_csv_quoting_crlf_and_bom(tmp_path: Path) -> None:
    _files(tmp_path, "d/a,b.jpg", 'd/q"uote.jpg', "d/plain.jpg")
    listed = tmp_path / "l.csv"
    listed.write_bytes(
        b'\xef\xbb\xbfpath,label\r\n"d/a,b.jpg",1\r\n"d/q""uote.jpg",0\r\nd/plain.jpg,1\r\n'
    )
    source = read_list_file(listed)
    assert source.paths == ("d/a,b.jpg", 'd/q"uote.jpg', "d/plain.jpg")
    assert source.labels.tolist() == [1, 0, 1]
    assert source.read(0) == b"bytes of d/a,b.jpg"


def test_undecodable_file_names_are_kept(tmp_path: Path) -> None:
    raw = os.fsencode(tmp_path) + b"/caf\xe9.jpg"
    with open(raw, "wb") as file:
        file.write(b"latin-1 name")
    listed = tmp_path / "l.tsv"
    listed.write_bytes(b"caf\xe9.jpg\t0\n")
    source = read_list_file(listed)
    assert source.read(0) == b"latin-1 name"


def test_paths_are_relative_to_the_list_files_folder(tmp_path: Path) -> None:
    _files(tmp_path, "data/x.jpg", "x.jpg")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _write(tmp_path / "data/l.tsv", "x.jpg\t0\n")
    os.symlink(tmp_path / "data", elsewhere / "data")
    source = read_list_file(elsewhere / "data" / "l.tsv")  # a folder link: resolved
    assert source.folder == (tmp_path / "data").resolve()
    assert source.read(0) == b"bytes of data/x.jpg"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a.jpg\t1\nb.jpg\t2\textra\n", r"line 2: expected 2 fields \(path and label\), found 3"),
        ("a.jpg\t1\n\n\nb.jpg\n", "line 4: expected 2 fields"),
        ("a.jpg\t1\n\tb\n", "line 2: the path is empty"),
        ("a.jpg\t1\n/etc/passwd.jpg\t1\n", "line 2: path '/etc/passwd.jpg' is absolute"),
        ("a.jpg\t1\nx/../../secret.jpg\t1\n", r"line 2: path 'x/../../secret.jpg' leaves"),
        ("a.jpg\t1\nb.jpg\t\n", "line 2: the label is empty"),
        ("a.jpg\t1\nb.jpg\t-1\n", "line 2: label '-1' is signed"),
        ("a.jpg\t1\nb.jpg\t99999999999\n", "line 2: label 99999999999 is too large"),
        ("", "lists no items"),
        ("path\tlabel\n\n", "lists no items"),
    ],
)
def test_errors_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    listed = _write(tmp_path / "l.tsv", text)
    with pytest.raises(InvalidArgumentError, match=message) as info:
        read_list_file(listed)
    assert str(listed.resolve()) in str(info.value)


def test_mixed_integers_and_names_name_both_lines(tmp_path: Path) -> None:
    listed = _write(tmp_path / "l.tsv", "a.jpg\t0\n\nb.jpg\t1\nc.jpg\tcat\nd.jpg\t2\n")
    with pytest.raises(InvalidArgumentError, match="labels mix integers and class names") as info:
        read_list_file(listed)
    message = str(info.value)
    assert "line 1 has the integer label '0'" in message
    assert "line 4 the class name 'cat'" in message  # counted across the blank line
    assert message.endswith("write every label as a class number or every label as a class name")


def test_an_unknown_header_is_pointed_at(tmp_path: Path) -> None:
    listed = _write(tmp_path / "l.tsv", "filename\tclass\na.jpg\t0\n")
    with pytest.raises(InvalidArgumentError, match="a header line must be exactly"):
        read_list_file(listed)


def test_csv_bad_quoting_names_the_line(tmp_path: Path) -> None:
    listed = _write(tmp_path / "l.csv", 'a.jpg,1\n"b.jpg"x,1\n')
    with pytest.raises(InvalidArgumentError, match="line 2"):
        read_list_file(listed)


def test_a_tsv_is_not_split_on_commas(tmp_path: Path) -> None:
    listed = _write(tmp_path / "l.tsv", "a,b.jpg\t3\n")
    assert read_list_file(listed).paths == ("a,b.jpg",)


@pytest.mark.parametrize("setup", ["missing", "folder", "suffix"])
def test_bad_list_file_paths(tmp_path: Path, setup: str) -> None:
    if setup == "folder":
        (tmp_path / "l.tsv").mkdir()
        path, message = tmp_path / "l.tsv", "not a regular file"
    elif setup == "suffix":
        path, message = _write(tmp_path / "l.txt", "a.jpg\t1\n"), "must end in .tsv"
    else:
        path, message = tmp_path / "l.tsv", "does not exist"
    with pytest.raises(InvalidArgumentError, match=message):
        read_list_file(path)


def test_read_of_a_removed_file_names_it(tmp_path: Path) -> None:
    _files(tmp_path, "a.jpg", "b.jpg")
    source = read_list_file(_write(tmp_path / "l.tsv", "a.jpg\t0\nb.jpg\t1\n"))
    os.remove(tmp_path / "b.jpg")
    assert source.read(0) == b"bytes of a.jpg"
    with pytest.raises(DecodeError, match=r"b\.jpg: it no longer exists"):
        source.read(1)


def test_read_never_follows_a_link_out_of_the_folder(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    _files(outside, "secret.jpg")
    root.mkdir()
    os.symlink(outside / "secret.jpg", root / "leak.jpg")
    source = read_list_file(_write(root / "l.tsv", "leak.jpg\t0\n"))
    with pytest.raises(DecodeError, match="resolves outside the source root"):
        source.read(0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_read_of_an_unreadable_file_says_permission(tmp_path: Path) -> None:
    _files(tmp_path, "a.jpg")
    source = read_list_file(_write(tmp_path / "l.tsv", "a.jpg\t0\n"))
    os.chmod(tmp_path / "a.jpg", 0)
    with pytest.raises(DecodeError, match="permission denied"):
        source.read(0)


def test_a_large_list_is_read_in_linear_time(tmp_path: Path) -> None:
    count = 300_000
    listed = tmp_path / "big.tsv"
    with open(listed, "w") as file:
        file.write("path\tlabel\n")
        file.writelines(f"n{i % 1000:08d}/img_{i}.JPEG\tn{i % 1000:08d}\n" for i in range(count))
    start = time.perf_counter()
    source = read_list_file(listed)
    elapsed = time.perf_counter() - start
    assert len(source) == count and len(source.classes) == 1000
    assert source.labels[1234] == 234 and source.paths[-1] == f"n00000999/img_{count - 1}.JPEG"
    assert isinstance(source.paths, PackedPaths) and source.labels.dtype == np.int32
    assert elapsed < 10, f"{count} lines took {elapsed:.1f} s"


@pytest.mark.parametrize("label", ["10000000", "2147483647"])
def test_a_large_integer_label_costs_one_class_not_millions(tmp_path: Path, label: str) -> None:
    """One label of 10,000,000 once built ten million class names (1.3 GB, 7 s)."""
    _files(tmp_path, "a.jpg", "b.jpg")
    source = read_list_file(_write(tmp_path / "l.tsv", f"a.jpg\t{label}\nb.jpg\t3\n"))
    assert source.classes == ("3", label) and source.labels.tolist() == [int(label), 3]


@pytest.mark.parametrize("label", ["2147483648", "100000000000000000000000", "9" * 5000])
def test_a_label_beyond_int32_is_a_clear_error(tmp_path: Path, label: str) -> None:
    _files(tmp_path, "a.jpg")
    with pytest.raises(InvalidArgumentError, match=r"line 1: label .* is too large \(at most 2147483647\); number classes from 0"):
        read_list_file(_write(tmp_path / "l.tsv", f"a.jpg\t{label}\n"))


def test_a_nul_byte_in_a_path_is_refused_at_listing(tmp_path: Path) -> None:
    """It passed the listing, then every read logged a traceback that blamed the stage."""
    _files(tmp_path, "a.jpg")
    listed = tmp_path / "l.tsv"
    listed.write_bytes(b"a.jpg\t0\nb\x00c.jpg\t1\n")
    with pytest.raises(InvalidArgumentError, match=r"line 2: the path .* holds a NUL byte"):
        read_list_file(listed)


@pytest.mark.parametrize("sep", ["\t", ","])
def test_a_nul_byte_in_a_label_is_refused_naming_the_line(tmp_path: Path, sep: str) -> None:
    """It became a class name `'1\\x00'`, or one side of a confusing "labels mix" error."""
    _files(tmp_path, "a.jpg", "b.jpg")
    listed = tmp_path / ("l.tsv" if sep == "\t" else "l.csv")
    listed.write_bytes(f"a.jpg{sep}0\nb.jpg{sep}1\0\n".encode())
    with pytest.raises(InvalidArgumentError, match=r"line 2: the label .* holds a NUL byte; fix that line"):
        read_list_file(listed)


@pytest.mark.parametrize("path", ["img/", ".", "img/."])
def test_a_path_naming_a_folder_is_refused_at_listing(tmp_path: Path, path: str) -> None:
    """It passed the listing, then every read failed as a file "outside the source root"."""
    _files(tmp_path, "img/a.jpg")
    listed = _write(tmp_path / "l.tsv", f"img/a.jpg\t0\n{path}\t1\n")
    with pytest.raises(InvalidArgumentError, match=r"line 2: path .* names a folder, not a file; list each image"):
        read_list_file(listed)


def test_a_file_name_ending_in_a_dot_is_a_file(tmp_path: Path) -> None:
    _files(tmp_path, "a.", "b..jpg")
    source = read_list_file(_write(tmp_path / "l.tsv", "a.\t0\nb..jpg\t1\n"))
    assert source.read(0) == b"bytes of a." and source.read(1) == b"bytes of b..jpg"


def test_zero_padded_labels_are_their_value(tmp_path: Path) -> None:
    """Thirteen digits or more were taken for a label beyond int32, whatever their value."""
    _files(tmp_path, "a.jpg", "b.jpg", "c.jpg")
    padded = "0" * 12 + "7"
    source = read_list_file(_write(tmp_path / "l.tsv", f"a.jpg\t{padded}\nb.jpg\t007\nc.jpg\t{'0' * 5000}3\n"))
    assert source.labels.tolist() == [7, 7, 3]
    assert source.classes == ("3", "7") and source.class_to_idx == {"3": 3, "7": 7}


def test_labels_are_stripped_and_duplicate_paths_are_separate_items(tmp_path: Path) -> None:
    """A path listed twice is two items (oversampling, or one image under two labels)."""
    _files(tmp_path, "a.jpg", "b.jpg")
    source = read_list_file(_write(tmp_path / "l.csv", "a.jpg, 1\nb.jpg,2 \na.jpg,\t5\n"))
    assert source.paths == ("a.jpg", "b.jpg", "a.jpg") and source.labels.tolist() == [1, 2, 5]
    assert source.read(0) == source.read(2) == b"bytes of a.jpg"
