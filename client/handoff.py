"""Batches that DataLoader workers hand to the training process as arena offsets, not bytes.

With `batched=True` and no transform, a DataLoader worker has nothing to compute: it would only
copy a batch out of joaderd's arena into shared memory for torch to pass to the training
process. That hand-off is what made workers slow for warm data (8% of a raw copy, against 44%
when the training process reads itself): torch sends one file descriptor per tensor over a
socket, each batch is a fresh shared-memory segment, and both processes fault on each of its
4 KiB pages.

So such a worker yields an `ArenaBatch`: the items' places in the arena (offsets, lengths),
their ids and labels, and a receipt. Pickling it for the DataLoader's result queue carries only
those numbers. Unpickling it in the training process (where `DataLoader.__next__` reads the
queue) copies the items from the arena into one of that process's pooled batch buffers
(`joader.client.batchpool`) and returns the tensors the user asked for: the training loop never
sees an `ArenaBatch`.

Pins: joaderd keeps a handed-out item in place until its reader acknowledges it, and the worker
must not acknowledge a batch before the training process has copied it. The training process
makes no gRPC call (it would then hold a gRPC channel when its DataLoader forks the next
epoch's workers, which can crash them). Instead it notes each copy on the client board, a
shared mapping the forked workers inherit: one 64-bit receipt per worker slot, the worker's pass
tag (32 bits of its token) and the batch's sequence number, written in one store. A worker's
batches reach the training process in the order it yielded them, so a receipt covers every
earlier batch of that worker too; the worker acknowledges what the receipt covers in its next
request, and at the end of its epoch waits for the receipt of its last batch. A batch the
training process never unpickles (the loop stopped early) stays pinned until a newer pass
supersedes the worker's and a lease passes, or the job ends: what joaderd already does for a
killed worker's last batch.
"""

from __future__ import annotations

import collections
import os
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from joader.cache.arena import ArenaReader
from joader.client.batchpool import BatchPool
from joader.client.board import RECEIPT_SLOTS, Board
from joader.errors import IntegrityError

_TAG_BITS = 32
_SEQ_MASK = (1 << _TAG_BITS) - 1


@dataclass(frozen=True)
class Layout:
    """The batch tensor the training loop gets."""

    shape: tuple[int, ...]  # one item's
    dtype: str
    batch_size: int
    return_index: bool
    crc_check: bool = False  # check each item's crc32 after the copy (JoaderDataset's verify=)


@dataclass(frozen=True)
class ArenaLocation:
    """Where one joaderd's arena is, as a handed-over batch names it (a restarted joaderd has a
    new one): its path, its owner's uid, and `held_by` (pid, fd), the lease keeper's descriptor
    of it, which reaches it after a restart removed its name. Not the server's arena
    (`joader.cache.arena.Arena`): only where to map it."""

    path: str
    server_uid: int | None
    held_by: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


class Segment:
    """Items of one batch in one arena (offsets), or copied already (`data`, their bytes
    concatenated: the worker copied them because joaderd asked it to, `copy_now`)."""

    __slots__ = ("arena", "checksums", "data", "item_ids", "lengths", "offsets")

    def __init__(self, arena: ArenaLocation | None) -> None:
        self.arena = arena
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.item_ids: list[int] = []
        self.checksums: list[int] = []
        self.data = bytearray()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_segment, (self.arena, self.offsets, self.lengths, self.item_ids, self.checksums, bytes(self.data)))


def _segment(arena: ArenaLocation | None, offsets: list[int], lengths: list[int], item_ids: list[int],
             checksums: list[int], data: bytes) -> Segment:
    segment = Segment(arena)
    segment.offsets, segment.lengths, segment.item_ids, segment.checksums = offsets, lengths, item_ids, checksums
    segment.data = bytearray(data)
    return segment


class ArenaBatch:
    """One batch as a worker hands it over: where its items are, not the items. Items of one
    arena form a segment; a batch has two only if joaderd restarted while it was filling (or
    joaderd asked for some to be copied at once)."""

    __slots__ = ("labels", "layout", "receipt", "segments")

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.segments: list[Segment] = []
        self.labels: list[int] = []
        self.receipt: tuple[int, int, int] | None = None  # board key, slot, value

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def item_ids(self) -> list[int]:
        return [item_id for segment in self.segments for item_id in segment.item_ids]

    def _segment(self, arena: ArenaLocation | None) -> Segment:
        if not self.segments or self.segments[-1].arena != arena:
            self.segments.append(Segment(arena))
        return self.segments[-1]

    def add(self, arena: ArenaLocation, offset: int, length: int, item_id: int, label: int, checksum: int = 0) -> None:
        segment = self._segment(arena)
        segment.offsets.append(offset)
        segment.lengths.append(length)
        segment.item_ids.append(item_id)
        segment.checksums.append(checksum)
        self.labels.append(label)

    def add_bytes(self, data: bytes, item_id: int, label: int) -> None:
        """An item the worker copied already (its crc32 checked, under verify=, when it copied it)."""
        segment = self._segment(None)
        segment.lengths.append(len(data))
        segment.item_ids.append(item_id)
        segment.checksums.append(0)
        segment.data += data
        self.labels.append(label)

    def __reduce__(self) -> tuple[Any, ...]:
        return (receive, (self.layout, self.segments, self.labels, self.receipt))


