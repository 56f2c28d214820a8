"""The decode pool's roster (joader.server.pool.roster): which workers get healthy tasks, and what
adding, sending to and stopping a worker does to the books; socket pairs, no processes."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from joader.server.pool.records import DecodeTask, PoolConfig, Probe, Worker
from joader.server.pool.roster import Roster
from joader.server.wire import Inbox

pytestmark = pytest.mark.timeout(30)

Pairs = list[tuple[socket.socket, socket.socket]]  # (joaderd's end, the worker's end)


@pytest.fixture
def roster() -> Iterator[Roster]:
    roster = Roster(PoolConfig(2), (), 0)
    yield roster
    roster.selector.close()


@pytest.fixture
def pairs() -> Iterator[Pairs]:
    made: Pairs = []
    yield made
    for ours, theirs in made:
        ours.close()
        theirs.close()


def _received(sock: socket.socket, count: int) -> list[object]:
    """The first `count` messages sent to `sock`'s peer (joader.server.wire)."""
    inbox = Inbox()
    while len(inbox.messages) < count:
        inbox.feed(sock.recv(4096))
    return list(inbox.messages)


def _worker(pairs: Pairs, index: int, *, probation: bool = False) -> Worker:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pairs.append((ours, theirs))
    return Worker(index, 1000 + index, ours, index, probation)


def test_members_are_the_workers_neither_retiring_nor_on_probation(roster: Roster, pairs: Pairs) -> None:
    member, retiring, probation = _worker(pairs, 0), _worker(pairs, 1), _worker(pairs, 2, probation=True)
    retiring.retiring = True
    for worker in (member, retiring, probation):
        roster.add(worker)
    assert roster.members() == [member]
    assert roster.probation is probation
    assert {key.data for key in roster.selector.get_map().values()} == {member, retiring, probation}


def test_send_queues_the_task_and_starts_its_clock_only_when_the_worker_was_idle(
        roster: Roster, pairs: Pairs) -> None:
    worker = _worker(pairs, 0)
    first, second = DecodeTask(1, 0, 1, 0, 8), Probe(7, 0, (2, 3))
    assert roster.send(worker, first)
    started = worker.started_s
    assert started > 0
    assert roster.send(worker, second)
    assert list(worker.tasks) == [first, second] and worker.started_s == started
    theirs = pairs[0][1]
    first_sent, second_sent = _received(theirs, 2)
    assert first_sent == (1, 0, 1, 0, 8) and second_sent[1:] == (7, 0, (2, 3))
    theirs.close()
    assert not roster.send(worker, DecodeTask(2, 0, 2, 8, 8))  # the caller handles the death
    assert list(worker.tasks) == [first, second]


def test_stop_takes_the_worker_off_the_roster_and_tells_it_to_exit(roster: Roster, pairs: Pairs) -> None:
    kept, probation = _worker(pairs, 0), _worker(pairs, 1, probation=True)
    roster.add(kept)
    roster.add(probation)
    roster.staged[(0, 5)] = probation.index
    roster.staged[(0, 6)] = kept.index
    roster.stop(probation)
    assert roster.probation is None and list(roster.workers) == [kept.index]
    assert dict(roster.staged) == {(0, 6): kept.index}  # what it kept is gone with it
    assert [key.data for key in roster.selector.get_map().values()] == [kept]
    assert probation.sock.fileno() == -1
    assert _received(pairs[1][1], 1) == [None]  # the stop message
