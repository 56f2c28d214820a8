"""A reader's checkpoint (`joader.client.checkpoint`): the saved dict, its validation, and the
resume point a pass carries."""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

import pytest
from pyroaring import BitMap

from joader.client.checkpoint import MAX_PARTS, Checkpoint, Owner, ResumePoint, indices_digest
from joader.errors import InvalidArgumentError

OWNER = Owner(source="demo", dataset=indices_digest(BitMap(range(40))), seed=7, seed_given=True, rank=1,
              world_size=2, hosts=None)

# What a JoaderDataset of this owner saved, written out as users' checkpoint files hold it.
SAVED = {
    "version": 1, "job": "joader", "epoch": 3, "consumed": BitMap([1, 5, 9]).serialize(), "seed": 7,
    "seed_given": True, "source": "demo", "dataset": indices_digest(BitMap(range(40))), "rank": 1,
    "world_size": 2, "parts": 2, "hosts": None,
}


def test_the_saved_dict_keeps_its_keys_order_and_values() -> None:
    checkpoint = Checkpoint(OWNER, 3, BitMap([1, 5, 9]), parts=2)
    state = checkpoint.state_dict()
    assert state == SAVED and list(state) == list(SAVED)
    assert pickle.dumps(state) == pickle.dumps(SAVED)  # byte for byte, as users' files hold it


def test_a_saved_checkpoint_loads_back_the_same() -> None:
    loaded = Checkpoint.from_state_dict(pickle.loads(pickle.dumps(SAVED)), OWNER)
    assert loaded == Checkpoint(OWNER, 3, BitMap([1, 5, 9]), parts=2)
    assert loaded.state_dict() == SAVED
    assert loaded.resume_point == ResumePoint(3, BitMap([1, 5, 9]), 2)


def test_epoch_zero_has_nothing_to_resume() -> None:
    assert Checkpoint(OWNER, 0, BitMap()).resume_point is None


def test_an_older_state_without_the_owner_keys_still_loads() -> None:
    state = {k: v for k, v in SAVED.items() if k not in ("source", "dataset", "parts")}
    loaded = Checkpoint.from_state_dict(state, OWNER)
    assert loaded.parts == 1 and loaded.owner.source == "demo"


def test_a_job_without_a_given_seed_resumes_whatever_seed_the_run_had() -> None:
    loaded = Checkpoint.from_state_dict(dict(SAVED, seed=12345, seed_given=False), OWNER)
    assert loaded.owner.seed == 12345


@pytest.mark.parametrize(("change", "words"), [
    ({"job": "other"}, "not a JoaderDataset state"),
    ({"version": 2}, "state version 2"),
    ({"rank": 0}, "is of rank 0 of 2, this dataset is rank 1 of 2"),
    ({"world_size": 4}, "is of rank 1 of 4"),
    ({"source": "imagenet"}, "source 'imagenet', not 'demo'"),
    ({"dataset": "0" * 16}, "other indices"),
    ({"seed": 8}, "seed 8, not 7"),
    ({"hosts": {"first_rank": 0}}, "saved with its ranks on hosts"),
    ({"epoch": -1}, "epoch -1 is not an epoch number"),
    ({"epoch": True}, "epoch True is not an epoch number"),
    ({"epoch": 2**32 - 1}, "is not an epoch number"),
    ({"parts": 0}, "parts 0 is not a number of readers"),
    ({"parts": MAX_PARTS + 1}, "is not a number of readers"),
    ({"consumed": b"garbage"}, "consumed set is unreadable"),
])
def test_a_wrong_state_is_refused_naming_what_is_wrong(change: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidArgumentError, match="load_state_dict") as raised:
        Checkpoint.from_state_dict(dict(SAVED, **change), OWNER)
    assert words in str(raised.value)


def test_problems_are_named_in_order_version_first() -> None:
    with pytest.raises(InvalidArgumentError, match="state version"):
        Checkpoint.from_state_dict(dict(SAVED, version=9, rank=0, epoch=-1), OWNER)
    with pytest.raises(InvalidArgumentError, match="another job .*source.*other indices"):
        Checkpoint.from_state_dict(dict(SAVED, source="x", dataset="y", epoch=-1), OWNER)


def test_not_a_dict_is_refused_before_anything_else() -> None:
    for state in (None, [], {"version": 1}):
        with pytest.raises(InvalidArgumentError, match="not a JoaderDataset state"):
            Checkpoint.check_tag(state)


def test_the_hosts_layout_must_match() -> None:
    layout = {"first_rank": 0, "local_ranks": 2, "world_size": 4}
    owner = replace(OWNER, hosts=layout)
    assert Checkpoint.from_state_dict(dict(SAVED, hosts=layout), owner).owner.hosts == layout
    with pytest.raises(InvalidArgumentError, match="hosts None, this rank's host is"):
        Checkpoint.from_state_dict(SAVED, owner)
