"""A batch that cannot be formed names its files, their sizes and the fix
(`joader.client.batch_shapes`): torch's own error named none."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate

from joader.client.batch_shapes import BatchShapeError, ItemNames, guard_shapes, shape_error
from joader.errors import JoaderError


class _Fetcher:
    def __init__(self) -> None:
        self.collate_fn = default_collate


def _batch(shapes: list[tuple[int, ...]], labels: list[int] | None = None) -> list[tuple[torch.Tensor, int]]:
    labels = labels or [0] * len(shapes)
    return [(torch.zeros(shape, dtype=torch.uint8), label) for shape, label in zip(shapes, labels, strict=True)]


def test_a_batch_of_two_shapes_names_the_odd_item_its_path_and_the_option(tmp_path: Path) -> None:
    for name in ("cat", "dog"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.jpg").write_bytes(b"x")
    (tmp_path / "dog" / "tiny.jpg").write_bytes(b"x")  # item 2
    fetcher, yielded = _Fetcher(), [7, 0, 2, 1]  # the odd item mid-batch: named by its place
    names = ItemNames(str(tmp_path), 3, {0: "cat", 1: "dog"})
    guard_shapes(fetcher, lambda n: yielded[-n:], {2: (3, 10, 10)}, names, "photos", (3, 64, 64))
    with pytest.raises(BatchShapeError) as raised:
        fetcher.collate_fn(_batch([(3, 64, 64), (3, 10, 10), (3, 64, 64)], [0, 1, 1]))
    assert str(raised.value) == (
        f"a batch of 'photos' cannot be formed: its items must have one shape (3x64x64), but item 2 (class "
        f"'dog', {tmp_path}/dog/tiny.jpg): 3x10x10 (joaderd serves an image smaller than S at its own size "
        "when upscale is off); pass upscale=True to JoaderDataset(root=...) (the default: every image is served "
        "at S, upscaled as torchvision's Resize + CenterCrop would), or run joaderd without --no-upscale photos; "
        "or give the DataLoader a collate_fn that pads")
    assert isinstance(raised.value, JoaderError) and isinstance(raised.value, RuntimeError)
    assert "stack expects each tensor to be equal size" in str(raised.value.__cause__)


def test_shapes_a_transform_made_name_the_transform_and_other_errors_pass() -> None:
    fetcher = _Fetcher()
    guard_shapes(fetcher, lambda n: [4, 5][-n:], {}, ItemNames(), "photos", (3, 64, 64))
    with pytest.raises(BatchShapeError, match=r"but item 5: 3x32x32 \(the transform gave them different shapes\); "
                                              r"make the transform end in a fixed size"):
        fetcher.collate_fn(_batch([(3, 48, 48), (3, 32, 32)]))
    assert fetcher.collate_fn(_batch([(3, 8, 8)] * 2))[0].shape == (2, 3, 8, 8)  # one shape: collated

    def broken(batch: Any) -> Any:
        raise ValueError("the user's own bug")

    other = _Fetcher()
    other.collate_fn = broken
    guard_shapes(other, lambda n: [], {}, ItemNames(), "photos", None)
    with pytest.raises(ValueError, match="the user's own bug"):
        other.collate_fn(_batch([(1,), (1,)]))


def test_the_guard_wraps_once_and_follows_the_newest_pass() -> None:
    fetcher = _Fetcher()
    guard_shapes(fetcher, lambda n: [1, 2], {}, ItemNames(), "photos", None)
    wrapped = fetcher.collate_fn
    guard_shapes(fetcher, lambda n: [8, 9], {9: (3, 1, 1)}, ItemNames(), "photos", (3, 4, 4))
    assert fetcher.collate_fn is wrapped
    with pytest.raises(BatchShapeError, match="but item 9: 3x1x1"):
        fetcher.collate_fn(_batch([(3, 4, 4), (3, 1, 1)]))


def test_batched_refuses_an_item_of_another_shape_by_name() -> None:
    error = shape_error("photos", "item 3 (class 'cat')", (3, 10, 10), (3, 64, 64))
    assert str(error).startswith("a batch of 'photos' cannot be formed: item 3 (class 'cat') was served as 3x10x10, "
                                 "not the stage's 3x64x64 (joaderd serves")
    assert str(error).endswith("or give the DataLoader a collate_fn that pads")


def test_a_stage_of_variable_sizes_names_a_padding_collate_not_upscale() -> None:
    fetcher = _Fetcher()
    guard_shapes(fetcher, lambda n: [3, 4][-n:], {3: (3, 5, 7), 4: (3, 6, 6)}, ItemNames(), "boxes", None)
    with pytest.raises(BatchShapeError) as raised:
        fetcher.collate_fn(_batch([(3, 5, 7), (3, 6, 6)]))
    assert "(as joaderd served them); its stage serves items of different sizes" in str(raised.value)
    assert "upscale" not in str(raised.value)


def test_item_names_of_a_description_name_the_class_by_label() -> None:
    description = SimpleNamespace(num_source_items=3, class_to_idx={"cat": 0, "dog": 1})
    names = ItemNames.of(None, description)
    assert names.classes == {0: "cat", 1: "dog"} and names.num_source_items == 3
    assert names.name(2, label=1) == "item 2 (class 'dog')"
