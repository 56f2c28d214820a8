"""`StallBook`: per-epoch data-stall figures as readers report them; status shows the newest epoch
that has a measured second, not one whose first request just reported zeros."""

from __future__ import annotations

from joader.server.records import StallBook


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
