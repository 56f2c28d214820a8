"""Where this process is in a training job: its rank, the job's world size, and the job's name.

Frameworks set these up at different times. torchrun sets `RANK` and `WORLD_SIZE` before the
script starts; Lightning's DDP launcher starts as a plain process (the dataset built at the top
of the script sees no environment at all), then becomes rank 0 of a process group it creates in
`trainer.fit`, and starts its other ranks with `WORLD_SIZE` and `LOCAL_RANK` but no `RANK`. A
dataset that took a missing `RANK` for 0 made the launcher a 1-rank job and a spawned rank "rank
0 of 2": a hang. So the placement is looked up again when iteration starts (`find`), and an
environment that names a world but not the rank is `None` (unsettled), never a guess.

Pure but for reading the environment and torch.distributed's state (both passed in by tests).
"""

from __future__ import annotations

import os
import shlex
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from joader.errors import InvalidArgumentError

# How a placement was found, most authoritative first.
GIVEN = "given"  # rank= and world_size= passed to the dataset
GROUP = "process group"  # torch.distributed, initialized
ENVIRONMENT = "environment"  # RANK and WORLD_SIZE (torchrun, accelerate launch)
ALONE = "alone"  # nothing says otherwise: one process (may still become a rank, see `find`)


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    how: str

    def same_place(self, other: Placement) -> bool:
        return (self.rank, self.world_size) == (other.rank, other.world_size)


def _group(distributed: Any) -> tuple[int, int] | None:
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return None
    return distributed.get_rank(), distributed.get_world_size()


def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidArgumentError(
            f"{key}={value!r} is not an integer; fix the environment, or pass rank= and "
            "world_size= to JoaderDataset") from None


def find(rank: int | None, world_size: int | None, *, env: Mapping[str, str] | None = None,
         distributed: Any = None) -> Placement | None:
    """This process's placement, or None when the environment names a world of several ranks
    but not this one's (Lightning's spawned ranks before `fit` creates the process group).

    Order: what was given; an initialized torch.distributed; `RANK`/`WORLD_SIZE`; else one
    process. A given `world_size` without `rank` takes the rank from the group or `RANK`.
    """
    env = os.environ if env is None else env
    if rank is not None and world_size is not None:
        return _checked(Placement(rank, world_size, GIVEN))
    group = _group(distributed)
    if group is not None:
        found = Placement(group[0] if rank is None else rank,
                          group[1] if world_size is None else world_size, GROUP)
        return _checked(found)
    env_size, env_rank = _int(env, "WORLD_SIZE"), _int(env, "RANK")
    size = world_size if world_size is not None else env_size
    if size is None or size == 1 and env_rank in (None, 0):
        if rank not in (None, 0):
            raise InvalidArgumentError(
                f"rank={rank} without world_size=; pass both (torch.distributed.get_rank() / "
                "get_world_size())")
        return Placement(0, 1, GIVEN if world_size is not None else ALONE)
    this = rank if rank is not None else env_rank
    if this is None:
        return None
    return _checked(Placement(this, size, ENVIRONMENT if rank is None or world_size is None else GIVEN))


def _checked(placement: Placement) -> Placement:
    if placement.world_size < 1 or not 0 <= placement.rank < placement.world_size:
        raise InvalidArgumentError(
            f"rank {placement.rank} is not in 0..{placement.world_size - 1} (world_size "
            f"{placement.world_size}, from {placement.how}); pass rank= and world_size= "
            "consistently (torch.distributed.get_rank() / get_world_size())")
    return placement


def unsettled_message(env: Mapping[str, str] | None = None) -> str:
    """Why `find` gave None, and what to do."""
    env = os.environ if env is None else env
    local = env.get("LOCAL_RANK")
    seen = f"WORLD_SIZE={env.get('WORLD_SIZE')}" + (f", LOCAL_RANK={local}" if local is not None else "")
    return (
        f"this process is one rank of a job ({seen}) but its rank is not known yet: RANK is not "
        "set and torch.distributed is not initialized (Lightning sets them up in trainer.fit). "
        "Iterate the dataset (or take len()) after the process group exists, which is what "
        "trainer.fit does; build the dataset in LightningDataModule.setup(); or pass rank= and "
        "world_size= to JoaderDataset")


