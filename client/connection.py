"""The job as one process reads it: its identity, and every request and reply that uses it.

A job's identity is its id, its secret, and the arena its replies point into. A joaderd restart
changes all three at once (the lease keeper attaches the job again and publishes the new ones on
the client board). A reader that kept one piece of the old identity read the rest of an epoch
out of the old arena: right labels, other items' pixels. So the identity is one immutable value,
`Identity`, owned by one `Connection` per dataset; every request is built from it, and every
reply is read through the arena the reply itself names (`NextResponse.arena`), never through a
mapping a reader captured. A reply from the server that died is still read correctly: the items
it handed out stay pinned and intact in its arena, which the job's lease keeper holds open.

The connection also owns what a restart asks of a reader: waiting for the keeper to attach the
job again, adopting the new identity (refusing a joaderd that serves another source under the
same name), and acknowledging only to the server that handed an item out.
"""

from __future__ import annotations

import base64
import copy
import logging
import multiprocessing.util
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from joader.cache.arena import ArenaReader
from joader.client.board import Board
from joader.client.channel import PendingCall, call_async, reset_channel
from joader.client.handoff import ArenaLocation
from joader.errors import (
    ERROR_CLASSES,
    IntegrityError,
    ParentDiedError,
    SourceChangedError,
    UnknownJobError,
)
from joader.proto import joader_pb2

logger = logging.getLogger(__name__)

_UNREACHABLE_GRACE_S = 5.0
_ARENAS_KEPT = 2  # mappings a process keeps: the current arena's, and the previous one's for
# replies still being read (a dead arena's pages count against /dev/shm while mapped)
# Whole batches one Next reply may carry when they are ready at once (a warm cache): one round
# trip, one protobuf and one acknowledgement per several batches (bench/micro/delivery.py). joaderd
# still waits only for the first; the others are handed out only if already prepared.
BATCHES_PER_REQUEST = 4


@dataclass(frozen=True)
class Identity:
    """Who this job is on one joaderd, and where that joaderd's arena is. Never mutated: a
    restart makes a new one (`generation` + 1)."""

    job_id: str
    secret: bytes
    arena_path: str
    server_uid: int | None
    fingerprint: str
    generation: int = 0
    keeper_pid: int | None = None  # the lease keeper holds `arena_fd` open (see ArenaReader)
    arena_fd: int | None = None
    # This process's rank in the job on this joaderd: its global rank, or its place among its
    # host's ranks when the job spans hosts (`joader.sampling.hosts`).
    rank: int = 0
    # Where this rank's Next calls go: a front of joaderd's (NOTE [ Next fronts ] in
    # server/fronts/__init__.py), or "" for joaderd's own address.
    next_address: str = ""

    @property
    def arena(self) -> str:
        """The arena's name, as replies name it."""
        return os.path.basename(self.arena_path)

    @classmethod
    def from_keeper(cls, info: dict[str, Any], generation: int) -> Identity:
        return cls(
            job_id=info["job_id"], secret=base64.b64decode(info["job_secret"]),
            arena_path=info["arena_path"], server_uid=info.get("server_uid"),
            fingerprint=info.get("fingerprint", ""), generation=generation,
            keeper_pid=info.get("keeper_pid"), arena_fd=info.get("arena_fd"), rank=int(info.get("rank", 0)),
            next_address=info.get("next_address") or "",
        )


@dataclass
class Reply:
    """One Next reply and the identity it was asked with: its acknowledgements go to that
    server only (a restarted joaderd never handed these items out)."""

    response: Any
    identity: Identity


