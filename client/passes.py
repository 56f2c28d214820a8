"""Passes: one `iter()` of a JoaderDataset, what names it on the wire, and where it resumes.

A pass is read by the training process alone, or by the DataLoader workers of one iterator
together (they share a token, and joaderd deals them one epoch between them). `Progress` is what
this process yielded (for `state_dict` and `epoch_order`); `continued_epoch` is what a pass tells a
restarted joaderd: the epoch it continues, or none (a new pass). What this rank already received
of that epoch the restarted joaderd learns from the lease keeper (`joader.client.keeper_process`).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import Any

from pyroaring import BitMap

from joader.client.board import RECEIPT_SLOTS, Board
from joader.client.checkpoint import RestShare, ResumePoint
from joader.errors import InvalidArgumentError

_TOKEN_MASK = (1 << 63) - 1
_NOTICE_WORKERS = 0  # board notice: "workers without a transform only add a copy"
_dataset_logger = logging.getLogger("joader.client.dataset")  # NOTE [ The dataset's logger ]


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
        self.resume: ResumePoint | None = None  # until the pass's first reply
        # The training loop's time inside next() and between calls, in this pass's epoch
        # (measured only by a reader in the training process: `Reader._deliver`).
        self.measured = False
        self.wait_s = 0.0
        self.step_s = 0.0
        self.items = 0  # yielded in this pass

    def take(self, resume: ResumePoint | None, board: Board | None) -> None:
        """The checkpoint this pass resumes. One loaded from every rank's states (`parts` 0:
        before the DataLoader's workers existed) is reported by each reader of this pass, and
        resumed by the first pass only (NOTE [ A loaded resume is one pass's ] in board.py)."""
        if resume is not None and resume.offer and board is not None and not board.take_resume(resume.offer, self.token):
            resume = None
        if resume is not None and not resume.parts:
            resume = dataclasses.replace(resume, parts=self.num_workers)
        self.resume = resume

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


def continued_epoch(board: Board | None, pass_: Pass) -> int:
    """The epoch `pass_` is reading, once some reader of it received items of one (this
    reader: its first reply named it; another DataLoader worker of its iterator: the board's
    current pass is this token's); 0 for a pass no reader of which received anything yet.

    Every request says it (`NextRequest.continue_epoch`): a restarted joaderd, which never saw
    the token, makes the pass continue that epoch, as the lease keepers' reports resumed it.
    A pass with 0 is a new pass there, the rank's next epoch.

    NOTE [ A new pass is never a resume ]
    A new pass that sent the epoch number it expects (the previous one + 1, nothing consumed)
    would be taken for a resume of that epoch: the restarted job would wait for the other
    ranks' reports, or deal that epoch twice."""
    if pass_.epoch:
        return pass_.epoch
    if board is None:
        return 0
    epoch, token = board.current_pass()
    return epoch if epoch and token == pass_.token else 0


class Progress:
    """What this process (or DataLoader worker) yielded, for `state_dict` and `epoch_order`:
    the epoch of its newest pass, the ids yielded of it (with, in an elastic resume's epoch,
    every old rank's and the rank's share of the rest), and each epoch's order."""

    def __init__(self) -> None:
        self.current: Pass | None = None  # the newest pass in this process
        self.epoch = 0
        self.consumed = BitMap()
        self.rest: RestShare | None = None
        self.finished = False
        self.orders: dict[int, list[int]] = {}

    def start_epoch(self, pass_: Pass, epoch: int) -> None:
        """The first reply of a pass names its epoch: this process's records follow it."""
        pass_.epoch = epoch
        resume = pass_.resume if pass_.resume is not None and pass_.resume.epoch == epoch else None
        pass_.resume = None
        if self.current is pass_:
            self.epoch = epoch
            self.consumed = BitMap(resume.consumed) if resume is not None else BitMap()
            self.rest = resume.rest if resume is not None else None
            self.finished = False
            self.orders.setdefault(epoch, [])
            while len(self.orders) > 1000:
                del self.orders[min(self.orders)]

    def saved(self, parts: int) -> tuple[int, BitMap, RestShare | None]:
        """The epoch, consumed ids and rest share a checkpoint records now: a finished epoch
        read by one process is saved as the start of the next."""
        if self.finished and parts == 1:
            return self.epoch + 1, BitMap(), None
        return self.epoch, self.consumed, self.rest

    def epoch_order(self, epoch: int) -> list[int]:
        """The indices this process yielded in `epoch`, in order (`JoaderDataset.epoch_order`)."""
        order = self.orders.get(epoch)
        if order is None:
            known = ", ".join(str(e) for e in sorted(self.orders)) or "none yet"
            raise InvalidArgumentError(
                f"epoch_order({epoch}): this process read no items of epoch {epoch} (epochs read: "
                f"{known}); with DataLoader workers, each worker process records its own")
        return list(order)

    def restore(self, epoch: int, consumed: BitMap, rest: RestShare | None = None) -> None:
        """A loaded checkpoint: this process's records go on from it."""
        self.epoch = epoch
        self.consumed = consumed
        self.rest = rest
        self.finished = False

    def yielded(self, pass_: Pass, indices: list[int]) -> None:
        pass_.items += len(indices)
        if self.current is pass_ and pass_.epoch:
            self.consumed.update(indices)
            self.orders[pass_.epoch].extend(indices)


def note_copy_only_workers(board: Board | None, worker: Any, transform: Any, batched: bool) -> None:
    """Once per rank (a board notice): DataLoader workers without a transform (and not batched),
    which only add a copy; said on the dataset's logger (NOTE [ The dataset's logger ] in joader.client.attachment)."""
    if worker is not None and transform is None and not batched and board is not None \
            and board.first_notice(_NOTICE_WORKERS):
        _dataset_logger.warning(
            "JoaderDataset in DataLoader workers without a transform: the workers only copy what "
            "joaderd prepared, and each batch then crosses to the training process once more "
            "(a shared-memory copy and a file-descriptor hand-off). num_workers=0 is faster here, "
            "or batched=True with DataLoader(batch_size=None), whose workers hand over only "
            "where each batch is; keep workers for a heavy per-job transform.")
