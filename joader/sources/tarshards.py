"""A source of WebDataset-style `.tar` shards, indexed once and read by offset.

Given a folder (its `*.tar` files), one `.tar` file, or a glob whose file name has wildcards
(`/data/shards/train-*.tar`), the shards are sorted by name and each is indexed once, when the
source is opened: only the tar headers are parsed (tarfile), and each sample's image is
remembered as (shard, data offset, size). A read is then one `os.pread` of exactly the image's
bytes, on a shard opened through `safe_open.open_in_root`.

WebDataset convention: a sample is a run of consecutive members sharing a key, where a member
name is `KEY.EXT` and the extension starts at the first dot of the file name
(`train/n0144_10026.JPEG` has key `train/n0144_10026`, extension `JPEG`). A sample needs
exactly one image member (an ImageFolder image extension, any case) and one `KEY.cls` member
holding its label, UTF-8 text (a byte-order mark and surrounding spaces are dropped; a NUL byte,
an empty label or several lines are errors). Labels are all integers or all class names, as in
a list file (`listfile.py`): integers are class numbers 0..2**31-1 without a sign, delivered as
written, and the classes are the distinct integers that occur, in numeric order, each mapped to
itself; class names are sorted into classes and a label is its index, as ImageFolder numbers
class folders. Other members (`.json`, `.txt` ...) and folder entries are ignored; a sample
without an image is skipped and counted.

Item id = shards in name order, then samples in archive order. `paths[i]` is
`<shard name>/<image member name>`.

Safety: shards must be regular files inside the shard folder (a symlink to a file elsewhere, a
FIFO or a folder named `x.tar` is refused); member names must be relative and stay inside the
archive (no `/...`, no `..`); image and label members must be plain regular members (not links,
not sparse). Compressed shards (`.tar.gz`) cannot be read by offset and are refused with the fix.
A shard rewritten after indexing (its size or mtime changed) fails its reads with a DecodeError
rather than returning the bytes of some other member.

Indexing is linear in the members. tarfile's header parsing costs about 20 us per member; the
common header (a ustar or GNU header of a regular file or folder) is parsed here by a faster
`TarInfo.frombuf` with the same results, everything else (pax and GNU long names, links, sparse
files, base-256 sizes, signed checksums) by tarfile's own.
"""

from __future__ import annotations

import glob
import logging
import os
import stat
import tarfile
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from joader.errors import DecodeError, InvalidArgumentError
from joader.sources.base import MAX_LABEL, ListedItems, PackedPaths, check_item_id, int_label
from joader.sources.imagefolder import IMG_EXTENSIONS
from joader.sources.safe_open import display_path, open_in_root

__all__ = ["IMAGE_EXTS", "TarSource", "index_tar_shards", "split_key"]

logger = logging.getLogger(__name__)

IMAGE_EXTS: frozenset[str] = frozenset(ext.lstrip(".") for ext in IMG_EXTENSIONS)
LABEL_EXT = "cls"
_MAX_LABEL_BYTES = 1024
_HINT = (
    "expected WebDataset shards: uncompressed .tar files whose members are KEY.jpg (or .png, "
    ".webp, ...) and KEY.cls holding the label (an integer or a class name)"
)


@dataclass(frozen=True, eq=False)
class TarSource(ListedItems):
    """The samples of a set of tar shards: an index of (shard, offset, size), labels, classes."""

    kind: ClassVar[str] = "tar"
    root: Path  # the resolved shard folder
    shards: tuple[str, ...]  # shard file names inside root, sorted
    classes: tuple[str, ...]
    class_to_idx: dict[str, int]
    paths: PackedPaths  # "<shard>/<image member>"; item id = position
    labels: np.ndarray  # int32, one per item
    shard_ids: np.ndarray  # int32: the shard (index into `shards`) of each item
    offsets: np.ndarray  # int64: where the image's data starts in its shard
    sizes: np.ndarray  # int64: the image's size in bytes
    # (st_size, st_mtime_ns, st_ctime_ns) of each shard when indexed. NOTE: the ctime too, because
    # a shard rewritten in place at the same size with its mtime put back (`touch -r`, rsync -t)
    # kept its stamp and served new pixels beside cached old ones; no one can set a ctime back.
    shard_stamps: tuple[tuple[int, int, int], ...]
    num_skipped: int = field(default=0)  # samples without an image member

    def read(self, item_id: int) -> bytes:
        """The image member's bytes, read by offset. DecodeError with the reason and the fix."""
        item_id = check_item_id(self, item_id)
        shard_id = int(self.shard_ids[item_id])
        shard = self.shards[shard_id]
        name = display_path(self.paths[item_id])
        try:
            fd = open_in_root(self.root, shard)
        except DecodeError as exc:
            raise DecodeError(f"cannot read {name}: {exc}") from None
        try:
            info = os.fstat(fd)
            if (info.st_size, info.st_mtime_ns, info.st_ctime_ns) != self.shard_stamps[shard_id]:
                raise DecodeError(
                    f"cannot read {name}: shard {display_path(self.root / shard)} changed since "
                    "joaderd indexed it (its size, modification or change time differs); restart joaderd "
                    "to index it again"
                )
            size = int(self.sizes[item_id])
            data = os.pread(fd, size, int(self.offsets[item_id]))
            if len(data) != size:
                raise DecodeError(
                    f"cannot read {name}: shard {display_path(self.root / shard)} ended after "
                    f"{len(data)} of the member's {size} bytes (truncated since joaderd indexed "
                    "it); restart joaderd to index it again"
                )
            return data
        except OSError as exc:
            raise DecodeError(
                f"cannot read {name}: {exc.strerror or exc}; check the shard "
                f"{display_path(self.root / shard)} and the storage it is on"
            ) from None
        finally:
            os.close(fd)


