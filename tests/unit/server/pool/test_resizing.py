"""Which members a shrink retires (joader.server.pool.resizing.retire_order): pure, no processes."""

from __future__ import annotations

import socket

from joader.server.pool.records import DecodeTask, Worker
from joader.server.pool.resizing import retire_order


def _worker(index: int, born: int, tasks: int) -> Worker:
    worker = Worker(index, 1000 + index, socket.socket(socket.AF_UNIX), born)
    for task_id in range(tasks):
        worker.tasks.append(DecodeTask(task_id, 0, task_id, 0, 0))
    return worker


def test_idle_workers_retire_first_then_the_least_loaded() -> None:
    busy, idle, loaded = _worker(0, 0, 1), _worker(1, 1, 0), _worker(2, 2, 2)
    try:
        assert retire_order([busy, idle, loaded], 1) == [idle]
        assert retire_order([busy, idle, loaded], 2) == [idle, busy]
    finally:
        for w in (busy, idle, loaded):
            w.sock.close()


def test_the_newest_retires_first_among_equals() -> None:
    old, new, newest = _worker(0, 0, 1), _worker(1, 5, 1), _worker(2, 9, 1)
    try:
        assert retire_order([old, newest, new], 2) == [newest, new]
    finally:
        for w in (old, new, newest):
            w.sock.close()


def test_no_surplus_retires_nobody() -> None:
    worker = _worker(0, 0, 0)
    try:
        assert retire_order([worker], 0) == []
    finally:
        worker.sock.close()