class Connection:
    """The one owner of a dataset's identity in this process (forked workers get a copy, and
    each adopts a restart on its own, from the board)."""

    def __init__(self, address: str, identity: Identity, board: Board | None, *, timeout_s: float,
                 crc_check: bool, keeper_note: Callable[[], str] | None = None) -> None:
        self.address = address
        self.identity = identity
        self.board = board
        self.timeout_s = timeout_s
        self.crc_check = crc_check  # JoaderDataset's verify=: each item's crc32 after its copy
        self._keeper_note = keeper_note or _no_keeper_note
        self._arenas: dict[str, Identity] = {identity.arena: identity}  # what replies may name
        self._mappings: tuple[int, dict[str, ArenaReader]] = (os.getpid(), {})
        # In a DataLoader worker: the training process's pid (`watch_parent`).
        self.parent_pid: int | None = None

    def watch_parent(self) -> None:
        """This process is a DataLoader worker: its waits end once its training process died.

        NOTE [ Workers that outlive their training process ]
        torch's worker loop checks its parent only between fetches; a worker waiting inside one
        (for the receipt of its last batch, for a joaderd restart) would wait out `timeout_s`
        after a killed job (a killed `batched=True` job's two workers stayed 7 minutes).
        `os.getppid()` changes the moment the parent dies (the worker is reparented);
        prctl(PR_SET_PDEATHSIG) would fire on the death of the forking *thread*."""
        if self.parent_pid is None:
            # The pid the worker was forked from, known since the fork: os.getppid() read now
            # may already be the reaper's (torch's own watchdog reads it so: a worker whose
            # training process dies right after forking it then waits for work for good).
            parent = multiprocessing.parent_process()
            self.parent_pid = parent.pid if parent is not None and parent.pid else os.getppid()
            # Before the result queue's finalizer (exitpriority -5), which waits to flush what
            # the worker put on it: once the pipe is full, for good, since its sibling workers
            # hold the pipe's read end and never read (two workers of a killed job, each with
            # a copied-out batch of 96 KB queued, never exited).
            multiprocessing.util.Finalize(None, _exit_if_orphaned, args=(self.parent_pid,), exitpriority=100)
        # Dead already (this runs when the worker's DataLoader fetcher is made, before torch's
        # watchdog, which would then never see it die): nothing to fetch for; leave now.
        _exit_if_orphaned(self.parent_pid)

    def check_parent(self) -> None:
        """Raises `ParentDiedError` in a DataLoader worker whose training process died."""
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            raise ParentDiedError(
                f"job {self.job_id}: the training process (pid {self.parent_pid}) of this DataLoader "
                f"worker (pid {os.getpid()}) died; the worker stops. Nothing to fix here: see why "
                "the training process ended (its log, the OOM killer).")

    @property
    def job_id(self) -> str:
        return self.identity.job_id

    # ----------------------------------------------------------------------------- identity

    def refresh(self) -> bool:
        """Adopts the identity the keeper published after a restart, if newer; True if it did."""
        board = self.board
        if board is None or board.generation == self.identity.generation:
            return False
        generation = board.generation
        info = board.identity()
        if "refused" in info:  # the keeper will not attach again: why, and as which error
            raise ERROR_CLASSES.get(info.get("error", ""), SourceChangedError)(info["refused"])
        identity = Identity.from_keeper(info, generation)
        if self.identity.fingerprint and identity.fingerprint and identity.fingerprint != self.identity.fingerprint:
            raise SourceChangedError(_changed_message(self.identity, identity))
        self.identity = identity
        self._arenas[identity.arena] = identity
        while len(self._arenas) > _ARENAS_KEPT + 1:
            del self._arenas[next(iter(self._arenas))]
        self._reset_channels()
        self.mapping(identity.arena)  # mapped now, while its file surely exists
        logger.debug("job %s: attached again to the restarted joaderd", identity.job_id)
        return True

    def await_reconnect(self, unreachable_since: list[float | None]) -> bool:
        """Whether to ask again after a refused or unknown-job call: waits while the lease
        keeper attaches the job to a restarted joaderd (then adopts it), and retries a refused
        connection for a few seconds (the first call after a restart can race the server's
        start). False: joaderd did not go away, the error stands."""
        board = self.board
        if board is None:
            return False
        now = time.monotonic()
        if board.generation == self.identity.generation and not board.reconnecting:
            since = unreachable_since[0]
            if since is None:
                since = unreachable_since[0] = now
            if now - since < _UNREACHABLE_GRACE_S:
                # The keeper's stream breaks as soon as joaderd dies; until it says so, or
                # after joaderd came back, a refused call is worth repeating.
                time.sleep(0.2)
                self._reset_channels()
                return True
            return False
        deadline = now + self.timeout_s
        logger.debug("job %s: waiting for the lease keeper to attach the job again", self.job_id)
        while board.generation == self.identity.generation:
            self.check_parent()
            if time.monotonic() > deadline:
                raise TimeoutError(self._stopped_message(f"within {self.timeout_s:g} s (timeout_s)")) from None
            if not board.reconnecting and board.generation == self.identity.generation:
                return False  # the keeper gave up (its stderr says why)
            time.sleep(0.05)
        self.refresh()
        unreachable_since[0] = None
        return True

    def _reset_channels(self) -> None:
        reset_channel(self.address)
        if self.identity.next_address:
            reset_channel(self.identity.next_address)

    def _stopped_message(self, waited: str) -> str:
        return (
            f"joaderd at {self.address} stopped while job {self.job_id} was reading, and no joaderd "
            f"came back there{' ' + waited if waited else ''}. See joaderd's log for why (a traceback "
            "there is a bug: please report it); start joaderd again as before, then the job (from "
            "its checkpoint if it saved one).")

    # ----------------------------------------------------------------------------- calls

    def request(self, fields: dict[str, Any], acks: Reply | list[int] | None = None,
                ack_ids: list[int] | None = None, on_reply: Callable[[Any], None] | None = None) -> Call:
        """Sends a Next with this identity. `acks`: the reply whose items (or `ack_ids` of
        them) are acknowledged, sent only if that reply came from this same server."""
        identity = self.identity
        ids: list[int] = []
        if isinstance(acks, Reply):
            if acks.identity.generation == identity.generation:
                ids = list(acks.response.item_ids) if ack_ids is None else ack_ids
        elif acks:
            ids = acks
        request = joader_pb2.NextRequest(job_id=identity.job_id, job_secret=identity.secret, acks=ids,
                                         pid=os.getpid(), **fields)
        pending = call_async(identity.next_address or self.address, "Next", request, timeout_s=self.timeout_s + 30)
        if on_reply is not None:
            pending.on_success(on_reply)
        return Call(pending, identity)

    def reply(self, call: Call, unreachable_since: list[float | None]) -> Reply | None:
        """The reply; None when the caller should ask again: joaderd restarted meanwhile and
        the job was attached again, or joaderd was briefly unreachable."""
        try:
            response = call.pending.result()
        except (ConnectionError, UnknownJobError) as error:
            if self.await_reconnect(unreachable_since):
                return None
            if isinstance(error, UnknownJobError):
                raise UnknownJobError(f"{error}{self._keeper_note()}") from None
            # NOTE [ A joaderd that stopped is not a joaderd never started ]
            # Not channel.translate's "no joaderd is answering ... start one": this job was
            # served, so a joaderd ran here and stopped; starting another elsewhere is the wrong fix.
            raise ConnectionError(self._stopped_message("")) from None
        unreachable_since[0] = None
        if response.arena and response.arena != call.identity.arena:
            raise IntegrityError(
                f"job {call.identity.job_id}: joaderd answered with items of arena {response.arena}, "
                f"but it serves {call.identity.arena}; the reply was not read. Report this as a bug.")
        return Reply(response, call.identity)

    def acknowledge(self, reply: Reply, ids: list[int], fields: dict[str, Any]) -> None:
        """Acknowledges `ids` of `reply` alone (no items asked). After a restart they are moot:
        the new joaderd never handed them out, and the resumed epoch skips them."""
        if not ids or reply.identity.generation != self.identity.generation:
            return
        unreachable: list[float | None] = [None]
        while True:
            try:
                self.request(fields, reply, ids).pending.result()
                return
            except (ConnectionError, UnknownJobError):
                if not self.await_reconnect(unreachable) or reply.identity.generation != self.identity.generation:
                    return  # joaderd is gone or came back: the pins went with the old server

    # ----------------------------------------------------------------------------- the arena

    def mapping(self, arena: str) -> ArenaReader:
        """This process's mapping of `arena` (a reply's), which must be one this job's
        identities named: a reply is never read through another arena."""
        pid, mappings = self._mappings
        if pid != os.getpid():
            mappings = {}
            self._mappings = (os.getpid(), mappings)
        mapping = mappings.get(arena)
        if mapping is None:
            where = self.arena(arena)
            mapping = ArenaReader(where.path, expected_uid=where.server_uid, held_by=where.held_by)
            mappings[arena] = mapping
            while len(mappings) > _ARENAS_KEPT:
                mappings.pop(next(iter(mappings))).close()
        return mapping

    def without_board(self) -> Connection:
        """A copy for a spawned process (pickled): no board (a forked mapping does not
        travel) and no mappings of this process's."""
        connection = copy.copy(self)
        connection.board = None
        connection._mappings = (0, {})
        connection._keeper_note = _no_keeper_note  # the keeper stays with the training process
        return connection

    def arena(self, arena: str) -> ArenaLocation:
        """`arena` as a batch handed to another process names it (`joader.client.handoff`)."""
        identity = self._arenas.get(arena)
        if identity is None:
            raise IntegrityError(
                f"job {self.job_id}: a reply names arena {arena!r}, which no joaderd this job "
                "attached to uses; nothing was read. Report this as a bug.")
        held = (identity.keeper_pid, identity.arena_fd) if identity.keeper_pid and identity.arena_fd else None
        return ArenaLocation(identity.arena_path, identity.server_uid, held)

    def check_crcs(self, response: Any, outs: list[Any], at: int = 0) -> None:
        """With the crc check on (JoaderDataset's `verify=`): each copied item's crc32 against the
        one its decode wrote (`response.checksums`; 0 means none was recorded)."""
        if not self.crc_check:
            return
        checksums = response.checksums
        for i, out in enumerate(outs):
            expected = checksums[at + i] if at + i < len(checksums) else 0
            if expected and zlib.crc32(memoryview(out).cast("B")) != expected:
                raise IntegrityError(
                    f"job {self.job_id}: item {response.item_ids[at + i]} read from arena {response.arena} "
                    "does not match the checksum of its decode: its bytes were overwritten or read "
                    "from the wrong place. Nothing was delivered; report this as a bug.")


def crc_check_wanted(verify: bool | None) -> bool:
    """JoaderDataset's `verify=`: the crc check of copied items; None: on when the environment
    has JOADER_VERIFY set (not "" or "0")."""
    if verify is None:
        return os.environ.get("JOADER_VERIFY", "") not in ("", "0")
    return bool(verify)


def _no_keeper_note() -> str:
    return ""


def _exit_if_orphaned(parent_pid: int) -> None:
    """At a DataLoader worker's exit: with its training process dead, nothing it queued will
    be read; leave without flushing it."""
    if os.getppid() != parent_pid:
        os._exit(0)


class Call:
    """A Next in flight and the identity it was sent with."""

    __slots__ = ("identity", "pending")

    def __init__(self, pending: PendingCall, identity: Identity) -> None:
        self.pending = pending
        self.identity = identity


def _changed_message(old: Identity, new: Identity) -> str:
    return (
        f"job {old.job_id}: joaderd restarted and now serves another source under this job's "
        f"source name (fingerprint {new.fingerprint}, was {old.fingerprint}: the item count, "
        "files, labels or stage differ). Resuming the epoch there would deliver other items "
        "under the same indices. Restart joaderd with the same --source and stage options, "
        "or start the job again from scratch."
    )
