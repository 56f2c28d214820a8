"""The lease keeper's parent side (`joader.client.keeper.Keeper`), with real child processes:
a stand-in keeper program that speaks the keeper's protocol (one JSON line each way, then
"close" or EOF on stdin), and the real keeper where no joaderd answers."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from joader.client.board import Board
from joader.client.keeper import Keeper
from joader.errors import InvalidArgumentError

# Answers the registration as told by argv[2] ("ok", "error", "silent"), then records what its
# stdin said until EOF in argv[1].
PROGRAM = r"""
import json, sys
registration = json.loads(sys.stdin.readline())
mode = sys.argv[2]
if mode == "ok":
    print(json.dumps({"ok": True, "job_id": "job-1", "seen": registration}), flush=True)
elif mode == "error":
    print(json.dumps({"ok": False, "kind": "InvalidArgumentError", "message": "no such indices"}), flush=True)
    sys.exit(1)
elif mode == "silent":
    sys.exit(3)
if registration.get("describe"):
    sys.exit(0)
rest = sys.stdin.read()
open(sys.argv[1], "w").write(rest)
"""

REGISTRATION = {"address": "unix:/nowhere/joaderd.sock", "source": "demo", "indices": "", "timeout_s": 5}


def _command(tmp_path: Path, mode: str) -> tuple[str, ...]:
    program = tmp_path / "keeper.py"
    program.write_text(PROGRAM)
    return (sys.executable, str(program), str(tmp_path / "stdin.txt"), mode)


def test_a_keeper_spawns_answers_lives_and_stops_with_a_clean_close(tmp_path: Path) -> None:
    board = Board.create()
    keeper = Keeper.spawn(REGISTRATION, board, command=_command(tmp_path, "ok"))
    assert keeper.info["job_id"] == "job-1"
    assert keeper.info["seen"] == dict(REGISTRATION, board_fd=board.fd)  # the board's descriptor travels
    assert keeper.alive() and keeper.exit_note() == ""
    assert keeper.pid == keeper.process.pid
    keeper.stop()
    assert keeper.process.returncode == 0
    assert (tmp_path / "stdin.txt").read_text() == "close\n"  # the lease ends on purpose
    assert not keeper.alive()
    assert f"pid {keeper.pid}, has exited" in keeper.exit_note()
    keeper.stop()  # again: nothing more


def test_a_forked_copy_never_stops_its_parents_keeper(tmp_path: Path) -> None:
    keeper = Keeper.spawn(REGISTRATION, command=_command(tmp_path, "ok"))
    try:
        pid = os.fork()
        if pid == 0:  # the copy a DataLoader worker holds
            keeper.stop()
            os._exit(0 if keeper.alive() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert keeper.alive()
    finally:
        keeper.stop()
    assert keeper.process.returncode == 0


def test_describe_reaps_the_keeper_that_answered(tmp_path: Path) -> None:
    info = Keeper.describe(REGISTRATION, command=_command(tmp_path, "ok"))
    assert info["seen"]["describe"] is True


def test_a_refused_registration_raises_the_keepers_error_and_leaves_nothing(tmp_path: Path) -> None:
    board = Board.create()
    with pytest.raises(InvalidArgumentError, match="no such indices"):
        Keeper.spawn(REGISTRATION, board, command=_command(tmp_path, "error"))
    assert board.fd == -1  # the board went with the failed spawn


def test_a_keeper_that_says_nothing_is_a_connection_error(tmp_path: Path) -> None:
    with pytest.raises(ConnectionError, match="could not register with joaderd at unix:/nowhere"):
        Keeper.spawn(REGISTRATION, command=_command(tmp_path, "silent"))


def test_the_real_keeper_with_no_joaderd_says_so_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    registration = dict(REGISTRATION, address=f"unix:{tmp_path}/joaderd.sock")
    with pytest.raises(ConnectionError, match="no joaderd is answering"):
        Keeper.spawn(registration)
    assert time.monotonic() - started < 30  # no socket file: no retries
