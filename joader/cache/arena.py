"""The shared-memory arena: one file under /dev/shm holding prepared items of any size.

Which bytes hold which item is the server's business (`joader.cache.allocator.ByteAllocator`,
owned by the item cache); the arena only creates, maps, guards and removes the file.

The server creates and owns the arena (`Arena.create`) and is the only one that unlinks it;
decode workers map it read-write; clients map it read-only (`ArenaReader`). Three traps shape
this module (docs/architecture.md, "Lessons already paid for"):

- tmpfs does not reserve pages on `ftruncate`, and writing past what /dev/shm holds kills the
  writer with SIGBUS. So the file is allocated with `os.posix_fallocate`, and ENOSPC becomes a
  `CacheSpaceError` at start, naming the free space and the fix.
- `multiprocessing.shared_memory` registers segments with the resource tracker, which unlinks the
  server's segment when a client exits. So everything here is a plain file plus `mmap`.
- A crashed server leaves its segment behind. Names carry the owner's uid and pid
  (`joader-<uid>-<pid>-<token>`), and the owner holds an `flock` on the file for as long as the
  arena is open. A restart removes (`remove_stale_arenas`) this user's segments that are
  unlocked *and* whose pid is gone. The lock is what proves death: it is released by the kernel
  when the owner dies, even when pids are reused or the owner lives in another pid namespace
  (two containers sharing /dev/shm). The pid check closes the short window between a new
  server's create and its lock.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np

from joader.errors import (
    CacheSpaceError,
    InvalidArgumentError,
    JoaderError,
    UntrustedServerError,
)
from joader.process_ref import pid_alive

__all__ = [
    "DEFAULT_SHM_DIR",
    "Arena",
    "ArenaReader",
    "arena_name_pattern",
    "format_size",
    "parse_size",
    "remove_stale_arenas",
    "shm_space",
]

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
_NAME_PREFIX = "joader"
# Names this process created: with the lock test these let a server that restarts with the same
# pid (pid 1 in a container) recognise its previous incarnation's segments.
_created_here: set[str] = set()


def arena_name_pattern(uid: int | None = None) -> re.Pattern[str]:
    """The names of arenas owned by `uid` (default: this process's uid); group 1 is the pid."""
    uid = os.getuid() if uid is None else uid
    return re.compile(rf"^{_NAME_PREFIX}-{uid}-(\d+)-[0-9a-f]+$")


class Arena:
    """A shared-memory file of `size_bytes`, mapped read-write."""

    ALIGN = 64  # the size is a multiple of this (the allocator's unit)

    def __init__(self, path: Path, capacity_bytes: int, mm: mmap.mmap, lock_fd: int) -> None:
        # Use `Arena.create`; this only wraps an already allocated, mapped file.
        self.path = path
        self.name = path.name
        self.capacity_bytes = capacity_bytes
        self.size_bytes = capacity_bytes - capacity_bytes % self.ALIGN  # never above capacity
        self._mmap: mmap.mmap | None = mm
        self._lock_fd: int | None = lock_fd  # holds the flock that marks the arena as alive
        self._unlinked = False

    @classmethod
    def create(
        cls,
        capacity_bytes: int,
        min_bytes: int = 1,
        *,
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
    ) -> Arena:
        """Create, fully allocate and map a new arena. Raises CacheSpaceError if it does not fit.

        `min_bytes`: the largest item it must hold (the arena is refused below that).
        """
        size_bytes = capacity_bytes - capacity_bytes % cls.ALIGN
        if size_bytes < max(min_bytes, cls.ALIGN):
            raise InvalidArgumentError(
                f"cache capacity {format_size(capacity_bytes)} is smaller than one prepared "
                f"item ({format_size(min_bytes)}); raise --cache-size to at least a few "
                "hundred items"
            )
        name = f"{_NAME_PREFIX}-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
        path = Path(shm_dir) / name
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileNotFoundError:
            raise CacheSpaceError(
                f"cannot create the cache arena: {shm_dir} does not exist; joader needs a tmpfs "
                "such as /dev/shm (Linux)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.posix_fallocate(fd, 0, size_bytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    raise _space_error(shm_dir, size_bytes) from None
                raise
            mm = mmap.mmap(
                fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        _created_here.add(name)
        logger.info("created cache arena %s: %s", path, format_size(size_bytes))
        return cls(path, capacity_bytes, mm, fd)

    @property
    def buffer(self) -> mmap.mmap:
        """The read-write mapping (raises once closed)."""
        if self._mmap is None:
            raise JoaderError(f"cache arena {self.name} is closed")
        return self._mmap

    def array(self, offset: int, shape: tuple[int, ...], dtype: np.dtype | type = np.uint8) -> np.ndarray:
        """A writable numpy view of `shape` and `dtype` at byte `offset`."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        if offset < 0 or offset + count * dtype.itemsize > self.size_bytes:
            raise InvalidArgumentError(
                f"{count * dtype.itemsize} bytes at offset {offset} are outside the arena "
                f"({self.size_bytes} bytes)")
        return np.frombuffer(self.buffer, dtype, count, offset).reshape(shape)

    def close(self) -> None:
        """Unmap and drop the lock (idempotent). Live numpy views keep the mapping until freed."""
        mm, self._mmap = self._mmap, None
        if mm is not None:
            _close_mmap(mm, self.name)
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the file (idempotent). Existing mappings, also clients', stay valid."""
        if not self._unlinked:
            self._unlinked = True
            _unlink_quietly(self.path)
            logger.info("removed cache arena %s", self.path)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        self.unlink()

    def __repr__(self) -> str:
        return f"Arena({str(self.path)!r}, size_bytes={self.size_bytes})"


class ArenaReader:
    """A client's read-only mapping of the server's arena, by name (or absolute path).

    Plain `open` + `mmap(PROT_READ)`: nothing is registered with Python's resource tracker, so a
    client exiting never removes the server's segment.

    The arena's path comes from the server, so before a byte is read the file must be what this
    user's joaderd makes: named `joader-<uid>-<pid>-<hex>` for `expected_uid` (default: ours), a
    regular file (opened without following symlinks), owned by `expected_uid` and writable by
    nobody else. Anything else (another user's file, a symlink into somewhere private, a file
    others could rewrite under us) raises `UntrustedServerError`.
    """

    def __init__(
        self,
        name: str,
        *,
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
        expected_uid: int | None = None,
        held_by: tuple[int, int] | None = None,
    ) -> None:
        """`held_by` (pid, fd): a process (the job's lease keeper) that holds the arena open.
        When joaderd restarted, the new one removes the dead one's arena file, but a reply the
        dead one sent before it died may still be read: its items are intact in that memory,
        reachable through the holder's descriptor (`/proc/PID/fd/FD`) after the name is gone."""
        self.path = Path(name) if os.sep in name else Path(shm_dir) / name
        self.name = self.path.name
        uid = os.getuid() if expected_uid is None else expected_uid
        if not arena_name_pattern(uid).match(self.name):
            raise UntrustedServerError(
                f"refusing to read {self.path}: not the name of a cache arena of uid {uid} "
                f"(expected {_NAME_PREFIX}-{uid}-<pid>-<hex>); the server that sent it is not "
                "your joaderd: point JOADER_ADDRESS at your own joaderd"
            )
        try:
            fd = _open_arena(self.path)
        except JoaderError:
            if held_by is None:
                raise
            fd = _open_held(self.path, *held_by)
        try:
            st = os.fstat(fd)
            _check_arena_file(self.path, st, uid)
            self.size_bytes = st.st_size
            self._mmap: mmap.mmap | None = mmap.mmap(
                fd, self.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ
            )
        finally:
            os.close(fd)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A zero-copy read-only view; copy out of it before acknowledging the item."""
        self._check_range(offset, nbytes)
        return memoryview(self._buffer())[offset : offset + nbytes]

    def array(
        self, offset: int, shape: tuple[int, ...], dtype: np.dtype | type = np.uint8
    ) -> np.ndarray:
        """A zero-copy, read-only numpy view."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        self._check_range(offset, count * dtype.itemsize)
        return np.frombuffer(self._buffer(), dtype, count, offset).reshape(shape)

    def copy_into(self, offset: int, out: np.ndarray) -> np.ndarray:
        """Copy `out.nbytes` bytes starting at `offset` into the contiguous array `out`."""
        if not out.flags.c_contiguous:
            raise InvalidArgumentError("copy_into needs a C-contiguous output array")
        src = self.array(offset, (out.nbytes,), np.uint8)
        out.reshape(-1).view(np.uint8)[:] = src
        return out

    def copy_many(self, offsets: Sequence[int], lengths: Sequence[int], outs: Iterable[Any]) -> None:
        """Copies each range `[offsets[i], offsets[i] + lengths[i])` into `outs[i]`, a
        C-contiguous writable buffer (numpy array) of exactly that many bytes.

        The client's delivery path: one bounds check for the whole reply, then a plain memcpy
        per item through memoryviews, about a third of `copy_into`'s Python per item (which
        builds two numpy views for each).
        """
        if offsets:
            low = min(offsets)
            high = max(offset + length for offset, length in zip(offsets, lengths, strict=True))
            self._check_range(low, high - low)
        with memoryview(self._buffer()) as source:
            for offset, length, out in zip(offsets, lengths, outs, strict=True):
                with memoryview(out) as view, view.cast("B") as target:
                    if target.nbytes != length:
                        raise InvalidArgumentError(
                            f"an item of {length} bytes at offset {offset} does not fit an output "
                            f"of {target.nbytes} bytes; the reply's shapes disagree with its lengths"
                        )
                    target[:] = source[offset : offset + length]

    def close(self) -> None:
        mm, self._mmap = self._mmap, None
        if mm is not None:
            _close_mmap(mm, self.name)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _buffer(self) -> mmap.mmap:
        if self._mmap is None:
            raise JoaderError(f"arena reader for {self.name} is closed")
        return self._mmap

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size_bytes:
            raise InvalidArgumentError(
                f"range [{offset}, {offset + nbytes}) outside the arena of {self.size_bytes} bytes; "
                "the descriptor does not belong to this arena (server restarted?)"
            )


def _open_arena(path: Path) -> int:
    """A read-only descriptor of `path`, which must not be a symlink (O_NOFOLLOW).

    O_NONBLOCK keeps a FIFO at that path from blocking the open; it changes nothing for the
    regular file an arena is.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        raise JoaderError(
            f"the server's cache arena {path} does not exist: joaderd has exited or "
            "restarted; reconnect to the running server"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedServerError(
                f"refusing to read {path}: it is a symbolic link, and joaderd never makes one; "
                "the server that sent it is not your joaderd: point JOADER_ADDRESS at your own"
            ) from None
        raise


def _open_held(path: Path, pid: int, fd: int) -> int:
    """`path`, unlinked, through the descriptor process `pid` holds (see `ArenaReader`)."""
    held = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(held)
        if target != f"{path} (deleted)" and target != str(path):
            raise FileNotFoundError(target)
        return os.open(held, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        raise JoaderError(
            f"the server's cache arena {path} does not exist any more, and no process holds it: "
            "joaderd restarted; reconnect to the running server"
        ) from None


def _check_arena_file(path: Path, st: os.stat_result, uid: int) -> None:
    """Raises `UntrustedServerError` unless `st` is a regular file of `uid` that only it writes."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISREG(st.st_mode) and st.st_uid == uid and not mode & 0o022:
        return
    raise UntrustedServerError(
        f"refusing to read {path}: owned by uid {st.st_uid}, mode 0o{mode:o}, "
        f"{'a regular file' if stat.S_ISREG(st.st_mode) else 'not a regular file'}; a cache "
        f"arena of your joaderd is a regular file owned by uid {uid} that no one else may "
        "write. The server that sent it is not your joaderd: point JOADER_ADDRESS at your own"
    )


def remove_stale_arenas(shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> list[str]:
    """Remove this user's arenas whose server is gone; return the removed names.

    Candidates are files named `joader-<my uid>-<pid>-*` and owned by this uid. One is stale when
    nobody holds its lock and its pid is not alive (or is this process, which did not create it).
    Live servers' segments and other users' files are never touched.
    """
    pattern = arena_name_pattern()
    uid = os.getuid()
    removed = []
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = pattern.match(entry.name)
        if match is None or entry.name in _created_here:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and pid_alive(pid):
            continue
        try:
            if (
                not entry.is_file(follow_symlinks=False)
                or entry.stat(follow_symlinks=False).st_uid != uid
            ):
                continue
            if _remove_if_unlocked(entry.path):
                removed.append(entry.name)
                logger.warning("removed stale cache arena %s left by a dead server", entry.path)
        except FileNotFoundError:
            continue  # another server removed it first
    return removed


def _remove_if_unlocked(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its server is alive (maybe in another pid namespace)
        os.unlink(path)
        return True
    finally:
        os.close(fd)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i)?)?(b)?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int) -> int:
    """Bytes in a size such as "2GiB", "512MB", "100M" or "1000".

    "KiB/MiB/GiB" are binary, "kB/MB/GB" decimal. A bare "K/M/G" is binary, as in Docker's
    `--shm-size` and most tools that take memory sizes.
    """
    if isinstance(text, int):
        if text < 0:
            raise InvalidArgumentError(f"size must be >= 0 bytes, got {text}")
        return text
    match = _SIZE_RE.match(text)
    if match is None:
        raise InvalidArgumentError(
            f"cannot read the size {text!r}; write a number of bytes with an optional unit, "
            "for example 2GiB, 512MB, 100M or 1000000"
        )
    number, prefix, binary, byte_suffix = match.groups()
    prefix = (prefix or "").lower()
    decimal = bool(prefix) and bool(byte_suffix) and not binary
    base = 1000 if decimal else 1024
    value = float(number) * base ** _POWERS[prefix]
    return int(value)


def format_size(num_bytes: int) -> str:
    """A short human form, binary units: 2.0 GiB."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def shm_space(shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> str:
    """How much of a tmpfs is free, for error messages: "1.2 MiB free of 64.0 MiB"."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return "free space unknown"
    return f"{format_size(st.f_bavail * st.f_frsize)} free of {format_size(st.f_blocks * st.f_frsize)}"


def _space_error(shm_dir: str | os.PathLike[str], size_bytes: int) -> CacheSpaceError:
    space = shm_space(shm_dir)
    return CacheSpaceError(
        f"cannot allocate a {format_size(size_bytes)} cache arena in {shm_dir} ({space}); "
        f"lower --cache-size, free space in {shm_dir}, or in Docker raise --shm-size"
    )


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _close_mmap(mm: mmap.mmap, name: str) -> None:
    try:
        mm.close()
    except BufferError:
        # Views (numpy arrays, memoryviews) still point into it; the mapping goes when they do.
        logger.debug("arena %s: mapping still has live views; it is released with them", name)
