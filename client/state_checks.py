"""The field checks of a loaded `JoaderDataset` state (`Checkpoint.from_state_dict` runs them).

Every field of the saved dict (`Checkpoint.state_dict`) is checked: its keys, the type and range
of each value, the fields' coherence with each other (an epoch 0 has nothing consumed), and,
given a `Share`, with the job that loads it (consumed ids among its items and no more than an
epoch gives the rank, `parts` the number of readers that load it). Each refusal is an
`InvalidArgumentError` that names the field, what is wrong and the fix.

NOTE [ A state is checked when it is loaded ]
What is not refused here is acted on later, far from the cause: consumed ids beyond the source
raised a raw IndexError when the client board marked them; `parts` larger than the readers
that load the state made joaderd wait for reports that never come, until `timeout_s`; an
epoch 0 with consumed ids resumed nothing (epoch 0 is the state before any read) and the whole
epoch came again. So nothing of a state is used before all of it passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyroaring import BitMap

from joader.errors import InvalidArgumentError

FIX_OWN = "load the state this job saved, or start without one"
REQUIRED = ("version", "job", "epoch", "consumed", "seed", "rank", "world_size")
# not written by older joaders; the rest_ keys only in an elastic resume's epoch
OPTIONAL = ("seed_given", "source", "dataset", "parts", "hosts", "rest_share", "rest_base")
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class Share:
    """What the job gives the reader that loads a state, to check the state against."""

    items: BitMap | None  # the job's items on this joaderd (None: every item of the source)
    num_source_items: int
    per_epoch: int  # items of one epoch this rank reads
    readers: int  # readers that each load a part of the rank's state: num_workers in a worker, else 1
    in_worker: bool = False  # loaded in a DataLoader worker

    def holds(self, ids: BitMap) -> BitMap:
        """The ids of `ids` that are not items of the job."""
        if self.items is not None:
            return ids - self.items
        return ids - BitMap(range(self.num_source_items))


def refuse(what: str, fix: str = FIX_OWN) -> InvalidArgumentError:
    return InvalidArgumentError(f"load_state_dict: {what}; {fix}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _names(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys)


def check_keys(state: dict[str, Any]) -> None:
    """Every key a JoaderDataset state has, and none other."""
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise refuse(f"the state has no {_names(missing)} (every JoaderDataset state has "
                     f"{_names(list(REQUIRED))})")
    unknown = [str(k) for k in state if k not in REQUIRED and k not in OPTIONAL]
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise refuse(f"unknown key{plural} {_names(unknown)} in the state (a JoaderDataset state has "
                     f"{_names(list(REQUIRED + OPTIONAL))})")


def check_owner_types(state: dict[str, Any]) -> None:
    """The owner's fields are of their types (compared to the job's only then: `False == 0`)."""
    rank, world_size, seed = state["rank"], state["world_size"], state["seed"]
    if rank is not None and not (is_int(rank) and rank >= 0):
        raise refuse(f"rank {rank!r} is not a rank (an int from 0)")
    if not (is_int(world_size) and world_size >= 1):
        raise refuse(f"world_size {world_size!r} is not a number of ranks (an int from 1)")
    if seed is not None and not (is_int(seed) and 0 <= seed <= MAX_SEED):
        raise refuse(f"seed {seed!r} is not a seed (None, or an int in 0..2**64-1)")
    if "seed_given" in state and not isinstance(state["seed_given"], bool):
        raise refuse(f"seed_given {state['seed_given']!r} is not True or False")
    for key, kind in (("source", "a source name"), ("dataset", "a digest of the job's indices")):
        if key in state and not isinstance(state[key], str):
            raise refuse(f"{key} {state[key]!r} is not {kind} (a str)")
    hosts = state.get("hosts")
    if hosts is not None and not isinstance(hosts, dict):
        raise refuse(f"hosts {hosts!r} is not a host layout (None, or the dict HostLayout.as_dict() gives)")


def check_epoch(epoch: Any, max_epoch: int) -> int:
    if not is_int(epoch) or not 0 <= epoch < max_epoch:
        raise refuse(f"epoch {epoch!r} is not an epoch number (0..{max_epoch - 1})")
    return int(epoch)


def check_parts(parts: Any, max_parts: int) -> int:
    if not is_int(parts) or not 1 <= parts <= max_parts:
        raise refuse(f"parts {parts!r} is not a number of readers (1..{max_parts})",
                     "load a state saved by JoaderDataset.state_dict() (with DataLoader workers, through "
                     "torchdata's StatefulDataLoader)")
    return int(parts)


def read_consumed(data: Any) -> BitMap:
    try:
        return BitMap.deserialize(data)
    except Exception as error:  # pyroaring raises ValueError or TypeError
        raise refuse(f"its consumed set is unreadable, not a serialized pyroaring BitMap ({error})") from error


def check_coherent(epoch: int, consumed: BitMap) -> None:
    """Epoch 0 is the state before any read: it has nothing consumed (read epochs start at 1)."""
    if epoch == 0 and consumed:
        raise refuse(f"epoch 0 with {len(consumed)} consumed ids: a state of epoch 0 is saved before any "
                     "item is read and has none (read epochs start at 1), and it resumes nothing, so "
                     "these items would be delivered again")


def _ids(ids: BitMap, most: int = 5) -> str:
    shown = ", ".join(str(i) for i in list(ids[:most]))
    return shown + (", ..." if len(ids) > most else "")


def read_rest(state: dict[str, Any]) -> tuple[int, int] | None:
    """(rest_share, rest_base) of a state saved in an elastic resume's epoch, else None."""
    if "rest_share" not in state and "rest_base" not in state:
        return None
    share, base = state.get("rest_share"), state.get("rest_base")
    if not (isinstance(share, int) and is_int(share) and share >= 0
            and isinstance(base, int) and is_int(base) and base >= 0):
        raise refuse(f"rest_share {share!r} and rest_base {base!r} are not counts of items (ints from 0, "
                     "both or neither)")
    return share, base


def check_share(consumed: BitMap, parts: int, share: Share, *, whole_job: bool = False) -> None:
    """The state fits the job that loads it: its ids, their count, its readers. `whole_job`: a
    state of an elastic resume's epoch, whose consumed set is every rank's (of every host)."""
    foreign = share.holds(consumed) if not whole_job else consumed - BitMap(range(share.num_source_items))
    if foreign:
        what = "id that is not an item" if len(foreign) == 1 else "ids that are not items"
        raise refuse(f"consumed holds {len(foreign)} {what} of this job ({_ids(foreign)})")
    if len(consumed) > share.per_epoch and not whole_job:
        raise refuse(f"consumed holds {len(consumed)} ids, more than the {share.per_epoch} items an "
                     "epoch gives this rank")
    if parts != share.readers:
        where = (f"a DataLoader worker of {share.readers}" if share.in_worker
                 else "the training process, not a DataLoader worker")
        saved = "reader of this rank saved its part" if parts == 1 else "readers of this rank saved their parts"
        raise refuse(f"parts {parts}: the state says {parts} {saved}, and it is loaded by "
                     f"{share.readers} ({where}), so joaderd would wait for parts that never come; "
                     "each DataLoader worker loads its own part (torchdata's StatefulDataLoader does, "
                     "with the num_workers that saved them), and a process that reads alone loads "
                     "what it saved alone")
