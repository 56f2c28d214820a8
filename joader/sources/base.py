"""One interface for every kind of source, and `open_source`, which picks the kind from a path.

A source is a fixed, ordered collection of items: item ids are `0..n-1`, each with a label and
a display name (`paths[i]`), and `read(i)` returns the item's encoded bytes (a JPEG file's
content, a tar member's data). The shared stage receives bytes, so every stage works on every
kind. Three kinds, all listed or indexed once, when opened:

- `imagefolder`: a folder of class subfolders, in torchvision's order (`imagefolder.py`);
- `list`: a `.tsv` / `.csv` file of `relative_path<TAB or ,>label` lines (`listfile.py`);
- `tar`: a folder, or a glob, of WebDataset-style `.tar` shards (`tarshards.py`).

Reads never leave the source's root: files are opened with `safe_open.open_in_root`, and tar
shards must be regular files inside their folder. A read that fails raises `DecodeError` with
the precise reason (removed since the listing, permission denied, outside the root ...).

Sources hold no open descriptors: they are plain values, safe to pickle or to inherit across
`fork` (joaderd's forker closes every inherited descriptor), and each read opens what it needs.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol, overload, runtime_checkable

import numpy as np

from joader.errors import DecodeError, InvalidArgumentError
from joader.sources.safe_open import display_path, open_in_root

__all__ = [
    "MAX_LABEL",
    "SOURCE_KINDS",
    "ItemSource",
    "check_item_id",
    "int_label",
    "open_source",
    "read_in_root",
]

logger = logging.getLogger(__name__)

SOURCE_KINDS: tuple[str, ...] = ("imagefolder", "list", "tar")
LIST_SUFFIXES: tuple[str, ...] = (".tsv", ".csv")
TAR_SUFFIX = ".tar"

KINDS_HINT = (
    "give a folder of class subfolders (ImageFolder: ROOT/<class>/<image>.jpg), a .tsv or .csv "
    "file of `relative/path.jpg<TAB or ,>label` lines, or a folder or glob of .tar shards "
    "(WebDataset: KEY.jpg + KEY.cls members, e.g. '/data/shards/train-*.tar')"
)

# Labels travel as int32 (`NextResponse.labels`, `AttachResponse.targets`): an integer label is
# a class number 0..MAX_LABEL, and one beyond it is an error naming where it was written.
MAX_LABEL = 2**31 - 1


@runtime_checkable
class ItemSource(Protocol):
    """The items of one source: ids `0..n-1`, their labels and display names, and their bytes."""

    # Read-only members (properties): the sources are frozen dataclasses, and `paths` may be
    # any Sequence[str] (PackedPaths).
    @property
    def kind(self) -> str: ...  # "imagefolder" | "list" | "tar"
    @property
    def root(self) -> Path: ...  # resolved; shown in status (the folder, the list file, the shard folder)
    # What a client sees as `ds.classes`, `ds.class_to_idx` and each item's label (Attach's
    # `classes`, `class_labels`, `targets`). Class names (folders, or names in a list or .cls):
    # classes sorted, label = index. Integer labels (list, .cls): delivered as written, classes
    # = the distinct integers that occur in numeric order, as text, each mapped to itself.
    @property
    def classes(self) -> tuple[str, ...]: ...
    @property
    def class_to_idx(self) -> dict[str, int]: ...  # class -> the label its items carry
    @property
    def paths(self) -> Sequence[str]: ...  # display names; item id = position ("cls/x.jpg", "shard.tar/KEY.jpg")
    @property
    def labels(self) -> np.ndarray: ...  # int32, one per item, 0..MAX_LABEL
    @property
    def num_skipped(self) -> int: ...  # entries left out when listing (symlinks leaving the root, ...)

    def __len__(self) -> int: ...

    def read(self, item_id: int) -> bytes:
        """The item's encoded bytes. Raises DecodeError with the reason and the fix."""
        ...


def open_source(path: str | os.PathLike[str]) -> ItemSource:
    """List or index the source at `path`, choosing its kind from what `path` is.

    - a folder with subfolders: an ImageFolder (exactly as `list_image_folder`, torchvision's
      ids and labels);
    - a `.tsv` or `.csv` file: a list file;
    - a folder without subfolders that holds `.tar` files, a `.tar` file, or a glob whose file
      name has wildcards (`/data/shards/train-*.tar`): tar shards.

    Raises InvalidArgumentError, naming what is wrong and what to give instead.
    """
    # Imported here: those modules import this one (the protocol and helpers).
    from joader.sources.imagefolder import list_image_folder
    from joader.sources.listfile import read_list_file
    from joader.sources.tarshards import index_tar_shards

    text = os.fspath(path)
    if not text:
        raise InvalidArgumentError(f"source path is empty; {KINDS_HINT}")
    if "\0" in text:  # every os call would raise ValueError; "does not exist" printed a raw NUL
        shown = display_path(text.replace("\0", "<NUL>"))
        raise InvalidArgumentError(
            f"source path {shown!r} holds a NUL byte, which no path can; fix the source's path"
        )
    given = Path(text).expanduser()
    if not os.path.lexists(given):
        if glob.has_magic(str(given)):
            return index_tar_shards(given)
        raise InvalidArgumentError(
            f"source path {display_path(given)} does not exist; {KINDS_HINT}"
        )
    if given.is_dir():
        has_subdirs, tars = _scan_top(given)
        if has_subdirs:
            if tars:
                logger.warning(
                    "source %s has class subfolders and .tar files (%s...): listing it as an "
                    "ImageFolder; to serve the shards, give '%s'",
                    display_path(given), display_path(tars[0]),
                    display_path(given / ("*" + TAR_SUFFIX)),
                )  # fmt: skip
            return list_image_folder(given)
        if tars:
            return index_tar_shards(given)
        raise InvalidArgumentError(
            f"source folder {display_path(given)} has neither class subfolders nor .tar shards; "
            f"{KINDS_HINT}"
        )
    if given.is_file():
        suffix = given.suffix.lower()
        if suffix in LIST_SUFFIXES:
            return read_list_file(given)
        if suffix == TAR_SUFFIX:
            return index_tar_shards(given)
        raise InvalidArgumentError(
            f"source path {display_path(given)} is a file that is neither a list (.tsv, .csv) "
            f"nor a tar shard (.tar); {KINDS_HINT}"
        )
    raise InvalidArgumentError(
        f"source path {display_path(given)} is neither a folder nor a regular file (a broken "
        f"link, a FIFO or a device?); {KINDS_HINT}"
    )


