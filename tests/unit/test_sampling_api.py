"""The sampler API: behaviour, determinism, errors, and the chain's incremental update.

These are exact (non-statistical) checks; the statistical guarantees live in tests/statistical.
"""

from __future__ import annotations

import random

import pytest
from pyroaring import BitMap, FrozenBitMap

from joader.errors import DuplicateJobError, InvalidArgumentError, JoaderError, UnknownJobError
from joader.sampling import (
    DependentSampler,
    IndependentSampler,
    Sampler,
    make_sampler,
)
from joader.sampling.chain import build_chain
from joader.sampling.checks import chi2_sf

pytestmark = pytest.mark.timeout(60)

SAMPLERS = ["dependent", "independent"]


def two_jobs(name: str, seed: int = 0) -> Sampler:
    sampler = make_sampler(name, seed)
    sampler.add_job("a", BitMap(range(600)))
    sampler.add_job("b", BitMap(range(300, 1300)))
    return sampler


@pytest.mark.parametrize("name", SAMPLERS)
def test_example_from_the_issue(name: str) -> None:
    sampler = two_jobs(name)
    picks = sampler.sample(["a", "b"])
    assert set(picks) == {"a", "b"}
    assert 0 <= picks["a"] < 600 and 300 <= picks["b"] < 1300
    assert picks["a"] not in sampler.remaining("a")
    assert sampler.num_remaining("a") == 599 and sampler.num_remaining("b") == 999
    sampler.remove_job("b")
    assert sampler.jobs() == ["a"]


def test_make_sampler_names() -> None:
    assert isinstance(make_sampler("dependent", 1), DependentSampler)
    assert isinstance(make_sampler("independent", 1), IndependentSampler)
    with pytest.raises(InvalidArgumentError, match="dependent"):
        make_sampler("nope")


@pytest.mark.parametrize("name", SAMPLERS)
def test_same_seed_same_picks(name: str) -> None:
    def run(seed: int) -> list[dict[str, int]]:
        sampler = two_jobs(name, seed)
        out = [sampler.sample(["a", "b"]) for _ in range(700)]
        sampler.add_job("c", BitMap(range(100, 200)))
        out += [sampler.sample(["b", "c"]) for _ in range(300)]
        sampler.remove_job("a")
        out += [sampler.sample(["c", "b"]) for _ in range(300)]
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_rng_argument_is_used() -> None:
    first = DependentSampler(rng=random.Random(3))
    second = DependentSampler(rng=random.Random(3))
    for sampler in (first, second):
        sampler.add_job("a", BitMap(range(50)))
    assert [first.sample(["a"]) for _ in range(50)] == [second.sample(["a"]) for _ in range(50)]


@pytest.mark.parametrize("name", SAMPLERS)
def test_epoch_counting_and_refill(name: str) -> None:
    sampler = make_sampler(name, 0)
    sampler.add_job("a", BitMap(range(10)))
    assert sampler.epoch("a") == 0 and sampler.num_remaining("a") == 10
    first = [sampler.sample(["a"])["a"] for _ in range(10)]
    assert sorted(first) == list(range(10))
    assert sampler.epoch("a") == 1 and sampler.num_remaining("a") == 0
    assert not sampler.needs("a", first[0])
    second = [sampler.sample(["a"])["a"] for _ in range(10)]
    assert sorted(second) == list(range(10)) and sampler.epoch("a") == 2


@pytest.mark.parametrize("name", SAMPLERS)
def test_reset_epoch_starts_over(name: str) -> None:
    sampler = make_sampler(name, 0)
    sampler.add_job("a", BitMap(range(10)))
    sampler.reset_epoch("a")  # nothing received yet: still epoch 0
    assert sampler.epoch("a") == 0
    got = [sampler.sample(["a"])["a"] for _ in range(4)]
    sampler.reset_epoch("a")
    assert sampler.num_remaining("a") == 10 and all(sampler.needs("a", x) for x in got)
    assert sampler.epoch("a") == 1
    rest = [sampler.sample(["a"])["a"] for _ in range(10)]
    assert sorted(rest) == list(range(10)) and sampler.epoch("a") == 2


@pytest.mark.parametrize("name", SAMPLERS)
def test_sitting_out_keeps_remaining_intact(name: str) -> None:
    sampler = two_jobs(name, 1)
    for _ in range(5):
        sampler.sample(["a", "b"])
    before = sampler.remaining("b")
    for _ in range(200):
        sampler.sample(["a"])
    assert sampler.remaining("b") == before
    assert sampler.sample([]) == {}


@pytest.mark.parametrize("name", SAMPLERS)
def test_remaining_and_dataset_cannot_corrupt_state(name: str) -> None:
    dataset = BitMap(range(20))
    sampler = make_sampler(name, 0)
    sampler.add_job("a", dataset)
    dataset.add(999)  # the caller's bitmap is copied at add_job
    snapshot = sampler.remaining("a")
    assert isinstance(snapshot, FrozenBitMap) and isinstance(sampler.dataset("a"), FrozenBitMap)
    assert 999 not in sampler.remaining("a") and 999 not in sampler.dataset("a")
    sampler.sample(["a"])
    assert len(snapshot) == 20  # a snapshot, not a live view


