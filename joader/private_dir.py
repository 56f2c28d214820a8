"""A user's private runtime directory, and files in it that another local user cannot redirect.

The auto-start (`joader.client.autostart`) and joaderd's default socket live in a directory with a
predictable name: `$XDG_RUNTIME_DIR/joader`, or `/tmp/joader-<uid>` without it. In /tmp anyone may
create that name first. Every name inside it is predictable too (`auto-<source>-<key>.log`: the
key is a hash of the spec, which an attacker computes with joader itself), so an attacker who owns
the directory can plant `auto-...-<key>.json -> ~victim/precious.txt`, and a victim's job that
opens the planted name follows the link and writes into its own file.

NOTE [ Check the directory before anything is written in it ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`private_dir` creates the directory 0700 if it is missing and then checks, with `lstat` (a
symlink is never followed), that it is a directory, not a symbolic link, owned by this user and
that no one else may write in it (a 0700 one made by this user: group or others' read or search
bits, which cannot plant anything, are taken away). Anything else is refused before a single file
is opened there, with the owner's name and the fix. Once the directory is ours and 0700, and its
parent is /tmp (sticky: others can neither rename nor remove our entry) or ours, no one but us and
root can change what is in it, so the paths below cannot be swapped after the check.

Every file is still opened with `O_NOFOLLOW` and checked to be a regular file of ours (a second
line of defence, and the one that holds for a directory made by an older joader before this
check existed), and whole files are written to a private temporary file and renamed over the
name (`os.replace` replaces a symlink, it never writes through one).

This module imports neither grpc nor torch: the training process uses it before it forks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from joader.errors import UntrustedServerError

__all__ = ["flocked", "lock_holder", "open_private", "owner_name", "private_dir", "write_private"]

_POLL_S = 0.05

_FIX = ("joader wrote nothing in it. Ask {owner} (or root) to remove it, or set XDG_RUNTIME_DIR to a "
        "directory of yours that only you can enter (mode 0700), and run the job again")


def owner_name(uid: int) -> str:
    """`name (uid N)`, or `uid N` for an id with no account."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def private_dir(directory: Path, *, parents: bool = False) -> Path:
    """`directory`, created 0700 if missing, checked to be this user's alone; else refused.

    NOTE [ Check the directory before anything is written in it ]. `parents` creates missing
    parents too (for `$XDG_RUNTIME_DIR/joader`, whose parent the session manager made)."""
    try:
        directory.mkdir(mode=0o700, parents=parents)
    except FileExistsError:
        pass
    except PermissionError:
        raise UntrustedServerError(
            f"cannot create the directory {directory}: permission denied in {directory.parent} "
            f"(owner {owner_name(os.lstat(directory.parent).st_uid)}). Set XDG_RUNTIME_DIR to a directory "
            "of yours that only you can enter (mode 0700), and run the job again") from None
    st = os.lstat(directory)
    problem = _problem(st)
    if problem is not None:
        owner = owner_name(st.st_uid)
        whose = "" if owner in problem else f"owner {owner}, "
        raise UntrustedServerError(
            f"the directory {directory} {problem} ({whose}mode 0o{stat.S_IMODE(st.st_mode):o}): "
            f"another local user could turn the files joader keeps there against you. "
            + _FIX.format(owner=owner.split(" (")[0] if st.st_uid != os.getuid() else "you"))
    if stat.S_IMODE(st.st_mode) != 0o700:  # ours, others may only read or enter: close it
        os.chmod(directory, 0o700, follow_symlinks=False)
    return directory


def _problem(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"belongs to {owner_name(st.st_uid)}, not to you ({owner_name(os.getuid())})"
    if st.st_mode & 0o022:
        return "is writable by group or others"
    return None


def open_private(path: Path, flags: int, mode: int = 0o600) -> int:
    """`os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)`, refused unless it is a regular file of
    this user's (a planted symlink, FIFO or another user's file is never written or read)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as error:
        if error.errno == 40:  # ELOOP: the name is a symbolic link
            raise UntrustedServerError(
                f"{path} is a symbolic link; joader does not follow links in its private directory "
                f"(someone planted it: {_link_target(path)}). Remove it, and check who can write in "
                f"{path.parent}") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"belongs to {owner_name(st.st_uid)}"
        raise UntrustedServerError(
            f"{path} {what}; joader only uses its own files in its private directory. Remove it, and "
            f"check who can write in {path.parent}")
    os.set_blocking(fd, True)
    return fd


def _link_target(path: Path) -> str:
    try:
        return f"it points to {os.readlink(path)}"
    except OSError:
        return "its target is unreadable"


def write_private(path: Path, data: bytes) -> None:
    """Writes `data` to `path` whole: a 0600 temporary file in the same directory, renamed over
    `path` (a symlink planted at `path` is replaced, never written through)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def flocked(path: Path, timeout_s: float, timed_out: Callable[[int], BaseException],
            busy: Callable[[int], None] = lambda fd: None) -> Iterator[int]:
    """An exclusive `flock` on the private file `path` (created 0600, `open_private`), held for
    the block; the kernel drops it if the holder dies. While another process holds it, `busy(fd)`
    is called at each poll (it may raise), and `timed_out(fd)` is raised after `timeout_s`."""
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                busy(fd)
                if time.monotonic() > deadline:
                    raise timed_out(fd) from None
                time.sleep(_POLL_S)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def lock_holder(fd: int) -> tuple[int, int] | None:
    """(pid, uid) of a process holding a `flock` on the file `fd` is open on, from /proc/locks."""
    inode = os.fstat(fd).st_ino
    try:
        with open("/proc/locks") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" ("->" marks a waiter)
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            pid = int(fields[4])
            try:
                return pid, os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
    return None