class Receipts:
    """A worker's side: which of its handed-over batches the training process has copied.

    `hand(batch)` stamps a batch just before it is yielded; `copied(arena)` returns the ids of
    the batches copied since the last call, those in `arena` only (a restarted joaderd does not
    know the old server's items), in the order they were handed over."""

    def __init__(self, board: Board, slot: int, token: int) -> None:
        self.board = board
        self.slot = slot
        self.tag = token & _SEQ_MASK
        self.seq = 0
        self.handed: collections.deque[tuple[int, ArenaBatch]] = collections.deque()
        board.note_receipt(slot, self.tag << _TAG_BITS)  # nothing copied of this pass yet

    @staticmethod
    def possible(board: Board | None, slot: int) -> bool:
        return board is not None and 0 <= slot < RECEIPT_SLOTS

    def hand(self, batch: ArenaBatch) -> ArenaBatch:
        self.seq += 1
        batch.receipt = (self.board.key, self.slot, (self.tag << _TAG_BITS) | self.seq)
        self.handed.append((self.seq, batch))
        return batch

    def copied(self, arena: str) -> list[int]:
        value = self.board.receipt(self.slot)
        if value >> _TAG_BITS != self.tag:
            return []  # the receipt of another pass in this slot: none of ours copied yet
        upto = value & _SEQ_MASK
        ids: list[int] = []
        while self.handed and self.handed[0][0] <= upto:
            _, batch = self.handed.popleft()
            for segment in batch.segments:
                if segment.arena is not None and segment.arena.name == arena:
                    ids.extend(segment.item_ids)
        return ids

    @property
    def outstanding(self) -> int:
        return len(self.handed)


class _Receiver:
    """This process's arena mappings and batch pools.

    One per process (a pid check, as for gRPC channels): a process forked from here gets its
    own, never the parent's pooled mappings, which the parent still writes into."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()  # the DataLoader's pin-memory thread may unpickle too
        self.mappings: dict[ArenaLocation, ArenaReader] = {}
        self.pools: dict[int, BatchPool] = {}

    def mapping(self, arena: ArenaLocation) -> ArenaReader:
        mapping = self.mappings.get(arena)
        if mapping is None:
            if len(self.mappings) >= 2:  # joaderd restarted twice: the oldest arena is done with
                self.mappings.pop(next(iter(self.mappings))).close()
            mapping = self.mappings[arena] = ArenaReader(arena.path, expected_uid=arena.server_uid,
                                                         held_by=arena.held_by)
        return mapping

    def pool(self, nbytes: int) -> BatchPool:
        pool = self.pools.get(nbytes)
        if pool is None:
            pool = self.pools[nbytes] = BatchPool(nbytes)
        return pool


_receiver: _Receiver | None = None
_receiver_lock = threading.Lock()


def _this_process() -> _Receiver:
    global _receiver
    with _receiver_lock:
        if _receiver is None or _receiver.pid != os.getpid():
            _receiver = _Receiver()
        return _receiver


def receive(layout: Layout, segments: list[Segment],
            labels: list[int], receipt: tuple[int, int, int] | None) -> tuple[torch.Tensor, ...]:
    """The batch's tensors, copied out of the arena in this process, and its receipt noted.

    Called by unpickling an `ArenaBatch`: what the DataLoader yields to the training loop."""
    receiver = _this_process()
    dtype = np.dtype(layout.dtype)
    with receiver.lock:
        pool = receiver.pool(layout.batch_size * int(np.prod(layout.shape)) * dtype.itemsize)
        images = pool.take().view(dtype).reshape(layout.batch_size, *layout.shape)[:len(labels)]
        at = 0
        for segment in segments:
            rows = images[at:at + len(segment.item_ids)]
            if segment.arena is None:
                rows.reshape(-1).view(np.uint8)[:] = np.frombuffer(segment.data, np.uint8)
            else:
                receiver.mapping(segment.arena).copy_many(segment.offsets, segment.lengths, rows)
                if layout.crc_check:
                    _check_crcs(segment, rows)
            at += len(segment.item_ids)
    if receipt is not None:
        key, slot, value = receipt
        board = Board.created(key)
        if board is not None:  # else the dataset was closed, and its job with it
            board.note_receipt(slot, value)
    label_tensor = torch.tensor(labels, dtype=torch.int64)
    if layout.return_index:
        item_ids = [item_id for segment in segments for item_id in segment.item_ids]
        return torch.tensor(item_ids, dtype=torch.int64), torch.from_numpy(images), label_tensor
    return torch.from_numpy(images), label_tensor


def _check_crcs(segment: Segment, rows: np.ndarray) -> None:
    for item_id, expected, row in zip(segment.item_ids, segment.checksums, rows, strict=True):
        if expected and zlib.crc32(row.reshape(-1).view(np.uint8)) != expected:
            raise IntegrityError(
                f"item {item_id} read from arena {segment.arena.name if segment.arena else '?'} does "
                "not match the checksum of its decode: its bytes were overwritten or read from the "
                "wrong place. Nothing was delivered; report this as a bug.")
