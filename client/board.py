"""The client board: what the readers of one rank know together, shared with its lease keeper.

A JoaderDataset's readers are the training process and its DataLoader workers (forked); its
lease keeper is a separate program. When joaderd restarts, the keeper attaches the job again and
the readers resume their epoch on the new server, which must learn which items this rank has
already received in it, from *all* its readers. So each reader marks the items it receives here,
and the keeper publishes the new job's identity here.

It is a memfd (`memfd_create`): an anonymous file that the forked workers inherit as a shared
mapping and the keeper receives as a descriptor (`pass_fds`). Nothing is left behind when the
processes die, however they die, and no other user can open it.

Layout (native-endian): generation u64 at 0 (bumped by the keeper after each re-attach),
reconnecting u64 at 8 (1 while the keeper looks for joaderd), epoch u64 at 16 and token u64 at 24
(the newest pass any reader of this rank received items of), identity length u32 at 32 and the
identity JSON after it (job id, secret, arena path, server uid; up to byte 2048), receipts u64 at
2048 (one per DataLoader worker slot, up to 255: which batches the training process copied out
of the arena, for a worker that handed it batches by offset, `joader.client.handoff`), notices u64
at 4088 (one bit per advice already logged by some reader, so forked DataLoader workers give it
once); the current pass of DataLoader workers at 4096 (key u64, token u64, then one u32 pid per
worker slot that joined it, `claim_pass`); at 8152 the epoch, share and base (u64 each) of an
elastic resume's rest this rank reads (`note_rest`); at 8176 the offer and the pass token
(u64 each) of the resume the training process loaded (`take_resume`); from byte 8192 one u32 per item of the
source: the epoch in which this rank last received it (0: never).
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import secrets
import struct
import weakref
from typing import TYPE_CHECKING, Any

from pyroaring import BitMap

from joader.errors import InvalidArgumentError

if TYPE_CHECKING:
    import numpy as np

_HEADER = 8192
_IDENTITY_AT = 36
_RECEIPTS_AT = 2048
_NOTICES_AT = 4088
RECEIPT_SLOTS = (_NOTICES_AT - _RECEIPTS_AT) // 8
_PASS_AT = 4096  # key, token, then RECEIPT_SLOTS pids
_REST_AT = 8152  # epoch, share, base
_TAKEN_AT = 8176  # offer, token
MAX_EPOCH = 2**32 - 1  # epochs are marked as u32
_U64 = struct.Struct("=Q")

class BoardClosedError(RuntimeError):
    """The board was closed (with its dataset); what a reader would note there is moot."""


# The boards this process created, by key: how a batch handed over by a forked DataLoader
# worker finds the board to note its receipt on.
_created: weakref.WeakValueDictionary[int, Board] = weakref.WeakValueDictionary()


class Board:
    """A mapping of the board; `create` in the dataset, `open` in the keeper."""

    def __init__(self, fd: int, owner: bool) -> None:
        self.fd = fd
        self._owner = owner
        self._map: mmap.mmap | None = None
        self._items: np.ndarray | None = None
        self._receipts: np.ndarray | None = None
        self._sized = False  # this process sized the board (`size_for`): its size is fixed
        self.key = secrets.randbits(63)

    @classmethod
    def create(cls) -> Board:
        fd = os.memfd_create("joader-board", 0)  # inheritable only where passed (pass_fds)
        os.ftruncate(fd, _HEADER)
        board = cls(fd, owner=True)
        _created[board.key] = board
        return board

    @classmethod
    def created(cls, key: int) -> Board | None:
        """The board with `key` if this process created it and it is still open."""
        board = _created.get(key)
        return board if board is not None and board.fd >= 0 else None

    @classmethod
    def open(cls, fd: int) -> Board:
        return cls(fd, owner=False)

    def size_for(self, num_source_items: int) -> None:
        """Makes room for one entry per item of the source (called once, after attach)."""
        os.ftruncate(self.fd, _HEADER + 4 * num_source_items)
        self._remap()
        self._sized = True

    def _remap(self) -> mmap.mmap:
        """The mapping, made again when the board grew (the keeper maps it before the dataset
        sizes it). Raises `BoardClosedError` once the board is closed.

        NOTE [ Marks after close ]
        A reply that arrives after `close()` is still marked by its gRPC callback, on another
        thread. Looking the size up with fstat on the closed descriptor prints EBADF (5 of 36
        clean closes mid-epoch did), and a descriptor number reused meanwhile would map another
        file. So a board sized here never looks at its descriptor again, and `close` clears the
        descriptor before the mapping."""
        mapping = self._map
        if mapping is not None and self._sized:
            return mapping
        fd = self.fd
        if fd < 0:
            raise BoardClosedError("joader board: closed with its dataset (JoaderDataset.close())")
        size = os.fstat(fd).st_size
        if mapping is None or len(mapping) != size:
            self._items = self._receipts = None
            mapping = self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return mapping

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """numpy views of the items' epochs and the receipts, made when first needed: the lease
        keeper uses neither (but after a restart), and numpy with its thread pool was about 0.1 s
        of the keeper's 0.2 s of CPU at start-up."""
        mapping = self._remap()
        if self._items is None or self._receipts is None:
            import numpy as np

            count = (len(mapping) - _HEADER) // 4
            self._items = np.frombuffer(mapping, dtype=np.uint32, count=count, offset=_HEADER)
            # One aligned 8-byte store per receipt (a numpy element), never two halves.
            self._receipts = np.frombuffer(mapping, dtype=np.uint64, count=RECEIPT_SLOTS, offset=_RECEIPTS_AT)
        return self._items, self._receipts

    def _get(self, offset: int) -> int:
        return _U64.unpack_from(self._remap(), offset)[0]

    def _set(self, offset: int, value: int) -> None:
        _U64.pack_into(self._remap(), offset, value)

    # ----------------------------------------------------------------------------- keeper
    @property
    def generation(self) -> int:
        return self._get(0)

    @property
    def reconnecting(self) -> bool:
        return bool(self._get(8))

    @reconnecting.setter
    def reconnecting(self, value: bool) -> None:
        self._set(8, int(value))

    def publish(self, identity: dict[str, Any]) -> None:
        """The keeper attached the job again: new identity, then a new generation."""
        data = json.dumps(identity).encode()
        mapping = self._remap()
        if _IDENTITY_AT + len(data) > _RECEIPTS_AT:
            raise ValueError("joader board: identity too large")
        mapping[_IDENTITY_AT:_IDENTITY_AT + len(data)] = data
        struct.pack_into("=I", mapping, 32, len(data))
        self._set(0, self.generation + 1)

    def refuse(self, message: str) -> None:
        """The keeper will not attach the job again (joaderd came back serving another source):
        readers that look for a new identity raise `message` instead."""
        self.publish({"refused": message[:1500]})

    def identity(self) -> dict[str, Any]:
        mapping = self._remap()
        (length,) = struct.unpack_from("=I", mapping, 32)
        return json.loads(bytes(mapping[_IDENTITY_AT:_IDENTITY_AT + length]))

    # ----------------------------------------------------------------------------- readers
    def first_notice(self, bit: int) -> bool:
        """True for the first reader to ask about notice `bit` (0..63): it logs the advice.
        A POSIX record lock on the word (per process, unlike flock, whose lock forked workers
        would share) makes the test-and-set atomic across the readers."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX, 8, _NOTICES_AT)
        try:
            notices = self._get(_NOTICES_AT)
            if notices & (1 << bit):
                return False
            self._set(_NOTICES_AT, notices | (1 << bit))
            return True
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 8, _NOTICES_AT)

    def claim_pass(self, key: int, slot: int, pid: int) -> int:
        """The token of the pass a DataLoader worker's `iter()` joins.

        The workers of one DataLoader iterator compute the same `key` (from their base seed),
        but the base seed repeats whenever the user re-seeds torch, so the key alone cannot
        tell a new iterator's workers from the old one's. The board can: a worker joins the
        current pass if its key matches and its slot is still free there; else it starts a new
        pass with a fresh random token, which the other workers of its iterator then join. A
        POSIX record lock makes the test-and-set atomic across the workers."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX, 16 + 4 * RECEIPT_SLOTS, _PASS_AT)
        try:
            import numpy as np

            mapping = self._remap()
            pids = np.frombuffer(mapping, dtype=np.uint32, count=RECEIPT_SLOTS, offset=_PASS_AT + 16)
            current_key, token = self._get(_PASS_AT), self._get(_PASS_AT + 8)
            if current_key == key and token and pids[slot] == 0:
                pids[slot] = pid
                return token
            token = secrets.randbits(63) | 1
            pids[:] = 0
            pids[slot] = pid
            self._set(_PASS_AT, key)
            self._set(_PASS_AT + 8, token)
            return token
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 16 + 4 * RECEIPT_SLOTS, _PASS_AT)

    def receipt(self, slot: int) -> int:
        """The last receipt noted in worker slot `slot` (0: none)."""
        return int(self._arrays()[1][slot])

    def note_receipt(self, slot: int, value: int) -> None:
        try:
            self._arrays()[1][slot] = value
        except BoardClosedError:
            pass  # the dataset closed: its job, which the receipt was for, ended with it

    def current_pass(self) -> tuple[int, int]:
        """(epoch, token) of the newest pass a reader of this rank received items of."""
        return self._get(16), self._get(24)

    def note_pass(self, epoch: int, token: int) -> None:
        try:
            if (epoch, token) != self.current_pass():
                self._set(24, token)
                self._set(16, epoch)
        except BoardClosedError:
            pass  # a reply that arrived after the dataset closed: its job ended with it

    def note_rest(self, epoch: int, share: int, base: int) -> None:
        """This rank reads `epoch` as its share of an elastic resume's rest (`share` items,
        counted from a consumed set of `base` items: NOTE [ An elastic resume ] in
        server/registry/resumes.py); the keeper's report after a restart says so."""
        try:
            self._set(_REST_AT, 0)
            self._set(_REST_AT + 8, share)
            self._set(_REST_AT + 16, base)
            self._set(_REST_AT, epoch)
        except BoardClosedError:
            pass  # as in note_pass

    def rest(self, epoch: int) -> tuple[int, int] | None:
        """(share, base) if this rank reads `epoch` as an elastic resume's rest, else None."""
        if not epoch or self._get(_REST_AT) != epoch:
            return None
        return self._get(_REST_AT + 8), self._get(_REST_AT + 16)

    def take_resume(self, offer: int, token: int) -> bool:
        """Whether pass `token` resumes the checkpoint `offer` (a random id the training process
        gave it when it loaded it): the first pass to ask takes it, and only its readers do.

        NOTE [ A loaded resume is one pass's ]
        A state loaded in the training process before its DataLoader's workers exist (every
        rank's states, an elastic resume) is copied into every worker the DataLoader forks, at
        each `iter()`: without this, the next epoch's workers resumed the same epoch again and
        read nothing. A POSIX record lock makes the test-and-set atomic across the workers."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX, 16, _TAKEN_AT)
        try:
            if self._get(_TAKEN_AT) != offer:
                self._set(_TAKEN_AT + 8, token)
                self._set(_TAKEN_AT, offer)
                return True
            return self._get(_TAKEN_AT + 8) == token
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 16, _TAKEN_AT)

    def mark(self, item_ids: list[int], epoch: int) -> None:
        """These items reached a reader in `epoch`. An id beyond the source is refused, and
        nothing marked: the board has one entry per item (a loaded state's ids are checked
        before, by `joader.client.state_checks`; joaderd's are the source's)."""
        import numpy as np

        try:
            items = self._arrays()[0]
        except BoardClosedError:
            return  # as in note_pass
        ids = np.asarray(item_ids, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= len(items)):
            bad = ids[(ids < 0) | (ids >= len(items))]
            raise InvalidArgumentError(
                f"joader board: item ids {bad[:5].tolist()} are not ids of the source's {len(items)} "
                "items, so the board cannot mark them; they came from a loaded state or from a "
                "joaderd that serves another source: load the state this job saved, and read "
                "from the joaderd the job attached to")
        items[ids] = epoch

    def received(self, epoch: int) -> BitMap:
        """The items this rank's readers received in `epoch`."""
        import numpy as np

        return BitMap(np.flatnonzero(self._arrays()[0] == epoch).astype(np.uint32))

    def close(self) -> None:
        """Closes the descriptor and drops the mapping. Not `mmap.close()`: another thread may
        be writing through it this moment (a reply's callback); CPython unmaps it when the last
        user lets go. The descriptor is cleared first, so that a thread that finds no mapping
        then finds no descriptor either (`_remap`)."""
        fd = self.fd
        if self._owner:
            self.fd = -1
        self._items = self._receipts = None
        self._map = None
        if self._owner and fd >= 0:
            os.close(fd)
