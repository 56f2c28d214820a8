"""`joader.client.placement`: a process's rank and world size as each launcher leaves them, and
the job name every rank agrees on. The environment and torch.distributed are passed in (a
distributed stand-in with the four calls `find` makes, and a store with c10d's compare_set
semantics); the real ones run in tests/integration/test_frameworks.py."""

from __future__ import annotations

from typing import Any

import pytest

from joader.client import placement
from joader.client.placement import ALONE, ENVIRONMENT, GIVEN, GROUP, Placement, find, job_name
from joader.errors import InvalidArgumentError


class Store:
    """c10d's compare_set: set `desired` if the key is absent and `expected` is empty; return
    the value now stored."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if key not in self.values and expected == "":
            self.values[key] = desired.encode()
        return self.values[key]


class Group:
    def __init__(self, rank: int, size: int, store: Store | None = None, initialized: bool = True) -> None:
        self.rank, self.size, self.initialized = rank, size, initialized
        store = store or Store()
        self.distributed_c10d = type("c10d", (), {"_get_default_store": staticmethod(lambda: store)})

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.size


def test_given_wins_over_everything() -> None:
    assert find(1, 4, env={"RANK": "0", "WORLD_SIZE": "2"}, distributed=Group(0, 2)) == Placement(1, 4, GIVEN)


def test_an_initialized_group_wins_over_the_environment() -> None:
    assert find(None, None, env={"RANK": "0", "WORLD_SIZE": "8"}, distributed=Group(1, 2)) == Placement(1, 2, GROUP)
    assert find(None, None, env={}, distributed=Group(0, 2, initialized=False)) == Placement(0, 1, ALONE)


def test_torchruns_environment() -> None:
    assert find(None, None, env={"RANK": "3", "WORLD_SIZE": "4"}) == Placement(3, 4, ENVIRONMENT)
    assert find(None, 4, env={"RANK": "2"}) == Placement(2, 4, ENVIRONMENT)


def test_nothing_is_one_process_and_world_size_one_is_too() -> None:
    assert find(None, None, env={}) == Placement(0, 1, ALONE)
    assert find(None, None, env={"WORLD_SIZE": "1"}) == Placement(0, 1, ALONE)
    assert find(None, 1, env={}) == Placement(0, 1, GIVEN)


def test_a_world_without_this_ranks_rank_is_unsettled_never_rank_0() -> None:
    """Lightning's spawned ranks before fit: WORLD_SIZE and LOCAL_RANK, no RANK."""
    env = {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "NODE_RANK": "0"}
    assert find(None, None, env=env) is None
    assert find(None, 2, env={}) is None
    message = placement.unsettled_message(env)
    assert "WORLD_SIZE=2, LOCAL_RANK=1" in message and "RANK is not set" in message
    assert message.endswith("or pass rank= and world_size= to JoaderDataset")


