"""What a pass tells joaderd about itself (joader.client.passes, joader.client.delivery), on a
real memfd board and without a server: after a joaderd restart, a pass that starts is a new
pass (it sends no epoch at all), and a pass some reader of which received items of an epoch
from the dead server continues that epoch, whichever of its readers asks."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from pyroaring import BitMap

from joader.client.board import Board
from joader.client.checkpoint import ResumePoint
from joader.client.connection import Connection, Identity
from joader.client.delivery import Reader, ReadOptions
from joader.client.passes import Pass, Progress, continued_epoch, note_copy_only_workers
from joader.errors import InvalidArgumentError

OLD = Identity("job-a", b"s" * 16, "/dev/shm/joader-0-1-aaaa", None, "fp", generation=0)


@pytest.fixture
def board() -> Iterator[Board]:
    board = Board.create()
    board.size_for(64)
    yield board
    board.close()


def _fields(board: Board, pass_: Pass) -> dict[str, Any]:
    """The fields of `pass_`'s next request for items, as its reader sends them."""
    conn = Connection("unix:/nowhere", OLD, board, timeout_s=5, crc_check=False)
    return Reader(conn, pass_, Progress(), ReadOptions(source="demo", batch_size=4))._fields(4)


def _worker(worker_id: int, seed: int = 1234) -> SimpleNamespace:
    return SimpleNamespace(id=worker_id, num_workers=2, seed=seed + worker_id)


def test_a_pass_that_starts_after_a_restart_is_a_new_pass_whatever_epochs_came_before(board: Board) -> None:
    """Epoch 1's iterator (two DataLoader workers) read part of its epoch, then joaderd
    restarted; the next iterator's workers start. They send no epoch and no resume: joaderd
    numbers the pass from the lease keeper's report. A pass that sent "resume epoch 2, nothing
    consumed" would be taken for a resume by a 2-rank job, which would wait on it."""
    first = [Pass.start(_worker(w), 0, board, pid=100 + w) for w in (0, 1)]
    assert first[0].token == first[1].token
    first[0].epoch = 1  # worker 0's first reply named epoch 1, and it received items
    board.note_pass(1, first[0].token)
    board.mark([3, 4, 5, 6], 1)
    second = [Pass.start(_worker(w), 1, board, pid=200 + w) for w in (0, 1)]  # a fresh iterator
    assert second[0].token == second[1].token != first[0].token
    for pass_ in second:
        assert continued_epoch(board, pass_) == 0
        fields = _fields(board, pass_)
        assert fields["continue_epoch"] == 0 and "resume_epoch" not in fields
    # The same, with the user re-seeding torch (the workers' key repeats): still a new pass.
    again = Pass.start(_worker(0), 0, board, pid=300)
    assert again.token not in (first[0].token, second[0].token)
    assert continued_epoch(board, again) == 0


def test_every_reader_of_an_interrupted_pass_continues_its_epoch(board: Board) -> None:
    """Worker 0 received items of epoch 3 before joaderd died; worker 1 of the same iterator had
    not yet asked. Both continue epoch 3 (the board names the pass), and neither resends what it
    received: the lease keeper reported that for the rank."""
    passes = [Pass.start(_worker(w), 0, board, pid=100 + w) for w in (0, 1)]
    passes[0].epoch = 3
    board.note_pass(3, passes[0].token)
    board.mark([1, 2], 3)
    for pass_ in passes:
        fields = _fields(board, pass_)
        assert fields["continue_epoch"] == 3 and "resume_epoch" not in fields
    plain = Pass(77, 0, 1)  # the training process, no workers: its own first reply named epoch 5
    plain.epoch = 5
    assert continued_epoch(None, plain) == 5 and continued_epoch(board, Pass(78, 0, 1)) == 0


def test_a_checkpoints_consumed_items_go_on_the_board_when_joaderd_takes_them(board: Board) -> None:
    """A pass resuming a checkpoint of epoch 2 (items 0..9 consumed by the run that saved it):
    once joaderd's first reply names epoch 2, the board says the rank received them in epoch 2,
    so a later restart's keeper report does not have them dealt again."""
    pass_ = Pass(41, 0, 1)
    pass_.resume = ResumePoint(2, BitMap(range(10)), 1)
    conn = Connection("unix:/nowhere", OLD, board, timeout_s=5, crc_check=False)
    reader = Reader(conn, pass_, Progress(), ReadOptions(source="demo", batch_size=4))
    assert reader._fields(4)["resume_epoch"] == 2
    reader._note_checkpoint(2)
    assert board.current_pass() == (2, 41) and board.received(2) == BitMap(range(10))


def test_progress_follows_its_current_pass_and_saves_a_finished_epoch_as_the_next() -> None:
    """`Progress` records what the current pass yielded; a checkpoint of a finished epoch read
    by one process is the start of the next, and a loaded checkpoint's epoch goes on."""
    progress = Progress()
    pass_ = Pass(5, 0, 1)
    pass_.resume = ResumePoint(3, BitMap([1, 2]), 1)
    progress.current = pass_
    progress.start_epoch(pass_, 3)  # joaderd took the resume: its consumed ids count as yielded
    assert pass_.resume is None and progress.consumed == BitMap([1, 2])
    progress.yielded(pass_, [7, 8])
    stale = Pass(4, 0, 1)
    progress.yielded(stale, [9])  # an older pass of this process: not recorded
    assert progress.orders[3] == [7, 8] and progress.consumed == BitMap([1, 2, 7, 8])
    assert progress.saved(parts=1) == (3, BitMap([1, 2, 7, 8]), None)
    progress.finished = True
    assert progress.saved(parts=1) == (4, BitMap(), None) and progress.saved(parts=2)[0] == 3
    progress.restore(6, BitMap([1]))
    assert (progress.epoch, progress.consumed, progress.finished) == (6, BitMap([1]), False)


def test_epoch_order_names_the_epochs_read_when_asked_for_another() -> None:
    progress = Progress()
    pass_ = Pass(1, 0, 1)
    progress.current = pass_
    progress.start_epoch(pass_, 3)
    progress.yielded(pass_, [5, 2, 7])
    assert progress.epoch_order(3) == [5, 2, 7]
    with pytest.raises(InvalidArgumentError, match=r"no items of epoch 4 \(epochs read: 3\)"):
        progress.epoch_order(4)
    with pytest.raises(InvalidArgumentError, match="epochs read: none yet"):
        Progress().epoch_order(0)


def test_copy_only_workers_are_noted_once_per_board(board: Board, caplog: pytest.LogCaptureFixture) -> None:
    worker = SimpleNamespace(id=0, num_workers=2)
    with caplog.at_level("WARNING", logger="joader.client.dataset"):
        note_copy_only_workers(board, worker, transform=lambda x: x, batched=False)  # a transform: fine
        note_copy_only_workers(board, worker, transform=None, batched=True)  # batched: fine
        note_copy_only_workers(board, None, transform=None, batched=False)  # no worker: fine
        assert not caplog.records
        note_copy_only_workers(board, worker, transform=None, batched=False)
        note_copy_only_workers(board, worker, transform=None, batched=False)
    assert [r.name for r in caplog.records] == ["joader.client.dataset"]
    assert "without a transform" in caplog.records[0].getMessage()
