"""Whether a source on disk is still the one joaderd listed: cheap stamps and their comparison.

joaderd lists a source once, then serves it for days. Meanwhile its folder may be renamed away
and back (a sync tool, a remount), or replaced by another dataset of the same layout under the
same path. Cached items are the old data; a decode after the swap reads the new data: mixing
them is wrong pixels under the same indices, with no error anywhere. So joaderd keeps a *stamp*
of each source taken right after listing and compares it with fresh ones while serving
(`joader.server.books.source_watch` decides what to do with the verdict).

A stamp is cheap by design, never a re-listing (a source of 1.28M files must not be walked every
few seconds):
- the root's identity `(st_dev, st_ino)` (the resolved folder; a list source's folder; a tar
  source's shard folder): a folder moved into the same path is another inode;
- the identity of up to `MAX_FOLDERS` sampled class folders (ImageFolder): a class folder
  replaced is another inode (their mtimes are kept for `joader status`, not judged: files
  added or removed change them, and a removed file is a per-item failure, not a new dataset);
- `(st_ino, st_size, st_mtime_ns)` of up to `MAX_FILES` sampled items' files (tar: sampled
  shards; list: the list file too), drawn once with the caller's RNG.

# NOTE why a sample is enough for the common cases, and what it misses
A dataset swapped under the same path (`mv photos photos.old; mv photos2 photos`) changes the
root's inode: every read is also checked against the listed root's identity
(`safe_open.open_in_root(..., root_id=)`), so the first decode after such a swap fails instead
of reading new pixels, and the check it triggers names the change. Files rewritten in place,
inside the same folders, are caught only if sampled (64 of them): a few files replaced in place
may go unnoticed until a restart (as before this check existed).
A touched file (same bytes, new mtime) counts as changed: a stamp cannot tell pixels apart, and
refusing is the side that never delivers wrong data.

Verdicts (`compare`): `OK` (the stamp matches; files missing here and there are per-item
failures, not a source event), `AWAY` (the root, or every sampled file, is gone: renamed away or
unmounted; serving resumes when it is back), `CHANGED` (another folder, or files that differ).

The functions that touch the disk are `watch_targets` (nothing: it only names paths) and
`take_stamp` (a few dozen `stat` calls); `compare` and `is_read_error` are pure.
"""

from __future__ import annotations

import enum
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_FILES",
    "MAX_FOLDERS",
    "MIN_DIFFERING",
    "READ_ERROR_PREFIX",
    "Stamp",
    "Verdict",
    "VerdictKind",
    "WatchTargets",
    "compare",
    "is_read_error",
    "take_stamp",
    "watch_targets",
]

MAX_FILES = 64
MAX_FOLDERS = 64
MIN_DIFFERING = 2  # sampled files that differ, for a source to count as CHANGED (`compare`)

# Every DecodeError a source's `read` raises starts with this (safe_open, read_in_root, tar
# shards); a stage's or the pool's failures do not ("cannot prepare", "stage ... failed").
READ_ERROR_PREFIX = "cannot read "

Identity = tuple[int, int]  # (st_dev, st_ino)
FileStamp = tuple[int, int, int]  # (st_ino, st_size, st_mtime_ns)
FolderStamp = tuple[int, int, int]  # (st_dev, st_ino, st_mtime_ns)


@dataclass(frozen=True)
class WatchTargets:
    """What to stat for a source: its root, sampled folders and sampled files (absolute paths),
    and the item id of each sampled file (None: a list file or a tar shard)."""

    root: str
    folders: tuple[str, ...]
    files: tuple[str, ...]
    file_items: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class Stamp:
    """One look at a source on disk; None where a path was missing (or not what it was)."""

    root: Identity | None
    folders: tuple[FolderStamp | None, ...]
    files: tuple[FileStamp | None, ...]


class VerdictKind(enum.Enum):
    OK = "ok"
    AWAY = "away"
    CHANGED = "changed"