# ------------------------------------------------------------------------------------ names

# NOTE [ Default names that tell trials apart ]
# Every job of one process was `<script>-<pid>`: the six trials of an Optuna study run in
# threads (`n_jobs`) showed as one name six times in `joader status`, Ray Tune's trials as
# `default_worker.py-<pid>`, a name that says nothing, and a bash loop's trials as
# `train.py-14907` ... `train.py-14910`, which learning rate is which only `ps` could say. So a
# process's jobs are named after the Ray Tune trial it runs, if it runs one, else after its
# command line (`command_name`: `train.py --lr 0.1`, paths shortened to their last part); the
# second and later dataset of a process under that name (an Optuna thread's trial, a validation
# set) is `<name> #2`, `#3`, ... (`<name>-2` for a name without arguments;
# `joader.client.attachment.next_solo_name`). A default name another live job has (the same
# command run twice) gets the pid, `train.py (pid 14907)`, when joaderd says so at attach
# (`joader.client.attachment`). The ranks of a DDP job keep their own rule (`job_name`): every
# rank must come to the same name.

NAME_MAX = 64  # characters of a default name (joaderd's log shows 80, a job id's prefix 40)
_WORD_MAX = 24  # characters of one argument in it


def command_name(argv: list[str]) -> str:
    """`train.py --lr 0.1`: the script and its arguments, each path shortened to its last part,
    unprintable characters replaced, words longer than 24 characters cut, path-valued words
    left out first when the whole would pass `NAME_MAX`, then the last words cut (" ...")."""
    script, args = _script(argv)
    words = [_word(arg) for arg in args]
    name = " ".join([script, *words])
    if len(name) > NAME_MAX:  # paths rarely tell trials apart: drop them (and their option)
        kept = [w for i, w in enumerate(words) if not _path_like(args[i])
                and not (w.startswith("-") and "=" not in w and i + 1 < len(args) and _path_like(args[i + 1]))]
        name = " ".join([script, *kept])
    if len(name) <= NAME_MAX:
        return name
    return name[:NAME_MAX - 3].rsplit(" ", 1)[0] + " ..."  # whole words


def _script(argv: list[str]) -> tuple[str, list[str]]:
    """(the program's short name, its arguments): `python -m pkg` shows as `pkg`."""
    if not argv or not argv[0]:
        return "python", []
    if argv[0] == "-c":
        return "python -c", list(argv[1:])
    path = argv[0].rstrip("/")
    base = os.path.basename(path) or "python"
    if base == "__main__.py":
        base = os.path.basename(os.path.dirname(path)) or base
    return _word(base), list(argv[1:])


def _path_like(arg: str) -> bool:
    value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
    return "/" in value


def _word(arg: str) -> str:
    """One argument as a name shows it: a path's last part, printable, without spaces (quoted
    if it has some), at most `_WORD_MAX` characters."""
    key, value = (arg.split("=", 1)[0] + "=", arg.split("=", 1)[1]) if arg.startswith("-") and "=" in arg \
        else ("", arg)
    if "/" in value:
        value = os.path.basename(value.rstrip("/")) or value
    word = "".join(c if c.isprintable() else "?" for c in key + value)
    if any(c.isspace() for c in word):
        word = shlex.quote(word)
    return word if len(word) <= _WORD_MAX else word[:_WORD_MAX - 3] + "..."


def with_pid(name: str, pid: int | None = None) -> str:
    """A default name another live job has, made this process's: `train.py (pid 14907)`."""
    return f"{name} (pid {os.getpid() if pid is None else pid})"


