"""The sampler API: behaviour, determinism, errors, and the chain's incremental update.

These are exact (non-statistical) checks; the statistical guarantees live in tests/statistical.
"""

from __future__ import annotations

import random

import pytest
from pyroaring import BitMap, FrozenBitMap

from joader.errors import DuplicateJobError, InvalidArgumentError, JoaderError, UnknownJobError
from joader.sampling import (
    ORDERS,
    DependentSampler,
    IndependentSampler,
    Sampler,
    check_order,
    make_sampler,
)
from joader.sampling.chain import build_chain, chain_order
from joader.sampling.checks import EpochRecorder, chi2_sf

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
    """A consumed run container fragments and makes every pick ~10x slower (bench/micro/sampler.py),
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

# ------------------------------------------------------------------------------------------------
# Resumed epochs (`remaining=`) and per-job random streams (`rng=`). The uniformity of a resumed
# epoch's order is tested in tests/statistical/test_sampling_resume.py.

RESUME_DATASET = BitMap(range(20))
RESUME_SET = BitMap([3, 5, 7, 11, 13])


def draw(sampler: Sampler, job_id: str, count: int) -> list[int]:
    return [sampler.sample([job_id])[job_id] for _ in range(count)]


@pytest.mark.parametrize("name", SAMPLERS)
def test_add_job_with_remaining_resumes_then_runs_whole_epochs(name: str) -> None:
    sampler = make_sampler(name, 0)
    sampler.add_job("a", RESUME_DATASET, remaining=RESUME_SET)
    assert sampler.epoch("a") == 0 and sampler.num_remaining("a") == 5
    assert sampler.remaining("a") == RESUME_SET and sampler.dataset("a") == RESUME_DATASET
    assert sampler.needs("a", 3) and not sampler.needs("a", 4)
    first = draw(sampler, "a", 5)
    assert sorted(first) == list(RESUME_SET) and sampler.epoch("a") == 1
    assert sampler.num_remaining("a") == 0
    for epoch in (2, 3):
        assert sorted(draw(sampler, "a", 20)) == list(RESUME_DATASET) and sampler.epoch("a") == epoch


@pytest.mark.parametrize("name", SAMPLERS)
def test_remaining_is_copied(name: str) -> None:
    remaining = BitMap(RESUME_SET)
    sampler = make_sampler(name, 0)
    sampler.add_job("a", RESUME_DATASET, remaining=remaining)
    remaining.add(4)
    remaining.remove(3)
    assert sampler.remaining("a") == RESUME_SET
    sampler.reset_epoch("a", remaining)
    remaining.clear()
    assert sampler.num_remaining("a") == 5 and sampler.needs("a", 4)


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resumed_job_among_others_is_exactly_once(name: str, seed: int) -> None:
    """A job resumed mid-run next to overlapping jobs (everyone sitting out at random): its
    first epoch is exactly R, later ones the whole dataset; the others are unaffected."""
    rng = random.Random(seed)
    sampler = make_sampler(name, seed)
    sampler.add_job("b", BitMap(range(5, 30)))
    sampler.add_job("c", BitMap(range(0, 12)))
    recorder = EpochRecorder()
    active = ["b", "c"]
    for round_index in range(400):
        if round_index == 37:
            sampler.add_job("a", RESUME_DATASET, remaining=RESUME_SET, rng=random.Random(seed))
            recorder.resumed(sampler, "a")
            active.append("a")
        participants = [j for j in active if rng.random() < 0.7]
        rng.shuffle(participants)
        recorder.record(sampler, sampler.sample(participants))
    for job_id in ("a", "b", "c"):
        assert recorder.exactly_once_problems(job_id) == []
    assert sorted(recorder.streams["a"][1]) == list(RESUME_SET)
    assert len(recorder.complete_epochs("a")) >= 5  # whole epochs 2, 3, ...
    for items in recorder.complete_epochs("a"):
        assert sorted(items) == list(RESUME_DATASET)


@pytest.mark.parametrize("name", SAMPLERS)
def test_reset_epoch_with_remaining(name: str) -> None:
    sampler = make_sampler(name, 0)
    sampler.add_job("a", RESUME_DATASET)
    sampler.reset_epoch("a", RESUME_SET)  # before any item: still epoch 0, and R is the subset
    assert sampler.epoch("a") == 0 and sampler.remaining("a") == RESUME_SET
    assert sorted(draw(sampler, "a", 5)) == list(RESUME_SET) and sampler.epoch("a") == 1
    got = draw(sampler, "a", 7)  # epoch 2, the whole dataset, cut short
    assert sampler.epoch("a") == 2
    sampler.reset_epoch("a", [1, 2, got[0]])  # items already received may come back
    assert sampler.epoch("a") == 2 and sampler.num_remaining("a") == len({1, 2, got[0]})
    assert sorted(draw(sampler, "a", 3)) == sorted({1, 2, got[0]}) and sampler.epoch("a") == 3
    assert sorted(draw(sampler, "a", 20)) == list(RESUME_DATASET) and sampler.epoch("a") == 4
    draw(sampler, "a", 2)
    sampler.reset_epoch("a")  # the default is still the whole dataset
    assert sampler.remaining("a") == RESUME_DATASET


@pytest.mark.parametrize("name", SAMPLERS)
def test_bad_remaining_and_rng_are_refused_with_the_fix(name: str) -> None:
    sampler = make_sampler(name, 0)
    sampler.add_job("a", RESUME_DATASET)
    got = draw(sampler, "a", 3)
    before = sampler.remaining("a")
    cases = [
        (BitMap(), r"'x': remaining is empty.*pass remaining=None to start a whole epoch"),
        ([], r"remaining is empty"),
        ([5, 20, 21], r"2 item\(s\) outside the job's dataset of 20, e\.g\. \[20, 21\]; pass a "
                      r"subset of the dataset"),
        ([-1], r"item ids.*pass a BitMap or an iterable of ints"),
        (["a"], r"item ids.*pass a BitMap"),
        (7, r"must be a set of item ids, got int; pass a BitMap"),
        ("12", r"must be a set of item ids, got str"),
    ]
    for remaining, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            sampler.add_job("x", RESUME_DATASET, remaining=remaining)
        with pytest.raises(InvalidArgumentError, match=message.replace("'x'", "'a'")):
            sampler.reset_epoch("a", remaining)
    with pytest.raises(InvalidArgumentError) as info:  # house style: the fix comes last
        sampler.add_job("x", RESUME_DATASET, remaining=[])
    assert str(info.value).endswith("; pass remaining=None to start a whole epoch instead")
    with pytest.raises(InvalidArgumentError, match=r"rng must be a random.Random, got int; "
                                                   r"pass random.Random\(seed\)"):
        sampler.add_job("x", RESUME_DATASET, rng=7)  # type: ignore[arg-type]
    with pytest.raises(UnknownJobError, match=r"'zz'.*add_job"):
        sampler.reset_epoch("zz", RESUME_SET)
    # the failed calls changed nothing: no job x, a's epoch goes on where it was
    assert sampler.jobs() == ["a"] and sampler.remaining("a") == before
    rest = draw(sampler, "a", 17)
    assert sorted(got + rest) == list(RESUME_DATASET) and sampler.epoch("a") == 1
    sampler.add_job("x", RESUME_DATASET, remaining=[1])  # the id is free
    assert sampler.remaining("x") == BitMap([1])


def solo_picks(sampler: Sampler, others_before: bool, others_after: bool) -> list[int]:
    """Three epochs of job "solo" (rng=Random(7)) in `sampler`; other jobs on overlapping
    datasets may be registered before and after it, and take rounds of their own in between."""
    other_rng = random.Random(99)
    others = []
    if others_before:
        sampler.add_job("before", BitMap(range(10, 40)))
        sampler.add_job("before2", BitMap(range(0, 25)), rng=random.Random(1))
        others += ["before", "before2"]
    sampler.add_job("solo", BitMap(range(30)), rng=random.Random(7))
    if others_after:
        sampler.add_job("after", BitMap(range(5, 15)))
        others.append("after")
    picks = []
    for _ in range(3 * 30):
        if others and other_rng.random() < 0.5:
            sampler.sample(other_rng.sample(others, other_rng.randint(1, len(others))))
        picks.append(sampler.sample(["solo"])["solo"])
    assert sampler.epoch("solo") == 3
    return picks


@pytest.mark.parametrize("name", SAMPLERS)
def test_solo_job_with_its_own_rng_gets_the_same_picks_in_every_run(name: str) -> None:
    reference = solo_picks(make_sampler(name, 0), False, False)
    for seed in range(3):
        assert solo_picks(make_sampler(name, seed), False, False) == reference
        # alone in its rounds: the other jobs' sets and streams do not matter either
        assert solo_picks(make_sampler(name, seed), True, False) == reference
        assert solo_picks(make_sampler(name, seed), False, True) == reference
        assert solo_picks(make_sampler(name, seed), True, True) == reference
    for epoch in range(3):
        assert sorted(reference[30 * epoch: 30 * (epoch + 1)]) == list(range(30))
    other = make_sampler(name, 0)
    other.add_job("solo", BitMap(range(30)), rng=random.Random(8))
    assert draw(other, "solo", 90) != reference


def test_independent_job_stream_ignores_the_other_participants() -> None:
    def run(with_others: bool) -> list[int]:
        sampler = make_sampler("independent", 3)
        sampler.add_job("a", BitMap(range(50)), rng=random.Random(7))
        sampler.add_job("b", BitMap(range(25, 75)))
        return [sampler.sample(["b", "a"] if with_others else ["a"])["a"] for _ in range(120)]

    assert run(True) == run(False)


def test_a_round_draws_from_the_root_most_participants_stream() -> None:
    """Every number of a round comes from the stream of the participant first in chain order
    (the smallest remaining set); the other streams are not touched."""
    small_rng, big_rng, sampler_rng = random.Random(1), random.Random(2), random.Random(3)
    sampler = DependentSampler(rng=sampler_rng)
    sampler.add_job("big", BitMap(range(0, 60)), rng=big_rng)
    sampler.add_job("small", BitMap(range(20, 40)), rng=small_rng)
    sampler.add_job("plain", BitMap(range(10, 50)))  # no rng: the sampler's stream
    assert [node.job_id for node in sampler.tree()] == ["small", "plain", "big"]  # by size
    roots = set()
    for round_index in range(200):
        participants = random.Random(round_index).sample(["big", "small", "plain"],
                                                         1 + round_index % 3)
        # the chain order of the round: the sampler's (possibly stale) order, unless a
        # participant's epoch is over; then the refill rebuilds the chain first
        order = [node.job_id for node in sampler.tree()]
        if any(not sampler.num_remaining(job_id) for job_id in participants):
            order = chain_order({
                job_id: sampler.dataset(job_id)
                if job_id in participants and not sampler.num_remaining(job_id)
                else sampler.remaining(job_id)
                for job_id in sampler.jobs()
            })
        root_most = min(participants, key=order.index)
        roots.add(root_most)
        stream = {"small": small_rng, "big": big_rng, "plain": sampler_rng}
        states = {job_id: rng.getstate() for job_id, rng in stream.items()}
        sampler.sample(participants)
        for job_id, rng in stream.items():
            assert (rng.getstate() != states[job_id]) == (job_id == root_most), (
                round_index, participants, order)
    assert roots == {"small", "plain", "big"}


@pytest.mark.parametrize("align", ["off", "first", "always"])
@pytest.mark.parametrize("seed", range(4))
def test_an_independent_job_is_out_of_every_other_jobs_rounds(align: str, seed: int) -> None:
    """An independent job's picks are a function of its own stream, and the other jobs' picks
    are exactly what they would be without it: it is out of the chain (no vertex splits the
    others' walk, nobody aligns with it), its rounds read no other stream, and the others'
    rounds never read its stream. Exact, not statistical: the same streams give the same picks."""
    rng = random.Random(seed)
    datasets = {"a": BitMap(range(40)), "b": BitMap(range(40)), "c": BitMap(range(20, 60))}
    plan = [[j for j in ("a", "b", "c", "solo") if rng.random() < 0.7] for _ in range(400)]
    late = rng.randrange(1, 40)

    def run(with_solo: bool, with_others: bool) -> tuple[dict[str, list[int]], DependentSampler]:
        sampler = DependentSampler(rng=random.Random(seed + 100), align=align)
        got: dict[str, list[int]] = {j: [] for j in ("a", "b", "c", "solo")}
        if with_others:
            sampler.add_job("a", datasets["a"], rng=random.Random(seed + 1))
        if with_solo:
            sampler.add_job("solo", BitMap(range(40)), rng=random.Random(seed + 4), independent=True)
            assert sampler.independent("solo")
            assert "solo" not in [node.job_id for node in sampler.tree()]
        for step, listed in enumerate(plan):
            if with_others and step == late:  # late joiners: candidates for alignment
                sampler.add_job("b", datasets["b"], rng=random.Random(seed + 2))
                sampler.add_job("c", datasets["c"], rng=random.Random(seed + 3))
            participants = [j for j in listed if j in sampler.jobs() and (with_solo or j != "solo")]
            picks = sampler.sample(participants)
            assert sorted(picks) == sorted(participants)
            for job_id, item in picks.items():
                got[job_id].append(item)
        return got, sampler

    both, sampler = run(True, True)
    alone, _ = run(True, False)
    without, _ = run(False, True)
    assert both["solo"] == alone["solo"]  # its order ignores whoever else is registered
    assert {j: both[j] for j in "abc"} == {j: without[j] for j in "abc"}  # and theirs ignores it
    for epoch in range(len(both["solo"]) // 40):
        assert sorted(both["solo"][40 * epoch: 40 * (epoch + 1)]) == list(range(40))
    assert not sampler.independent("a")


def test_an_independent_job_without_an_rng_gets_a_stream_of_its_own() -> None:
    """Without `rng`, an independent job's stream is seeded once from the sampler's when it is
    added: the other jobs' rounds (which read the sampler's stream) never read it."""
    def run(with_other_rounds: bool) -> list[int]:
        sampler = DependentSampler(seed=5)
        sampler.add_job("solo", BitMap(range(30)), independent=True)
        sampler.add_job("plain", BitMap(range(30)))
        return [sampler.sample(["plain", "solo"] if with_other_rounds else ["solo"])["solo"]
                for _ in range(60)]

    assert run(True) == run(False)


def test_order_names_are_checked_with_the_choices() -> None:
    assert check_order("shared") == "shared"
    assert check_order("independent") == "independent"
    with pytest.raises(InvalidArgumentError, match="'shared', 'independent'.*got 'indep'"):
        check_order("indep")
    assert ORDERS == ("shared", "independent")


def check_chain(sampler: DependentSampler) -> None:
    """The incrementally updated chain equals a rebuild, and partitions every R."""
    nodes = sampler.tree()
    remaining = [sampler.remaining(node.job_id) for node in nodes]
    inner, leaves = build_chain(remaining)
    assert [node.vertex for node in nodes] == inner
    assert [node.leaf for node in nodes] == leaves
    for k, node in enumerate(nodes):
        union = BitMap(node.leaf)
        for vertex in inner[: k + 1]:
            assert not (union & vertex)
            union |= vertex
        assert union == remaining[k]
        assert sampler.num_remaining(node.job_id) == len(remaining[k])


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_own_streams_resumes_and_resets_keep_the_invariants(name: str, seed: int) -> None:
    """Jobs with streams of their own (and some without), resumed and reset with subsets,
    sitting out at random (single-participant rounds included): exactly once per epoch, and
    (dependent) the chain kept up to date equals a rebuild after every round."""
    rng = random.Random(seed)
    for trial in range(15):
        sampler = make_sampler(name, trial)
        recorder = EpochRecorder()
        datasets = {}
        for i in range(rng.randint(2, 5)):
            job_id = f"j{i}"
            density = rng.uniform(0.2, 1.0)
            datasets[job_id] = BitMap(x for x in range(40) if rng.random() < density) or BitMap([3])
            own = random.Random(rng.random()) if rng.random() < 0.7 else None
            alone = rng.random() < 0.25  # an independent job (order="independent")
            if rng.random() < 0.5:
                subset = BitMap(x for x in datasets[job_id] if rng.random() < 0.5)
                sampler.add_job(job_id, datasets[job_id], remaining=subset or None, rng=own,
                                independent=alone)
                if subset:
                    recorder.resumed(sampler, job_id)
            else:
                sampler.add_job(job_id, datasets[job_id], rng=own, independent=alone)
        names = list(datasets)
        for step in range(200):
            if step % 41 == 40:
                job_id = rng.choice(names)
                subset = BitMap(x for x in datasets[job_id] if rng.random() < 0.3)
                recorder.abandon(sampler, job_id)
                sampler.reset_epoch(job_id, subset or None)
                if subset:
                    recorder.resumed(sampler, job_id)
            participants = [j for j in names if rng.random() < 0.6]
            recorder.record(sampler, sampler.sample(participants))
            if isinstance(sampler, DependentSampler):
                check_chain(sampler)
        for job_id in names:
            assert recorder.exactly_once_problems(job_id) == [], (trial, job_id)


@pytest.mark.parametrize("align", ["off", "first", "always"])
@pytest.mark.parametrize("seed", range(20))
def test_every_round_serves_exactly_its_participants(align: str, seed: int) -> None:
    """Issue 27, finding 0: a late joiner whose first round aligned its epoch onto a running
    job's rest rebuilt the chain mid-round, and the round's picks went to the old positions: a
    job that sat out got an item (and a silent refill), a participant got none. Random joins,
    leaves and sit-outs on identical and overlapping datasets; every round must give each
    participant one item, nobody else anything, and each job's epochs must be exactly once."""
    rng = random.Random(seed)
    sampler = DependentSampler(rng=random.Random(seed), align=align)
    datasets = [BitMap(range(40)), BitMap(range(40)), BitMap(range(20, 60))]
    got: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    next_id = 0
    for _ in range(600):
        if len(got) < 5 and rng.random() < 0.05:
            job_id = f"j{next_id}"
            next_id += 1
            dataset = rng.choice(datasets)
            sampler.add_job(job_id, dataset, rng=random.Random(rng.random()))
            got[job_id], sizes[job_id] = [], len(dataset)
        if len(got) > 1 and rng.random() < 0.01:
            gone = rng.choice(sorted(got))
            sampler.remove_job(gone)
            del got[gone]
        participants = [j for j in got if rng.random() < 0.7]
        picks = sampler.sample(participants)
        assert set(picks) == set(participants), (participants, picks)
        for job_id, item in picks.items():
            got[job_id].append(item)
    for job_id, items in got.items():
        size = sizes[job_id]
        for start in range(0, len(items) - size + 1, size):
            epoch = items[start:start + size]
            assert len(set(epoch)) == size, f"{job_id}: an epoch repeats an item"


