"""A source listed in a file: `.tsv` or `.csv` lines of `relative_path<TAB or ,>label`.

- Paths are relative to the folder holding the list file (the resolved file, if it is a
  symlink) and may not leave it: absolute paths and `..` components are refused at listing, and
  every read goes through `safe_open.open_in_root`, so a symlink cannot leave it either.
- Item id = line order (blank lines are ignored). A first line `path<sep>label` is a header.
- Labels are all integers or all class names. Integers are class numbers: 0 to 2**31-1 (the
  int32 every label travels as), no sign (`-1` is refused, not taken for a class name), leading
  zeros allowed (`007` is 7). They are delivered as written; the classes are the distinct
  integers that occur, in numeric order, as text, each mapped to itself in `class_to_idx` (so
  one label of 10,000,000 costs one class, not ten million). Class names are sorted into
  classes and label = index, as ImageFolder numbers its class folders. A label is stripped of
  surrounding spaces; an empty one, or one holding a NUL byte, is an error.
- A path listed twice is two items (oversampling, or one image under two labels): joader does
  not merge them. A path naming a folder (`x/`, `.`) is refused at listing.
- `.csv` follows the csv module's quoting (a path with a comma is written `"a,b.jpg",3`);
  `.tsv` has no quoting: a field is everything between tabs.
- The file is UTF-8; bytes that are not UTF-8 are kept as they are (surrogateescape), so any
  Linux file name can be listed.

Files are not checked for existence when listing (a million stats on network storage would
make start-up slow); a missing file fails its read with a DecodeError naming it.

Every error names the line number and the fix.
"""

from __future__ import annotations

import bisect
import csv
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from joader.errors import InvalidArgumentError
from joader.sources.base import (
    MAX_LABEL,
    ListedItems,
    PackedPaths,
    check_item_id,
    int_label,
    read_in_root,
)
from joader.sources.safe_open import display_path, root_identity

