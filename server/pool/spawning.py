"""Worker spawning and adoption: how the decode pool gets its workers from the forker.

joaderd never forks once gRPC runs, so every worker (a member, a replacement, the probation
worker) comes from the forker (`joader.server.pool.forker`): `spawn` asks it over the control
socket, and its answer carries the new worker's socket (SCM_RIGHTS). The forker is asked one
request at a time, so each answer is the request's: one request, one reply, never a reply taken
for another's.

A slow forker. `spawn` waits up to `SPAWN_TIMEOUT_S` for the forker's answer. Two things can
keep it waiting, and only one is permanent (see NOTE [ A slow forker is not a gone one ]):

- the forker is *gone*: EOF on the control socket, a send that fails, or its process has exited
  (`os.waitpid(pid, WNOHANG)` after a timeout). No worker can ever start again: the pool says so
  (critical) and fails what waits once no member is left (`DecodePool._dispatch`).
- the forker is *slow*: the timeout passed and its process is alive (a very loaded or swapping
  host, a SIGSTOP). The request stays *owed* (`owed`): its answer comes later on the control
  socket, where the consumer reads it (`read_control`, with its descriptor) and adopts the
  worker where the pool needs one now (`adopt_as`: a member while below the target, else the
  probation worker while a suspect waits, the need the request was for first), or stops it (the
  forker reaps it) if none. Meanwhile no other request is sent. Replacement then goes on as
  usual (`FaultHandling.replace_deferred`, every slice) until the pool is back at its target;
  tasks wait meanwhile, as for any pool fault. A reminder is logged every `SPAWN_TIMEOUT_S` while the
  answer is owed. Growth asked for while an answer is owed (`resize`) is made up by the
  replacement path once it comes, so it counts against the replacement rate limit there
  (harmless: growth is rare, the limit generous).
"""

from __future__ import annotations

import array
import logging
import os
import pickle
import select
import selectors
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, Literal

from joader.server.pool.forker import forker_main, log_exit
from joader.server.pool.records import SourceSpec, Worker
from joader.server.pool.roster import Roster
from joader.server.pool.worker import MAX_MESSAGE, WorkerContext
from joader.server.wire import send_message

if TYPE_CHECKING:
    from joader.server.pool.faults import FaultHandling

__all__ = ["SPAWN_TIMEOUT_S", "ForkerGone", "ForkerSlow", "NoWorker", "OwedSpawn", "WorkerSpawning",
           "adopt_as", "reap", "recv_with_fd", "start_forker"]

logger = logging.getLogger("joader.server.pool.decode_pool")  # the pool's log, whichever part writes

# How long `spawn` waits for the forker's answer before going on without it (the answer is still
# adopted when it comes: the module docstring, "A slow forker"). A module constant so that a test
# can shorten it.
SPAWN_TIMEOUT_S = 30.0

# NOTE [ A slow forker is not a gone one ]
# A forker that does not answer in time is asked whether its process lives before it is given
# up on. Were every timeout taken for a gone forker, the pool would never start a worker again
# after one slow answer (a loaded or swapping host): once the last worker died every decode
# would fail until joaderd restarted, though the forker's late answer, and the worker in it,
# was on its way. So a late answer is owed, read by the consumer and adopted.


class ForkerGone(OSError):
    """The forker can never answer again (EOF on its socket, or its process has exited)."""


class NoWorker(OSError):
    """No worker this time, though the forker is there: the pool tries again later."""


class ForkerSlow(NoWorker):
    """The forker is alive but did not answer within `SPAWN_TIMEOUT_S`; its answer is owed."""


@dataclass
class OwedSpawn:
    """The one spawn request the forker has not answered yet (module docstring, "A slow forker")."""

    probation: bool  # what it was asked for: the probation worker, or a member
    replacing: bool  # a member replacing a dead one (counted in `workers_replaced` when adopted)
    since: float  # monotonic time of the request
    reminded: float  # monotonic time of the last log line about it


def start_forker(arena_path: str, sources: Sequence[SourceSpec]) -> tuple[socket.socket, int]:
    """Forks the forker (`joader.server.pool.forker`); returns joaderd's end of its control socket
    and its pid. Call it before joaderd imports grpc."""
    control, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the forker
        try:
            child_end_fd = child_end.fileno()
            forker_main(child_end, WorkerContext(arena_path, tuple(sources)), parent, keep={child_end_fd})
        finally:
            os._exit(0)
    child_end.close()
    return control, pid


