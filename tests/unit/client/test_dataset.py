"""`JoaderDataset`, the facade: its arguments, and one job read, checkpointed and resumed on a
real joaderd."""

from __future__ import annotations

import gc
import pickle
import threading

import numpy as np
import pytest
import torch
from pyroaring import BitMap

from joader.client.dataset import JoaderDataset, to_bitmap
from joader.errors import InvalidArgumentError

from .conftest import ITEMS


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"on_error": "ignore"}, "on_error must be 'skip' or 'raise'"),
    ({"prefetch": -1}, "prefetch must be an int >= 0"),
    ({"prefetch": True}, "prefetch must be an int >= 0"),
    ({"batch_size": 0}, "batch_size must be >= 1"),
    ({"seed": -1}, "seed must be in 0..2**64-1"),
    ({"order": "random"}, "order must be one of 'shared', 'independent', got 'random'"),
    ({"threads": 0}, "threads must be 'auto', None or a positive int"),
    ({"indices": []}, "indices is empty"),
    ({"indices": [1, 1, 2]}, "indices repeat items: 1 (2 times)"),
    ({"indices": [-1]}, "indices must be in 0.."),
    ({"indices": [0.5]}, "indices must be integers"),
    ({"decoder": "jpeg"}, "decoder must be one of pil, pil-draft, turbo, got 'jpeg'"),
    ({"upscale": "no"}, "upscale must be True or False, got 'no'"),
    ({"exif_transpose": 1}, "exif_transpose must be True or False, got 1"),
])
def test_wrong_arguments_are_refused_before_any_job_is_attached(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        JoaderDataset("demo", address="unix:/nowhere/s.sock", **({"threads": None} | kwargs))  # type: ignore[arg-type]
    assert words in str(raised.value)


def test_indices_become_a_bitmap() -> None:
    assert to_bitmap(None) is None
    assert to_bitmap(range(3, 6)) == BitMap([3, 4, 5])
    assert to_bitmap(range(6, 0, -2)) == BitMap([2, 4, 6])
    assert to_bitmap(np.array([9, 2], dtype=np.int64)) == BitMap([2, 9])


def test_an_epoch_checkpointed_midway_resumes_with_exactly_the_rest(joaderd: str) -> None:
    ds = JoaderDataset("demo", address=joaderd, return_index=True, threads=None, batch_size=4, seed=3,
                       name="checkpoint")
    assert len(ds) == ITEMS and ds.rank == 0 and ds.world_size == 1 and ds.seed == 3
    assert len(ds.targets) == ITEMS and len(ds.classes) == 3
    items = iter(ds)
    taken = [int(next(items)[0]) for _ in range(10)]
    state = ds.state_dict()
    items.close()
    ds.close()
    assert state["epoch"] == 1 and BitMap.deserialize(state["consumed"]) == BitMap(taken)
    again = JoaderDataset("demo", address=joaderd, return_index=True, threads=None, batch_size=4, seed=3,
                          name="checkpoint-again")
    try:
        again.load_state_dict(pickle.loads(pickle.dumps(state)))
        rest = [int(index) for index, _, _ in again]
        assert sorted(rest + taken) == list(range(ITEMS))
        assert again.epoch_order(1) == rest
        saved = again.state_dict()  # a finished epoch is saved as the start of the next
        assert saved["epoch"] == 2 and saved["consumed"] == BitMap().serialize()
        with pytest.raises(InvalidArgumentError, match="epoch_order\\(5\\)"):
            again.epoch_order(5)
    finally:
        again.close()


def test_the_iterator_keeps_the_job_alive_without_the_dataset(joaderd: str) -> None:
    items = iter(JoaderDataset("demo", address=joaderd, threads=None, name="alone"))
    gc.collect()
    assert len(list(items)) == ITEMS


@pytest.mark.parametrize("how", ["an epoch", "a pass left midway", "never read", "with"])
def test_a_trial_in_a_thread_ends_its_job_when_it_ends_with_no_cycle_collection(joaderd: str, how: str) -> None:
    # NOTE [ A sweep's trial ends its job ]: an Optuna objective in a thread of the study's n_jobs.
    # Python's cycle collector is off: the job must end by reference counting alone.
    ended: dict[str, object] = {}

    def objective() -> None:
        if how == "with":
            with JoaderDataset("demo", address=joaderd, threads=None, batch_size=4, name="trial") as ds:
                ended["keeper"] = ds._keeper
                assert len(list(torch.utils.data.DataLoader(ds, batch_size=4))) == ITEMS // 4
            ended["at block end"] = not ds._keeper.alive()  # type: ignore[union-attr]
            return
        ds = JoaderDataset("demo", address=joaderd, threads=None, batch_size=4, name="trial")
        ended["keeper"] = ds._keeper
        loader = torch.utils.data.DataLoader(ds, batch_size=4)
        if how == "an epoch":
            assert sum(len(labels) for _, labels in loader) == ITEMS
        elif how == "a pass left midway":
            batches = iter(loader)
            next(batches)

    gc.disable()
    try:
        thread = threading.Thread(target=objective)
        thread.start()
        thread.join()
        keeper = ended["keeper"]
        assert not keeper.alive(), "the lease keeper outlived its trial"  # type: ignore[attr-defined]
        assert ended.get("at block end", True)
    finally:
        gc.enable()


def test_close_ends_the_lease_keeper_and_a_pickled_dataset_carries_no_lease(joaderd: str) -> None:
    ds = JoaderDataset("demo", address=joaderd, threads=None, name="pickled")
    keeper = ds._keeper
    assert keeper is not None and keeper.alive()
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._keeper is None and copy._connection is not None and copy._connection.board is None
    assert copy.job_id == ds.job_id and copy.classes == ds.classes
    ds.close()
    assert not keeper.alive()
