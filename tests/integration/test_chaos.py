"""The chaos soak's short form (`bench/soak/chaos.py`): jobs in every client mode, joaderd killed -9
and restarted (also at an epoch's end), jobs killed and resumed from checkpoints, decode workers
killed; every delivered sample's pixels and label checked against a decode made here, every
epoch of every job exactly once. The full form runs 20 minutes or more (see the README)."""

from __future__ import annotations

import pytest

from joader.testing import chaos

pytestmark = pytest.mark.timeout(330)


def test_a_short_soak_delivers_only_the_right_samples_exactly_once() -> None:
    summary = chaos.soak(60.0, seed=17, fault_every_s=3.0, episode_s=30.0)  # 20 faults, two episodes
    print(summary.line())
    assert summary.ok, summary.line() + "".join(f"\n  {p}" for p in summary.problems[:15])
    # Real work was checked: at least two epochs' worth of the soak's 240 items. Not a rate: a
    # floor of 3,000 samples in the 60 s failed on a loaded machine (2,984) with every sample
    # right, which is a speed assertion (it checked 2,984-7,376 here).
    assert summary.samples_checked >= 2 * 240, summary.line()
    assert summary.joaderd_restarts >= 2 and summary.restarts_at_epoch_end >= 1, summary.line()
    assert summary.client_kills >= 1 and summary.worker_kills >= 1, summary.line()
