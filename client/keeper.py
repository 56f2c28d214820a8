"""The lease keeper's parent side: `Keeper` spawns the keeper process, reads its answer, says
whether it is still alive, and stops it. It is the only code that writes to the keeper's stdin.

`JoaderDataset` runs the keeper as a child (`python -m joader.client.keeper_process`, that
module's docstring has the protocol) so that the training process itself never holds a gRPC
channel when a DataLoader forks its workers: the parent writes the registration as one JSON line;
the keeper answers with the job's description (or the error) and holds the lease until its stdin
reaches EOF ("close" first: the lease ends on purpose, and the job's other ranks go on).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from joader.client.board import Board
from joader.errors import ERROR_CLASSES, JoaderError

KEEPER_COMMAND = (sys.executable, "-m", "joader.client.keeper_process")
REGISTER_TIMEOUT_S = 60.0  # for the keeper's answer: it retries a restarting joaderd meanwhile


class Keeper:
    """The lease keeper of one job, seen from the training process that spawned it.

    One job: hold the child process. `spawn` starts it and returns once it answered with the
    job's description (`info`), raising the error it reported otherwise; `alive` and
    `exit_note` say whether it still runs; `stop` ends it (and the job's lease with it) and
    closes the client board the keeper shares with this process's readers. A forked copy of
    the training process (a DataLoader worker) holds a copy of this object, and never stops
    the keeper: the lease is its parent's.
    """

    def __init__(self, process: subprocess.Popen[str], info: dict[str, Any], board: Board | None) -> None:
        self.process = process
        self.info = info
        self.board = board
        self.owner_pid = os.getpid()

    @classmethod
    def spawn(cls, registration: dict[str, Any], board: Board | None = None, *,
              timeout_s: float = REGISTER_TIMEOUT_S, command: Sequence[str] = KEEPER_COMMAND) -> Keeper:
        """A keeper holding the lease of the job `registration` describes. `board` goes to the
        keeper (its descriptor is passed on) and is closed when the keeper stops."""
        if board is not None:
            registration = dict(registration, board_fd=board.fd)
        fds = (board.fd,) if board is not None else ()
        try:
            process, info = _start_keeper(registration, timeout_s, fds, command)
        except BaseException:
            if board is not None:
                board.close()
            raise
        return cls(process, info, board)

    @classmethod
    def describe(cls, registration: dict[str, Any], *, timeout_s: float = REGISTER_TIMEOUT_S,
                 command: Sequence[str] = KEEPER_COMMAND) -> dict[str, Any]:
        """joaderd's description of the source and dataset: an `Attach` that registers nothing
        (the keeper answers and exits; it is reaped here)."""
        process, info = _start_keeper(dict(registration, describe=True), timeout_s, (), command)
        cls(process, info, None).stop()
        return info

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        """Whether the keeper process still runs (a zombie not yet reaped counts as running)."""
        try:
            os.kill(self.process.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def exit_note(self) -> str:
        """What an error about the job should add when the keeper is gone, else ""."""
        if self.alive():
            return ""
        return (f" (this process's lease keeper, pid {self.pid}, has exited: it was killed, "
                "or could not reach joaderd; its stderr says why)")

    def stop(self) -> None:
        """Ends the lease on purpose ("close": the job's other ranks go on), waits for the
        keeper to exit (killing it after 5 s) and closes the board. Only in the process that
        spawned it; called again, it does nothing more."""
        if os.getpid() != self.owner_pid:  # a forked copy: the lease is the parent's
            return
        keeper = self.process
        if self.board is not None:
            self.board.close()
        try:
            if keeper.stdin is not None and not keeper.stdin.closed:
                keeper.stdin.write("close\n")
                keeper.stdin.close()
            keeper.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            keeper.kill()
            keeper.wait()
        if keeper.stdout is not None:
            keeper.stdout.close()


def _start_keeper(registration: dict[str, Any], timeout_s: float, pass_fds: tuple[int, ...],
                  command: Sequence[str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """The keeper process and its answer, or the error it reported, raised here.

    NOTE [ The frame that raises a failed registration ]
    joader/testing/chaos.py (`_never_attached`) tells a launch that never attached (no joaderd
    answered) by this function's name in the traceback: keep the raise here, under this name."""
    keeper = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              pass_fds=pass_fds)
    assert keeper.stdin is not None and keeper.stdout is not None
    keeper.stdin.write(json.dumps(registration) + "\n")
    keeper.stdin.flush()
    ready, _, _ = select.select([keeper.stdout], [], [], timeout_s)
    line = keeper.stdout.readline() if ready else ""
    if not line:
        Keeper(keeper, {}, None).stop()
        raise ConnectionError(
            f"joader could not register with joaderd at {registration['address']} within "
            f"{timeout_s:g} s. Start one with `joaderd --source NAME=PATH`, or set JOADER_ADDRESS."
        )
    reply = json.loads(line)
    if reply.get("ok"):
        return keeper, reply
    Keeper(keeper, {}, None).stop()
    kind, message = reply.get("kind", "JoaderError"), reply.get("message", "unknown error")
    if kind == "ConnectionError":
        raise ConnectionError(message)
    if kind == "TimeoutError":
        raise TimeoutError(message)
    raise ERROR_CLASSES.get(kind, JoaderError)(message)