def adopt_as(*, asked_probation: bool, member_wanted: bool,
             probation_wanted: bool) -> Literal["member", "probation"] | None:
    """What a worker the forker sent late becomes: the probation worker if one is wanted and
    either no member is or the request was for it (the need it was asked for first), else a
    member if one is wanted, else nothing (it is stopped). Pure."""
    if probation_wanted and (not member_wanted or asked_probation):
        return "probation"
    if member_wanted:
        return "member"
    return None


class WorkerSpawning:
    """The `DecodePool`'s part that asks the forker for workers and adopts them (see the module
    docstring). State it owns: `control` and `forker_pid` (the forker), `owed` (a request not
    answered yet), `forker_gone`, `_born` (workers started so far). It puts the workers on the
    roster (`joader.server.pool.roster`); `faults` (`joader.server.pool.faults`) says whether a
    suspect waits for a probation worker and counts replacements."""

    faults: FaultHandling  # set by `DecodePool` once it exists (it refers to this part too)
    control: socket.socket  # joaderd's end of the forker's control socket (`start`)
    forker_pid: int

    def __init__(self, roster: Roster, dispatch: Callable[[], None]) -> None:
        self._roster = roster
        self._dispatch = dispatch
        self._born = 0  # workers started so far
        self.forker_gone = False
        self.owed: OwedSpawn | None = None  # a spawn request the forker has not answered yet

    def start(self, arena_path: str) -> None:
        """Forks the forker (`start_forker`) and watches its control socket."""
        self.control, self.forker_pid = start_forker(arena_path, self._roster.sources)
        self._roster.selector.register(self.control, selectors.EVENT_READ, None)

    def stop(self, timeout_s: float) -> None:
        """Closes the control socket (the forker sees EOF, kills what is left and exits) and
        reaps the forker, killing it after `timeout_s`."""
        self.control.close()
        reap(self.forker_pid, timeout_s)

    def spawn(self, index: int, *, probation: bool = False, replacing: bool = False) -> Worker:
        """Asks the forker for a worker and waits up to `SPAWN_TIMEOUT_S` for its answer (exit
        notices may come first). Raises `ForkerGone` if the forker can never answer, and
        `ForkerSlow` if it is alive but did not answer in time: the request is then owed
        (`owed`), and `_late_worker` takes its answer. Callers do not call it while one is owed.
        """
        if self.owed is not None:  # its answer would be taken for this one's
            raise ForkerSlow("an earlier request to the forker is still unanswered")
        try:
            self.control.send(b"spawn")
        except OSError as error:
            raise ForkerGone(f"cannot ask it for a worker: {error}") from None
        sent = time.monotonic()
        deadline = sent + SPAWN_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.control], [], [], remaining)[0]:
                # a timeout alone is not a gone forker: NOTE [ A slow forker is not a gone one ]
                if self._forker_exited():
                    raise ForkerGone("its process has exited")
                self.owed = OwedSpawn(probation, replacing, sent, time.monotonic())
                logger.warning(
                    "decode pool: the forker (pid %d) did not answer within %g s, but its process is "
                    "alive (a loaded or swapping host?): it is slow, not gone. Its worker is taken "
                    "when it answers; %d of %d workers meanwhile", self.forker_pid, SPAWN_TIMEOUT_S,
                    len(self._roster.members()), self._roster.num_workers)
                raise ForkerSlow(f"the forker did not answer within {SPAWN_TIMEOUT_S:g} s")
            message = recv_with_fd(self.control)
            if message is None:
                continue
            data, fd = message
            if not data:
                raise ForkerGone("its control socket closed")
            kind, pid, _ = pickle.loads(data)
            if kind == "exit":
                if fd is not None:  # cannot happen: only answers carry a socket
                    os.close(fd)
                log_exit(data)
                continue
            if fd is None:
                logger.error("decode pool: the forker's answer (worker pid %d) came without the worker's "
                             "socket (out of descriptors?); that worker exits by itself", pid)
                raise NoWorker("the forker's answer came without the worker's socket")
            return self._start(index, pid, socket.socket(fileno=fd), probation)

    def _start(self, index: int, pid: int, sock: socket.socket, probation: bool) -> Worker:
        """A worker the forker started, made a member (or the probation worker) under `index`."""
        worker = Worker(index, pid, sock, self._born, probation)
        self._born += 1
        self._roster.add(worker)
        if probation:
            logger.info("decode pool: probation worker %d started (pid %d) for %d suspect(s)",
                        index, pid, len(self.faults.suspects))
        else:
            logger.info("decode pool: worker %d started (pid %d)", index, pid)
        return worker

    def read_control(self) -> None:
        """The forker's messages outside `spawn`: exit notices, an owed answer (with the new
        worker's socket, hence `recv_with_fd`: a plain `recv` drops it), or EOF."""
        message = recv_with_fd(self.control)
        if message is None:
            return
        data, fd = message
        if not data:
            self.forker_lost("its control socket closed")
            self._dispatch()
            return
        kind, pid, _ = pickle.loads(data)
        if kind == "spawned":
            self._late_worker(pid, fd)
            self._dispatch()
            return
        if fd is not None:  # cannot happen: only answers carry a socket
            os.close(fd)
        log_exit(data)

    def _late_worker(self, pid: int, fd: int | None) -> None:
        """The owed answer (module docstring, "A slow forker"; NOTE [ A slow forker is not a gone
        one ]): its worker is adopted where the pool needs one now (`adopt_as`), or stopped if there
        is none."""
        roster = self._roster
        owed, self.owed = self.owed, None
        if fd is None:
            logger.error("decode pool: the forker's answer (worker pid %d) came without the worker's "
                         "socket (out of descriptors?); that worker exits by itself", pid)
            return
        sock = socket.socket(fileno=fd)
        late_s = time.monotonic() - owed.since if owed is not None else 0.0
        role = adopt_as(asked_probation=owed is not None and owed.probation,
                        member_wanted=len(roster.members()) < roster.num_workers,
                        probation_wanted=roster.probation is None and bool(self.faults.suspects))
        if owed is None or roster.closed or self.forker_gone or role is None:
            try:
                send_message(sock, None)  # it exits; the forker reaps it
            except OSError:
                pass
            sock.close()
            if owed is None:  # cannot happen: one request, one answer
                logger.error("decode pool: the forker sent a worker (pid %d) nobody asked for; stopped it", pid)
            else:
                logger.warning("decode pool: the forker answered %.1f s late; its worker (pid %d) is "
                               "not needed any more, stopped", late_s, pid)
            return
        logger.warning("decode pool: the forker answered %.1f s late; its worker (pid %d) joins the pool",
                       late_s, pid)
        self._start(next(i for i in count() if i not in roster.workers), pid, sock, role == "probation")
        if owed.replacing and role == "member":
            self.faults.replaced += 1

    def forker_lost(self, why: str) -> None:
        """The forker is gone for good (logged once): no worker can start again, and what waits
        fails once no member is left (`DecodePool._dispatch`)."""
        if self.forker_gone or self._roster.closed:
            return
        self.forker_gone = True
        self.owed = None  # its answer can never come (and its worker died with it)
        try:
            self._roster.selector.unregister(self.control)
        except (KeyError, ValueError):
            pass
        logger.critical("decode pool: the forker process is gone (%s); no worker can be started again "
                        "(%d of %d left): restart joaderd", why, len(self._roster.members()),
                        self._roster.num_workers)

    def _forker_exited(self) -> bool:
        """Whether the forker's process has exited (reaping it: `close` copes with that)."""
        try:
            pid, _ = os.waitpid(self.forker_pid, os.WNOHANG)
        except ChildProcessError:
            return True
        return pid != 0

    def remind_owed(self) -> None:
        """While an answer is owed (every slice): a reminder every `SPAWN_TIMEOUT_S`, and a look
        at whether the forker has exited meanwhile (its EOF says so too)."""
        owed = self.owed
        now = time.monotonic()
        if owed is None or now - owed.reminded < SPAWN_TIMEOUT_S:
            return
        owed.reminded = now
        if self._forker_exited():
            self.forker_lost("its process has exited")
            self._dispatch()
            return
        logger.warning("decode pool: still waiting for the forker's answer (%.0f s so far; its process "
                       "is alive); %d of %d workers meanwhile", now - owed.since, len(self._roster.members()),
                       self._roster.num_workers)


def reap(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.02)


def recv_with_fd(sock: socket.socket) -> tuple[bytes, int | None] | None:
    """One message of the forker's and the descriptor passed with it (SCM_RIGHTS, or None);
    (b"", None) at EOF (or a broken socket); None if there is none now. Never blocks, as
    `recv_nowait`; a descriptor beyond the first (none is ever sent) is closed.

    `sock.recvmsg`, not `socket.recv_fds`: see NOTE [ recvmsg, not socket.recv_fds ].
    """
    # NOTE [ recvmsg, not socket.recv_fds ]
    # In Python 3.11 `socket.recv_fds` ignores its `flags` argument (it never passes them to
    # `recvmsg`), so MSG_DONTWAIT does nothing there: the consumer would block in it whenever
    # `spawn`, on another thread, had taken the message select saw.
    fds = array.array("i")
    try:
        data, ancdata, _flags, _addr = sock.recvmsg(
            MAX_MESSAGE, socket.CMSG_SPACE(fds.itemsize), socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    except OSError:
        return b"", None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    for extra in fds[1:] if data else fds:
        os.close(extra)
    return data, (fds[0] if data and fds else None)
