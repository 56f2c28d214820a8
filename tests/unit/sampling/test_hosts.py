"""The host partition (`joader.sampling.hosts`): exact cuts for every layout, the same parts for
the same items whatever the job, nearly the same for overlapping items, and torchrun's env."""

from __future__ import annotations

import itertools

import pytest
from pyroaring import BitMap

from joader.errors import InvalidArgumentError
from joader.sampling.hosts import HostLayout, host_part, keyed_order, layout_from_env, source_salt

SALT = source_salt("demo")


def _parts(items: BitMap, sizes: list[int], drop_last: bool = False) -> list[BitMap]:
    world, first, parts = sum(sizes), 0, []
    for local in sizes:
        parts.append(host_part(items, SALT, HostLayout(world, first, local, 0), drop_last=drop_last))
        first += local
    return parts


@pytest.mark.parametrize(("sizes", "n"), list(itertools.product(
    [[1, 1], [2, 1], [1, 2], [2, 2], [3, 1, 2], [8, 8], [1, 1, 1, 1, 1]], [160, 159, 97, 1000, 17])))
def test_every_rank_gets_the_same_count_and_the_union_is_the_dataset(sizes: list[int], n: int) -> None:
    items = BitMap(range(5, 5 + n))
    world = sum(sizes)
    m = -(-n // world)
    parts = _parts(items, sizes)
    assert [len(p) for p in parts] == [local * m for local in sizes]  # ceil(|part| / L) = m on every host
    assert BitMap.union(*parts) == items
    assert sum(len(p) for p in parts) - n == world * m - n  # padding: W*m - |D| repeats, < W
    m = n // world
    dropped = _parts(items, sizes, drop_last=True)
    assert [len(p) for p in dropped] == [local * m for local in sizes]
    union = BitMap.union(*dropped)
    assert union <= items and len(union) == world * m and n - len(union) < world
    assert sum(len(p) for p in dropped) == len(union)  # disjoint


def test_the_cut_depends_on_the_source_and_items_not_on_the_job() -> None:
    items = BitMap(range(1000))
    assert _parts(items, [2, 2]) == _parts(BitMap(items), [2, 2])
    other = [host_part(items, source_salt("other"), HostLayout(4, 0, 2, 0), drop_last=False)]
    assert other[0] != _parts(items, [2, 2])[0]


def test_overlapping_datasets_get_nearly_the_same_parts() -> None:
    """A tuning job on 90% of the items and a full job on the same hosts: each host's parts
    overlap in all but a few items (the cuts move a little), so they share on every host."""
    full = _parts(BitMap(range(2000)), [2, 2])
    tuning = _parts(BitMap(range(1800)), [2, 2])
    for f, t in zip(full, tuning, strict=True):
        assert len(t & f) >= 0.95 * len(t), (len(t & f), len(t))


def test_the_keyed_order_is_not_the_id_order() -> None:
    """Each host's part spreads over the whole id range (ids in order would give host 0 the
    first half: one class per host in an ImageFolder sorted by class)."""
    part = _parts(BitMap(range(10_000)), [1, 1])[0]
    deciles = [sum(1 for i in part if k * 1000 <= i < (k + 1) * 1000) for k in range(10)]
    assert all(400 <= d <= 600 for d in deciles), deciles  # 500 expected, sd ~16
    assert sorted(keyed_order(BitMap(range(50)), SALT).tolist()) == list(range(50))


def test_layout_from_torchrun_environment() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    layout = layout_from_env(3, 5, env)
    assert layout == HostLayout(5, 2, 2, 1) and layout.rank == 3 and layout.label == "ranks2-3of5"
    assert layout_from_env(3, 5, {**env, "LOCAL_WORLD_SIZE": "5", "LOCAL_RANK": "3"}) is None  # one host
    assert layout_from_env(1, 2, env) is None  # rank= and world_size= given for another job
    assert layout_from_env(3, 5, {"RANK": "3", "WORLD_SIZE": "5"}) is None  # no torchrun layout: one host
    with pytest.raises(InvalidArgumentError, match="consecutive ranks"):
        layout_from_env(0, 5, {**env, "RANK": "0"})  # local rank 1 would be global rank -1
    with pytest.raises(InvalidArgumentError, match="not an integer"):
        layout_from_env(3, 5, {**env, "LOCAL_RANK": "x"})


def test_too_few_items_for_the_ranks_is_refused_with_the_fix() -> None:
    with pytest.raises(InvalidArgumentError, match="at least one item"):
        host_part(BitMap(range(3)), SALT, HostLayout(4, 0, 2, 0), drop_last=True)
    with pytest.raises(InvalidArgumentError, match="too few"):
        host_part(BitMap(range(3)), SALT, HostLayout(8, 0, 4, 0), drop_last=False)
