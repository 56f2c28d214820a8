"""Issue 36, item 6: every field of a loaded `JoaderDataset` state is checked against the job.

One table, run through a real `JoaderDataset.load_state_dict` on a real joaderd: for each field,
a tampered value and the words the `InvalidArgumentError` must say (the field, what is wrong,
the fix). Nothing is read: a state is refused when it is loaded, never by a raw exception in the
board, a hang until `timeout_s`, or an epoch delivered again. The checks that need a DataLoader
worker or another rank's share run on the pure `Checkpoint.from_state_dict` with a `Share`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pyroaring import BitMap
from torch.utils.data import IterableDataset

from joader.client.checkpoint import Checkpoint, Owner, Share, indices_digest
from joader.client.dataset import JoaderDataset
from joader.client.loader import JoaderDataLoader
from joader.errors import InvalidArgumentError

MISSING = object()  # a key taken out of the state
FIX_OWN = "load the state this job saved, or start without one"


@pytest.fixture(scope="module")
def dataset(joaderd: str) -> Iterator[JoaderDataset]:
    """A job of 40 of the demo source's 48 items, seed 3, read by this process alone."""
    ds = JoaderDataset("demo", address=joaderd, indices=range(0, 40), seed=3, batch_size=4, threads=None,
                       name="state-fields", timeout_s=5)
    yield ds
    ds.close()


def _resumable(ds: JoaderDataset) -> dict[str, Any]:
    """What this job saves a third into epoch 1."""
    return dict(ds.state_dict(), epoch=1, consumed=BitMap([1, 5, 9]).serialize())


# (field, tampered value, words the error says). The first three are the tester's findings.
TAMPERED: list[tuple[str, Any, str]] = [
    ("consumed", BitMap([1, 400]).serialize(),
     "consumed holds 1 id that is not an item of this job (400)"),
    ("parts", 3, "parts 3: the state says 3 readers of this rank saved their parts, and it is loaded by 1 "
              "(the training process, not a DataLoader worker), so joaderd would wait for parts that never come"),
    ("epoch", (0, BitMap(range(10)).serialize()), "epoch 0 with 10 consumed ids"),
    ("consumed", BitMap([1, 44]).serialize(), "not an item of this job (44)"),
    ("consumed", b"garbage", "consumed set is unreadable"),
    ("consumed", [1, 2], "consumed set is unreadable"),
    ("consumed", MISSING, "the state has no 'consumed'"),
    ("epoch", -1, "epoch -1 is not an epoch number"),
    ("epoch", True, "epoch True is not an epoch number"),
    ("epoch", "1", "epoch '1' is not an epoch number"),
    ("epoch", 2**32 - 1, "is not an epoch number"),
    ("epoch", MISSING, "the state has no 'epoch'"),
    ("parts", 0, "parts 0 is not a number of readers"),
    ("parts", True, "parts True is not a number of readers"),
    ("parts", 10**6, "parts 1000000 is not a number of readers"),
    ("version", 2, "state version 2"),
    ("version", True, "state version True"),
    ("version", MISSING, "state version None"),
    ("job", "other", "not a JoaderDataset state"),
    ("rank", 1, "the state is of rank 1 of 1, this dataset is rank 0 of 1"),
    ("rank", False, "rank False is not a rank"),
    ("rank", MISSING, "the state has no 'rank'"),
    ("world_size", 2, "the state is of rank 0 of 2"),
    ("world_size", 1.0, "world_size 1.0 is not a number of ranks"),
    ("source", "imagenet", "source 'imagenet', not 'demo'"),
    ("dataset", "0" * 16, "other indices"),
    ("seed", 4, "seed 4, not 3"),
    ("seed", -1, "seed -1 is not a seed"),
    ("seed", MISSING, "the state has no 'seed'"),
    ("seed_given", "yes", "seed_given 'yes' is not True or False"),
    ("hosts", {"first_rank": 0}, "saved with its ranks on hosts"),
    ("hosts", "all", "hosts 'all' is not a host layout"),
    ("extra", 1, "unknown key 'extra'"),
]


@pytest.mark.parametrize(("field", "value", "words"), TAMPERED, ids=[f"{i:02d}-{f}" for i, (f, _, _) in enumerate(TAMPERED)])
def test_each_tampered_field_is_refused_naming_it(dataset: JoaderDataset, field: str, value: Any,
                                                  words: str) -> None:
    state = _resumable(dataset)
    if value is MISSING:
        del state[field]
    elif field == "epoch" and isinstance(value, tuple):
        state["epoch"], state["consumed"] = value
    else:
        state[field] = value
    with pytest.raises(InvalidArgumentError) as raised:
        dataset.load_state_dict(state)
    message = str(raised.value)
    assert message.startswith("load_state_dict: ") and words in message, message


def test_what_this_job_saved_still_loads(dataset: JoaderDataset) -> None:
    dataset.load_state_dict(dataset.state_dict())  # epoch 0, nothing consumed
    dataset.load_state_dict(_resumable(dataset))
    dataset.load_state_dict(dict(_resumable(dataset), consumed=BitMap(range(40)).serialize()))  # all of it
    older = {k: v for k, v in _resumable(dataset).items() if k not in ("source", "dataset", "parts", "hosts",
                                                                       "seed_given")}
    dataset.load_state_dict(older)  # written before those keys existed
    dataset._resume = None  # nothing is read here


