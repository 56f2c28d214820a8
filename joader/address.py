"""Where joaderd listens: the default per-user Unix socket, `JOADER_ADDRESS`, and parsing.

Server and client resolve the address the same way, so that a plain `joaderd` and a plain
`JoaderDataset(...)` meet without configuration. The default is a Unix domain socket in a
directory only the user can enter; TCP is used only when asked for, and never on all interfaces
by default.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from joader.errors import InvalidArgumentError

ENV_ADDRESS = "JOADER_ADDRESS"


def default_socket_path() -> Path:
    """`$XDG_RUNTIME_DIR/joader/joaderd.sock`, or `/tmp/joader-<uid>/joaderd.sock`."""
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.path.isdir(runtime_dir):
        return Path(runtime_dir) / "joader" / "joaderd.sock"
    return Path(tempfile.gettempdir()) / f"joader-{os.getuid()}" / "joaderd.sock"


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