@pytest.mark.parametrize("align", ["off", "first", "always"])
@pytest.mark.parametrize("seed", range(8))
def test_rounds_drawn_together_are_the_rounds_drawn_one_by_one(align: str, seed: int) -> None:
    """`sample_rounds` (the scheduler's batches of rounds) gives exactly the picks of as many
    `sample` calls: twin samplers, random joins (some independent, some resumed), leaves,
    resets and sit-outs on identical, overlapping and nested datasets, batches of 1 to 30
    rounds that cross epochs and their refills."""
    rng = random.Random(seed)
    twins = [DependentSampler(rng=random.Random(seed), align=align) for _ in range(2)]
    datasets = [BitMap(range(40)), BitMap(range(40)), BitMap(range(20, 60)), BitMap(range(10))]
    jobs: list[str] = []
    for step in range(300):
        if len(jobs) < 5 and rng.random() < 0.1:
            job_id, dataset = f"j{step}", rng.choice(datasets)
            remaining = BitMap(rng.sample(list(dataset), rng.randrange(1, len(dataset)))) \
                if rng.random() < 0.2 else None
            independent = rng.random() < 0.15
            stream = rng.random()
            for sampler in twins:
                sampler.add_job(job_id, dataset, remaining=remaining, rng=random.Random(stream),
                                independent=independent)
            jobs.append(job_id)
        if len(jobs) > 1 and rng.random() < 0.03:
            gone = jobs.pop(rng.randrange(len(jobs)))
            for sampler in twins:
                sampler.remove_job(gone)
        if jobs and rng.random() < 0.03:
            reset = rng.choice(jobs)
            for sampler in twins:
                sampler.reset_epoch(reset)
        participants = [j for j in jobs if rng.random() < 0.7]
        if not participants:
            continue
        rounds = rng.randrange(1, 31)
        one_by_one = [twins[0].sample(participants) for _ in range(rounds)]
        assert twins[1].sample_rounds(participants, rounds) == one_by_one, (step, participants, rounds)
        for job_id in jobs:
            assert twins[0].remaining(job_id) == twins[1].remaining(job_id), (step, job_id)
            assert twins[0].epoch(job_id) == twins[1].epoch(job_id), (step, job_id)
        if align == "off":  # (an aligned epoch's second phase is in `remaining`, not in the chain)
            check_chain(twins[1])
