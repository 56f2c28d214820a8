"""An exiting joaderd leaves its successor's files alone (issue 36, item 7: the idle-exit race).

An auto-started joaderd that exits for idleness closes its listener first, then spends up to
seconds in its shutdown (gRPC's grace, the threads' joins, the decode pool) before it removes
"its" socket and ready file. A job starting in that window finds the socket refusing, starts a
new joaderd for the spec, and the new one removes the dead socket and binds the same path, and
writes the same ready file. The old one's cleanup then removed both by path: the new server
served on an unlinked socket nobody could reach (the next job started a third server, and the
orphan held its arena until its own idle exit), and a starter whose ready file was removed
waited its whole start timeout.

Here the successor is played by the test: the old server's socket file replaced by another
listener, its ready file by another server's, then the old server stopped.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Any

from joader.launch import read_ready_file, write_ready_file


def test_an_exiting_server_removes_only_its_own_socket_and_ready_file(demo_root: Path, start_joaderd: Any) -> None:
    old = start_joaderd({"demo": demo_root}, cache_items=32)
    path = Path(old.address[len("unix:"):])
    ready = old.process.ready_file
    assert read_ready_file(ready) is not None
    path.unlink()  # what the successor's prepare_server_socket does to a socket that refuses
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as successor:
        successor.bind(str(path))
        successor.listen()
        ino = os.stat(path).st_ino
        write_ready_file(ready, {"address": old.address, "pid": 1, "version": 1})
        old.process.signal(signal.SIGTERM)  # not stop(): the launcher then removes its own directory
        assert old.process.proc.wait(timeout=60) == 0
        assert path.exists() and os.stat(path).st_ino == ino, "the old server removed its successor's socket"
        assert read_ready_file(ready) == {"address": old.address, "pid": 1, "version": 1}, \
            "the old server removed its successor's ready file"
        path.unlink()
