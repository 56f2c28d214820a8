"""`joader.client.frameworks`: what a dataset learns from the call stack, with the real torch
DataLoader and torchdata StatefulDataLoader (and accelerate's real wrappers in
tests/integration/test_frameworks.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from joader.client import frameworks


class Seen(IterableDataset):
    """Yields, for each of 12 items, the batch size its fetch asked for (as JoaderDataset's
    items mode looks it up: once, at the first item of a pass)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        size = frameworks.loader_batch_size(skip=1)
        for _ in range(12):
            yield torch.tensor(-1 if size is None else size)


@pytest.mark.parametrize(("make", "expected"), [
    (lambda ds: DataLoader(ds, batch_size=5), 5),
    (lambda ds: DataLoader(ds, batch_size=5, num_workers=2), 5),
    (lambda ds: StatefulDataLoader(ds, batch_size=3), 3),
    (lambda ds: DataLoader(ds, batch_size=None), -1),  # no collation: batches are the dataset's
])
def test_the_loaders_batch_size_is_seen_from_its_fetch(make, expected: int) -> None:  # type: ignore[no-untyped-def]
    seen = {int(v) for batch in make(Seen()) for v in torch.as_tensor(batch).flatten()}
    assert seen == {expected}


def test_nothing_is_seen_outside_a_loader() -> None:
    assert {int(v) for v in Seen()} == {-1}


def test_no_accelerate_wrapper_and_no_lightning_loop_here() -> None:
    assert frameworks.accelerate_wrapper() is None
    assert frameworks.lightning_epoch_done() is False