@pytest.mark.parametrize(("rank", "size", "env", "words"), [
    (None, None, {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    (None, None, {"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is not in 0..1"),
    (3, None, {}, "rank=3 without world_size="),
    (None, None, {"RANK": "1", "WORLD_SIZE": "1"}, "rank 1 is not in 0..0"),
])
def test_inconsistent_places_are_refused_with_the_fix(rank: Any, size: Any, env: dict[str, str], words: str) -> None:
    with pytest.raises(InvalidArgumentError, match=words):
        find(rank, size, env=env)


def test_ranks_of_a_group_agree_on_a_new_name_per_dataset() -> None:
    store = Store()
    names = [job_name(Placement(r, 2, GROUP), ordinal="demo/abc/0", env={}, distributed=Group(r, 2, store))
             for r in (1, 0)]
    assert names[0] == names[1]
    other = job_name(Placement(0, 2, GROUP), ordinal="demo/abc/1", env={}, distributed=Group(0, 2, store))
    assert other != names[0]  # a second dataset of the same source and indices: another job
    again = job_name(Placement(0, 2, GROUP), ordinal="demo/abc/0", env={}, distributed=Group(0, 2, Store()))
    assert again != names[0]  # the next run (a new store): a new name, whatever its port


def test_names_without_a_group() -> None:
    one = Placement(0, 1, ALONE)
    assert job_name(one, ordinal="o", env={}) == placement.process_name()
    ranks = Placement(0, 2, ENVIRONMENT)
    assert job_name(ranks, ordinal="o", env={"TORCHELASTIC_RUN_ID": "abc"}).endswith("-abc")
    # torchrun without a run id says "none": its agent (the ranks' parent) is one per run
    named = job_name(ranks, ordinal="o", env={"TORCHELASTIC_RUN_ID": "none", "MASTER_PORT": "29500"}, ppid=77)
    assert named.endswith("-77-29500")
    assert job_name(ranks, ordinal="o", env={"MASTER_ADDR": "h", "MASTER_PORT": "1"}).endswith("-h-1")
    with pytest.raises(InvalidArgumentError, match="pass the same name= in every rank"):
        job_name(ranks, ordinal="o", env={})


class RayTune:
    """`ray.tune` as a trial's worker has it: `get_context().get_trial_name()`."""

    def __init__(self, trial: str | None, fails: bool = False) -> None:
        self.trial, self.fails = trial, fails

    def get_context(self) -> Any:
        if self.fails:
            raise RuntimeError("an API that changed")
        return type("TuneContext", (), {"get_trial_name": lambda _self: self.trial})()


def _session(active: bool) -> Any:
    return type("session", (), {"get_session": staticmethod(lambda: object() if active else None)})


def test_a_ray_tune_trial_names_its_processs_jobs_and_ray_is_never_imported() -> None:
    trial = {"ray": object(), "ray.tune": RayTune("train_cnn_5f3a2_00001"),
             "ray.train._internal.session": _session(True)}
    assert placement.ray_trial_name(trial) == "train_cnn_5f3a2_00001"
    assert placement.process_name(modules=trial) == "train_cnn_5f3a2_00001"
    assert job_name(Placement(0, 1, ALONE), ordinal="o", env={}, modules=trial) == "train_cnn_5f3a2_00001"
    # a Ray worker outside a trial (a task, the driver): its session is None, Ray's call is not made
    outside = dict(trial, **{"ray.train._internal.session": _session(False), "ray.tune": RayTune(None, fails=True)})
    assert placement.ray_trial_name(outside) is None
    # a Ray that moved its session: the public call alone; and one whose call fails: no trial
    moved = {"ray": object(), "ray.tune": RayTune("t_00000")}
    assert placement.ray_trial_name(moved) == "t_00000"
    assert placement.ray_trial_name({"ray": object(), "ray.tune": RayTune(None)}) is None
    assert placement.ray_trial_name({"ray": object(), "ray.tune": RayTune("x", fails=True)}) is None
    # Ray imported without Ray Tune, or not at all: the script's name
    for modules in ({"ray": object()}, {}):
        assert placement.ray_trial_name(modules) is None
        assert placement.process_name(modules=modules, argv=["/x/train.py", "--lr", "0.1"]) == "train.py --lr 0.1"
    # the ranks of a DDP job keep their rule, trial or not
    ranks = Placement(0, 2, ENVIRONMENT)
    assert job_name(ranks, ordinal="o", env={"TORCHELASTIC_RUN_ID": "abc"}, modules=trial).endswith("-abc")


def test_later_datasets_of_a_name_are_numbered() -> None:
    assert placement.numbered("sweep.py", 1) == "sweep.py"
    assert placement.numbered("sweep.py", 3) == "sweep.py-3"
    assert placement.numbered("sweep.py --lr 0.1", 2) == "sweep.py --lr 0.1 #2"  # not "--lr 0.1-2"


@pytest.mark.parametrize(("argv", "name"), [
    (["/home/me/exp/train.py", "--lr", "0.1"], "train.py --lr 0.1"),
    (["train.py", "--lr=0.01", "--data", "/datasets/imagenet/train/"], "train.py --lr=0.01 --data train"),
    (["/venv/lib/python3.11/site-packages/pytest/__main__.py", "-q"], "pytest -q"),  # python -m pytest -q
    (["-c", "7"], "python -c 7"),
    ([""], "python"),
    ([], "python"),
    (["train.py", "--note", "two words\n"], "train.py --note 'two words?'"),
    (["train.py", "--tag", "x" * 40], "train.py --tag " + "x" * 21 + "..."),
    (["train.py", "--data", "/d/a/" + "imagenet" * 2, "--out", "/runs/" + "r" * 20, "--epochs", "90",
      "--batch-size", "256", "--lr", "0.1"], "train.py --epochs 90 --batch-size 256 --lr 0.1"),
    (["train.py", *[f"--opt{i}" for i in range(20)]], "train.py " + " ".join(f"--opt{i}" for i in range(7)) + " ..."),
])
def test_a_default_name_is_the_command_line_short_and_printable(argv: list[str], name: str) -> None:
    assert placement.command_name(argv) == name
    assert len(name) <= placement.NAME_MAX


def test_a_name_another_live_job_has_takes_the_pid() -> None:
    assert placement.with_pid("train.py --lr 0.1", pid=14907) == "train.py --lr 0.1 (pid 14907)"
