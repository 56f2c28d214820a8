"""An elastic resume (`joader.client.relayout`): every rank's states of a job resumed by another
layout of ranks or hosts; the rest's shares against a brute-force model of the hosts' parts."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from pyroaring import BitMap

from joader.client.checkpoint import Checkpoint, Owner, RestShare, Share, indices_digest
from joader.client.relayout import NewLayout, rest_checkpoint
from joader.errors import InvalidArgumentError
from joader.sampling.hosts import HostLayout, host_part, source_salt

ITEMS = BitMap(range(100))
SALT = source_salt("demo")


def _owner(rank: int | None, world_size: int, hosts: dict[str, int] | None = None) -> Owner:
    return Owner("demo", indices_digest(ITEMS), 7, True, rank, world_size, hosts)


def _state(rank: int, world_size: int, epoch: int, consumed: list[int], parts: int = 1) -> dict[str, Any]:
    return Checkpoint(_owner(rank, world_size), epoch, BitMap(consumed), parts).state_dict()


def _share(items: BitMap | None = None, per_epoch: int = 34) -> Share:
    return Share(items, 100, per_epoch, 1)


def _resume(states: list[dict[str, Any]], rank: int, world_size: int, *, drop_last: bool = False,
            hosts: HostLayout | None = None, items: BitMap | None = None) -> Checkpoint | None:
    layout = NewLayout(ITEMS, world_size, drop_last, SALT, hosts)
    owner = _owner(rank, world_size, hosts.as_dict() if hosts else None)
    return rest_checkpoint(states, owner, _share(items), layout)


def test_two_ranks_states_resume_on_three_as_equal_shares_of_the_rest() -> None:
    states = [_state(0, 2, 3, list(range(0, 20, 2))), _state(1, 2, 3, list(range(1, 20, 2)))]
    checkpoint = _resume(states, 2, 3)
    assert checkpoint is not None
    assert checkpoint.epoch == 3 and checkpoint.consumed == BitMap(range(20)) and checkpoint.parts == 0
    assert checkpoint.rest == RestShare(share=27, base=20)  # ceil(80 / 3), padding 1
    assert checkpoint.owner.rank == 2 and checkpoint.owner.world_size == 3
    resume = checkpoint.resume_point
    assert resume is not None and resume.rest == checkpoint.rest and resume.offer  # one pass's (board)
    dropped = _resume(states, 0, 3, drop_last=True)
    assert dropped is not None and dropped.rest == RestShare(26, 20)


def test_every_worker_part_counts_and_one_process_takes_a_ddp_checkpoint() -> None:
    """Two ranks of two DataLoader workers each -> one process (a DDP checkpoint debugged in
    one process): the rest is all of what no worker consumed."""
    states = [_state(0, 2, 1, [1, 2], parts=2), _state(0, 2, 1, [3], parts=2),
              _state(1, 2, 1, [4, 5], parts=2), _state(1, 2, 1, [6], parts=2)]
    checkpoint = _resume(states, 0, 1)
    assert checkpoint is not None and checkpoint.consumed == BitMap(range(1, 7))
    assert checkpoint.rest == RestShare(94, 6)


def test_the_newest_epoch_resumes_and_a_fresh_job_resumes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert _resume([_state(0, 2, 0, []), _state(1, 2, 0, [])], 0, 3) is None
    with caplog.at_level(logging.WARNING, logger="joader.client.dataset"):
        checkpoint = _resume([_state(0, 2, 4, [1, 2]), _state(1, 2, 3, list(range(50, 100)))], 0, 4)
    assert checkpoint is not None and checkpoint.epoch == 4 and checkpoint.consumed == BitMap([1, 2])
    assert "rank(s) [1] of the saving job had saved an older epoch" in caplog.text


@pytest.mark.parametrize(("states", "words"), [
    ([_state(0, 2, 1, [1])], r"no state of rank\(s\) \[1\] of the saving job's 2"),
    ([_state(0, 2, 1, [1], parts=2), _state(1, 2, 1, [2])], "rank 0 has 1 state"),
    ([_state(0, 2, 1, [1]), _state(0, 3, 1, [2])], r"world sizes \[2, 3\]"),
    ([], "a non-empty list"),
    ([dict(_state(0, 1, 1, [1]), source="imagenet")], "another job"),
    ([{"version": 1}], "not a JoaderDataset state"),
])
def test_states_that_cannot_give_the_rest_are_refused_with_the_fix(states: list[dict[str, Any]], words: str) -> None:
    with pytest.raises(InvalidArgumentError, match=words) as raised:
        _resume(states, 0, 3)
    assert "load_state_dict" in str(raised.value)


def test_one_ranks_own_state_on_another_layout_is_refused_naming_every_ranks_states() -> None:
    with pytest.raises(InvalidArgumentError, match="from EVERY rank's state") as raised:
        Checkpoint.from_state_dict(_state(0, 2, 1, [1]), _owner(0, 3))
    assert "JoaderDataLoader" in str(raised.value) and "all_gather_object" in str(raised.value)


def test_a_state_saved_in_the_rest_keeps_its_share_and_loads_with_every_ranks_ids() -> None:
    """A checkpoint saved later in an elastic resume's epoch: its consumed set is the union it
    resumed from plus what it read since (more than one rank's epoch, ids of other hosts)."""
    saved = Checkpoint(_owner(0, 3), 2, BitMap(range(60)), 1, RestShare(14, 50)).state_dict()
    assert saved["rest_share"] == 14 and saved["rest_base"] == 50
    loaded = Checkpoint.from_state_dict(saved, _owner(0, 3), _share(items=BitMap(range(0, 100, 3)), per_epoch=34))
    assert loaded.rest == RestShare(14, 50) and loaded.consumed == BitMap(range(60))
    assert loaded.resume_point is not None and loaded.resume_point.offer == 0  # its own rank's: no offer
    with pytest.raises(InvalidArgumentError, match="rest_share"):
        Checkpoint.from_state_dict(dict(saved, rest_base=-1), _owner(0, 3))


@pytest.mark.parametrize("drop_last", [False, True], ids=["padding", "drop_last"])
@pytest.mark.parametrize("ranks_per_host", [[1, 1], [2, 1], [1, 2, 3]], ids=str)
def test_on_several_hosts_every_rank_gets_one_share_that_each_hosts_rest_fills(
        ranks_per_host: list[int], drop_last: bool) -> None:
    """Brute force over the hosts' parts of the new layout (`host_part`): each host's rest (its
    part less the union) is dealt to its ranks, every rank gets the same share, and no host's
    ranks fall short of it (padding) or, under drop_last, none has fewer than its ranks need."""
    rng = random.Random(40)
    world = sum(ranks_per_host)
    for _ in range(25):
        union = BitMap(rng.sample(range(100), rng.randrange(0, 60)))
        states = [_state(r, 2, 1, list(union)[r::2]) for r in range(2)]
        shares, first = set(), 0
        for local in ranks_per_host:
            layout = HostLayout(world, first, local, 0)
            part = host_part(ITEMS, SALT, layout, drop_last=drop_last)
            checkpoint = _resume(states, first, world, drop_last=drop_last, hosts=layout, items=part)
            assert checkpoint is not None and checkpoint.rest is not None
            assert checkpoint.rest.base == len(union & part)
            left = len(part - union)
            share = checkpoint.rest.share
            assert (share * local <= left) if drop_last else (share * local >= left)
            shares.add(share)
            first += local
        assert len(shares) == 1, f"ranks on different hosts got different shares: {shares}"


def test_on_one_host_the_share_is_ceil_or_floor_of_the_rest() -> None:
    states = [_state(0, 1, 2, list(range(10)))]
    for world in (1, 2, 3, 7):
        padded = _resume(states, 0, world)
        dropped = _resume(states, 0, world, drop_last=True)
        assert padded is not None and padded.rest is not None and padded.rest.share == -(-90 // world)
        assert dropped is not None and dropped.rest is not None and dropped.rest.share == 90 // world


def test_a_share_is_the_same_whichever_rank_computes_it() -> None:
    states = [_state(r, 4, 1, list(range(r, 40, 4))) for r in range(4)]
    results = [_resume(states, rank, 6) for rank in range(6)]
    assert len({(c.epoch, c.rest, tuple(c.consumed)) for c in results if c is not None}) == 1
