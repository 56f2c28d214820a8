"""The client board's pass claims (`Board.claim_pass`), on a real memfd board."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyroaring import BitMap

from joader.client.board import Board
from joader.errors import InvalidArgumentError


@pytest.fixture
def board() -> Iterator[Board]:
    board = Board.create()
    board.size_for(16)
    yield board
    board.close()


def test_the_workers_of_one_iterator_share_a_token(board: Board) -> None:
    tokens = {board.claim_pass(key=77, slot=slot, pid=1000 + slot) for slot in range(4)}
    assert len(tokens) == 1 and tokens.pop() != 77  # a fresh token, not the (repeating) key


def test_a_reseeded_iterator_gets_a_new_token_though_its_key_repeats(board: Board) -> None:
    """torch.manual_seed before each epoch: fresh workers compute the same key again. A slot
    already taken in the current pass means a new iterator; its other workers join it."""
    first = [board.claim_pass(key=77, slot=slot, pid=1000 + slot) for slot in range(2)]
    second = [board.claim_pass(key=77, slot=slot, pid=2000 + slot) for slot in range(2)]
    assert first[0] == first[1] and second[0] == second[1] and first[0] != second[0]


def test_a_persistent_workers_next_pass_has_a_new_key_and_token(board: Board) -> None:
    first = board.claim_pass(key=1, slot=0, pid=1000)
    assert board.claim_pass(key=2, slot=0, pid=1000) != first
    assert board.claim_pass(key=2, slot=1, pid=1001) == board.claim_pass(key=2, slot=2, pid=1002)


def test_tokens_survive_a_resize_of_the_board() -> None:
    board = Board.create()
    try:
        token = board.claim_pass(key=5, slot=0, pid=1)
        board.size_for(1000)
        assert board.claim_pass(key=5, slot=1, pid=2) == token
    finally:
        board.close()


def test_a_reply_marked_after_the_dataset_closed_is_dropped_quietly(tmp_path: Path) -> None:
    """Issue 27, finding 5b: a reply that arrives after `JoaderDataset.close()` is still marked
    by its gRPC callback, on another thread. The board looked its size up on the closed
    descriptor (`OSError: [Errno 9] Bad file descriptor`, printed by 5 of 36 clean closes
    mid-epoch); with the descriptor's number reused meanwhile, it would have mapped another
    file. After a close, what a reader would note is dropped, and no other file is touched."""
    board = Board.create()
    board.size_for(16)
    board.mark([1, 2], 1)
    board.close()
    reused = tmp_path / "reused"
    reused.write_bytes(b"\0" * 64)
    fd = os.open(reused, os.O_RDWR)  # most likely the board's old descriptor number
    try:
        errors: list[BaseException] = []

        def callback() -> None:  # as `Reader._mark` and a hand-off receipt do it
            try:
                board.note_pass(1, 5)
                board.mark([3], 1)
                board.note_receipt(0, 7)
            except BaseException as error:  # noqa: BLE001  reported below
                errors.append(error)

        thread = threading.Thread(target=callback)
        thread.start()
        thread.join()
        assert not errors, errors
        assert reused.read_bytes() == b"\0" * 64
        assert Board.created(board.key) is None
    finally:
        os.close(fd)


def test_ids_beyond_the_source_are_refused_and_nothing_is_marked(board: Board) -> None:
    """Issue 36, item 6: a loaded state's ids beyond the source raised a raw `IndexError: index
    400 is out of bounds` here; the board refuses them by name, and marks none of the others."""
    with pytest.raises(InvalidArgumentError, match=r"item ids \[400\] are not ids of the source's 16 items"):
        board.mark([1, 400], 1)
    assert board.received(1) == BitMap()
    board.mark([1, 2], 1)
    assert board.received(1) == BitMap([1, 2])


def test_a_loaded_resume_is_taken_by_the_first_pass_only(board: Board) -> None:
    """NOTE [ A loaded resume is one pass's ]: every DataLoader worker forked at each `iter()`
    carries the resume the training process loaded; the first pass takes it (all its workers),
    the next epoch's passes do not, and a newly loaded resume (a new offer) is taken again."""
    assert board.take_resume(offer=11, token=5) and board.take_resume(offer=11, token=5)
    assert not board.take_resume(offer=11, token=6)
    assert board.take_resume(offer=12, token=6) and not board.take_resume(offer=12, token=5)


def test_an_elastic_rest_share_is_kept_for_its_epoch(board: Board) -> None:
    assert board.rest(3) is None
    board.note_rest(3, share=27, base=20)
    assert board.rest(3) == (27, 20) and board.rest(4) is None and board.rest(0) is None
    for key in (77, 78):  # the pass bookkeeping beside it is untouched
        board.claim_pass(key=key, slot=0, pid=1)
    assert board.rest(3) == (27, 20)
