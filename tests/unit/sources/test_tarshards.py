"""Tar-shard sources: WebDataset samples indexed once, read by offset, refused when unsafe."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from joader.errors import DecodeError, InvalidArgumentError
from joader.sources import ItemSource, TarSource, index_tar_shards
from joader.sources.tarshards import _FastTarInfo, split_key

pytestmark = pytest.mark.timeout(120)

Member = tuple[str, bytes] | tarfile.TarInfo


def _tar(path: Path, members: list[Member], fmt: int = tarfile.PAX_FORMAT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=fmt) as archive:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                archive.addfile(member)
                continue
            name, data = member
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _sample(key: str, label: str | int, ext: str = "jpg") -> list[Member]:
    return [(f"{key}.{ext}", f"image {key}".encode()), (f"{key}.cls", str(label).encode())]


def test_order_labels_and_bytes(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    folder_entry = tarfile.TarInfo("train")
    folder_entry.type = tarfile.DIRTYPE
    _tar(
        shards / "b.tar",
        [*_sample("z", 1), ("z.json", b"{}"), *_sample("a", 0, "PNG")],
    )
    _tar(
        shards / "a.tar",
        [folder_entry, *_sample("train/n01_9", 2), *_sample("train/n01_1", 0, "jpeg")],
    )
    (shards / "notes.txt").write_text("not a shard")
    source = index_tar_shards(shards)
    assert isinstance(source, TarSource) and isinstance(source, ItemSource)
    assert source.kind == "tar" and source.root == shards.resolve()
    assert source.shards == ("a.tar", "b.tar")
    # Shards by name, then samples in archive order (not sorted by key).
    assert source.paths == (
        "a.tar/train/n01_9.jpg", "a.tar/train/n01_1.jpeg", "b.tar/z.jpg", "b.tar/a.PNG",
    )  # fmt: skip
    assert source.labels.dtype == np.int32 and source.labels.tolist() == [2, 0, 1, 0]
    assert source.classes == ("0", "1", "2") and source.class_to_idx == {"0": 0, "1": 1, "2": 2}
    assert len(source) == source.num_items == 4 and source.num_skipped == 0
    expected = [b"image train/n01_9", b"image train/n01_1", b"image z", b"image a"]
    assert [source.read(i) for i in range(4)] == expected
    with pytest.raises(InvalidArgumentError, match="out of range"):
        source.read(4)
    again = pickle.loads(pickle.dumps(source))  # a plain value: no descriptors held
    assert again.read(3) == b"image a"


def test_class_names_glob_and_single_shard(tmp_path: Path) -> None:
    _tar(tmp_path / "train-0001.tar", _sample("k1", "zebra") + _sample("k2", "ant"))
    _tar(tmp_path / "train-0000.tar", _sample("k0", "zebra\n"))
    _tar(tmp_path / "val-0000.tar", _sample("v0", "ant"))
    source = index_tar_shards(tmp_path / "train-*.tar")
    assert source.shards == ("train-0000.tar", "train-0001.tar")
    assert source.classes == ("ant", "zebra") and source.class_to_idx == {"ant": 0, "zebra": 1}
    assert source.labels.tolist() == [1, 1, 0]
    single = index_tar_shards(tmp_path / "val-0000.tar")
    assert single.paths == ("val-0000.tar/v0.jpg",) and single.read(0) == b"image v0"


def test_webdataset_keys() -> None:
    assert split_key("a/b.seg.png") == ("a/b", "seg.png")
    assert split_key("dir.v2/x.JPG") == ("dir.v2/x", "JPG")
    assert split_key("noext") == ("noext", "")


def test_samples_without_an_image_are_skipped_and_counted(tmp_path: Path) -> None:
    _tar(
        tmp_path / "s.tar",
        [*_sample("a", 0), ("meta.json", b"{}"), ("meta.cls", b"1"), *_sample("b", 1),
         ("c.seg.png", b"mask"), ("c.cls", b"1")],
    )  # fmt: skip
    source = index_tar_shards(tmp_path)
    assert source.paths == ("s.tar/a.jpg", "s.tar/b.jpg")
    assert source.num_skipped == 2


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_index_matches_tarfile_for_every_format(tmp_path: Path, fmt: int) -> None:
    long_dir = "d" * 90 + "/" + "e" * 40  # ustar: split into prefix and name
    members: list[Member] = []
    for k in range(30):
        key = f"{long_dir}/k{k:03d}" if k % 3 == 0 else f"k{k:03d}"
        if fmt != tarfile.USTAR_FORMAT and k % 5 == 0:
            key = "x" * 120 + f"_{k}_é"  # GNU long names, pax path records
        members += _sample(key, k % 7)
        members.append((f"{key}.txt", b"x" * (k * 37)))
    shard = _tar(tmp_path / "s.tar", members, fmt)
    source = index_tar_shards(shard)
    with tarfile.open(shard) as archive:
        images = [m for m in archive.getmembers() if m.name.endswith(".jpg")]
    assert [p.removeprefix("s.tar/") for p in source.paths] == [m.name for m in images]
    assert source.offsets.tolist() == [m.offset_data for m in images]
    assert source.sizes.tolist() == [m.size for m in images]
    assert source.labels.tolist() == [k % 7 for k in range(30)]


def test_fast_header_parser_equals_tarfiles() -> None:
    def parse(cls: type[tarfile.TarInfo], buf: bytes) -> object:
        try:
            info = cls.frombuf(buf, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            return type(exc)
        return (info.name, info.size, info.type, info.chksum)

    infos = []
    for name, kind, size in [
        ("a.jpg", tarfile.REGTYPE, 1),
        ("p" * 99 + "/" + "n" * 90 + ".jpg", tarfile.REGTYPE, 77),  # ustar prefix + name
        ("x" * 150 + ".jpg", tarfile.REGTYPE, 5),  # GNU long name, pax path record
        ("old/", tarfile.AREGTYPE, 0),  # a V7 folder
        ("new", tarfile.DIRTYPE, 0),
        ("link.jpg", tarfile.SYMTYPE, 0),
        ("é.jpg", tarfile.REGTYPE, 8**11 + 3),  # base-256 size in GNU format
    ]:
        info = tarfile.TarInfo(name)
        info.type, info.size = kind, size
        infos.append(info)
    compared = 0
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        for info in infos:
            try:
                blob = info.tobuf(fmt, "utf-8", "surrogateescape")
            except ValueError:  # too long or too large for ustar
                continue
            for start in range(0, len(blob), 512):  # headers, and long-name data blocks
                buf = blob[start : start + 512]
                assert parse(_FastTarInfo, buf) == parse(tarfile.TarInfo, buf)
                compared += 1
    assert compared > 20
    assert parse(_FastTarInfo, b"\0" * 512) is tarfile.EOFHeaderError
    assert parse(_FastTarInfo, b"garbage".ljust(512, b"!")) is tarfile.InvalidHeaderError


def _index_error(target: Path | str, match: str) -> str:
    with pytest.raises(InvalidArgumentError, match=match) as info:
        index_tar_shards(target)
    return str(info.value)


def test_a_sample_without_a_label(tmp_path: Path) -> None:
    _tar(tmp_path / "s.tar", [*_sample("a", 0), ("b.jpg", b"img"), ("b.json", b"{}")])
    message = _index_error(tmp_path, r"member 'b\.jpg': sample 'b' has no b\.cls member")
    assert str(tmp_path / "s.tar") in message


def test_mixed_label_kinds_name_both_members(tmp_path: Path) -> None:
    _tar(tmp_path / "a.tar", _sample("x", 3))
    _tar(tmp_path / "b.tar", _sample("y", "cat"))
    message = _index_error(tmp_path, "labels mix integers and class names")
    assert "a.tar/x.cls ('3')" in message and "b.tar/y.cls ('cat')" in message


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([("../evil.jpg", b"x"), ("../evil.cls", b"0")], "the name leaves the archive's folder"),
        ([("/etc/evil.jpg", b"x")], "the name leaves the archive's folder"),
        ([("a/../../b.jpg", b"x")], "the name leaves the archive's folder"),
        ([("a.jpg", b"x"), ("a.png", b"y"), ("a.cls", b"0")], "already has the image"),
        ([("a.jpg", b"x"), ("a.cls", b"0"), ("a.cls", b"1")], "second .cls"),
        ([("a.jpg", b"x"), ("a.cls", b"")], "the label is empty"),
        ([("a.jpg", b"x"), ("a.cls", b"-2")], "is signed"),
        ([("a.jpg", b"x"), ("a.cls", b"1\n2")], "several lines"),
        ([("a.txt", b"x"), ("a.cls", b"1")], "hold no sample with an image"),
    ],
)
def test_member_errors(tmp_path: Path, members: list[Member], match: str) -> None:
    _tar(tmp_path / "s.tar", members)
    _index_error(tmp_path, match)


def test_link_members_are_refused(tmp_path: Path) -> None:
    link = tarfile.TarInfo("a.jpg")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/shadow"
    _tar(tmp_path / "s.tar", [link, ("a.cls", b"0")])
    _index_error(tmp_path, r"member 'a\.jpg' is not a plain file")


def test_a_shard_linking_out_of_the_folder(tmp_path: Path) -> None:
    shards, outside = tmp_path / "shards", tmp_path / "outside"
    _tar(shards / "a.tar", _sample("a", 0))
    _tar(outside / "b.tar", _sample("b", 0))
    os.symlink(outside / "b.tar", shards / "b.tar")
    message = _index_error(shards, "resolves outside the source root")
    assert "b.tar" in message
    os.remove(shards / "b.tar")
    os.symlink(shards / "a.tar", shards / "c.tar")  # a link inside the folder is fine
    assert index_tar_shards(shards).paths == ("a.tar/a.jpg", "c.tar/a.jpg")


def test_a_shard_that_is_not_a_tar(tmp_path: Path) -> None:
    _tar(tmp_path / "a.tar", _sample("a", 0))
    (tmp_path / "b.tar").write_bytes(b"this is not a tar archive at all\n" * 40)
    message = _index_error(tmp_path, "is not a tar archive")
    assert str(tmp_path / "b.tar") in message


def test_an_empty_or_folder_shard(tmp_path: Path) -> None:
    (tmp_path / "empty.tar").write_bytes(b"")
    _index_error(tmp_path, "empty.tar is not a tar archive")
    os.remove(tmp_path / "empty.tar")
    (tmp_path / "dir.tar").mkdir()
    _index_error(tmp_path, "it is not a regular file")


def test_a_compressed_shard(tmp_path: Path) -> None:
    raw = _tar(tmp_path / "raw" / "a.tar", _sample("a", 0)).read_bytes()
    (tmp_path / "a.tar").write_bytes(gzip.compress(raw))
    _index_error(tmp_path, "gzip-compressed.*decompress it")
    os.remove(tmp_path / "a.tar")
    (tmp_path / "a.tar.gz").write_bytes(gzip.compress(raw))
    _index_error(tmp_path, "holds only compressed shards")


def test_a_truncated_shard(tmp_path: Path) -> None:
    members = _sample("a", 0) + [("b.jpg", b"y" * 5000), ("b.cls", b"1")]
    blob = _tar(tmp_path / "full" / "s.tar", members).read_bytes()
    (tmp_path / "s.tar").write_bytes(blob[:3000])  # inside b.jpg's data
    _index_error(tmp_path, "past the end of the shard")
    (tmp_path / "s.tar").write_bytes(blob[:1800])  # inside b.jpg's header
    _index_error(tmp_path, "corrupt or truncated")
    garbage = blob[:2048] + b"\x01" * 512 + b"\0" * 1024  # an unreadable header after sample a
    (tmp_path / "s.tar").write_bytes(garbage)
    _index_error(tmp_path, "unreadable tar header at byte")


def test_empty_sources(tmp_path: Path) -> None:
    _index_error(tmp_path, "holds no .tar shards")
    _index_error(tmp_path / "train-*.tar", "matches no file")
    _index_error(tmp_path / "*" / "a.tar", "wildcards are allowed in the file name only")
    _index_error(tmp_path / "missing.tar", "does not exist")


def test_reads_after_the_shard_changed(tmp_path: Path) -> None:
    shard = _tar(tmp_path / "s.tar", _sample("a", 0) + _sample("b", 1))
    source = index_tar_shards(tmp_path)
    assert source.read(1) == b"image b"
    _tar(tmp_path / "s.tar", _sample("b", 1))  # rewritten: offsets no longer hold
    with pytest.raises(DecodeError, match="s.tar/b.jpg: shard .* changed since joaderd indexed"):
        source.read(1)
    os.remove(shard)
    with pytest.raises(DecodeError, match=r"cannot read s\.tar/a\.jpg: .*it no longer exists"):
        source.read(0)


def test_a_shard_rewritten_at_the_same_size_with_its_mtime_put_back_is_seen(tmp_path: Path) -> None:
    """`touch -r` or `rsync -t` after an in-place rewrite: size and mtime as indexed, other bytes."""
    shard = _tar(tmp_path / "s.tar", _sample("a", 0) + _sample("b", 1))
    source = index_tar_shards(tmp_path)
    before = os.stat(shard)
    data = shard.read_bytes()
    shard.write_bytes(data.replace(b"image b", b"IMAGE B"))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(shard).st_size, os.stat(shard).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(DecodeError, match="s.tar/b.jpg: shard .* changed since joaderd indexed"):
        source.read(1)


def test_many_members_index_in_linear_time(tmp_path: Path) -> None:
    members: list[Member] = []
    for k in range(20_000):
        members += _sample(f"{k:06d}", k % 100)
    _tar(tmp_path / "s.tar", members, tarfile.GNU_FORMAT)
    source = index_tar_shards(tmp_path)
    assert len(source) == 20_000 and source.labels[-1] == 99
    assert source.read(12_345) == b"image 012345"


def test_a_large_cls_label_costs_one_class_and_one_beyond_int32_is_a_clear_error(tmp_path: Path) -> None:
    """A .cls label of 10,000,000 once built ten million class names (1.3 GB, 7 s)."""
    _tar(tmp_path / "s" / "a.tar", [("x.jpg", b"x"), ("x.cls", b"10000000"), ("y.jpg", b"y"), ("y.cls", b"4")])
    source = index_tar_shards(tmp_path / "s")
    assert source.classes == ("4", "10000000") and source.labels.tolist() == [10_000_000, 4]
    assert source.class_to_idx == {"4": 4, "10000000": 10_000_000}
    _tar(tmp_path / "t" / "a.tar", [("x.jpg", b"x"), ("x.cls", b"1" + b"0" * 23)])
    with pytest.raises(InvalidArgumentError, match=r"is too large \(at most 2147483647\); number classes from 0"):
        index_tar_shards(tmp_path / "t")


def _huge_size_member(name: str, size: int) -> bytes:
    """A GNU header claiming `size` bytes (base-256 past 8**11), with no data after it."""
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(tarfile.GNU_FORMAT)


@pytest.mark.parametrize("size", [2**70, 2**62, 2**40])
def test_a_corrupt_size_in_an_ignored_member_is_a_clear_error(tmp_path: Path, size: int) -> None:
    """2**70 in a `.json` member escaped as a raw ValueError from tarfile's seek past it."""
    shard = _tar(tmp_path / "s" / "a.tar", _sample("x", 1))
    data = shard.read_bytes().rstrip(b"\0")
    data += b"\0" * (-len(data) % 512) + _huge_size_member("x.json", size) + b"\0" * 1024
    shard.write_bytes(data)
    with pytest.raises(InvalidArgumentError, match=r"member 'x.json': its data ends at byte \d+, past the end of "
                                                   r"the shard \(\d+ bytes\); the shard is truncated or corrupt"):
        index_tar_shards(tmp_path / "s")


def test_cls_labels_drop_a_byte_order_mark_and_keep_zero_padding_as_their_value(tmp_path: Path) -> None:
    """A .cls saved by a Windows editor was the class name '\\ufeff1'; 13 digits were "too large"."""
    _tar(tmp_path / "s" / "a.tar", [("x.jpg", b"x"), ("x.cls", b"\xef\xbb\xbf1\r\n"),
                                    ("y.jpg", b"y"), ("y.cls", b"0000000000001"), ("z.jpg", b"z"), ("z.cls", b"4")])
    source = index_tar_shards(tmp_path / "s")
    assert source.labels.tolist() == [1, 1, 4] and source.classes == ("1", "4")


def test_a_nul_byte_in_a_cls_label_is_refused(tmp_path: Path) -> None:
    _tar(tmp_path / "s.tar", [("a.jpg", b"x"), ("a.cls", b"1\0")])
    _index_error(tmp_path, r"member 'a.cls': the label .* holds a NUL byte; a .cls member holds one class number")
