"""Opening a source file without ever reading outside the source root, and printable paths.

The listing (`imagefolder.list_image_folder`) skips symlinks that leave the root, but a listing
is a snapshot: a file can be replaced by a symlink to `/etc/shadow` (or by a FIFO, or removed)
after joaderd listed it. So every read re-checks, on the descriptor actually opened:

- `O_NONBLOCK`: opening a FIFO named `x.jpg` would otherwise block the worker until a writer
  appears (forever); with it the open returns and the file-type check refuses it. It changes
  nothing for regular files.
- the opened descriptor is resolved through `/proc/self/fd/N` (what was opened, not what the
  name pointed to a moment earlier) and must lie inside the real root; a check of the *name*
  before opening would race with a swap.
- `fstat` must show a regular file (not a FIFO, a device or a directory).
- with the root's identity from the listing (`root_id`, ImageFolder and list sources): the root
  folder is opened, must still be that inode, and the file is opened relative to it. A dataset
  swapped in under the same path (`mv photos photos.old; mv photos2 photos`) then fails its
  reads ("was replaced") instead of mixing new pixels with the old ones cached
  (`joader.sources.watch`, `joader.server.books.source_watch`).

Every failure is a `DecodeError` whose message says which of these happened and what to do, so
a file removed since the listing is not reported as "corrupt", and a permission problem not as
"not an image".

Paths on Linux are bytes; Python carries undecodable bytes as lone surrogates
(surrogateescape), which cannot be encoded into a log line, a proto string or a terminal.
`display_path` renders them as `\\xNN` for messages; keep the original for opening.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat

from joader.errors import DecodeError

__all__ = ["display_path", "open_in_root", "open_regular", "root_identity"]

logger = logging.getLogger(__name__)

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_RELIST_HINT = "restart joaderd to re-list it"


def display_path(path: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> str:
    """`path` as text safe to encode anywhere: undecodable bytes become `\\xNN`."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def open_in_root(root: str | os.PathLike[str], relpath: str,
                 root_id: tuple[int, int] | None = None) -> int:
    """A read-only descriptor of the regular file `root/relpath`, which must stay inside `root`.

    `root_id`: the root's `(st_dev, st_ino)` when the source was listed (`root_identity`); the
    file is then opened relative to the root folder, which must still be that one (module
    docstring). The caller owns (and closes) the descriptor. Raises `DecodeError` with the
    reason and fix.
    """
    real_root = _real_root(os.fspath(root))
    path = os.path.join(os.fspath(root), relpath)
    fd = _open(path) if root_id is None else _open_under(os.fspath(root), relpath, root_id)
    try:
        resolved = _opened_path(fd, path)
        if not _is_inside(real_root, resolved):
            raise DecodeError(
                f"{display_path(path)} resolves outside the source root (a symlink to "
                f"{display_path(resolved)}); joader never reads outside {display_path(real_root)} "
                "- copy the file into the source folder or remove the link"
            )
        _require_regular(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file `path` (no root to stay in; see `open_in_root`).

    For callers that read a path they were given (the baseline loader), not a source listing.
    """
    fd = _open(os.fspath(path))
    try:
        _require_regular(fd, os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


@functools.lru_cache(maxsize=64)
def _real_root(root: str) -> str:
    """The root with its symlinks resolved, once per process: later swaps cannot move it."""
    return os.path.realpath(root)


def root_identity(root: str | os.PathLike[str]) -> tuple[int, int]:
    """`(st_dev, st_ino)` of a source's root folder, for `open_in_root(..., root_id=)`."""
    info = os.stat(root)
    return info.st_dev, info.st_ino


def _open_under(root: str, relpath: str, root_id: tuple[int, int]) -> int:
    """`relpath` opened under the folder at `root`, which must be the listed one (`root_id`).

    The root is opened first and checked on its descriptor, and the file is opened relative to
    that descriptor: a folder swapped in at the root's path in between cannot be read from.
    """
    path = os.path.join(root, relpath)
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise DecodeError(
            f"cannot read {display_path(path)}: the source folder {display_path(root)} is gone "
            "(renamed, moved or unmounted since joaderd listed it); put it back at that path "
            "(joaderd serves it again when it is back)"
        ) from None
    except OSError:
        return _open(path)  # permission and I/O errors: reported for the file, as before
    try:
        info = os.fstat(root_fd)
        if (info.st_dev, info.st_ino) != tuple(root_id):
            raise DecodeError(
                f"cannot read {display_path(path)}: the source folder {display_path(root)} was "
                "replaced since joaderd listed it (another folder is at its path now); the "
                "cached items are from the old data: restart joaderd to serve the new data, or "
                "give the new data another name"
            )
        return _open(relpath, dir_fd=root_fd, shown=path)
    finally:
        os.close(root_fd)


def _open(path: str, dir_fd: int | None = None, shown: str | None = None) -> int:
    """`path` opened read-only (relative to `dir_fd` if given); `shown` names it in errors."""
    opened, path = path, shown or path

    if "\0" in path:
        # os.open raises ValueError, which escaped as a traceback blaming the stage. Listings
        # refuse such names; this keeps any other caller's read a DecodeError.
        raise DecodeError(
            f"cannot read {display_path(path.replace(chr(0), '<NUL>'))}: the path holds a NUL "
            "byte, which no file name can; fix the source's listing of it"
        )
    try:
        return os.open(opened, _OPEN_FLAGS, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        raise DecodeError(
            f"cannot read {display_path(path)}: it no longer exists; it was removed or renamed "
            f"since joaderd listed the source; {_RELIST_HINT}"
        ) from None
    except PermissionError:
        raise DecodeError(
            f"cannot read {display_path(path)}: permission denied; it cannot be read by "
            f"joaderd's user (uid {os.geteuid()}); fix its permissions"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DecodeError(
                f"cannot read {display_path(path)}: it is a symlink loop; remove or fix the link"
            ) from None
        raise DecodeError(
            f"cannot read {display_path(path)}: {exc.strerror or exc}; check the file and the "
            "storage it is on"
        ) from None


def _opened_path(fd: int, path: str) -> str:
    """The path of what `fd` refers to, as the kernel resolved it when it was opened."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        # No /proc (a minimal container): resolving the name again is racy, but still refuses
        # links that point outside at this moment.
        logger.debug("no /proc/self/fd; resolving %s by name", display_path(path))
        return os.path.realpath(path)


def _is_inside(real_root: str, resolved: str) -> bool:
    if not os.path.isabs(resolved):  # e.g. "pipe:[123]", "anon_inode:..."
        return False
    try:
        return resolved != real_root and os.path.commonpath([real_root, resolved]) == real_root
    except ValueError:
        return False


def _require_regular(fd: int, path: str) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise DecodeError(
            f"cannot read {display_path(path)}: it is not a regular file (it is a "
            f"{_file_kind(mode)}); joader reads only regular files - remove it from the source "
            f"and {_RELIST_HINT}"
        )


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    )
    return next((name for test, name in kinds if test(mode)), f"file of mode {mode:o}")
