"""Receipts of handed-over batches (joader.client.handoff), on a real client board."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest

from joader.client.board import RECEIPT_SLOTS, Board
from joader.client.handoff import ArenaBatch, ArenaLocation, Layout, Receipts

LAYOUT = Layout((3, 4, 4), "uint8", 2, False)
OLD, NEW = ArenaLocation("joader-arena-old", 0), ArenaLocation("joader-arena-new", 0)


@pytest.fixture
def board() -> Iterator[Board]:
    board = Board.create()
    board.size_for(16)
    yield board
    board.close()


def batch(arena: ArenaLocation, *ids: int) -> ArenaBatch:
    made = ArenaBatch(LAYOUT)
    for item_id in ids:
        made.add(arena, 64 * item_id, 48, item_id, item_id % 3)
    return made


def copy(handed: ArenaBatch) -> None:
    """What unpickling in the training process notes, without the copy."""
    assert handed.receipt is not None
    key, slot, value = handed.receipt
    board = Board.created(key)
    assert board is not None
    board.note_receipt(slot, value)


def test_a_receipt_covers_the_batch_and_every_earlier_one_in_order(board: Board) -> None:
    receipts = Receipts(board, 1, token=0xABCDEF0123)
    _, second, third = (receipts.hand(batch(OLD, i, i + 1)) for i in (0, 2, 4))
    assert receipts.copied(OLD.name) == [] and receipts.outstanding == 3
    copy(second)  # batches reach the training process in order: the first was copied before
    assert receipts.copied(OLD.name) == [0, 1, 2, 3]
    assert receipts.copied(OLD.name) == []  # acknowledged once
    copy(third)
    assert receipts.copied(OLD.name) == [4, 5] and receipts.outstanding == 0


def test_another_pass_in_the_same_slot_acknowledges_nothing_of_this_one(board: Board) -> None:
    old_pass = Receipts(board, 0, token=1)
    stale = old_pass.hand(batch(OLD, 7))
    receipts = Receipts(board, 0, token=2)
    receipts.hand(batch(OLD, 1))
    copy(stale)  # the old iterator's batch, drained after the new pass began
    assert receipts.copied(OLD.name) == []
    assert Receipts(board, 3, token=5).copied(OLD.name) == []  # a fresh slot: nothing copied


def test_items_of_a_restarted_joaderds_old_arena_are_not_acknowledged_to_the_new_one(board: Board) -> None:
    receipts = Receipts(board, 2, token=9)
    spanning = batch(OLD, 1)
    spanning.add(NEW, 0, 48, 2, 0)  # joaderd restarted while this batch was filling
    assert len(spanning.segments) == 2 and spanning.item_ids == [1, 2]
    copy(receipts.hand(spanning))
    assert receipts.copied(NEW.name) == [2]


def test_a_handed_over_batch_pickles_to_offsets_not_pixels(board: Board) -> None:
    receipts = Receipts(board, 0, token=3)
    handed = receipts.hand(batch(OLD, *range(64)))
    assert len(pickle.dumps(handed)) < 4096  # a 256x256x3 batch of 64 is 12 MiB
    assert not Receipts.possible(None, 0) and not Receipts.possible(board, RECEIPT_SLOTS)
    assert Receipts.possible(board, RECEIPT_SLOTS - 1)
