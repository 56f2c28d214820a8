"""Where joaderd listens, and who may be trusted there: the default socket, `JOADER_ADDRESS`,
parsing, the server's socket preparation and the client's check of who serves.

Server and client resolve the address the same way, so that a plain `joaderd` and a plain
`JoaderDataset(...)` meet without configuration. The default is a Unix domain socket in a
directory only the user can enter; TCP is used only when asked for, and never on all interfaces
unless `--allow-remote` says so.

Why the checks below. Without `XDG_RUNTIME_DIR` the default socket is
`/tmp/joader-<uid>/joaderd.sock`, and /tmp is shared: another local user can create
`/tmp/joader-<uid>` (mode 777) before the victim's first joaderd does, then swap the socket
and serve the victim images of their own choosing. So:

- the server (`prepare_server_socket`) refuses a socket directory that is a symlink, is not
  its own, or is writable by others, and never deletes anything at the socket path that is not
  a dead socket;
- the client (`verify_server`) checks the directory the same way and then asks the kernel who
  is listening (`SO_PEERCRED`) before it sends a byte.

A sticky directory owned by root (or by us), such as /tmp itself, is accepted for an explicit
`--listen unix:/tmp/x.sock`: others may create entries there but cannot remove or replace ours.
TCP carries no identity at all; see `verify_server`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import struct
import tempfile
from pathlib import Path

from joader.errors import InvalidArgumentError, JoaderError, UntrustedServerError
from joader.private_dir import private_dir

__all__ = [
    "ENV_ADDRESS",
    "SUN_PATH_MAX",
    "default_socket_path",
    "is_loopback",
    "prepare_server_socket",
    "resolve_address",
    "runtime_dir",
    "socket_path",
    "verify_server",
]

logger = logging.getLogger(__name__)

ENV_ADDRESS = "JOADER_ADDRESS"
_SERVER_DIR_FIX = (
    "remove it, or set XDG_RUNTIME_DIR, or pass --listen unix:/a/private/dir/joaderd.sock"
)
_CLIENT_DIR_FIX = (
    "do not use it: remove it if it is yours and restart joaderd, or set XDG_RUNTIME_DIR or "
    "JOADER_ADDRESS to the socket of your own joaderd"
)
_CLIENT_SOCKET_FIX = (
    "Do not use it: start your own joaderd, and set XDG_RUNTIME_DIR or JOADER_ADDRESS to its "
    "socket"
)
_PROBE_TIMEOUT_S = 1.0


SUN_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path holds 108 with the closing NUL)
_LONGEST_NAME = len("auto-") + 32 + len("-") + 12 + len(".sock")  # an auto-started server's socket


def runtime_dir() -> Path:
    """The user's private directory for joaderd's default socket and the auto-started servers'
    files: `$XDG_RUNTIME_DIR/joader`, else `$TMPDIR/joader-<uid>`, else `/tmp/joader-<uid>`; the
    first in which the longest socket name joader uses fits a Unix socket's 107 bytes (a long
    XDG_RUNTIME_DIR or TMPDIR would otherwise make every bind fail). Checked before use
    (`joader.private_dir`)."""
    uid = os.getuid()
    candidates = [Path(tempfile.gettempdir()) / f"joader-{uid}", Path("/tmp") / f"joader-{uid}"]
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        candidates.insert(0, Path(xdg) / "joader")
    for candidate in candidates:
        if len(os.fsencode(candidate)) + 1 + _LONGEST_NAME <= SUN_PATH_MAX:
            return candidate
    return candidates[-1]


def default_socket_path() -> Path:
    """`joaderd.sock` in `runtime_dir()`: `$XDG_RUNTIME_DIR/joader/joaderd.sock`, or
    `/tmp/joader-<uid>/joaderd.sock`."""
    return runtime_dir() / "joaderd.sock"


def resolve_address(address: str | None = None) -> str:
    """The gRPC target for `address`, else `$JOADER_ADDRESS`, else the default socket.

    Accepts `unix:/path`, `unix:///path`, a bare filesystem path, or `HOST:PORT`.
    """
    raw = address or os.environ.get(ENV_ADDRESS) or f"unix:{default_socket_path()}"
    if raw.startswith("unix:"):
        path = raw[len("unix:"):]
        path = path.removeprefix("//")
        if not path:
            raise InvalidArgumentError(f"address {raw!r} names no socket path; use unix:/path/to.sock")
        return f"unix:{path}"
    if raw.startswith("/") or raw.startswith("."):
        return f"unix:{os.path.abspath(raw)}"
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgumentError(
            f"cannot parse address {raw!r}: use unix:/path/to.sock or HOST:PORT (e.g. 127.0.0.1:7070)"
        )
    return raw


def socket_path(address: str) -> Path | None:
    """The filesystem path of a resolved `unix:` address, or None for TCP."""
    return Path(address[len("unix:"):]) if address.startswith("unix:") else None


def is_loopback(address: str) -> bool:
    """Whether only this host can reach `address`: a Unix socket, or TCP on a loopback address.

    Loopback is 127.0.0.0/8, ::1 (also as ::ffff:127.x.y.z) and the name `localhost`. Any other
    name counts as remote: what it resolves to is not ours to know at configuration time.
    """
    resolved = resolve_address(address)
    if socket_path(resolved) is not None:
        return True
    host = resolved.rpartition(":")[0].removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


# --- the server side --------------------------------------------------------------------------


def prepare_server_socket(path: Path, address: str, *, remove_dead: bool = True) -> None:
    """Makes `path`'s directory ready for joaderd to bind, or refuses with the reason and fix.

    Creates the directory (mode 0700; its parents too, but only for the default location),
    checks that no one else controls it, and clears a dead socket left by a joaderd that died.
    Refuses when a live joaderd listens there, and when anything other than a socket is at
    `path` (it is never deleted).

    joaderd checks at start with `remove_dead=False` and removes a dead socket only right
    before it binds: jobs started while a restarted joaderd lists its sources and allocates its
    arena (seconds) then still find a socket, which refuses, and wait for it (the lease keeper's
    first attach), instead of finding none and failing at once.
    """
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise InvalidArgumentError(
            f"the socket path {path} is {len(os.fsencode(path))} bytes, and a Unix socket's path holds at "
            f"most {SUN_PATH_MAX}: pass --listen unix:/a/shorter/path.sock, or set XDG_RUNTIME_DIR to a "
            "shorter directory")
    if path.parent == runtime_dir():  # the default socket, and the auto-started servers'
        private_dir(path.parent, parents=True)
    else:
        _make_private_dir(path.parent, parents=False)
        _check_dir(path.parent, allow_sticky=True, fix=_SERVER_DIR_FIX)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidArgumentError(
            f"{path} exists and is not a socket (it is {_kind(st.st_mode)}); joaderd does not "
            "delete it. Remove it yourself if it is not needed, or pass --listen "
            "unix:/another/path.sock"
        )
    if _is_listening(path):
        owner = "" if st.st_uid == os.getuid() else f" (its socket belongs to uid {st.st_uid})"
        raise JoaderError(
            f"another joaderd is already listening at {address}{owner}; stop it, or start this "
            "one with --listen unix:/other/path.sock (and set JOADER_ADDRESS for its clients)"
        )
    if remove_dead:
        _remove_dead_socket(path, st)


def _make_private_dir(directory: Path, *, parents: bool) -> None:
    try:
        directory.mkdir(mode=0o700, parents=parents)
    except FileExistsError:
        return  # checked by the caller, whoever made it
    except FileNotFoundError:
        raise InvalidArgumentError(
            f"cannot create the socket directory {directory}: {directory.parent} does not exist; "
            "create it, or pass --listen unix:/an/existing/private/dir/joaderd.sock"
        ) from None
    except PermissionError:
        raise InvalidArgumentError(
            f"cannot create the socket directory {directory}: permission denied; pass --listen "
            "unix:/a/private/dir/joaderd.sock in a directory you own"
        ) from None
    logger.debug("created socket directory %s", directory)


def _remove_dead_socket(path: Path, st: os.stat_result) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except PermissionError:
        raise InvalidArgumentError(
            f"{path} is a dead socket owned by uid {st.st_uid} that you cannot remove; ask its "
            "owner to remove it, or pass --listen unix:/another/path.sock"
        ) from None
    logger.info("removed %s, a socket left by a joaderd that did not exit cleanly", path)


def _is_listening(path: Path) -> bool:
    """Whether something accepts connections on the socket `path`.

    Only a refused connection (or a vanished file) proves the socket dead. A timeout means a
    listener too busy to accept (full backlog): alive, and its socket must not be removed.
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except (TimeoutError, BlockingIOError):
        return True
    except OSError:
        return False  # refused, vanished, or not ours to reach: nothing answers
    finally:
        probe.close()
    return True


