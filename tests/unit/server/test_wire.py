"""The wire between joaderd and a decode worker (server/wire.py): framed messages on a
stream, reassembled from reads of any size, in order."""

from __future__ import annotations

import socket

from joader.server.pool.records import DecodeResult
from joader.server.wire import Inbox, frame, recv_nowait, send_message


def test_messages_come_back_whole_and_in_order_whatever_the_reads_cut() -> None:
    messages = [DecodeResult(task_id, True, None, f"{task_id}.jpg", 0.001, (3, 2, 2), "uint8", 12, task_id)
                for task_id in range(5)] + [None, [(1, 0, 2, 3, 4)]]
    data = b"".join(frame(message) for message in messages)
    for cut in (1, 3, 7, len(data)):
        inbox = Inbox()
        for start in range(0, len(data), cut):
            inbox.feed(data[start:start + cut])
        assert list(inbox.messages) == messages and not inbox.partial


def test_a_message_cut_short_waits_for_its_tail() -> None:
    inbox = Inbox()
    data = frame((7, 0, 1, 2, 3))
    inbox.feed(data[:-1])
    assert not inbox.messages and inbox.partial
    inbox.feed(data[-1:])
    assert list(inbox.messages) == [(7, 0, 1, 2, 3)] and not inbox.partial


def test_one_read_takes_every_message_a_worker_sent_since_the_last() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert recv_nowait(ours) is None  # nothing yet: never blocks
        for task_id in range(20):
            send_message(theirs, DecodeResult(task_id, True, None, "a.jpg", 0.001))
        inbox = Inbox()
        data = recv_nowait(ours)
        assert data
        inbox.feed(data)
        assert [result.task_id for result in inbox.messages] == list(range(20))  # one read, not 20
        theirs.close()
        assert recv_nowait(ours) == b""  # EOF
    finally:
        ours.close()
        theirs.close()