__all__ = ["ListSource", "read_list_file"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ListSource(ListedItems):
    """The items of a list file: paths relative to its folder, labels, class names."""

    kind: ClassVar[str] = "list"
    root: Path  # the resolved list file
    folder: Path  # the folder paths are relative to (root.parent); reads never leave it
    classes: tuple[str, ...]
    class_to_idx: dict[str, int]
    paths: PackedPaths  # as written in the file; item id = position
    labels: np.ndarray  # int32, one per item
    num_skipped: int = field(default=0)  # always 0: a bad line is an error, not skipped
    # (st_dev, st_ino) of `folder` when listed: reads refuse another folder at its path
    root_id: tuple[int, int] | None = field(default=None)

    def read(self, item_id: int) -> bytes:
        """The bytes of the item's file (inside `folder`); DecodeError with the reason."""
        return read_in_root(self.folder, self.paths[check_item_id(self, item_id)], self.root_id)


def _hint(sep: str) -> str:
    shown = "<TAB>" if sep == "\t" else sep
    return (
        f"expected one `relative/path.jpg{shown}label` per line (an optional first line "
        f"`path{shown}label`), labels all integers or all class names"
    )


def read_list_file(path: str | os.PathLike[str]) -> ListSource:
    """Read a `.tsv` / `.csv` list file. Raises InvalidArgumentError naming the bad line."""
    given = Path(path).expanduser()
    suffix = given.suffix.lower()
    if suffix not in (".tsv", ".csv"):
        raise InvalidArgumentError(
            f"list file {display_path(given)} must end in .tsv (tab-separated) or .csv "
            "(comma-separated); rename it"
        )
    sep = "\t" if suffix == ".tsv" else ","
    if not given.exists():
        raise InvalidArgumentError(f"list file {display_path(given)} does not exist; {_hint(sep)}")
    if not given.is_file():
        raise InvalidArgumentError(
            f"list file {display_path(given)} is not a regular file; {_hint(sep)}"
        )
    real = given.resolve()
    name = display_path(real)
    root_id = root_identity(real.parent)
    try:
        with open(real, encoding="utf-8", errors="surrogateescape", newline="") as file:
            paths, raw_labels, line_numbers = _parse(file, sep, name)
    except OSError as exc:
        raise InvalidArgumentError(
            f"cannot read list file {name}: {exc.strerror or exc}; check that joaderd's user "
            "may read it"
        ) from None
    if not paths:
        raise InvalidArgumentError(f"list file {name} lists no items; {_hint(sep)}")
    classes, class_to_idx, labels = _labels(raw_labels, line_numbers, name, sep)
    return ListSource(
        root=real,
        folder=real.parent,
        classes=classes,
        class_to_idx=class_to_idx,
        paths=PackedPaths(paths),
        labels=labels,
        root_id=root_id,
    )


class _LineNumbers(Sequence[int]):
    """The line number of each item, stored as (position, line - position) where that changes.

    Items are on consecutive lines except after blank lines, a header or multi-line quoted
    fields, so a million-line file costs a few entries, not a second million-entry list.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []  # positions where the offset changes
        self._offsets: list[int] = []
        self._count = 0

    def mark(self, position: int, offset: int) -> None:
        """From `position` on, line = position + `offset`."""
        self._starts.append(position)
        self._offsets.append(offset)

    def close(self, count: int) -> None:
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, position):  # type: ignore[no-untyped-def, override]
        if not 0 <= position < self._count:
            raise IndexError(position)
        return position + self._offsets[bisect.bisect_right(self._starts, position) - 1]


def _parse(file: object, sep: str, name: str) -> tuple[list[str], list[str], _LineNumbers]:
    """(paths, label texts, the line number of each item)."""
    if sep == "\t":
        reader = csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE, strict=True)  # type: ignore[arg-type]
    else:
        reader = csv.reader(file, delimiter=",", strict=True)  # type: ignore[arg-type]
    paths: list[str] = []
    labels: list[str] = []
    add_path, add_label = paths.append, labels.append
    line_numbers = _LineNumbers()
    offset = None  # line - position in the current run of consecutive lines
    first = True
    try:
        for row in reader:
            if len(row) != 2 or first:
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue  # a blank line
                if first:
                    first = False
                    row[0] = row[0].removeprefix("\ufeff")  # a UTF-8 byte-order mark
                    if (
                        len(row) == 2
                        and row[0].strip().lower() == "path"
                        and row[1].strip().lower() == "label"
                    ):
                        continue  # the header
                if len(row) != 2:
                    raise InvalidArgumentError(
                        f"list file {name}, line {reader.line_num}: expected 2 fields (path and "
                        f"label), found {len(row)}: {display_path(_clip(sep.join(row)))!r}; "
                        f"{_hint(sep)}"
                    )
            rel, label = row
            if (
                not rel
                or rel[0] == "/"
                or rel[-1] in "/."
                or ".." in rel
                or rel.isspace()
                or "\0" in rel
            ):
                _check_path(rel, name, reader.line_num, sep)
            if reader.line_num - len(paths) != offset:
                offset = reader.line_num - len(paths)
                line_numbers.mark(len(paths), offset)
            add_path(rel)
            add_label(label.strip())
    except csv.Error as exc:
        raise InvalidArgumentError(
            f"list file {name}, line {reader.line_num}: {exc}; {_hint(sep)}"
            + (' (quote a path holding a comma or a quote: "a,b.jpg",3)' if sep == "," else "")
        ) from None
    line_numbers.close(len(paths))
    return paths, labels, line_numbers


def _check_path(rel: str, name: str, line: int, sep: str) -> None:
    if "\0" in rel:  # no file name holds one: it failed at decode, blaming the stage
        shown = display_path(rel.replace("\0", "\\0"))
        raise InvalidArgumentError(
            f"list file {name}, line {line}: the path {shown!r} holds a NUL byte, which no file "
            "name can; fix that line (is the file binary, or UTF-16?)"
        )
    if not rel.strip():
        raise InvalidArgumentError(
            f"list file {name}, line {line}: the path is empty; {_hint(sep)}"
        )
    if rel.startswith("/"):
        raise InvalidArgumentError(
            f"list file {name}, line {line}: path {display_path(rel)!r} is absolute; paths are "
            f"relative to the list file's folder {display_path(os.path.dirname(name))} - write "
            "them relative to it, or move the list file"
        )
    if ".." in rel and ".." in rel.split("/"):
        raise InvalidArgumentError(
            f"list file {name}, line {line}: path {display_path(rel)!r} leaves the list file's "
            f"folder {display_path(os.path.dirname(name))} (a '..' component); joader never reads "
            "outside it - put the list file in a folder above the data"
        )
    if rel.endswith("/") or rel.rsplit("/", 1)[-1] == ".":
        # It passed the listing, then every read failed as a file "outside the source root".
        raise InvalidArgumentError(
            f"list file {name}, line {line}: path {display_path(rel)!r} names a folder, not a "
            "file; list each image file of it on its own line"
        )


def _labels(
    raw: list[str], line_numbers: Sequence[int], name: str, sep: str
) -> tuple[tuple[str, ...], dict[str, int], np.ndarray]:
    """(classes, class_to_idx, int32 labels) from the label texts: all integers or all names."""
    line_of = line_numbers.__getitem__
    is_int = [text.isascii() and text.isdigit() for text in raw]
    num_ints = sum(is_int)
    if num_ints == len(raw):
        # Python ints, and digit strings too long for one never converted: 10**23 or 5,000
        # digits is an error that names the line, not an overflow or a traceback.
        values = [int(text) if len(text) <= 12 else int_label(text) for text in raw]
        top = max(values, default=0)
        if top > MAX_LABEL:
            at = values.index(top)
            raise InvalidArgumentError(
                f"list file {name}, line {line_of(at)}: label {_clip(raw[at])} is too large (at most "
                f"{MAX_LABEL}); number classes from 0"
            )
        # The classes that occur, not 0..top: one label of 10,000,000 once built ten million
        # class names (1.3 GB) and an Attach reply nobody could receive.
        distinct = sorted(set(values))
        classes = tuple(str(k) for k in distinct)
        return classes, dict(zip(classes, distinct, strict=True)), np.asarray(values, dtype=np.int32)
    for position, text in enumerate(raw):
        if not text:
            raise InvalidArgumentError(
                f"list file {name}, line {line_of(position)}: the label is empty; {_hint(sep)}"
            )
        if "\0" in text:  # a binary or UTF-16 file, or C-string padding: not a class name
            shown = _clip(display_path(text.replace("\0", "\\0")))
            raise InvalidArgumentError(
                f"list file {name}, line {line_of(position)}: the label {shown!r} holds a NUL "
                "byte; fix that line (is the file binary, or UTF-16?)"
            )
        if text[0] in "+-" and text[1:].isascii() and text[1:].isdigit():
            raise InvalidArgumentError(
                f"list file {name}, line {line_of(position)}: label {text!r} is signed; integer "
                "labels are class numbers 0, 1, 2, ... - write them without a sign"
            )
    if num_ints:
        first_int = is_int.index(True)
        first_name = is_int.index(False)
        header = (
            " (a header line must be exactly `path<sep>label`)"
            if min(first_int, first_name) == 0
            else ""
        )
        raise InvalidArgumentError(
            f"list file {name}: labels mix integers and class names - line "
            f"{line_of(first_int)} has the integer label {raw[first_int]!r}, line "
            f"{line_of(first_name)} the class name {display_path(raw[first_name])!r}{header}; "
            "write every label as a class number or every label as a class name"
        )
    classes = tuple(sorted(set(raw)))
    class_to_idx = {c: k for k, c in enumerate(classes)}
    labels = np.fromiter((class_to_idx[text] for text in raw), dtype=np.int32, count=len(raw))
    return classes, class_to_idx, labels


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