def split_key(member_name: str) -> tuple[str, str]:
    """(key, extension) of a member name, WebDataset's way: the extension starts at the first
    dot of the file name (`a/b.seg.png` -> (`a/b`, `seg.png`)); (name, "") without a dot."""
    folder, _, base = member_name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), (ext if dot else "")


def index_tar_shards(path: str | os.PathLike[str]) -> TarSource:
    """Index the shards of a folder, one `.tar` file, or a glob. InvalidArgumentError if bad."""
    root, names = _find_shards(Path(path).expanduser())
    index = _Index(root)
    for shard_id, shard in enumerate(names):
        index.add_shard(shard_id, shard)
    if not index.paths:
        raise InvalidArgumentError(
            f"the {len(names)} shard(s) in {display_path(root)} hold no sample with an image "
            f"member (image extensions: {' '.join(sorted(IMAGE_EXTS))}); {_HINT}"
        )
    if index.num_skipped:
        logger.warning(
            "tar shards in %s: skipped %d samples without an image member (first: %s)",
            display_path(root), index.num_skipped, index.first_skipped,
        )  # fmt: skip
    classes, class_to_idx, labels = index.labels()
    return TarSource(
        root=root,
        shards=tuple(names),
        classes=classes,
        class_to_idx=class_to_idx,
        paths=PackedPaths(index.paths),
        labels=labels,
        shard_ids=np.frombuffer(index.shard_ids, dtype=np.int32).copy(),
        offsets=np.frombuffer(index.offsets, dtype=np.int64).copy(),
        sizes=np.frombuffer(index.sizes, dtype=np.int64).copy(),
        shard_stamps=tuple(index.stamps),
        num_skipped=index.num_skipped,
    )


def _find_shards(given: Path) -> tuple[Path, list[str]]:
    """(the resolved shard folder, the shard file names in it, sorted)."""
    text = str(given)
    if os.path.isdir(given):
        folder = given
        try:
            names = [
                entry.name
                for entry in os.scandir(folder)
                if entry.name.lower().endswith(".tar") and not entry.name.startswith(".")
            ]
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot list shard folder {display_path(folder)}: {exc.strerror or exc}; check "
                "that joaderd's user may read it"
            ) from None
        if not names:
            compressed = sorted(
                e.name for e in os.scandir(folder) if e.name.lower().endswith((".tar.gz", ".tgz"))
            )
            if compressed:
                raise InvalidArgumentError(
                    f"shard folder {display_path(folder)} holds only compressed shards (e.g. "
                    f"{display_path(compressed[0])}); joader reads members by offset, which needs "
                    "uncompressed .tar files - decompress them (gunzip)"
                )
            raise InvalidArgumentError(
                f"folder {display_path(folder)} holds no .tar shards; {_HINT}"
            )
    elif glob.has_magic(text) and not os.path.lexists(given):
        folder = given.parent
        if glob.has_magic(str(folder)):
            raise InvalidArgumentError(
                f"shard glob {display_path(given)}: wildcards are allowed in the file name only "
                "(all shards in one folder); give e.g. '/data/shards/train-*.tar'"
            )
        if not folder.is_dir():
            raise InvalidArgumentError(
                f"shard glob {display_path(given)}: folder {display_path(folder)} does not exist; "
                "fix the path"
            )
        names = [
            name
            for name in glob.glob(given.name, root_dir=folder)
            if not os.path.isdir(os.path.join(folder, name))
        ]
        if not names:
            raise InvalidArgumentError(
                f"shard glob {display_path(given)} matches no file; check the pattern (e.g. "
                "'/data/shards/train-*.tar')"
            )
    else:
        if not os.path.lexists(given):
            raise InvalidArgumentError(f"shard path {display_path(given)} does not exist; {_HINT}")
        folder, names = given.parent, [given.name]
    return folder.resolve(), sorted(names)