# --- the client side --------------------------------------------------------------------------


def verify_server(address: str, timeout_s: float = 5.0) -> int | None:
    """Checks that this user's own process serves `address`; returns its uid (None for TCP).

    For a Unix socket: its directory must be ours and not writable by others (or a sticky
    directory of root's or ours, like /tmp), the socket file ours, and the listening process,
    as the kernel reports it (`SO_PEERCRED`), must run as our uid. Not even root's server is
    accepted: joaderd is a per-user daemon, the arena the client maps must be owned by the
    server's uid (see `ArenaReader`), and a joaderd run by another account, root included, is
    either a misconfiguration or someone else's data.

    TCP carries no identity, so nothing can be checked: anyone who can bind the port (any local
    user, for a port above 1024, once joaderd is not running) can serve a client that connects
    there. Prefer the default Unix socket; use TCP only on hosts whose users you trust.

    Raises `UntrustedServerError` when someone else may control the socket, and
    `ConnectionError` when nothing is listening.
    """
    resolved = resolve_address(address)
    path = socket_path(resolved)
    if path is None:
        return None
    try:
        _check_dir(path.parent, allow_sticky=True, fix=_CLIENT_DIR_FIX)
        st = os.lstat(path)
    except FileNotFoundError:
        raise ConnectionError(_no_server(resolved, "no such socket")) from None
    _check_socket_file(path, st)
    pid, uid = _peer_credentials(path, resolved, timeout_s)
    if uid != os.getuid():
        raise UntrustedServerError(
            f"the socket {path} is served by uid {uid} (pid {pid}), not by you (uid "
            f"{os.getuid()}): another account's process listens where your joaderd should, and "
            f"could serve you data of its choosing. {_CLIENT_SOCKET_FIX}"
        )
    return uid