def test_the_fixes_are_named(dataset: JoaderDataset) -> None:
    for field, value in (("consumed", BitMap([400]).serialize()), ("parts", 3), ("extra", 1)):
        with pytest.raises(InvalidArgumentError) as raised:
            dataset.load_state_dict(dict(_resumable(dataset), **{field: value}))
        assert str(raised.value).endswith(FIX_OWN), str(raised.value)


# ------------------------------------------------------------------------- readers and ranks

OWNER = Owner(source="demo", dataset=indices_digest(BitMap(range(40))), seed=7, seed_given=True, rank=1,
              world_size=2, hosts=None)
SAVED = {
    "version": 1, "job": "joader", "epoch": 3, "consumed": BitMap([1, 5, 9]).serialize(), "seed": 7,
    "seed_given": True, "source": "demo", "dataset": indices_digest(BitMap(range(40))), "rank": 1,
    "world_size": 2, "parts": 2, "hosts": None,
}
# Rank 1 of 2 over ids 0..39: 20 a epoch; loaded in one of 2 DataLoader workers.
SHARE = Share(items=BitMap(range(40)), num_source_items=48, per_epoch=20, readers=2, in_worker=True)


@pytest.mark.parametrize(("change", "share", "words"), [
    ({"consumed": BitMap(range(21)).serialize()}, SHARE,
     "consumed holds 21 ids, more than the 20 items an epoch gives this rank"),
    ({"parts": 3}, SHARE, "parts 3: the state says 3 readers of this rank saved their parts, and it is "
                          "loaded by 2 (a DataLoader worker of 2)"),
    ({"parts": 1}, SHARE, "parts 1: the state says 1 reader of this rank saved"),
    ({"consumed": BitMap([47]).serialize()}, Share(items=None, num_source_items=40, per_epoch=20, readers=2),
     "not an item of this job (47)"),
])
def test_counts_and_readers_are_checked_against_the_share(change: dict[str, Any], share: Share, words: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        Checkpoint.from_state_dict(dict(SAVED, **change), OWNER, share)
    assert words in str(raised.value), str(raised.value)


def test_a_state_within_the_share_loads() -> None:
    loaded = Checkpoint.from_state_dict(dict(SAVED, consumed=BitMap(range(20)).serialize()), OWNER, SHARE)
    assert loaded.consumed == BitMap(range(20)) and loaded.parts == 2
    # Without a share (no job to check against) only the state's own coherence is checked.
    assert Checkpoint.from_state_dict(SAVED, OWNER).parts == 2


# ------------------------------------------------------------------------- JoaderDataLoader


class _Stream(IterableDataset):
    """Ten items, with a dataset state of its own (what it loaded is kept)."""

    loaded: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[int]:
        return iter(range(10))

    def state_dict(self) -> dict[str, Any]:
        return {"pos": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def _gathered(num_workers: int = 0) -> dict[str, Any]:
    """What JoaderDataLoader.state_dict() gives one process after a batch (no process group)."""
    loader = JoaderDataLoader(_Stream(), batch_size=2, num_workers=num_workers)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    del batches
    return state


LOADER_TAMPERED: list[tuple[str, Any, str]] = [
    ("joader_loader", True, "loader state version True"),
    ("extra", 1, "unknown key(s) 'extra' in the state"),
    ("ranks", [{}], "ranks[0] is {}, neither a StatefulDataLoader state nor {'joader_fresh': True}"),
    ("ranks", [{"joader_fresh": "no"}], "ranks[0] is {'joader_fresh': 'no'}, neither"),
    ("ranks", [{"joader_fresh": False}], "ranks[0] is {'joader_fresh': False}, neither"),
    ("ranks", [5], "the state is malformed (world_size 1, 1 rank entries)"),
    ("world_size", 2, "the state is malformed (world_size 2, 1 rank entries)"),
]


@pytest.mark.parametrize(("field", "value", "words"), LOADER_TAMPERED,
                         ids=[f"{i:02d}-{f}" for i, (f, _, _) in enumerate(LOADER_TAMPERED)])
def test_each_tampered_loader_field_is_refused_naming_it(field: str, value: Any, words: str) -> None:
    state = dict(_gathered(), **{field: value})
    loader = JoaderDataLoader(_Stream(), batch_size=2)
    with pytest.raises(InvalidArgumentError) as raised:
        loader.load_state_dict(state)
    assert words in str(raised.value), str(raised.value)


def test_a_loader_state_of_other_num_workers_is_refused_when_loaded_not_at_iter() -> None:
    """torchdata raised a bare `AssertionError: State doesn't contain key '_num_yielded'` at the
    next iter(); the loader refuses it when it is loaded, naming the num_workers to use."""
    loader = JoaderDataLoader(_Stream(), batch_size=2)
    with pytest.raises(InvalidArgumentError, match="saved by a loader with num_workers=2, this loader has "
                                                   "num_workers=0; .* build the loader with num_workers=2"):
        loader.load_state_dict(_gathered(num_workers=2))
    with pytest.raises(InvalidArgumentError, match="num_workers=0, this loader has num_workers=2"):
        JoaderDataLoader(_Stream(), batch_size=2, num_workers=2).load_state_dict(_gathered())
    loader.load_state_dict(_gathered())  # its own still loads, and reaches the dataset
    assert len(list(loader)) == 5 and loader.dataset.loaded == {"pos": 0}
