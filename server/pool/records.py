"""The records the decode pool's modules share: its configuration, results and statistics, and
the tasks, probes and workers it keeps books of.

The pool (`joader.server.pool.decode_pool`) is a roster of workers (`joader.server.pool.roster`)
and parts split by concern; every part works on these records:

- `DecodeTask`: one item to prepare into a range of the arena (capacity 0: *size first*);
- `Probe`: items whose exact sizes the cache asked for (`joader.server.pool.probes`);
- `Worker`: joaderd's end of one decode worker: its socket and the tasks sent to it, the head
  being the one it runs. A worker is a *member* of the pool (gets healthy tasks), *retiring*
  (`joader.server.pool.resizing`), or the *probation worker* (`joader.server.pool.faults`).
"""

from __future__ import annotations

import socket
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from joader.server.wire import Inbox, frame, recv_nowait

__all__ = ["MAX_MESSAGE", "PROBE", "DecodeResult", "DecodeTask", "Finished", "NeedsBytes", "PoolConfig", "PoolStats",
           "Probe", "ProbeSizes", "SourceSpec", "Worker", "recv_nowait"]

MAX_MESSAGE = 1 << 16  # bytes of one message on the forker's control socket, at most
PROBE = "probe"  # a probe task: (PROBE, probe id, source index, item ids)


@dataclass(frozen=True)
class SourceSpec:
    """What a worker needs to prepare items of one source (inherited through fork, never
    pickled): the items (`joader.sources.base.ItemSource`) and the stage (`joader.stages.Stage`)."""

    source: Any
    stage: Any


# NOTE [ Named worker results ]
# A worker answers each task with one pickled message: a decode with a `DecodeResult` (or a
# `NeedsBytes`: it did not fit its range), a probe with a `ProbeSizes`. They were positional tuples, a probe's told apart by its first field (a
# "sizes" tag) and a decode's rebuilt field by field on joaderd's side; they are now named
# tuples, pickled as they are (by class, fields in order: a worker is forked from joaderd and
# has the same module), and joaderd's reader (`DecodePool._read_message`) tells them apart by
# type.


class DecodeResult(NamedTuple):
    """A decode's final result, as its worker sent it (`joader.server.pool.worker.run_task`).

    A named tuple, not a frozen dataclass: one is built per decode on the results thread, and
    a frozen dataclass's `__init__` (a `object.__setattr__` per field) cost 0.95 us against
    0.25 us (issue 37)."""

    task_id: int
    ok: bool
    error: str | None  # set when ok is False: names the file and the reason
    path: str
    decode_s: float
    shape: tuple[int, ...] = ()  # of the prepared item, when ok
    dtype: str = ""
    nbytes: int = 0  # its bytes, when ok
    checksum: int = 0  # zlib.crc32 of the bytes written into the arena (clients may verify)

    @property
    def size_only(self) -> bool:
        """False: a decode that settles its item (`NeedsBytes.size_only` is True)."""
        return False


class NeedsBytes(NamedTuple):
    """A decode that did not fit the range it was given (*size first*: none; or its file changed
    since its size was read), as its worker sent it (`joader.server.pool.worker.run_task`):
    nothing was written, the worker keeps the prepared array, and the item needs `nbytes`
    (more than it was given). Not a failure: the cache allocates that and submits the item
    again (`joader.server.books.item_sizes`)."""

    task_id: int
    error: str  # "<file>: <bytes> bytes, <capacity> allocated", for the log
    path: str
    decode_s: float
    shape: tuple[int, ...]  # of the prepared item
    dtype: str
    nbytes: int  # what the item needs (at least 1: an empty item takes one unit)

    @property
    def ok(self) -> bool:
        """False: nothing was written."""
        return False

    @property
    def checksum(self) -> int:
        return 0

    @property
    def size_only(self) -> bool:
        """True: the item's size, not a decode that settles it."""
        return True


Finished = DecodeResult | NeedsBytes  # what `DecodePool.get_results` returns


class ProbeSizes(NamedTuple):
    """A probe's answer, as its worker sent it (`joader.server.pool.worker.run_probe`)."""

    probe_id: int
    sizes: tuple[tuple[int, int], ...]  # (item id, exact bytes or 0 if unknown), in the probe's order