def _check_socket_file(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISSOCK(st.st_mode):
        raise ConnectionError(_no_server(f"unix:{path}", f"{path} is {_kind(st.st_mode)}, not a socket"))
    if st.st_uid != os.getuid():
        raise UntrustedServerError(
            f"the socket {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): "
            f"someone else made it. {_CLIENT_SOCKET_FIX}"
        )


def _peer_credentials(path: Path, address: str, timeout_s: float) -> tuple[int, int]:
    """(pid, uid) of the process listening on `path`, from the kernel."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (ConnectionRefusedError, FileNotFoundError):
        raise ConnectionError(_no_server(address, "connection refused")) from None
    except TimeoutError:
        raise ConnectionError(
            f"joaderd at {address} did not accept a connection within {timeout_s:g} s; it may be "
            "hung or overloaded: check its log, or restart it"
        ) from None
    except OSError as error:
        raise ConnectionError(_no_server(address, error.strerror or str(error))) from None
    finally:
        sock.close()
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _no_server(address: str, detail: str) -> str:
    return (
        f"no joaderd is answering at {address} ({detail}). Start one with "
        "`joaderd --source NAME=PATH`, or point JOADER_ADDRESS (or address=) at the one running."
    )


# --- shared -----------------------------------------------------------------------------------


def _check_dir(directory: Path, *, allow_sticky: bool, fix: str) -> None:
    """Raises `UntrustedServerError` unless `directory` is one no other user can write into
    (or, with `allow_sticky`, a sticky one of root's or ours). FileNotFoundError propagates."""
    st = os.lstat(directory)
    problem = _dir_problem(st, allow_sticky=allow_sticky)
    if problem is not None:
        raise UntrustedServerError(
            f"the socket directory {directory} {problem} (owner uid {st.st_uid}, mode "
            f"0o{stat.S_IMODE(st.st_mode):o}): another local user could swap the socket in it; "
            f"{fix}"
        )


def _dir_problem(st: os.stat_result, *, allow_sticky: bool) -> str | None:
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"is {_kind(st.st_mode)}, not a directory"
    if allow_sticky and st.st_mode & stat.S_ISVTX and st.st_uid in (0, uid):
        return None  # like /tmp: others may add entries, but not remove or replace ours
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by you (uid {uid})"
    if st.st_mode & 0o022:
        return "is writable by group or others"
    return None


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")