class _Index:
    """The index under construction, shard by shard."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: list[str] = []
        # Compact columns: a million items cost 8 bytes each per column, not a Python int each.
        self.label_codes = array("i")  # per item: the code of its label text
        self.label_texts: dict[str, int] = {}  # label text -> code, in order of first use
        self.shard_ids = array("i")
        self.offsets = array("q")
        self.sizes = array("q")
        self.stamps: list[tuple[int, int, int]] = []
        self.num_skipped = 0
        self.first_skipped = ""
        self._first_int: str | None = None  # "shard/member" of the first integer label
        self._first_name: str | None = None  # and of the first class name

    def add_shard(self, shard_id: int, shard: str) -> None:
        where = display_path(self.root / shard)
        try:
            fd = open_in_root(self.root, shard)  # regular, inside the folder, not a FIFO
        except DecodeError as exc:
            raise InvalidArgumentError(f"shard {where}: {exc}") from None
        try:
            info = os.fstat(fd)
            self.stamps.append((info.st_size, info.st_mtime_ns, info.st_ctime_ns))
            with open(fd, "rb", closefd=False) as file:
                self._members(shard_id, shard, fd, file, info)
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot read shard {where}: {exc.strerror or exc}; check the file and the "
                "storage it is on"
            ) from None
        finally:
            os.close(fd)

    def _members(
        self, shard_id: int, shard: str, fd: int, file: object, info: os.stat_result
    ) -> None:
        where = display_path(self.root / shard)
        if not stat.S_ISREG(info.st_mode):  # open_in_root checked it; keep the invariant local
            raise InvalidArgumentError(f"shard {where} is not a regular file; {_HINT}")
        head = os.pread(fd, 2, 0)
        if head == b"\x1f\x8b":
            raise InvalidArgumentError(
                f"shard {where} is gzip-compressed; joader reads members by offset, which needs "
                "an uncompressed .tar - decompress it (gunzip) or write shards without compression"
            )
        try:
            archive = tarfile.open(fileobj=file, mode="r:", tarinfo=_FastTarInfo)  # type: ignore[call-overload]
        except tarfile.ReadError as exc:
            raise InvalidArgumentError(
                f"shard {where} is not a tar archive ({exc}); {_HINT}"
            ) from None
        sample = _Sample(self, shard_id, shard)
        try:
            while True:
                member = archive.next()
                if member is None:
                    break
                archive.members.clear()  # tarfile keeps every header otherwise: O(members) memory
                sample.add(member, fd, info.st_size)
        except tarfile.TarError as exc:
            raise InvalidArgumentError(
                f"shard {where} is corrupt or truncated after {self._count_in(shard_id)} samples "
                f"({exc}); rewrite or re-download it"
            ) from None
        sample.finish()
        end = archive.offset
        tail = os.pread(fd, min(max(info.st_size - end, 0), 1 << 20), end)
        if tail.strip(b"\0"):
            raise InvalidArgumentError(
                f"shard {where}: unreadable tar header at byte {end} (after "
                f"{self._count_in(shard_id)} samples): the shard is corrupt or truncated; rewrite "
                "or re-download it"
            )

    def _count_in(self, shard_id: int) -> int:
        count = 0
        for sid in reversed(self.shard_ids):
            if sid != shard_id:
                break
            count += 1
        return count

    def add_item(
        self, shard_id: int, path: str, offset: int, size: int, label: str, where: str
    ) -> None:
        is_int = label.isascii() and label.isdigit()
        if is_int and self._first_int is None:
            self._first_int = f"{where} ({label!r})"
        elif not is_int and self._first_name is None:
            self._first_name = f"{where} ({display_path(label)!r})"
        if self._first_int is not None and self._first_name is not None:
            raise InvalidArgumentError(
                f"tar shards in {display_path(self.root)}: labels mix integers and class names - "
                f"{self._first_int} is an integer, {self._first_name} a class name; write every "
                ".cls as a class number or every .cls as a class name"
            )
        self.paths.append(path)
        self.label_codes.append(self.label_texts.setdefault(label, len(self.label_texts)))
        self.shard_ids.append(shard_id)
        self.offsets.append(offset)
        self.sizes.append(size)

    def labels(self) -> tuple[tuple[str, ...], dict[str, int], np.ndarray]:
        """(classes, class_to_idx, int32 labels): integers as they are (classes: the distinct
        integers that occur, each mapped to itself), names by sorted rank."""
        texts = list(self.label_texts)  # by code
        codes = np.frombuffer(self.label_codes, dtype=np.int32)
        if self._first_name is None:  # all integers
            values = [int_label(text) for text in texts]
            top = max(values)
            if top > MAX_LABEL:
                where = self.paths[int(np.argmax(codes == values.index(top)))]
                raise InvalidArgumentError(
                    f"tar shards in {display_path(self.root)}: label {texts[values.index(top)][:40]} of "
                    f"{display_path(where)} is too large (at most {MAX_LABEL}); number classes "
                    "from 0"
                )
            # The classes that occur, not 0..top: one label of 10,000,000 once built ten
            # million class names (1.3 GB) and an Attach reply nobody could receive.
            distinct = sorted(set(values))
            classes = tuple(str(k) for k in distinct)
            class_to_idx = dict(zip(classes, distinct, strict=True))
            by_code = np.asarray(values, dtype=np.int32)
        else:
            classes = tuple(sorted(texts))
            rank = {c: k for k, c in enumerate(classes)}
            by_code = np.asarray([rank[text] for text in texts], dtype=np.int32)
            class_to_idx = rank
        return classes, class_to_idx, by_code[codes]


class _Sample:
    """Groups consecutive members with the same key into one sample (WebDataset's rule)."""

    def __init__(self, index: _Index, shard_id: int, shard: str) -> None:
        self.index = index
        self.shard_id = shard_id
        self.shard = shard
        self.where = display_path(index.root / shard)
        self.key: str | None = None
        self.image: tarfile.TarInfo | None = None
        self.label: str | None = None
        self.first_member = ""

    def add(self, member: tarfile.TarInfo, fd: int, shard_size: int) -> None:
        name = member.name
        _check_name(name, self.where)
        if member.isdir():
            return
        if _has_data(member) and member.offset_data + member.size > shard_size:
            # Every member with data, read or not: tarfile seeks past it, and a corrupt size
            # (base-256, 2**70) in an ignored member once escaped as a raw ValueError.
            raise InvalidArgumentError(
                f"{self._what(name)}: its data ends at byte "
                f"{member.offset_data + member.size}, past the end of the shard ({shard_size} "
                "bytes); the shard is truncated or corrupt - rewrite or re-download it"
            )
        key, ext = split_key(name)
        if key != self.key:
            self.finish()
            self.key, self.image, self.label, self.first_member = key, None, None, name
        ext = ext.lower()
        is_image = ext in IMAGE_EXTS
        if not is_image and ext != LABEL_EXT:
            return  # .json, .txt ...: not ours to read
        if not member.isreg() or member.issparse():
            raise InvalidArgumentError(
                f"{self._what(name)} is not a plain file (a link, a device or a sparse "
                "file); joader reads member data by offset - write the shard with regular "
                "members (tar --dereference)"
            )
        if is_image:
            if self.image is not None:
                raise InvalidArgumentError(
                    f"{self._what(name)}: sample {display_path(key)!r} already has the image "
                    f"{display_path(self.image.name)!r}; a sample has one image - give the other "
                    "its own key"
                )
            self.image = member
            return
        if self.label is not None:
            raise InvalidArgumentError(
                f"{self._what(name)}: sample {display_path(key)!r} has a second .cls "
                "member; keep one"
            )
        if member.size > _MAX_LABEL_BYTES:
            raise InvalidArgumentError(
                f"{self._what(name)} is {member.size} bytes, too long for a label; a .cls "
                "member holds a class number or a class name"
            )
        data = os.pread(fd, member.size, member.offset_data)
        # A byte-order mark (a .cls saved by a Windows editor) is not part of the label.
        label = data.decode("utf-8", "surrogateescape").removeprefix("\ufeff").strip()
        if "\0" in label:  # C-string padding, UTF-16, a binary member: not a class name
            shown = display_path(label.replace("\0", "\\0"))[:80]
            raise InvalidArgumentError(
                f"{self._what(name)}: the label {shown!r} holds a NUL byte; a .cls member holds "
                "one class number or class name as UTF-8 text - rewrite it without NUL bytes"
            )
        if not label or "\n" in label:
            raise InvalidArgumentError(
                f"{self._what(name)}: the label is "
                f"{'empty' if not label else 'several lines'}; a .cls member holds one class "
                "number or class name"
            )
        if label[0] in "+-" and label[1:].isascii() and label[1:].isdigit():
            raise InvalidArgumentError(
                f"{self._what(name)}: label {label!r} is signed; integer labels are class "
                "numbers 0, 1, 2, ... - write them without a sign"
            )
        self.label = label

    def _what(self, member_name: str) -> str:
        return f"shard {self.where}, member {display_path(member_name)!r}"

    def finish(self) -> None:
        """Close the current sample: add it as an item, or skip it (no image)."""
        if self.key is None:
            return
        key, image, label = self.key, self.image, self.label
        self.key = None
        if image is None:
            self.index.num_skipped += 1
            if not self.index.first_skipped:
                self.index.first_skipped = f"{self.where}: {display_path(self.first_member)!r}"
            return
        if label is None:
            raise InvalidArgumentError(
                f"shard {self.where}, member {display_path(image.name)!r}: sample "
                f"{display_path(key)!r} has no {display_path(key)}.cls member; every sample "
                "needs its label in KEY.cls, next to its image in the archive"
            )
        self.index.add_item(
            self.shard_id,
            f"{self.shard}/{image.name}",
            image.offset_data,
            image.size,
            label,
            f"{self.shard}/{key}.cls",
        )


_FAST_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE)


