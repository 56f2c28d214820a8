"""`StallBook`: per-epoch data-stall figures as readers report them; status shows the newest epoch
that has a measured second, not one whose first request just reported zeros."""

from __future__ import annotations

from joader.server.books.records import StallBook


def test_the_newest_measured_epoch_is_the_latest() -> None:
    stall = StallBook()
    assert stall.latest == 0
    stall.report(1, (0, 1), 0.0, 0.0, 0)
    assert stall.latest == 1  # nothing measured yet: the only epoch there is
    stall.report(1, (0, 1), 2.0, 6.0, 64)
    stall.report(2, (0, 2), 0.0, 0.0, 0)  # the next epoch's first request
    assert stall.latest == 1 and stall.epoch(1) == (2.0, 6.0, 64)
    stall.report(2, (0, 2), 0.5, 1.5, 8)
    assert stall.latest == 2


def test_an_epoch_whose_first_batch_waited_is_not_shown_as_all_stall() -> None:
    """Its first batch's wait came with no step yet: 100% "stall" for a loop that barely
    waited (top during a bash loop of tiny epochs, issue 38). Once a second of waiting passed
    with no step, the epoch is shown: the loop is stuck."""
    stall = StallBook()
    stall.report(1, (0, 1), 0.2, 4.0, 64)
    stall.report(2, (0, 2), 0.01, 0.0, 8)
    assert stall.latest == 1
    stall.report(2, (0, 2), 0.01, 0.05, 16)
    assert stall.latest == 2
    stall.report(3, (0, 3), 1.5, 0.0, 0)
    assert stall.latest == 3
