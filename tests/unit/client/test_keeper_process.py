"""The lease keeper process itself (`joader.client.keeper_process`): what it sends joaderd."""

from __future__ import annotations

import threading

from pyroaring import BitMap

from joader.client import keeper_process
from joader.client.board import Board


def test_the_first_request_carries_the_order() -> None:
    """A lease keeper's first message, also when it attaches again after a restart: the
    job's order travels with it (joaderd refuses a rank whose order differs from its job's)."""
    base = {"source": "demo", "indices": "", "name": "j"}
    stop = threading.Event()
    first = next(keeper_process._requests(base | {"order": "independent"}, stop, [1.0]))
    assert first.order == "independent"
    assert next(keeper_process._requests(base, stop, [1.0])).order == "shared"


def test_a_restart_report_carries_an_elastic_resumes_share() -> None:
    """After a joaderd restart in an epoch that resumed on another layout, the keeper's report
    says the rank's share of the rest (NOTE [ An elastic resume ]): without it the restarted
    joaderd took the union (every old rank's items) for this rank's own and gave it nothing."""
    board = Board.create()
    board.size_for(40)
    try:
        board.note_pass(4, token=9)
        board.mark([1, 2, 3], 4)
        registration = {"source": "demo", "indices": "", "name": "j"}
        plain = keeper_process._with_report(registration, board)
        assert "resume_rest" not in plain and BitMap.deserialize(plain["resume_consumed"]) == BitMap([1, 2, 3])
        board.note_rest(4, share=12, base=2)
        report = keeper_process._with_report(registration, board)
        first = next(keeper_process._requests(report, threading.Event(), [1.0]))
        assert (first.resume_epoch, first.resume_rest, first.resume_share, first.resume_base) == (4, True, 12, 2)
    finally:
        board.close()