class _FastTarInfo(tarfile.TarInfo):
    """tarfile's TarInfo, with a fast path for the common header.

    `TarInfo.frombuf` decodes every field (uid, gid, mtime, user and group names ...) with
    generic helpers, about 15 us a header; an index needs the name, the size and the type. For
    a header with the ustar magic (POSIX or GNU), of a regular file or a folder, with octal
    numbers and an unsigned checksum that matches, this parses those, exactly as `frombuf`
    does; any other header goes to `frombuf` itself.
    """

    @classmethod
    def frombuf(cls, buf: bytes, encoding: str, errors: str) -> tarfile.TarInfo:  # type: ignore[override]
        kind = buf[156:157]
        if len(buf) == tarfile.BLOCKSIZE and buf[257:262] == b"ustar" and kind in _FAST_TYPES:
            try:
                chksum = int(_field(buf, 148, 156) or b"0", 8)
                size = int(_field(buf, 124, 136) or b"0", 8)
            except ValueError:  # base-256 numbers (0x80, 0xff first) and the like
                return super().frombuf(buf, encoding, errors)
            if 256 + sum(buf) - sum(buf[148:156]) == chksum and size >= 0:
                obj = cls()
                obj.chksum = chksum
                obj.size = size
                name = buf[0:100]
                end = name.find(b"\0")
                obj.name = (name if end == -1 else name[:end]).decode(encoding, errors)
                obj.type = kind
                if kind == tarfile.AREGTYPE and obj.name.endswith("/"):
                    obj.type = tarfile.DIRTYPE  # an old V7 folder
                if obj.type == tarfile.DIRTYPE:
                    obj.name = obj.name.rstrip("/")
                prefix = buf[345:500]
                end = prefix.find(b"\0")
                if end:  # not an empty prefix
                    text = (prefix if end == -1 else prefix[:end]).decode(encoding, errors)
                    obj.name = text + "/" + obj.name
                return obj
        return super().frombuf(buf, encoding, errors)


def _field(buf: bytes, start: int, stop: int) -> bytes:
    """A numeric header field as tarfile's `nti` reads it: up to the first NUL, stripped."""
    raw = buf[start:stop]
    end = raw.find(b"\0")
    return (raw if end == -1 else raw[:end]).strip()


def _has_data(member: tarfile.TarInfo) -> bool:
    """Whether `member.size` bytes of data follow its header, as tarfile skips them.

    Links, folders and devices have none whatever their size field says; a sparse member's
    `size` is its expanded size, larger than the data stored.
    """
    return (member.isreg() or member.type not in tarfile.SUPPORTED_TYPES) and not member.issparse()


def _check_name(name: str, where: str) -> None:
    if name.startswith("/") or (".." in name and ".." in name.split("/")):
        raise InvalidArgumentError(
            f"shard {where}, member {display_path(name)!r}: the name leaves the archive's folder "
            "(absolute, or a '..' component); joader refuses such archives - write the shard "
            "with relative member names"
        )
