"""Listing a source in torchvision's ImageFolder layout: `root/<class>/**/<image>`.

Item ids and labels match `torchvision.datasets.ImageFolder(root)` exactly, so indices a user
computed against an ImageFolder mean the same items here: classes are the sorted names of the
root's subfolders; items are visited class by class in sorted order, and within a class in
`sorted(os.walk(class_dir))` order with file names sorted.

One deliberate difference: nothing outside the root is ever read. Symlinks (files, folders or
class folders) that resolve outside the root are skipped, counted and logged; so are broken
symlinks and symlink loops (where os.walk would recurse until the path is too long).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from joader.errors import InvalidArgumentError
from joader.sources.base import ListedItems, PackedPaths, check_item_id, read_in_root
from joader.sources.safe_open import root_identity

__all__ = ["IMG_EXTENSIONS", "SourceListing", "full_path", "list_image_folder"]

logger = logging.getLogger(__name__)

# torchvision.datasets.folder.IMG_EXTENSIONS; matched case-insensitively, as torchvision does.
IMG_EXTENSIONS: tuple[str, ...] = (
    ".jpg",
    ".jpeg",
    ".png",
    ".ppm",
    ".bmp",
    ".pgm",
    ".tif",
    ".tiff",
    ".webp",
)

_LAYOUT_HINT = (
    "expected the ImageFolder layout: ROOT/<class name>/<image>.jpg, one subfolder per class "
    f"(image extensions: {' '.join(IMG_EXTENSIONS)})"
)


@dataclass(frozen=True, eq=False)
class SourceListing(ListedItems):
    """The items of one source: relative paths, their labels, and the class names.

    An `ItemSource` of kind "imagefolder": `read(i)` returns the bytes of `root/paths[i]`.
    """

    kind: ClassVar[str] = "imagefolder"
    root: Path  # resolved
    classes: tuple[str, ...]
    class_to_idx: dict[str, int]
    paths: PackedPaths  # relative POSIX paths; item id = position (NOTE [ A listing the decode workers share ])
    labels: np.ndarray  # int32, one per item
    num_skipped: int = field(default=0)  # symlinks leaving the root, broken links, loops
    # (st_dev, st_ino) of the root when listed: reads refuse another folder at its path
    root_id: tuple[int, int] | None = field(default=None)

    def read(self, item_id: int) -> bytes:
        """The bytes of item `item_id`'s file, opened only if it still lies inside the root.

        Raises DecodeError with the precise reason (removed or renamed since the listing,
        permission denied, a symlink now leaving the root, not a regular file, an I/O error, the
        root folder gone or replaced by another since it was listed).
        """
        return read_in_root(self.root, self.paths[check_item_id(self, item_id)], self.root_id)


def full_path(listing: SourceListing, item_id: int) -> Path:
    """The absolute path of item `item_id`."""
    if not 0 <= item_id < len(listing.paths):
        raise InvalidArgumentError(
            f"item id {item_id} out of range: source {listing.root} has ids 0..{len(listing) - 1}"
        )
    return listing.root / listing.paths[item_id]


def list_image_folder(root: str | os.PathLike[str]) -> SourceListing:
    """List an ImageFolder tree. Raises InvalidArgumentError if `root` is not one."""
    given = Path(root).expanduser()
    if not given.exists():
        raise InvalidArgumentError(f"source folder {given} does not exist; {_LAYOUT_HINT}")
    if not given.is_dir():
        raise InvalidArgumentError(f"source path {given} is not a folder; {_LAYOUT_HINT}")
    real_root = given.resolve()
    root_id = root_identity(real_root)  # before the walk: a swap during it is then refused
    walker = _Walker(real_root)

    classes = sorted(entry.name for entry in os.scandir(real_root) if entry.is_dir())
    if not classes:
        raise InvalidArgumentError(
            f"source folder {real_root} has no class subfolders; {_LAYOUT_HINT}"
        )
    class_to_idx = {name: i for i, name in enumerate(classes)}

    paths: list[str] = []
    labels: list[int] = []
    for name in classes:
        found = walker.list_class(name)
        paths.extend(found)
        labels.extend([class_to_idx[name]] * len(found))
        if not found:
            logger.warning("source %s: class folder %r holds no images", real_root, name)
    if not paths:
        raise InvalidArgumentError(f"source folder {real_root} holds no images; {_LAYOUT_HINT}")
    if walker.num_skipped:
        logger.warning(
            "source %s: skipped %d symlinks that leave the folder, are broken or loop",
            real_root,
            walker.num_skipped,
        )
    return SourceListing(
        root=real_root,
        classes=tuple(classes),
        class_to_idx=class_to_idx,
        paths=PackedPaths(paths),
        labels=np.asarray(labels, dtype=np.int32),
        num_skipped=walker.num_skipped,
        root_id=root_id,
    )


class _Walker:
    """Walks class folders in torchvision's order without leaving the root."""

    def __init__(self, real_root: Path) -> None:
        self.real_root = str(real_root)
        self.num_skipped = 0

    def list_class(self, name: str) -> list[str]:
        top = os.path.join(self.real_root, name)
        if os.path.islink(top) and self._outside(top):
            return []
        # (virtual dir path, relative dir, file names); sorted like sorted(os.walk(top)).
        dirs: list[tuple[str, str, list[str]]] = []
        self._walk(top, name, dirs, visited=set())
        dirs.sort(key=lambda d: d[0])
        found: list[str] = []
        for _, rel_dir, files in dirs:
            found.extend(f"{rel_dir}/{fname}" for fname in sorted(files))
        return found

    def _walk(
        self, path: str, rel: str, out: list[tuple[str, str, list[str]]], visited: set[str]
    ) -> None:
        real = os.path.realpath(path)
        if real in visited:  # a symlink loop: os.walk(followlinks=True) would not stop
            self.num_skipped += 1
            return
        visited = visited | {real}
        files: list[str] = []
        subdirs: list[str] = []
        try:
            entries = list(os.scandir(path))
        except OSError as exc:  # os.walk ignores unreadable folders too
            logger.warning("cannot read folder %s: %s", path, exc)
            return
        for entry in entries:
            is_link = entry.is_symlink()
            if is_link and self._outside(entry.path):
                continue
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                subdirs.append(entry.name)
            elif entry.name.lower().endswith(IMG_EXTENSIONS):
                if is_link and not os.path.exists(entry.path):
                    self.num_skipped += 1
                    continue
                files.append(entry.name)
        out.append((path, rel, files))
        for sub in subdirs:
            self._walk(os.path.join(path, sub), f"{rel}/{sub}", out, visited)

    def _outside(self, link: str) -> bool:
        real = os.path.realpath(link)
        if os.path.commonpath([real, self.real_root]) == self.real_root:
            return False
        self.num_skipped += 1
        return True
