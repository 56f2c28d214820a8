"""`Fronts`' pure parts: where a front's socket goes, and which left-behind sockets go."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from joader.server.fronts.fronts import remove_stale_sockets, socket_for


def _dead_socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # the file stays: a socket nobody listens on


def test_a_fronts_socket_is_beside_joaderds_and_named_for_its_pid(tmp_path: Path) -> None:
    assert socket_for(tmp_path / "joaderd.sock", 1, 4242) == tmp_path / ".joaderd-4242-next1.sock"


def test_only_the_sockets_of_joaderds_that_are_gone_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    stale = socket_for(tmp_path / "j.sock", 0, dead_pid)
    live = socket_for(tmp_path / "j.sock", 0, os.getpid())
    not_a_socket = socket_for(tmp_path / "j.sock", 1, dead_pid)
    other = tmp_path / f".joaderd-{dead_pid}.sock"  # joaderd's own bind name: not a front's
    for path in (stale, live, other):
        _dead_socket(path)
    not_a_socket.write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _dead_socket(elsewhere / "x.sock")
    link = socket_for(tmp_path / "j.sock", 2, dead_pid)
    link.symlink_to(elsewhere / "x.sock")  # named as a front's socket: not followed, not removed
    assert remove_stale_sockets(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and not_a_socket.exists() and other.exists()
    assert link.is_symlink() and (elsewhere / "x.sock").exists()