@pytest.mark.parametrize("name", SAMPLERS)
def test_join_and_leave_mid_epoch(name: str) -> None:
    sampler = two_jobs(name, 2)
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for _ in range(100):
        for job_id, item in sampler.sample(["a", "b"]).items():
            got[job_id].append(item)
    sampler.add_job("c", BitMap(range(500, 700)))
    for _ in range(150):
        for job_id, item in sampler.sample(["a", "b", "c"]).items():
            got[job_id].append(item)
    sampler.remove_job("b")
    for _ in range(350):
        for job_id, item in sampler.sample(["a", "c"]).items():
            got[job_id].append(item)
    assert sorted(got["a"][:600]) == list(range(600))
    assert sorted(got["c"][:200]) == list(range(500, 700))
    assert len(set(got["b"])) == len(got["b"]) == 250
    with pytest.raises(UnknownJobError):
        sampler.remaining("b")


@pytest.mark.parametrize("name", SAMPLERS)
def test_errors_name_the_job_and_the_fix(name: str) -> None:
    sampler = two_jobs(name)
    with pytest.raises(InvalidArgumentError, match=r"'e'.*empty dataset"):
        sampler.add_job("e", BitMap())
    with pytest.raises(DuplicateJobError, match=r"'a' is already registered.*remove_job"):
        sampler.add_job("a", BitMap([1]))
    with pytest.raises(UnknownJobError, match=r"unknown job 'zz'"):
        sampler.sample(["a", "zz"])
    with pytest.raises(InvalidArgumentError, match=r"'a' is listed twice"):
        sampler.sample(["a", "b", "a"])
    for call in (sampler.remove_job, sampler.remaining, sampler.num_remaining,
                 sampler.reset_epoch, sampler.epoch, sampler.dataset):
        with pytest.raises(UnknownJobError, match=r"'zz'.*add_job"):
            call("zz")
    with pytest.raises(UnknownJobError):
        sampler.needs("zz", 1)
    with pytest.raises(InvalidArgumentError):
        sampler.add_job("", BitMap([1]))
    # a failed call changes nothing
    assert sampler.num_remaining("a") == 600 and sampler.jobs() == ["a", "b"]
    assert issubclass(UnknownJobError, JoaderError)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_update_equals_rebuild(seed: int) -> None:
    """After every round, the vertices and leaves kept up to date by the O(n) update equal a
    from-scratch `build_chain` over the same ordered remaining sets, under random datasets,
    random sitting out, refills, joins and leaves; and every R is partitioned along its path."""
    rng = random.Random(seed)
    for trial in range(40):
        sampler = DependentSampler(seed=trial)
        names = [f"j{i}" for i in range(rng.randint(1, 6))]
        for job_id in names:
            density = rng.random()
            items = BitMap(x for x in range(48) if rng.random() < density) or BitMap([7])
            sampler.add_job(job_id, items)
        for step in range(150):
            if step == 70 and len(names) > 1:
                sampler.remove_job(names.pop(rng.randrange(len(names))))
            if step == 100:
                names.append("late")
                sampler.add_job("late", BitMap(range(rng.randint(1, 20), 40)))
            sampler.sample([j for j in names if rng.random() < 0.7])
            nodes = sampler.tree()
            remaining = [sampler.remaining(node.job_id) for node in nodes]
            inner, leaves = build_chain(remaining)
            assert [node.vertex for node in nodes] == inner, (trial, step)
            assert [node.leaf for node in nodes] == leaves, (trial, step)
            for k, node in enumerate(nodes):
                union = BitMap(node.leaf)
                for vertex in inner[: k + 1]:
                    assert not (union & vertex)
                    union |= vertex
                assert union == remaining[k]
                assert sampler.num_remaining(node.job_id) == len(remaining[k])


def test_chain_of_nested_datasets() -> None:
    """Nested datasets give one vertex per size step and empty leaves (no sharing lost)."""
    inner, leaves = build_chain([BitMap(range(10)), BitMap(range(20)), BitMap(range(30))])
    assert inner == [BitMap(range(10)), BitMap(range(10, 20)), BitMap(range(20, 30))]
    assert leaves == [BitMap(), BitMap(), BitMap()]
    assert build_chain([]) == ([], [])


def test_chi2_sf_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for x, df in [(0.5, 1), (3.0, 1), (10.0, 3), (100.0, 81), (150.0, 100), (9000.0, 9801),
                  (11000.0, 9801), (40.0, 2), (0.0, 4)]:
        assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("name", SAMPLERS)
def test_range_datasets_are_stored_without_run_containers(name: str) -> None:
    """A consumed run container fragments and makes every pick ~10x slower (bench/sampler.py),
    so datasets given as ranges are expanded to array/bitset containers at add_job."""
    sampler = make_sampler(name, 0)
    sampler.add_job("a", BitMap(range(200_000)))
    sampler.add_job("b", range(100, 70_000))
    for job_id in ("a", "b"):
        assert sampler.dataset(job_id).get_statistics()["n_run_containers"] == 0
        assert sampler.remaining(job_id) == sampler.dataset(job_id)


def test_equal_sizes_are_ordered_so_the_identical_pair_shares_every_round() -> None:
    """Ties in the chain's size order are broken by overlap, not by name: with a = b = 0:50 and
    c = 25:75 (all of size 50), a and b must share every round, whatever their names."""
    from pyroaring import BitMap

    from joader.sampling import DependentSampler

    for names in (("a", "b", "c"), ("c", "b", "a"), ("x", "z", "y")):
        first, second, other = names
        sampler = DependentSampler(seed=5)
        sampler.add_job(first, BitMap(range(0, 50)))
        sampler.add_job(second, BitMap(range(0, 50)))
        sampler.add_job(other, BitMap(range(25, 75)))
        shared = sum(
            picks[first] == picks[second]
            for picks in (sampler.sample([first, second, other]) for _ in range(50 * 20))
        )
        assert shared == 50 * 20, names
