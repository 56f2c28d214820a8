"""The Next front process (server/fronts/front.py), with this test as joaderd on the other end
of its socket pair: a call's bytes go through unparsed both ways; joaderd's errors reach the
client as the same status and error class; a client that gives up is cancelled on joaderd's
side; the front exits and removes its socket when joaderd closes the link."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from joader.client.channel import translate
from joader.errors import UnknownJobError
from joader.proto import GRPC_OPTIONS
from joader.server.fronts.messages import CANCEL, ERROR, NEXT, READY, REPLY
from joader.server.wire import Inbox, frame

pytestmark = pytest.mark.timeout(60)


class Core:
    """This test's side of the link: reads the front's messages, answers them."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbox = Inbox()

    def read(self, timeout_s: float = 10.0) -> tuple[Any, ...]:
        self.sock.settimeout(timeout_s)
        while not self.inbox.messages:
            data = self.sock.recv(1 << 16)
            assert data, "the front closed its link"
            self.inbox.feed(data)
        return self.inbox.messages.popleft()  # type: ignore[no-any-return]

    def send(self, message: tuple[Any, ...]) -> None:
        self.sock.sendall(frame(message))


@pytest.fixture
def front() -> Iterator[tuple[subprocess.Popen[bytes], Core, str, Path]]:
    directory = Path(tempfile.mkdtemp(prefix="fr-", dir="/tmp"))
    path = directory / "next0.sock"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    process = subprocess.Popen([sys.executable, "-m", "joader.server.fronts.front", "--link-fd",
                                str(theirs.fileno()), "--socket", str(path)], pass_fds=(theirs.fileno(),))
    theirs.close()
    core = Core(ours)
    try:
        ready = core.read(timeout_s=30)
        assert ready[0] == READY and ready[1] == f"unix:{path}" and ready[2] == process.pid
        assert path.stat().st_mode & 0o777 == 0o600
        yield process, core, ready[1], path
    finally:
        ours.close()
        try:
            process.wait(timeout=10)
        finally:
            process.kill()
            process.wait()
            path.unlink(missing_ok=True)
            directory.rmdir()


def _next(address: str) -> Any:
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    return channel, channel.unary_unary("/joader.Joader/Next")  # bytes in, bytes out


def test_a_call_goes_through_as_bytes_and_its_reply_comes_back(front: Any) -> None:
    _, core, address, _ = front
    channel, call = _next(address)
    with channel:
        pending = call.future(b"\x00not a NextRequest\xff", timeout=10)
        kind, call_id, payload = core.read()
        assert (kind, payload) == (NEXT, b"\x00not a NextRequest\xff")  # never parsed by the front
        core.send((REPLY, call_id, b"reply bytes"))
        assert pending.result() == b"reply bytes"


def test_an_error_reaches_the_client_as_joaderd_raised_it(front: Any) -> None:
    _, core, address, _ = front
    channel, call = _next(address)
    with channel:
        pending = call.future(b"", timeout=10)
        _, call_id, _ = core.read()
        core.send((ERROR, call_id, "NOT_FOUND", "UnknownJobError", "no job x; attach again"))
        with pytest.raises(grpc.RpcError) as raised:
            pending.result()
    error = translate(raised.value, address)
    assert isinstance(error, UnknownJobError) and "no job x; attach again" in str(error)


def test_a_client_that_gives_up_is_cancelled_on_joaderds_side(front: Any) -> None:
    _, core, address, _ = front
    channel, call = _next(address)
    with channel:
        with pytest.raises(grpc.RpcError) as raised:
            call(b"", timeout=0.5)  # joaderd never answers: the deadline passes
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _, call_id, _ = core.read()
    assert core.read() == (CANCEL, call_id)
    core.send((REPLY, call_id, b"too late"))  # an answer for a call that is gone is dropped


def test_the_front_exits_and_removes_its_socket_when_joaderd_closes_the_link(front: Any) -> None:
    process, core, address, path = front
    channel, call = _next(address)
    with channel:
        pending = call.future(b"", timeout=10)
        core.read()
        core.sock.close()  # joaderd's exit (even a SIGKILL: the kernel closes it)
        with pytest.raises(grpc.RpcError) as raised:
            pending.result()
        assert isinstance(translate(raised.value, address), ConnectionError)  # the server went away
    assert process.wait(timeout=10) == 0
    deadline = time.monotonic() + 5
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not path.exists()
