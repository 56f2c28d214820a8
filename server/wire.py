"""The wire between joaderd and a decode worker: pickled messages, each framed by its length,
over a stream socket (`AF_UNIX`, `SOCK_STREAM`), so that one read takes every result a worker
sent since the last.

NOTE [ One read per batch of results ]
A worker's socket was `SOCK_SEQPACKET`: one message per result, one `recv` (a system call,
and a release and retake of the GIL that another thread may win) per result on joaderd's
results thread. With cheap decodes (issue 37's tiny images, 0.1-0.3 ms) that was thousands of
reads per second for results a few hundred bytes long. On a stream each read takes whatever
the socket holds (`READ_BYTES` at most): every result sent while the last batch was filed.
A worker still sends each result the moment it is done, never holding one back for a batch:
a result held in a worker that then crashed would be lost, and the task blamed for the crash
would be one that had finished (joader.server.pool.faults blames the oldest unanswered task).
Messages keep their order, and the reader handles every whole message before a worker's EOF;
a message cut short by the worker's death (a kill in the middle of a send) is dropped with it,
as an unsent one was. The forker's control socket stays `SOCK_SEQPACKET` (one message per
request, and the descriptors it passes).
"""

from __future__ import annotations

import pickle
import socket
import struct
from collections import deque
from typing import Any

__all__ = ["READ_BYTES", "Inbox", "frame", "recv_nowait", "send_message"]

_HEADER = struct.Struct("<I")  # a message's length, before it
READ_BYTES = 1 << 20  # bytes one read takes at most


def frame(message: Any) -> bytes:
    """`message` pickled, after its length: what goes on the wire."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def send_message(sock: socket.socket, message: Any) -> None:
    """Sends one framed message whole (raises OSError if the peer is gone)."""
    sock.sendall(frame(message))


class Inbox:
    """The messages received on one stream socket, put back together from its reads (`feed`),
    in order; a message's tail that has not come yet waits for the next read."""

    __slots__ = ("_buffer", "messages")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.messages: deque[Any] = deque()  # whole messages, not taken yet

    def feed(self, data: bytes) -> None:
        """Adds a read's bytes; every message they complete goes to `messages`."""
        buffer = self._buffer
        buffer += data
        start, size, header = 0, len(buffer), _HEADER.size
        while size - start >= header:
            (length,) = _HEADER.unpack_from(buffer, start)
            end = start + header + length
            if end > size:
                break
            self.messages.append(pickle.loads(bytes(buffer[start + header:end])))
            start = end
        if start:
            del buffer[:start]

    @property
    def partial(self) -> bool:
        """Whether part of a message waits for the rest."""
        return bool(self._buffer)


def recv_nowait(sock: socket.socket) -> bytes | None:
    """What the socket holds now (`READ_BYTES` at most), b"" at EOF (or a broken socket), None
    if nothing.

    Never blocks: `WorkerSpawning.spawn` (which may run on the submitting thread, when a send
    finds a worker dead) can take the data select saw before the consumer thread got the lock.
    """
    try:
        return sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError:
        return b""
