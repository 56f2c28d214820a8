"""`--cache-size auto` (server/cache_sizing.py): the whole prepared dataset plus 1/16, capped at
half of /dev/shm's free space and a quarter of the RAM, never below one item; each cap decides
in its own case, and the reason says which. With a shared budget (auto-started servers), all of
them together stay within half of /dev/shm's size and a quarter of the RAM or cgroup limit, for
any order of starts and stops (a model of the host, every permutation)."""

from __future__ import annotations

import itertools
import os

import pytest

from joader.cache.arena import Arena
from joader.errors import CacheSpaceError
from joader.server.cache_sizing import (
    CGROUP_LIMIT,
    MARGIN_DIVISOR,
    CacheSize,
    PreparedSource,
    SharedBudget,
    auto_cache_size,
    budget_bytes,
    cgroup_memory_limit,
    host_memory,
    memory_limit,
    prepared_bytes,
    shm_size_bytes,
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


# --- one budget for all of a user's auto-started servers (--cache-budget-dir) ---------------------------

HUGE = PreparedSource("photos", 160, 3 * 512 * 8 * 512, exact=False)  # resize:512's bound: 960 MiB


def shared(sources: list[PreparedSource], *, shm_size: int, shm_free: int, others: list[int],
           ram: int = PLENTY, least: int = 64) -> CacheSize:
    budget = SharedBudget(shm_size, tuple((f"pid {100 + i}: photos (resize)", n) for i, n in enumerate(others)))
    return auto_cache_size(sources, shm_free_bytes=shm_free, ram_bytes=ram, min_bytes=least, budget=budget)


def test_the_budget_is_half_of_dev_shms_size_or_a_quarter_of_the_ram_whichever_is_lower() -> None:
    assert budget_bytes(1 * GiB, 24 * GiB) == (512 * MiB, "half of the 1.0 GiB shared-memory filesystem")
    assert budget_bytes(24 * GiB, 8 * GiB, CGROUP_LIMIT) == (
        2 * GiB, "a quarter of this cgroup's memory limit (8.0 GiB)")


def test_a_server_takes_its_whole_dataset_when_it_fits_in_what_the_others_left() -> None:
    choice = shared([CROP], shm_size=1 * GiB, shm_free=900 * MiB, others=[100 * MiB])
    assert choice.size_bytes == 2000 * 3 * 224 * 224 * 17 // 16
    assert choice.reason.endswith("plus 1/16), within the 512.0 MiB budget of all auto-started servers "
                                  "(half of the 1.0 GiB shared-memory filesystem)")


def test_a_dataset_that_does_not_fit_takes_half_of_what_the_others_left() -> None:
    choice = shared([HUGE], shm_size=1 * GiB, shm_free=768 * MiB, others=[256 * MiB])
    assert choice.size_bytes == 128 * MiB
    assert choice.reason.startswith(
        "half of what the 1 other auto-started server (256.0 MiB) left of the 512.0 MiB budget of all "
        "auto-started servers (half of the 1.0 GiB shared-memory filesystem) (256.0 MiB left)")
    assert choice.describe().startswith("cache 128.0 MiB, half of what")


def test_half_of_dev_shm_free_still_caps_it_when_others_than_joaderd_fill_it() -> None:
    choice = shared([HUGE], shm_size=1 * GiB, shm_free=100 * MiB, others=[])
    assert choice.size_bytes == 50 * MiB
    assert choice.reason.startswith("capped at half of /dev/shm free (100.0 MiB free)")


def test_a_cgroup_limit_below_the_ram_sets_the_budget() -> None:
    choice = auto_cache_size([HUGE], shm_free_bytes=24 * GiB, ram_bytes=1 * GiB, min_bytes=64,
                             ram_what=CGROUP_LIMIT, budget=SharedBudget(24 * GiB))
    assert choice.size_bytes == 128 * MiB  # half of a quarter of 1 GiB
    assert "a quarter of this cgroup's memory limit (1.0 GiB)" in choice.reason


def test_refused_when_the_others_left_less_than_one_item_naming_them_and_the_fix() -> None:
    with pytest.raises(CacheSpaceError) as error:
        shared([CROP], shm_size=1 * GiB, shm_free=600 * MiB, others=[300 * MiB, 212 * MiB], least=3 * 224 * 224)
    message = str(error.value)
    assert "already hold 512.0 MiB of the 512.0 MiB budget of all auto-started servers" in message
    assert "pid 100: photos (resize) (300.0 MiB); pid 101: photos (resize) (212.0 MiB)" in message
    assert message.endswith("or give this one an explicit size (JOADER_CACHE_SIZE=512MiB for auto-started "
                            "servers, --cache-size for joaderd)")
    assert "joader servers --stop" in message


def test_four_specs_in_a_1_gib_dev_shm_take_half_of_it_together_not_15_16() -> None:
    """The tester's case (issue 36): resize 512/640/768/896 in 1 GiB. Each server alone took half
    of what was free: 512 + 256 + 128 + 64 = 960 MiB. With the budget: 256 + 128 + 64 + 32."""
    legacy, held = [], []
    for _ in range(4):
        legacy.append(size([HUGE], shm=1 * GiB - sum(legacy), ram=24 * GiB).size_bytes)
        held.append(shared([HUGE], shm_size=1 * GiB, shm_free=1 * GiB - sum(held), others=held,
                           ram=24 * GiB).size_bytes)
    assert [n // MiB for n in legacy] == [512, 256, 128, 64]  # the bug: no bound on the total
    assert [n // MiB for n in held] == [256, 128, 64, 32]
    assert sum(held) <= 512 * MiB


def _model_run(events: list[tuple[str, int]], datasets: dict[int, PreparedSource], *, shm_size: int,
               ram: int, least: int, foreign: int) -> None:
    """Starts and stops servers in the given order against a model host whose /dev/shm holds the
    live arenas and `foreign` bytes of others' (DataLoader batches); checks the invariants."""
    total, _ = budget_bytes(shm_size, ram)
    live: dict[int, int] = {}
    for kind, key in events:
        if kind == "stop":
            live.pop(key, None)
            continue
        held = sum(live.values())
        free = max(0, shm_size - held - foreign)
        left = total - held
        try:
            choice = shared([datasets[key]], shm_size=shm_size, shm_free=free, others=list(live.values()),
                            ram=ram, least=least)
        except CacheSpaceError:
            assert left < _up(least), (events, live)  # refused only when the budget has no room
            continue
        assert choice.size_bytes % Arena.ALIGN == 0 and choice.size_bytes >= least
        wanted = _up(datasets[key].items * _up(datasets[key].item_bytes) * 17 // 16)
        # the whole dataset when it fits in what is left and in half of /dev/shm free, else no more
        # than half of what is left (or the floor)
        if wanted <= left and wanted <= free // 2:
            assert choice.size_bytes >= prepared_bytes([datasets[key]])
        else:
            assert choice.size_bytes <= max(_up(least), left // 2, wanted if wanted <= left else 0)
        live[key] = choice.size_bytes
        assert sum(live.values()) <= total, (events, live)  # the budget holds after every start


def _up(n: int) -> int:
    return -(-n // Arena.ALIGN) * Arena.ALIGN


@pytest.mark.parametrize("least", [64, 3 * 224 * 224, 40 * MiB])
@pytest.mark.parametrize("foreign", [0, 300 * MiB])
def test_the_total_never_exceeds_the_budget_for_any_order_of_starts_and_stops(least: int, foreign: int) -> None:
    datasets = {
        0: HUGE,  # never fits
        1: CROP,  # 305 MiB with its margin: fits an empty budget, not a used one
        2: PreparedSource("small", 100, 3 * 64 * 64, exact=True),  # 1.2 MiB: always fits
        3: PreparedSource("mid", 1000, 3 * 224 * 224, exact=True),  # 153 MiB
        4: PreparedSource("big", 400, 3 * 512 * 512, exact=True),  # 319 MiB
    }
    for order in itertools.permutations(datasets):
        _model_run([("start", key) for key in order], datasets, shm_size=1 * GiB, ram=24 * GiB,
                   least=least, foreign=foreign)
        # the first two stop in the middle, and start again: entries of the dead count no more
        middle = [("start", order[0]), ("start", order[1]), ("stop", order[0]), ("start", order[2]),
                  ("stop", order[1]), ("start", order[3]), ("start", order[0]), ("start", order[4]),
                  ("start", order[1])]
        _model_run(middle, datasets, shm_size=1 * GiB, ram=2 * GiB, least=least, foreign=foreign)


def test_any_number_of_servers_stay_within_the_budget_and_each_gets_half_of_the_rest() -> None:
    imagenet = PreparedSource("imagenet", 1_281_167, 3 * 224 * 8 * 224, exact=False)  # resize:224
    held: list[int] = []
    for _ in range(30):
        try:
            held.append(shared([imagenet], shm_size=24 * GiB, shm_free=24 * GiB - sum(held), others=held,
                               ram=int(23.5 * GiB), least=3 * 224 * 224).size_bytes)
        except CacheSpaceError:
            break
    total = budget_bytes(24 * GiB, int(23.5 * GiB))[0]
    assert sum(held) <= total
    assert held[0] == total // 2 // 64 * 64 and held[1] == (total - held[0]) // 2 // 64 * 64
    assert 10 < len(held) < 30  # refused once less than one item is left


def test_memory_limit_reads_the_lowest_cgroup_limit_on_the_way_to_the_root() -> None:
    files = {
        "/proc/self/cgroup": "12:memory:/slurm/job_7\n0::/user.slice/job.scope\n",
        "/proc/self/mountinfo": (
            "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
            "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
            "42 31 0:39 / /proc rw - proc proc rw\n"),
        "/sys/fs/cgroup/memory/slurm/job_7/memory.limit_in_bytes": "9223372036854771712\n",  # no limit here
        "/sys/fs/cgroup/memory/slurm/memory.limit_in_bytes": f"{6 * GiB}\n",  # the parent's
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "/sys/fs/cgroup/unified/user.slice/job.scope/memory.max": "max\n",
        "/sys/fs/cgroup/unified/user.slice/memory.max": f"{8 * GiB}\n",
    }
    assert cgroup_memory_limit(files.get) == 6 * GiB
    del files["/sys/fs/cgroup/memory/slurm/memory.limit_in_bytes"]
    assert cgroup_memory_limit(files.get) == 8 * GiB  # the v2 one
    assert memory_limit(files.get) == (8 * GiB, CGROUP_LIMIT) or memory_limit(files.get)[0] < 8 * GiB


def test_a_container_sees_its_own_cgroup_at_the_mount_point() -> None:
    files = {  # a cgroup namespace: /proc/self/cgroup says "/", the mount's root is the container's
        "/proc/self/cgroup": "0::/\n",
        "/proc/self/mountinfo": "30 25 0:26 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw\n",
        "/sys/fs/cgroup/memory.max": f"{2 * GiB}\n",
    }
    assert cgroup_memory_limit(files.get) == 2 * GiB
    assert cgroup_memory_limit({}.get) is None  # nothing readable: no limit known


def test_host_memory_counts_no_more_than_the_cgroup_allows(tmp_path: os.PathLike[str]) -> None:
    _, ram = host_memory(tmp_path)
    assert ram == memory_limit()[0]
    assert shm_size_bytes(tmp_path) > 0