@dataclass(frozen=True)
class Verdict:
    """What `compare` found: the kind, for messages how many sampled files differ, and which
    (positions in the stamp's files)."""

    kind: VerdictKind
    files_differ: int = 0
    files_sampled: int = 0
    root_replaced: bool = False
    folders_replaced: int = 0
    differing: tuple[int, ...] = ()

    def describe(self) -> str:
        """`12 of 64 sampled files differ, and its folder was replaced` style."""
        parts = []
        if self.files_differ:
            parts.append(f"{self.files_differ} of {self.files_sampled} sampled files differ")
        if self.root_replaced:
            parts.append("its folder was replaced: another folder is at its path now")
        if self.folders_replaced:
            parts.append(f"{self.folders_replaced} sampled class folders were replaced")
        return ", and ".join(parts) or "its files differ from those joaderd listed"


def is_read_error(error: str | None) -> bool:
    """Whether a failed decode's error is a read of the source (not a stage or pool failure)."""
    return bool(error) and error.startswith(READ_ERROR_PREFIX)  # type: ignore[union-attr]


def watch_targets(listing: Any, rng: random.Random, *, max_files: int = MAX_FILES,
                  max_folders: int = MAX_FOLDERS) -> WatchTargets:
    """The paths to stamp for `listing` (an `ItemSource`), sampled with `rng`."""
    kind = getattr(listing, "kind", "imagefolder")
    root = Path(listing.root)
    if kind == "tar":
        shards = list(listing.shards)
        picked = sorted(rng.sample(range(len(shards)), min(max_files, len(shards))))
        return WatchTargets(str(root), (), tuple(str(root / shards[i]) for i in picked),
                            (None,) * len(picked))
    paths = listing.paths
    picked = sorted(rng.sample(range(len(paths)), min(max_files, len(paths))))
    if kind == "list":
        folder = Path(listing.folder)
        files = (str(root), *(str(folder / paths[i]) for i in picked))
        return WatchTargets(str(folder), (), files, (None, *picked))
    classes = list(listing.classes)
    chosen = sorted(rng.sample(range(len(classes)), min(max_folders, len(classes))))
    return WatchTargets(str(root), tuple(str(root / classes[i]) for i in chosen),
                        tuple(str(root / paths[i]) for i in picked), tuple(picked))


def take_stamp(targets: WatchTargets) -> Stamp:
    """Stats the targets (a few dozen `stat` calls; no read, no listing)."""
    root = _stat(targets.root)
    return Stamp(
        root=(root.st_dev, root.st_ino) if root is not None and _is_dir(root) else None,
        folders=tuple(_folder(path) for path in targets.folders),
        files=tuple(_file(path) for path in targets.files),
    )


def compare(listed: Stamp, now: Stamp, ignore: frozenset[int] = frozenset()) -> Verdict:
    """`now` against the stamp taken when the source was listed (pure).

    `ignore`: positions of sampled files whose change is a file's own business (their item
    failed since the listing: a broken file fixed on disk is served again, by design).
    A source CHANGED when its root or a sampled class folder is another inode, or when at least
    `min_differing(n)` of its n present sampled files differ: one file edited or fixed in place
    is the file's business, as before (its cached copy, if any, is a copy of one image); two or
    more of 64 are a dataset rewritten in place (`MIN_DIFFERING`).
    """
    sampled = len(listed.files)
    if now.root is None:
        return Verdict(VerdictKind.AWAY, files_sampled=sampled)
    present = [i for i, is_ in enumerate(now.files) if is_ is not None]
    if listed.files and not present and any(listed.files):
        return Verdict(VerdictKind.AWAY, files_sampled=sampled)  # an empty mount point, say
    differing = tuple(i for i in present if listed.files[i] != now.files[i] and i not in ignore)
    replaced = now.root != listed.root
    folders = sum(1 for was, is_ in zip(listed.folders, now.folders, strict=True)
                  if was is not None and is_ is not None and was[:2] != is_[:2])
    if replaced or folders or len(differing) >= MIN_DIFFERING:
        return Verdict(VerdictKind.CHANGED, len(differing), sampled, replaced, folders, differing)
    return Verdict(VerdictKind.OK, len(differing), sampled, differing=differing)



def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:  # gone, unreadable, a stale mount: all "not there now"
        return None


def _is_dir(info: os.stat_result) -> bool:
    return (info.st_mode & 0o170000) == 0o040000


def _folder(path: str) -> FolderStamp | None:
    info = _stat(path)
    return (info.st_dev, info.st_ino, info.st_mtime_ns) if info is not None and _is_dir(info) else None


def _file(path: str) -> FileStamp | None:
    info = _stat(path)
    return (info.st_ino, info.st_size, info.st_mtime_ns) if info is not None else None
