"""Exact sizes (joader.server.books.item_sizes) on their own: how a decode's range is chosen
(`range_kind`, pure), the size memory and misfits. The cache's use of them is tested in
tests/unit/server/books/test_item_cache.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from joader.server.books.item_sizes import MISFITS, NO_SIZE, ItemSizes, range_kind
from joader.server.books.records import Source
from joader.stages import ItemSpec

BOUND = 4096


class VariableStage:
    name = "resize:8"
    spec = ItemSpec.variable(BOUND, "uint8", 3)


def _source(stage: object) -> Source:
    listing = SimpleNamespace(paths=tuple(f"{i}.jpg" for i in range(10)), labels=[0] * 10)
    return Source("s", listing, stage, 0, seed=1)


@pytest.mark.parametrize("busy", [False, True])
@pytest.mark.parametrize("sized_first", [False, True])
def test_a_known_size_is_exact_whatever_else(busy: bool, sized_first: bool) -> None:
    assert range_kind(known=100, misfits=0, size_coming_while_busy=busy, can_size_first=sized_first) == "exact"


def test_an_item_that_outgrew_its_size_too_often_gets_the_bound() -> None:
    assert range_kind(known=100, misfits=MISFITS - 1, size_coming_while_busy=False, can_size_first=False) == "exact"
    assert range_kind(known=100, misfits=MISFITS, size_coming_while_busy=False, can_size_first=False) == "at_bound"


def test_an_unknown_size_waits_for_its_probe_only_while_every_worker_is_busy() -> None:
    assert range_kind(known=0, misfits=0, size_coming_while_busy=True, can_size_first=True) == "wait"
    assert range_kind(known=0, misfits=0, size_coming_while_busy=False, can_size_first=True) == "sized_first"
    assert range_kind(known=0, misfits=0, size_coming_while_busy=False, can_size_first=False) == "at_bound"


def test_the_size_memory_keeps_sizes_up_to_the_bound() -> None:
    sizes, source = ItemSizes(), _source(VariableStage())
    assert sizes.known(source, 3) == NO_SIZE
    sizes.remember(source, 3, 1000)
    sizes.remember(source, 4, 0)  # an empty item still takes one unit
    sizes.remember(source, 5, source.max_item_bytes + 1)  # above the bound: not kept
    assert (sizes.known(source, 3), sizes.known(source, 4), sizes.known(source, 5)) == (1000, 1, NO_SIZE)


def test_misfits_count_in_a_row_until_the_item_fits() -> None:
    sizes = ItemSizes()
    sizes.misfit(7)
    sizes.misfit(7)
    assert sizes.misfits(7) == 2 and sizes.misfits(8) == 0
    sizes.fitted(7)
    assert sizes.misfits(7) == 0
