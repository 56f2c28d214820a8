"""A Next front: `python -m joader.server.fronts.front` (NOTE [ Next fronts ]).

A grpc.aio server for `joader.Joader/Next` alone, on the Unix socket it is given; each call's
request bytes go to joaderd over the socket pair it inherited (`--link-fd`), and joaderd's reply
bytes (or error) go back to the caller unparsed. The front never parses a message: joaderd does,
and refuses what is malformed as it does on its own socket. It exits when joaderd closes the link
(or on SIGTERM); SIGINT is ignored, since a Ctrl-C in a terminal reaches the whole process group
and joaderd's own shutdown ends its fronts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import grpc

from joader.proto import ERROR_METADATA_KEY, MAX_MESSAGE_BYTES
from joader.server.fronts.messages import CANCEL, ERROR, NEXT, READY, REPLY
from joader.server.wire import Inbox, frame

logger = logging.getLogger("joader.server.front")

_SERVICE = "joader.Joader"


class Link(asyncio.Protocol):
    """The front's end of its socket pair to joaderd: calls out, replies back by call id."""

    def __init__(self) -> None:
        self._inbox = Inbox()
        self._transport: asyncio.Transport | None = None
        self._waiting: dict[int, asyncio.Future[tuple[Any, ...]]] = {}
        self._ids = itertools.count(1)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        inbox = self._inbox
        inbox.feed(data)
        while inbox.messages:
            message = inbox.messages.popleft()
            future = self._waiting.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        for future in self._waiting.values():
            if not future.done():
                future.cancel()
        self._waiting.clear()

    def send(self, message: tuple[Any, ...]) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame(message))

    async def next(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """One Next call, relayed: its request's bytes to joaderd, the reply's bytes back."""
        if self.closed.done():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "joaderd is stopping")
        call_id = next(self._ids)
        future: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        self.send((NEXT, call_id, request))
        try:
            answer = await future
        except asyncio.CancelledError:
            if self._waiting.pop(call_id, None) is not None:
                self.send((CANCEL, call_id))  # the client went away: joaderd ends the call
            if self.closed.done():
                await context.abort(grpc.StatusCode.UNAVAILABLE, "joaderd stopped")
            raise
        if answer[0] == REPLY:
            return answer[2]  # type: ignore[no-any-return]
        _, _, code, class_name, details = answer
        assert answer[0] == ERROR
        if class_name:
            context.set_trailing_metadata(((ERROR_METADATA_KEY, class_name),))
        await context.abort(grpc.StatusCode[code], details)
        raise AssertionError("abort returns only by raising")


async def serve(link_fd: int, path: Path, receive_limit: int) -> int:
    loop = asyncio.get_running_loop()
    link = Link()
    await loop.create_unix_connection(lambda: link, sock=socket.socket(fileno=link_fd))
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", receive_limit),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    # No deserializer or serializer: the handler gets the request's bytes and returns the reply's.
    handler = grpc.unary_unary_rpc_method_handler(link.next)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {"Next": handler}),))
    if server.add_insecure_port(f"unix:{path}") == 0:
        raise OSError(f"a Next front cannot listen at {path}")
    os.chmod(path, 0o600)
    await server.start()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    link.send((READY, f"unix:{path}", os.getpid()))
    stopped = asyncio.ensure_future(stop.wait())
    ends: list[asyncio.Future[Any]] = [link.closed, stopped]
    await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    await server.stop(grace=0.2)  # removes the socket it bound
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="joaderd-front", description=__doc__.split("\n")[0])
    parser.add_argument("--link-fd", type=int, required=True, help="the socket pair's end to joaderd")
    parser.add_argument("--socket", type=Path, required=True, help="the Unix socket to serve Next on")
    parser.add_argument("--receive-limit", type=int, default=MAX_MESSAGE_BYTES)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="joaderd-front %(process)d: %(message)s")
    try:
        return asyncio.run(serve(args.link_fd, args.socket, args.receive_limit))
    except OSError as error:
        print(f"joaderd-front {os.getpid()}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