@dataclass(frozen=True)
class PoolConfig:
    num_workers: int
    # a decode running longer kills its worker; None: "auto", fitted to the measured decode
    # times, at most `decode_timeout_ceiling_s` (joader.server.pool.timeout; joaderd's default)
    decode_timeout_s: float | None = 60.0
    decode_timeout_ceiling_s: float = 60.0
    tasks_per_worker: int = 2  # sent ahead, so that a worker never idles between tasks
    max_attempts: int = 2


@dataclass(frozen=True)
class PoolStats:
    """A snapshot for `joader status`. Retiring workers (`joader.server.pool.resizing`) are counted
    only in `workers_retiring`: `workers_alive`, `workers_busy` and `worker_pids` are the pool's
    members, `workers_configured` its target."""

    workers_configured: int
    workers_alive: int
    workers_busy: int
    workers_replaced: int
    tasks_retried: int
    tasks_timed_out: int
    worker_pids: tuple[int, ...]
    workers_retiring: int = 0  # finishing the tasks they have, then stopped
    resizes: tuple[str, ...] = ()  # "21:04:05 workers 2 -> 3 (reason)", the most recent last
    crash_loop: bool = False  # over ten deaths nothing explains within a minute: replacements slowed
    restart_in_s: float = 0.0  # when the next delayed replacement starts (0: none waiting)
    suspects: int = 0  # tasks in the suspect lane (waiting or running in the probation worker)
    # files that hung or killed a worker twice, the last time alone: they fail at once, and are
    # not decoded again until they change on disk (joader.server.pool.quarantine)
    quarantined: int = 0
    probation_pid: int = 0  # the probation worker (0: none running)
    decode_timeout_s: float = 0.0  # the timeout in force (joader.server.pool.timeout)
    quarantine_lifted: int = 0  # quarantined files tried again because they changed on disk


class DecodeTask:
    """One item to prepare into `capacity` bytes at `offset` of the arena (the message a worker
    runs), with what its faults have shown so far (`joader.server.pool.faults`)."""

    __slots__ = ("attempts", "capacity", "item_id", "offset", "presumed", "reason", "source_index", "task_id")

    def __init__(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        self.task_id = task_id
        self.source_index = source_index
        self.item_id = item_id
        self.offset = offset
        self.capacity = capacity
        self.attempts = 0  # deaths or timeouts of workers while running it
        self.reason = ""
        # its first death was presumed its own (the worker replaced without asking the policy):
        # charged to the policy if it then decodes
        self.presumed = False

    @property
    def key(self) -> tuple[int, int]:
        return self.source_index, self.item_id

    def fields(self) -> tuple[int, int, int, int, int]:
        """What its worker runs (`joader.server.pool.worker.run_task`)."""
        return self.task_id, self.source_index, self.item_id, self.offset, self.capacity

    def message(self) -> bytes:
        return frame(self.fields())


class Probe:
    """Up to `PROBE_BATCH` items of one source whose exact sizes the cache asked for
    (`joader.server.pool.probes`)."""

    __slots__ = ("item_ids", "probe_id", "source_index")

    def __init__(self, probe_id: int, source_index: int, item_ids: tuple[int, ...]) -> None:
        self.probe_id = probe_id
        self.source_index = source_index
        self.item_ids = item_ids

    def message(self) -> bytes:
        return frame((PROBE, self.probe_id, self.source_index, self.item_ids))


class Worker:
    """joaderd's end of one decode worker: its socket and the tasks sent to it."""

    __slots__ = ("born", "inbox", "index", "pid", "probation", "retiring", "sock", "started_s", "tasks")

    def __init__(self, index: int, pid: int, sock: socket.socket, born: int, probation: bool = False) -> None:
        self.index = index
        self.pid = pid
        self.sock = sock
        self.born = born  # the pool's count of workers started before this one: larger is newer
        self.tasks: deque[DecodeTask | Probe] = deque()  # sent, unfinished; the head is the one running
        self.started_s = 0.0  # when the head task started
        self.retiring = False  # gets no new task; stopped once `tasks` is empty
        self.probation = probation  # runs suspects only, one at a time; not a member of the pool
        self.inbox = Inbox()  # its messages as read off its socket (joader.server.wire)
