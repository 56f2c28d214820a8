"""PackedPaths (joader/sources/base.py, NOTE [ A listing the decode workers share ]): a
listing's paths without an object per path, read as the tuple it replaces."""

from __future__ import annotations

import os
import pickle
import random

import pytest

from joader.sources.base import PackedPaths

pytestmark = pytest.mark.timeout(60)


def _names(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pool = ["a", "Z", " ", ",", "é", "日本", "\udcff", "\udc80x", "."]  # surrogates: non-UTF-8 bytes
    return ["" if rng.random() < 0.02 else f"c{rng.randrange(9)}/" + "".join(rng.choices(pool, k=rng.randrange(1, 9)))
            for _ in range(count)]


@pytest.mark.parametrize("seed", range(4))
def test_it_reads_as_the_tuple_it_replaces(seed: int) -> None:
    names = _names(500, seed)
    packed, plain = PackedPaths(names), tuple(names)
    assert len(packed) == len(plain) and list(packed) == names and packed == plain and packed == names
    for index in [0, 1, 250, 499, -1, -500]:
        assert packed[index] == plain[index]
    assert packed[10:40:3] == list(plain[10:40:3]) and packed[-5:] == list(plain[-5:])
    assert all(os.fsencode(a) == os.fsencode(b) for a, b in zip(packed, plain, strict=True))  # bytes exact
    assert pickle.loads(pickle.dumps(packed)) == packed
    assert packed != plain[:-1] and packed != (*plain[:-1], plain[-1] + "x")
    for bad in (500, -501):
        with pytest.raises(IndexError, match="out of range"):
            packed[bad]


def test_an_empty_listing_and_one_empty_name() -> None:
    assert len(PackedPaths([])) == 0 and list(PackedPaths([])) == []
    assert list(PackedPaths(["", "a", ""])) == ["", "a", ""]


def test_it_holds_no_object_per_path() -> None:
    """The point: reading a path in a forked worker writes no shared page (no reference count
    of a per-path object), and the listing takes tens of bytes per item, not a str each."""
    packed = PackedPaths([f"n{i % 1000:08d}/img_{i}.JPEG" for i in range(100_000)])
    assert not hasattr(packed, "__dict__")
    assert packed._blob.__sizeof__() + packed._ends.__sizeof__() < 100_000 * 40
