"""`EpochShare.receiver`: the rank the next pick goes to, the rank furthest from its target (the
lowest index on a tie), None when every rank has its share; checked against the plain walk it
replaced (issue 37: it runs twice a round, a world size of 1 takes no walk)."""

from __future__ import annotations

import random

from joader.server.books.records import EpochShare


def _model(target: list[int], assigned: list[int]) -> int | None:
    best, best_need = None, 0
    for rank, (want, have) in enumerate(zip(target, assigned, strict=True)):
        if want - have > best_need:
            best, best_need = rank, want - have
    return best


def test_receiver_matches_the_walk_it_replaced() -> None:
    rng = random.Random(37)
    for _ in range(5000):
        world = rng.choice([1, 1, 2, 3, 8])
        target = [rng.randrange(0, 6) for _ in range(world)]
        assigned = [rng.randrange(0, 8) for _ in range(world)]
        assert EpochShare(1, target, assigned).receiver() == _model(target, assigned)


def test_dealing_a_fresh_epoch_is_round_robin_then_none() -> None:
    share = EpochShare(1, [3, 3, 3], [0, 0, 1])  # rank 2 consumed one before a resume
    dealt = []
    while (rank := share.receiver()) is not None:
        dealt.append(rank)
        share.assigned[rank] += 1
    assert dealt == [0, 1, 0, 1, 2, 0, 1, 2]
    single = EpochShare(1, [2], [0])
    assert single.receiver() == 0
    single.assigned[0] = 2
    assert single.receiver() is None
