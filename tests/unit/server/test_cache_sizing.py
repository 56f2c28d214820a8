"""`--cache-size auto` (server/cache_sizing.py): the whole prepared dataset plus 1/16, capped at
half of /dev/shm's free space and a quarter of the RAM, never below one item; each cap decides
in its own case, and the reason says which."""

from __future__ import annotations

import os

import pytest

from joader.cache.arena import Arena
from joader.server.cache_sizing import (
    MARGIN_DIVISOR,
    CacheSize,
    PreparedSource,
    auto_cache_size,
    host_memory,
    prepared_bytes,
)

MiB = 2**20
GiB = 2**30
PLENTY = 1 << 50  # a cap that never decides
CROP = PreparedSource("imagenet", 2000, 3 * 224 * 224, exact=True)  # center-crop:224, 147.0 KiB each


def size(sources: list[PreparedSource], *, shm: int = PLENTY, ram: int = PLENTY, least: int = 64) -> CacheSize:
    return auto_cache_size(sources, shm_free_bytes=shm, ram_bytes=ram, min_bytes=least)


def test_the_whole_prepared_dataset_plus_a_sixteenth_when_it_fits() -> None:
    choice = size([CROP])
    dataset = 2000 * 3 * 224 * 224  # a multiple of 64 already
    assert choice.dataset_bytes == dataset
    assert choice.size_bytes == dataset + dataset // MARGIN_DIVISOR
    assert choice.size_bytes % Arena.ALIGN == 0
    assert choice.describe() == ("cache 305.1 MiB = the whole prepared dataset (287.1 MiB for 2,000 items, "
                                 "plus 1/16)")


def test_items_count_in_the_allocators_64_byte_units_and_sources_add_up() -> None:
    gray = PreparedSource("mnist", 1000, 28 * 28, exact=True)  # 784 bytes take 832
    assert prepared_bytes([gray]) == 1000 * 832
    both = size([gray, CROP])
    assert both.dataset_bytes == 1000 * 832 + 2000 * 3 * 224 * 224
    assert "for 3,000 items in 2 sources" in both.reason


def test_a_variable_stage_counts_its_bound_and_says_so() -> None:
    resize = PreparedSource("photos", 100, 3 * 160 * 8 * 160, exact=False)  # resize:160's bound
    choice = size([resize])
    assert choice.dataset_bytes == 100 * 3 * 160 * 8 * 160
    assert "at the stage's bound per item" in choice.reason


def test_capped_at_half_of_dev_shm_free() -> None:
    choice = size([CROP], shm=200 * MiB + 1)  # half: 100 MiB, below the 306 MiB wanted
    assert choice.size_bytes == 100 * MiB
    assert choice.reason.startswith("capped at half of /dev/shm free (200.0 MiB free)")
    assert choice.describe().startswith("cache 100.0 MiB, capped at half of /dev/shm free")
    assert "the prepared dataset is 287.1 MiB" in choice.reason


def test_capped_at_a_quarter_of_the_ram() -> None:
    choice = size([CROP], shm=4 * GiB, ram=512 * MiB)
    assert choice.size_bytes == 128 * MiB
    assert choice.reason.startswith("capped at a quarter of the host's RAM (512.0 MiB)")


def test_the_lower_cap_wins_whichever_it_is() -> None:
    assert size([CROP], shm=300 * MiB, ram=800 * MiB).size_bytes == 150 * MiB  # /dev/shm's
    assert size([CROP], shm=800 * MiB, ram=300 * MiB).size_bytes == 75 * MiB  # the RAM's


def test_never_below_one_item_the_least_the_arena_takes() -> None:
    item = 3 * 224 * 224
    choice = size([CROP], shm=100 * 1024, ram=PLENTY, least=item)  # /dev/shm nearly full
    assert choice.size_bytes == item
    assert choice.reason.startswith("raised to the least the arena takes (one item of 147.0 KiB)")
    assert "raise --shm-size" in choice.reason


def test_a_tiny_dataset_gets_its_size_rounded_to_the_arenas_unit() -> None:
    choice = size([PreparedSource("one", 1, 10, exact=True)])
    assert (choice.dataset_bytes, choice.size_bytes) == (64, 128)  # 64 + a sixteenth, in 64-byte units


@pytest.mark.parametrize("shm", [0, 1])
def test_a_full_dev_shm_still_gives_the_floor(shm: int) -> None:
    assert size([CROP], shm=shm, least=5000).size_bytes == 5056


def test_host_memory_reads_dev_shm_and_the_ram(tmp_path: os.PathLike[str]) -> None:
    free, ram = host_memory(tmp_path)
    assert free > 0 and ram > 0
