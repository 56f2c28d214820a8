"""`Fronts`: joaderd's Next fronts started, watched and stopped (NOTE [ Next fronts ]).

Each front is `python -m joader.server.fronts.front`, started with one end of a socket pair (the
other is a `Relay` on joaderd's event loop) and the path of its own socket beside joaderd's. A
front counts once it says it listens (READY); until then, and for a front that never gets there,
jobs are sent to joaderd's own socket. A front that dies before it is ready is started again, at
most `START_ATTEMPTS` times; one that dies after is a failure of joaderd (`on_failure`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from joader.address import SUN_PATH_MAX
from joader.process_ref import pid_alive
from joader.server.fronts.relay import Relay
from joader.server.service import JoaderServicer

logger = logging.getLogger(__name__)

START_ATTEMPTS = 3  # a front that died before it listened, started this many times at most
STOP_WAIT_S = 2.0  # a front has this long to exit once its link closed, then it is killed
_SOCKET_NAME = re.compile(r"\.joaderd-(\d+)-next\d+\.sock")


def socket_for(sock: Path, index: int, pid: int) -> Path:
    """Front `index`'s socket: beside joaderd's, named for joaderd's pid (never a successor's)."""
    return sock.parent / f".joaderd-{pid}-next{index}.sock"


def remove_stale_sockets(directory: Path) -> list[Path]:
    """Front sockets of joaderds that are gone (a front killed with its joaderd leaves one)."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            match = _SOCKET_NAME.fullmatch(entry.name)
            # lstat: a link named like a front's socket is not followed (nor removed)
            if match and not pid_alive(int(match.group(1))) and stat.S_ISSOCK(entry.lstat().st_mode):
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed.append(entry)
    return removed


@dataclass
class Front:
    index: int
    path: Path
    process: subprocess.Popen[bytes] | None = None
    relay: Relay | None = None
    transport: asyncio.BaseTransport | None = None
    address: str = ""  # set once it listens
    pid: int = 0
    attempts: int = 0
    failed: str = ""  # why it was given up on (it never listened)


class Fronts:
    """The Next fronts of one joaderd, on its event loop."""

    def __init__(self, count: int, sock: Path | None, receive_limit: int, servicer: JoaderServicer,
                 on_failure: Callable[[str], None]) -> None:
        self._servicer = servicer
        self._receive_limit = receive_limit
        self._on_failure = on_failure
        self._stopping = False
        self._turn = itertools.count()
        self.fronts: list[Front] = []
        if count and sock is None:
            logger.warning("--fronts %d: Next fronts serve Unix sockets only; joaderd listens on TCP, "
                           "so it serves Next itself", count)
            return
        if count and sock is not None:
            path = socket_for(sock, count - 1, os.getpid())
            if len(os.fsencode(path)) > SUN_PATH_MAX:
                logger.warning("--fronts %d: a front's socket path %s would be over %d bytes; joaderd "
                               "serves Next itself (set XDG_RUNTIME_DIR or --listen to a shorter path)",
                               count, path, SUN_PATH_MAX)
                return
            for name in remove_stale_sockets(sock.parent):
                logger.info("removed %s, a Next front's socket left by a joaderd that is gone", name)
            self.fronts = [Front(i, socket_for(sock, i, os.getpid())) for i in range(count)]

    async def start(self) -> None:
        for front in self.fronts:
            await self._spawn(front)

    def next_address(self) -> str:
        """The front the next attaching rank is sent to, in turn; "" while none listens."""
        ready = [f for f in self.fronts if f.address]
        return ready[next(self._turn) % len(ready)].address if ready else ""

    def status(self) -> list[dict[str, Any]]:
        return [{"pid": f.pid or None, "address": f.address or None, "ready": bool(f.address),
                 "calls": f.relay.calls if f.relay is not None else 0, "failed": f.failed or None}
                for f in self.fronts]

    def pids(self) -> list[int]:
        return [f.pid for f in self.fronts if f.pid and f.process is not None and f.process.poll() is None]

    async def _spawn(self, front: Front) -> None:
        front.attempts += 1
        with contextlib.suppress(OSError):
            front.path.unlink()  # this joaderd's own name: a front of it that was killed
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            front.process = subprocess.Popen(
                [sys.executable, "-m", "joader.server.fronts.front", "--link-fd", str(theirs.fileno()),
                 "--socket", str(front.path), "--receive-limit", str(self._receive_limit)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as error:
            ours.close()
            self._gave_up(front, f"it could not be started: {error}")
            return
        finally:
            theirs.close()
        front.pid = front.process.pid

        def ready(address: str, pid: int) -> None:
            front.address = address
            logger.info("Next front %d (pid %d) listens at %s", front.index, pid, address)

        relay = Relay(self._servicer, ready, lambda: self._lost(front))
        front.relay = relay
        front.transport, _ = await asyncio.get_running_loop().create_unix_connection(lambda: relay, sock=ours)

    def _lost(self, front: Front) -> None:
        """The front's link closed: it exited (or joaderd is stopping)."""
        if self._stopping:
            return
        code = None
        if front.process is not None:
            try:
                code = front.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:  # it closed the link but lives on: a front must not
                front.process.kill()
                code = front.process.wait()
        if front.address:
            self._on_failure(
                f"Next front {front.index} (pid {front.pid}) exited (status {code}) while serving: "
                "replies it carried may be lost, so joaderd stops; its jobs' keepers attach them again "
                "to a restarted joaderd, which resumes every epoch from what the readers consumed")
            return
        if front.attempts >= START_ATTEMPTS:
            self._gave_up(front, f"it exited {front.attempts} times (last status {code}) before it listened")
            return
        logger.warning("Next front %d (pid %d) exited (status %s) before it listened; starting it again",
                       front.index, front.pid, code)
        asyncio.get_running_loop().call_later(0.5, lambda: asyncio.ensure_future(self._respawn(front)))

    async def _respawn(self, front: Front) -> None:
        if not self._stopping:
            await self._spawn(front)

    def _gave_up(self, front: Front, why: str) -> None:
        front.failed = why
        logger.warning("Next front %d: %s; joaderd serves Next itself for the jobs it would have served "
                       "(its stderr above says why)", front.index, why)

    async def stop(self) -> None:
        """Closes every link; each front then stops serving and exits (killed after STOP_WAIT_S)."""
        self._stopping = True
        for front in self.fronts:
            if front.transport is not None:
                front.transport.close()
        deadline = time.monotonic() + STOP_WAIT_S
        for front in self.fronts:
            process = front.process
            if process is None:
                continue
            while process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if process.poll() is None:
                logger.warning("Next front %d (pid %d) did not exit within %.0f s of its link's close; "
                               "killed", front.index, front.pid, STOP_WAIT_S)
                process.kill()
                process.wait()
            with contextlib.suppress(OSError):
                front.path.unlink()