def ray_trial_name(modules: Mapping[str, Any] | None = None) -> str | None:
    """The name of the Ray Tune trial this process runs now (`ray.tune.get_context()
    .get_trial_name()`, Ray 2.x), or None: not in a trial, or Ray not in use.

    Ray is looked at only when the process has imported Ray Tune already (a trial's worker has:
    it runs the trainable); it is never imported here (seconds of start-up, and Ray's own
    threads, in every training script). Outside a trial Ray's call warns once and gives None, so
    its session is looked up first where Ray keeps it (ray.train._internal.session, the
    function trainable's); a Ray that moved it gets the public call alone.
    """
    modules = sys.modules if modules is None else modules
    tune = modules.get("ray.tune")
    if "ray" not in modules or tune is None:
        return None
    session = modules.get("ray.train._internal.session")
    get_session = getattr(session, "get_session", None)
    try:
        if get_session is not None and get_session() is None:
            return None
        name = tune.get_context().get_trial_name()
    except Exception:  # noqa: BLE001  a Ray whose API changed: the plain default name
        return None
    return str(name) if name else None


def process_name(*, modules: Mapping[str, Any] | None = None, argv: list[str] | None = None) -> str:
    """The default name of a job of one process: its Ray Tune trial's name, else its command
    line, `train.py --lr 0.1` (NOTE [ Default names that tell trials apart ])."""
    trial = ray_trial_name(modules)
    if trial:
        return trial
    return command_name(sys.argv if argv is None else argv)


def numbered(name: str, serial: int) -> str:
    """`name` for the first dataset of a process under it, then `name #2`, `name #3`, ... (a
    name without arguments: `name-2`, ...)."""
    if serial <= 1:
        return name
    return f"{name} #{serial}" if " " in name else f"{name}-{serial}"


def job_name(placement: Placement, *, ordinal: str, env: Mapping[str, str] | None = None,
             distributed: Any = None, ppid: int | None = None,
             modules: Mapping[str, Any] | None = None) -> str:
    """A default name for the job: the same on every rank of one run, and new in the next run
    (a name is how ranks find their job; consecutive runs under one name collided when it came
    from a fixed `MASTER_PORT`, e.g. accelerate's 29500).

    One process: `process_name` (its Ray Tune trial's name, else its command line; a process's
    later datasets number it, `joader.client.attachment.next_solo_name`). Ranks with a process
    group: a name that the first rank to ask writes into the group's store (`compare_set`, so no
    rank waits for another), keyed by `ordinal` (the dataset's place among this process's
    datasets of its source and indices, the same on every rank). Else torchrun's run id; else torchrun's agent (the ranks' parent, one
    per run on a host) and its master port; else the master address and port.
    """
    env = os.environ if env is None else env
    if placement.world_size == 1:
        return process_name(modules=modules)
    script = os.path.basename(sys.argv[0] or "python") or "python"
    store = _store(distributed)
    if store is not None:
        candidate = f"{script}-{uuid.uuid4().hex[:12]}"
        try:
            agreed = store.compare_set(f"joader/job-name/{ordinal}", "", candidate)
        except (RuntimeError, NotImplementedError, AttributeError):
            agreed = None  # a store without compare_set: the environment's name below
        if agreed:
            return agreed.decode() if isinstance(agreed, bytes) else str(agreed)
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if run not in ("", "none"):
        return f"{script}-{run}"
    port = env.get("MASTER_PORT", "")
    if "TORCHELASTIC_RUN_ID" in env:  # torchrun without a run id: its agent is the ranks' parent
        return f"{script}-{os.getppid() if ppid is None else ppid}-{port}"
    if port:
        return f"{script}-{env.get('MASTER_ADDR', '')}-{port}"
    raise InvalidArgumentError(
        f"the {placement.world_size} ranks of a job find each other by name; pass the same name= "
        "in every rank (or initialize torch.distributed first, or run under torchrun)")


def _store(distributed: Any) -> Any:
    """The default process group's store, if there is one (a private but long-stable API)."""
    if _group(distributed) is None:
        return None
    getter = getattr(getattr(distributed, "distributed_c10d", None), "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None
