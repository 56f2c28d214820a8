"""joaderd's side of one Next front's link (NOTE [ Next fronts ]): the calls a front relays,
served by the same code as the calls on joaderd's own socket (`JoaderServicer.start_next` and
`finish_next`), answered as the reply's bytes or an error's status.

A call whose batch is ready is answered inside the read that brought it, without a task; the
answers of one read go back in one write. A call that must wait becomes a task, cancelled if the
front says its client went away (its `finally` ends the registry's call, as grpc.aio's
cancellation does on joaderd's own socket).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from joader.errors import JoaderError, status_code_name
from joader.proto import joader_pb2
from joader.server.fronts.messages import CANCEL, ERROR, NEXT, READY, REPLY
from joader.server.service import JoaderServicer, Malformed, WaitingNext, log_refusal, tolerant
from joader.server.wire import Inbox, frame

logger = logging.getLogger(__name__)

_parse = tolerant(joader_pb2.NextRequest)
_INTERNAL = ("INTERNAL", None, "internal error in joaderd (Next)")


def error_answer(call_id: int, error: JoaderError) -> tuple[Any, ...]:
    """The ERROR message that makes the front end its call as joaderd's own socket would."""
    return (ERROR, call_id, status_code_name(error), type(error).__name__, str(error))


class Relay(asyncio.Protocol):
    """One front's link, on joaderd's event loop."""

    def __init__(self, servicer: JoaderServicer, on_ready: Callable[[str, int], None],
                 on_lost: Callable[[], None]) -> None:
        self._servicer = servicer
        self._on_ready = on_ready
        self._on_lost = on_lost
        self._inbox = Inbox()
        self._transport: asyncio.Transport | None = None
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self.calls = 0  # relayed so far (the status shows it)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._on_lost()

    def data_received(self, data: bytes) -> None:
        inbox = self._inbox
        inbox.feed(data)
        out: list[bytes] = []
        while inbox.messages:
            message = inbox.messages.popleft()
            kind = message[0]
            if kind == NEXT:
                self.calls += 1
                answer = self._start(message[1], message[2])
                if answer is not None:
                    out.append(frame(answer))
            elif kind == CANCEL:
                task = self._tasks.pop(message[1], None)
                if task is not None:
                    task.cancel()
            elif kind == READY:
                self._on_ready(message[1], message[2])
        if out:
            self._write(b"".join(out))

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _start(self, call_id: int, payload: bytes) -> tuple[Any, ...] | None:
        """The answer at once, or None when the call waits in a task of its own."""
        request = _parse(payload)
        if isinstance(request, Malformed):
            log_refusal("Next", request, "a Next front")
            return error_answer(call_id, request.error("Next"))
        try:
            started = self._servicer.start_next(request)
        except JoaderError as error:
            return error_answer(call_id, error)
        except Exception:
            logger.exception("internal error in Next (relayed by a front)")
            return (ERROR, call_id, *_INTERNAL)
        if isinstance(started, WaitingNext):
            task = asyncio.get_running_loop().create_task(self._finish(call_id, started))
            self._tasks[call_id] = task
            return None
        return (REPLY, call_id, started.SerializeToString())

    async def _finish(self, call_id: int, waiting: WaitingNext) -> None:
        try:
            reply = await self._servicer.finish_next(waiting)
            answer: tuple[Any, ...] = (REPLY, call_id, reply.SerializeToString())
        except JoaderError as error:
            answer = error_answer(call_id, error)
        except asyncio.CancelledError:
            return  # the client went away (or the link): nobody to answer
        except Exception:
            logger.exception("internal error in Next (relayed by a front)")
            answer = (ERROR, call_id, *_INTERNAL)
        finally:
            self._tasks.pop(call_id, None)
        self._write(frame(answer))

