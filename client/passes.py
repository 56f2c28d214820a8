"""Passes: one `iter()` of a JoaderDataset, what names it on the wire, and where it resumes.

A pass is read by the training process alone, or by the DataLoader workers of one iterator
together (they share a token, and joaderd deals them one epoch between them). `Progress` is what
this process yielded (for `state_dict` and `epoch_order`); `resume_point` is what a pass tells a
restarted joaderd so that its epoch goes on without what this rank already received.
"""

from __future__ import annotations

import secrets
from typing import Any

from pyroaring import BitMap

from joader.client.board import RECEIPT_SLOTS, Board

_TOKEN_MASK = (1 << 63) - 1


class Pass:
    """One pass in this process: its token and DataLoader worker id (what names it on the
    wire), its epoch once the first reply named it, and the checkpoint it resumes, if any."""

    __slots__ = ("epoch", "items", "measured", "num_workers", "resume", "step_s", "token",
                 "wait_s", "worker_id")

    def __init__(self, token: int, worker_id: int, num_workers: int) -> None:
        self.token = token
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.epoch = 0
        self.resume: dict[str, Any] | None = None
        # The training loop's time inside next() and between calls, in this pass's epoch
        # (measured only by a reader in the training process: `JoaderDataset._timed`).
        self.measured = False
        self.wait_s = 0.0
        self.step_s = 0.0
        self.items = 0  # yielded in this pass

    @classmethod
    def start(cls, worker: Any, passes: int, board: Board | None, pid: int) -> Pass:
        """A new pass: in the training process a random token; in a DataLoader worker, the
        token its iterator's workers share (`Board.claim_pass`: their base seed repeats when
        the user re-seeds torch, so it only keys the claim)."""
        if worker is None:
            return cls(secrets.randbits(63), 0, 1)
        key = hash((worker.seed - worker.id, passes)) & _TOKEN_MASK
        if board is not None and 0 <= worker.id < RECEIPT_SLOTS:
            token = board.claim_pass(key, worker.id, pid)
        else:  # a spawned worker (no board) or more workers than slots: the key, as before
            token = key
        return cls(token, worker.id, worker.num_workers)


def resume_point(board: Board, stream: Pass) -> dict[str, Any] | None:
    """What `stream` tells a restarted joaderd: its epoch, without what this rank received of
    it (from every reader, on the board); for a pass with no item yet, the next epoch.

    Computed anew at every restart, from the board as it is then: a resume computed at an
    earlier restart and not yet delivered lacks what the other readers received in between
    (that dealt them again). Only a checkpoint's resume (`load_state_dict`) that no joaderd
    has taken yet is kept as it is: the board knows nothing of that epoch."""
    if stream.resume is not None and not stream.resume.get("from_board") and not stream.epoch:
        return stream.resume
    epoch, token = board.current_pass()
    if stream.epoch:
        return {"epoch": stream.epoch, "consumed": board.received(stream.epoch), "parts": 1, "from_board": True}
    if epoch and token == stream.token:  # another reader of this pass got its first items
        return {"epoch": epoch, "consumed": board.received(epoch), "parts": 1, "from_board": True}
    if epoch:  # a new pass: the next epoch, whole, keeping the numbering
        return {"epoch": epoch + 1, "consumed": BitMap(), "parts": 1, "from_board": True}
    return None


class Progress:
    """What this process (or DataLoader worker) yielded, for `state_dict` and `epoch_order`:
    the epoch of its newest pass, the ids yielded of it, and each epoch's order."""

    def __init__(self) -> None:
        self.current: Pass | None = None  # the newest pass in this process
        self.epoch = 0
        self.consumed = BitMap()
        self.finished = False
        self.orders: dict[int, list[int]] = {}

    def start_epoch(self, stream: Pass, epoch: int) -> None:
        """The first reply of a pass names its epoch: this process's records follow it."""
        stream.epoch = epoch
        if stream.resume is not None and int(stream.resume["epoch"]) == epoch:
            consumed = stream.resume["consumed"]
        else:
            consumed = BitMap()
        stream.resume = None
        if self.current is stream:
            self.epoch = epoch
            self.consumed = BitMap(consumed)
            self.finished = False
            self.orders.setdefault(epoch, [])
            while len(self.orders) > 1000:
                del self.orders[min(self.orders)]

    def yielded(self, stream: Pass, indices: list[int]) -> None:
        stream.items += len(indices)
        if self.current is stream and stream.epoch:
            self.consumed.update(indices)
            self.orders[stream.epoch].extend(indices)
