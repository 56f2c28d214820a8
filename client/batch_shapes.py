"""A batch whose items differ in shape: an error that names the files, their sizes and the fix.

With `upscale=False` (or a user stage whose items vary in size) joaderd serves an image smaller
than S at its own size. torch's default collate then fails mid-epoch with "stack expects each
tensor to be equal size, but got [3, 64, 64] at entry 0 and [3, 10, 10] at entry 23", which
names no file and no option. So the collate of the DataLoader that fetches this dataset's items
is wrapped (`guard_shapes`): a failure over samples whose tensors differ in shape becomes
`BatchShapeError`, naming each odd item (its id, class and path), its shape as joaderd served
it, and the fix. Any other failure, and any batch of one shape, passes unchanged: a collate
that pads is the user's to give.

NOTE [ Which items a failed batch holds ]
A DataLoader's fetcher takes `batch_size` items from the dataset's iterator, then collates
them: the samples of the batch are the last `len(batch)` items this process yielded, in order
(`Progress.orders`). So the error names items by position, whatever the transform made of them.

`batched=True` copies items straight into one batch tensor: an item of another shape is refused
there (`shape_error`), with the same words.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from joader.errors import BatchShapeError

__all__ = ["BatchShapeError", "ItemNames", "guard_shapes", "shape_error"]

logger = logging.getLogger(__name__)

_NAMED = 3  # odd items named in one message
FIX_UPSCALE = ("pass upscale=True to JoaderDataset(root=...) (the default: every image is served at S, upscaled "
               "as torchvision's Resize + CenterCrop would), or run joaderd without --no-upscale {source}; or "
               "give the DataLoader a collate_fn that pads")
FIX_VARIABLE = ("its stage serves items of different sizes (joaderd's description of the source says so): give "
                "the DataLoader a collate_fn that pads, or a transform that ends in a fixed size")
FIX_TRANSFORM = ("make the transform end in a fixed size (e.g. torchvision's CenterCrop), or give the "
                 "DataLoader a collate_fn that pads")


@dataclass
class ItemNames:
    """How an item is named in an error: its class (from joaderd's description) and its path,
    listed from `root` when the dataset started its joaderd itself (only when an error needs it:
    listing a large source takes a while)."""

    root: str | None = None
    num_source_items: int = 0
    classes: dict[int, str] = field(default_factory=dict)  # label -> class name
    _paths: Sequence[str] | None = None
    _listed: bool = False

    @classmethod
    def of(cls, root: str | None, description: Any) -> ItemNames:
        """A job's names from joaderd's description of it (`Attachment.description`)."""
        return cls(root, description.num_source_items,
                   {label: name for name, label in description.class_to_idx.items()})

    def name(self, item_id: int, label: int | None = None) -> str:
        parts = [f"item {item_id}"]
        if label is not None and label in self.classes:
            parts.append(f"class {self.classes[label]!r}")
        path = self.path(item_id)
        if path is not None:
            parts.append(path)
        return parts[0] + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else "")

    def path(self, item_id: int) -> str | None:
        if not self._listed:
            self._listed = True
            self._paths = self._list()
        if self._paths is None or not 0 <= item_id < len(self._paths):
            return None
        return os.path.join(self.root or "", self._paths[item_id])

    def _list(self) -> Sequence[str] | None:
        if self.root is None:
            return None
        from joader.sources.base import open_source  # the server's listing, as joaderd made it

        try:
            listing = open_source(self.root)
        except Exception as error:  # noqa: BLE001  a name is a courtesy: the error is the shape's
            logger.debug("listing %s for an error message failed: %s", self.root, error)
            return None
        return listing.paths if len(listing) == self.num_source_items else None


def shape_error(source: str, item: str, served: tuple[int, ...], expected: tuple[int, ...] | None,
                others: str = "") -> BatchShapeError:
    """The error for items served in another shape than the batch's."""
    want = f"the stage's {_shape(expected)}" if expected is not None else "the batch's other items'"
    return BatchShapeError(
        f"a batch of {source!r} cannot be formed: {item} was served as {_shape(served)}, not {want}{others} "
        f"(joaderd serves an image smaller than S at its own size when upscale is off); "
        f"{FIX_UPSCALE.format(source=source)}")


def guard_shapes(fetcher: Any, recent: Callable[[int], list[int]], served: dict[int, tuple[int, ...]],
                 names: ItemNames, source: str, expected: tuple[int, ...] | None) -> None:
    """Wraps the collate of `fetcher` (the DataLoader's, found on the stack) once: a failure
    over samples of different shapes becomes `BatchShapeError`. `recent(n)`: the last `n`
    item ids this process yielded (NOTE [ Which items a failed batch holds ]); `served`: the
    shapes joaderd served of the items that were not the stage's `expected` shape."""
    collate = getattr(fetcher, "collate_fn", None)
    if collate is None:
        return
    now = (recent, served, names, source, expected)
    if getattr(collate, "joader_shape_guard", False):
        collate.joader_shapes[0] = now  # this pass's
        return
    # A list the wrapper and its attribute share, not the wrapper naming itself: a function in
    # its own closure is a reference cycle, and would keep the dataset's job alive until the
    # cycle collector runs (NOTE [ A sweep's trial ends its job ] in dataset.py).
    shapes = [now]

    @functools.wraps(collate)
    def collate_one_shape(batch: Any) -> Any:
        try:
            return collate(batch)
        except Exception as error:
            found = odd_shapes(batch)
            if found is None:
                raise
            raise batch_error(found, len(batch), *shapes[0]) from error

    collate_one_shape.joader_shape_guard = True  # type: ignore[attr-defined]
    collate_one_shape.joader_shapes = shapes  # type: ignore[attr-defined]
    fetcher.collate_fn = collate_one_shape


def odd_shapes(batch: Any) -> tuple[tuple[int, ...], list[tuple[int, tuple[int, ...], Any]]] | None:
    """(the batch's most common shape, [(position, shape, label)] of the samples of another one),
    at the first place in a sample where tensors differ; None if none do."""
    if not isinstance(batch, list) or not batch:
        return None
    samples = [s if isinstance(s, tuple | list) else (s,) for s in batch]
    width = min(len(s) for s in samples)
    for place in range(width):
        tensors = [s[place] for s in samples]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            continue
        shapes = [tuple(t.shape) for t in tensors]
        common = Counter(shapes).most_common(1)[0][0]
        odd = [(i, shape, _label(samples[i])) for i, shape in enumerate(shapes) if shape != common]
        if odd:
            return common, odd
    return None


def batch_error(found: tuple[tuple[int, ...], list[tuple[int, tuple[int, ...], Any]]], size: int,
                recent: Callable[[int], list[int]], served: dict[int, tuple[int, ...]], names: ItemNames,
                source: str, expected: tuple[int, ...] | None) -> BatchShapeError:
    """The message for a batch of `size` samples that `odd_shapes` found mixed: sample `i` is
    item `recent(size)[i]` (NOTE [ Which items a failed batch holds ])."""
    common, odd = found
    ids = recent(size)
    ids = ids if len(ids) == size else []
    named, served_odd = [], False
    for position, shape, label in odd[:_NAMED]:
        item_id = ids[position] if ids else None
        what = names.name(item_id, label) if item_id is not None else f"the sample at position {position}"
        served_shape = served.get(item_id) if item_id is not None else None
        served_odd |= served_shape is not None
        named.append(f"{what}: {_shape(served_shape or shape)}")
    more = f" and {len(odd) - _NAMED} more" if len(odd) > _NAMED else ""
    if served_odd and expected is None:
        fix, why = FIX_VARIABLE, "as joaderd served them"
    elif served_odd:
        fix = FIX_UPSCALE.format(source=source)
        why = "joaderd serves an image smaller than S at its own size when upscale is off"
    else:
        fix, why = FIX_TRANSFORM, "the transform gave them different shapes"
    want = _shape(expected) if served_odd and expected is not None else _shape(common)
    return BatchShapeError(
        f"a batch of {source!r} cannot be formed: its items must have one shape ({want}), but "
        f"{'; '.join(named)}{more} ({why}); {fix}")


def _label(sample: Sequence[Any]) -> int | None:
    last = sample[-1] if sample else None
    if isinstance(last, torch.Tensor) and last.numel() == 1:
        last = last.item()
    return last if isinstance(last, int) else None


def _shape(shape: tuple[int, ...] | None) -> str:
    return "x".join(str(d) for d in shape) if shape else "?"
