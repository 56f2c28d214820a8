"""One pass's reader (`joader.client.delivery.Reader`) against a real joaderd: what it records
as yielded, its stall timing, its modes, and a pass a newer one superseded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from pyroaring import BitMap

from joader.client.dataset import JoaderDataset
from joader.client.delivery import Reader, ReadOptions, check_read_arguments, shapes
from joader.client.passes import Pass, Progress
from joader.errors import InvalidArgumentError, PassSupersededError
from joader.proto import joader_pb2

from .conftest import IMAGE_SIZE, ITEMS


@pytest.fixture
def dataset(joaderd: str) -> Iterator[JoaderDataset]:
    ds = JoaderDataset("demo", address=joaderd, batch_size=8, threads=None, prefetch=0, name="delivery")
    yield ds
    ds.close()


def _reader(ds: JoaderDataset, progress: Progress, token: int, **options: object) -> Reader:
    pass_ = Pass(token, 0, 1)
    progress.current = pass_
    assert ds._connection is not None
    return Reader(ds._connection, pass_, progress,
                  ReadOptions(source="demo", batch_size=8, return_index=True, item_shape=ds.item_shape,
                              item_dtype=ds.item_dtype, **options))  # type: ignore[arg-type]


def test_a_reader_records_what_the_loop_took_in_its_progress(dataset: JoaderDataset) -> None:
    progress = Progress()
    reader = _reader(dataset, progress, 11)
    taken = [int(index) for index, image, label in reader.start()]
    assert sorted(taken) == list(range(ITEMS))
    epoch = reader.pass_.epoch
    assert epoch >= 1 and progress.epoch == epoch and progress.finished
    assert progress.consumed == BitMap(range(ITEMS)) and progress.orders[epoch] == taken
    assert reader.pass_.items == ITEMS
    # In the training process the loop's time inside next() and between calls is measured.
    assert reader.pass_.measured and reader.pass_.wait_s > 0


def test_items_are_counted_when_taken_not_when_read(dataset: JoaderDataset) -> None:
    progress = Progress()
    items = _reader(dataset, progress, 12).start()
    first = [int(next(items)[0]) for _ in range(3)]
    assert list(progress.consumed) == sorted(first) and not progress.finished
    items.close()  # the leftover batch goes back to joaderd


def test_a_superseded_pass_yields_nothing_more(dataset: JoaderDataset) -> None:
    progress = Progress()
    reader = _reader(dataset, progress, 13)
    items = reader.start()
    next(items)
    progress.current = Pass(14, 0, 1)  # a newer iter() in this process
    with pytest.raises(PassSupersededError):
        next(items)
    assert reader.pass_.items == 1 and len(progress.consumed) == 1  # nothing more recorded


def test_batched_mode_gives_whole_batches_of_one_tensor(dataset: JoaderDataset) -> None:
    progress = Progress()
    batches = list(_reader(dataset, progress, 15, batched=True).start())
    assert [len(labels) for _, _, labels in batches] == [8] * (ITEMS // 8)
    indices, images, labels = batches[0]
    assert images.shape == (8, 3, IMAGE_SIZE, IMAGE_SIZE) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and indices.tolist() == progress.orders[progress.epoch][:8]
    assert progress.finished and len(progress.consumed) == ITEMS


def test_a_request_carries_the_stall_figures_once_measured(dataset: JoaderDataset) -> None:
    progress = Progress()
    reader = _reader(dataset, progress, 16)
    assert "stall_epoch" not in reader._fields(8)
    reader.pass_.measured, reader.pass_.epoch, reader.pass_.wait_s = True, 2, 0.5
    fields = reader._fields(8)
    assert fields["stall_epoch"] == 2 and fields["stall_wait_s"] == 0.5 and fields["max_items"] == 8


def test_shapes_are_read_from_the_flat_dims() -> None:
    response = joader_pb2.NextResponse(dims=[3, 4, 4, 1, 2], ndims=[3, 2])
    assert shapes(response) == [(3, 4, 4), (1, 2)]


@pytest.mark.parametrize(("on_error", "prefetch", "batch_size", "named"), [
    ("ignore", 1, None, "on_error must be 'skip' or 'raise', got 'ignore'"),
    ("skip", -1, None, "prefetch must be an int >= 0"),
    ("skip", True, None, "prefetch must be an int >= 0"),
    ("raise", 1.5, None, "prefetch must be an int >= 0"),
    ("skip", 0, 0, "batch_size must be >= 1, got 0"),
])
def test_reading_arguments_are_refused_by_name(on_error: str, prefetch: object, batch_size: int | None,
                                               named: str) -> None:
    with pytest.raises(InvalidArgumentError, match=named.replace("(", r"\(")):
        check_read_arguments(on_error, prefetch, batch_size)  # type: ignore[arg-type]
    check_read_arguments("raise", 0, 1)  # accepted