def _scan_top(folder: Path) -> tuple[bool, list[str]]:
    """(whether `folder` has subfolders, the names of the .tar files directly in it)."""
    has_subdirs = False
    tars: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except OSError as exc:
        raise InvalidArgumentError(
            f"cannot read source folder {display_path(folder)}: {exc.strerror or exc}; check "
            "that joaderd's user may list it"
        ) from None
    for entry in entries:
        try:
            is_dir = entry.is_dir()
        except OSError:
            is_dir = False
        if is_dir:
            has_subdirs = True
        elif entry.name.lower().endswith(TAR_SUFFIX) and not entry.name.startswith("."):
            tars.append(entry.name)
    return has_subdirs, sorted(tars)


class PackedPaths(Sequence[str]):
    """A listing's relative paths in one bytes object and one array of ends: a read-only
    sequence of str, as a tuple of paths, without an object per path.

    NOTE [ A listing the decode workers share ]
    A tuple of 1,281,167 str objects took about 110 MB in joaderd, and each forked decode
    worker copied the pages of the paths it touched: reading `paths[i]` writes the str's
    reference count, so over an epoch a worker's private memory grew to about the whole
    listing (322 MiB at 1.28M items, issue 37). Here a path is decoded on access from the
    shared bytes (os.fsdecode: the surrogates of a non-UTF-8 name come back as they were), so
    the listing's pages stay shared and untouched, and it takes about 40 bytes per item."""

    __slots__ = ("_blob", "_ends")

    def __init__(self, paths: Sequence[str]) -> None:
        encoded = [os.fsencode(path) for path in paths]
        self._blob = b"".join(encoded)
        self._ends = array("q", itertools.accumulate(len(e) for e in encoded))

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self._path(i) for i in range(*index.indices(len(self._ends)))]
        count = len(self._ends)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"path index {index} out of range (0..{count - 1})")
        return self._path(index)

    def _path(self, index: int) -> str:
        ends = self._ends
        return os.fsdecode(self._blob[ends[index - 1] if index else 0:ends[index]])

    def __iter__(self) -> Iterator[str]:
        start = 0
        blob = self._blob
        for end in self._ends:
            yield os.fsdecode(blob[start:end])
            start = end

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedPaths):
            return self._blob == other._blob and self._ends == other._ends
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedPaths({len(self)} paths)"


class ListedItems:
    """`len()` and `num_items` from `paths`, for the sources' dataclasses (one definition)."""

    paths: Sequence[str]

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def num_items(self) -> int:
        return len(self.paths)


def check_item_id(source: ItemSource, item_id: int) -> int:
    """`item_id` as an int in `0..len(source)-1`; InvalidArgumentError otherwise."""
    count = len(source)
    if not 0 <= item_id < count:
        raise InvalidArgumentError(
            f"item id {item_id} out of range: source {display_path(source.root)} has ids "
            f"0..{count - 1}"
        )
    return int(item_id)


def int_label(digits: str) -> int:
    """The value of a label written as ASCII digits, or `MAX_LABEL + 1` for one too large.

    Never converts more than 12 significant digits: 5,000 digits would make `int()` raise
    (it refuses more than 4,300) or, below that, take quadratic time; zero padding
    (`0000000000007`) is still the value it pads. Callers refuse anything above `MAX_LABEL`.
    """
    if len(digits) > 12:
        digits = digits.lstrip("0") or "0"
        if len(digits) > 12:
            return MAX_LABEL + 1
    return int(digits)


def read_in_root(root: str | os.PathLike[str], relpath: str,
                 root_id: tuple[int, int] | None = None) -> bytes:
    """The whole content of the regular file `root/relpath`, never read outside `root` (and,
    with `root_id`, only from the root folder that was listed: `safe_open.open_in_root`).

    Raises DecodeError with `safe_open`'s precise reasons (removed since listed, permission
    denied, a symlink leaving the root, not a regular file, the root gone or replaced), or the
    I/O error of the read.
    """
    fd = open_in_root(root, relpath, root_id)
    try:
        with open(fd, "rb", closefd=False) as file:
            return file.read()
    except OSError as exc:
        raise DecodeError(
            f"cannot read {display_path(os.path.join(root, relpath))}: "
            f"{exc.strerror or exc}; check the file and the storage it is on"
        ) from None
    finally:
        os.close(fd)
