"""A reader's checkpoint: where one process (or DataLoader worker) is in its job's epochs.

`JoaderDataset.state_dict()` returns `Checkpoint.state_dict()`, a plain dict users save with
their model; `load_state_dict(state)` reads it back with `Checkpoint.from_state_dict`, which
checks it before anything is resumed. The dict is the on-the-wire format: its keys and values
must stay as they are, or checkpoints users already saved would no longer load.

- `Owner`: whose checkpoint it is (the source, a digest of the indices, the seed, the rank and
  the hosts' layout); a checkpoint of another job or rank is refused, naming the difference;
- `Checkpoint`: its owner, the epoch, the ids yielded of it, and how many readers reported;
- `ResumePoint`: what a new pass carries to joaderd until its first reply (the epoch and the
  ids consumed of it), the part of a checkpoint joaderd acts on;
- `RestShare`: in an epoch whose rest was dealt anew to another layout of ranks (an elastic
  resume, `joader.client.relayout`), this rank's share of that rest.

Every field of a loaded state is checked before any is used (`joader.client.state_checks`):
against the job that loads it when given its `Share`.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from pyroaring import BitMap

from joader.client import state_checks as checks
from joader.client.board import MAX_EPOCH
from joader.client.state_checks import FIX_OWN, Share
from joader.errors import InvalidArgumentError

__all__ = ["MAX_PARTS", "STATE_VERSION", "Checkpoint", "Owner", "RestShare", "ResumePoint", "Share",
           "indices_digest"]

STATE_VERSION = 1
JOB_TAG = "joader"
MAX_PARTS = 1024  # readers of one rank a state may say reported (DataLoader workers)
# How to resume on another layout of ranks or hosts: the epoch's rest is dealt anew from the
# union of what every rank consumed, so it needs every rank's state (`joader.client.relayout`).
ANOTHER_LAYOUT = (
    "an epoch resumes on another number of ranks or hosts from EVERY rank's state, not one's: save "
    "through joader.client.loader.JoaderDataLoader (its state_dict() holds every rank's), or gather "
    "each rank's JoaderDataset.state_dict() (torch.distributed.all_gather_object) and pass the list "
    "to load_state_dict")


def indices_digest(bitmap: BitMap | None) -> str:
    """A short digest of a job's indices (None: the whole source)."""
    data = bitmap.serialize() if bitmap is not None else b"all"
    return hashlib.sha256(data).hexdigest()[:16]


@dataclass(frozen=True)
class RestShare:
    """This rank's share of an epoch whose rest was dealt anew to another layout of ranks (an
    elastic resume): `share` items, counted from a consumed set of which `base` ids are items
    of this rank's joaderd job (NOTE [ An elastic resume ] in server/registry/resumes.py). What
    the rank consumes beyond them comes off its share."""

    share: int
    base: int


@dataclass(frozen=True)
class ResumePoint:
    """Where a pass resumes: `consumed` of `epoch` were yielded by the readers that saved it
    (`parts` of them: joaderd waits for as many reports); `rest`, in an elastic resume's epoch,
    the rank's share of its rest."""

    epoch: int
    consumed: BitMap
    parts: int = 1
    rest: RestShare | None = None
    # Loaded in the training process for the workers of its next `iter()` (parts 0): a random id
    # the first pass to take it claims on the client board (NOTE [ A loaded resume is one pass's ]).
    offer: int = 0


@dataclass(frozen=True)
class Owner:
    """Whose checkpoint: one rank of one job (the same source, indices and given seed)."""

    source: str
    dataset: str  # `indices_digest` of the job's indices
    seed: int | None
    seed_given: bool
    rank: int | None
    world_size: int
    hosts: dict[str, int] | None = None  # `HostLayout.as_dict()` when the job spans hosts

    def check(self, state: dict[str, Any]) -> None:
        """Refuses `state` if another rank or another job saved it (keys an older joader did
        not write are not checked)."""
        if state.get("world_size") != self.world_size:
            raise InvalidArgumentError(
                f"load_state_dict: the state is of rank {state.get('rank')} of {state.get('world_size')}, "
                f"this dataset is rank {self.rank} of {self.world_size}; {ANOTHER_LAYOUT}")
        if state.get("rank") != self.rank:
            raise InvalidArgumentError(
                f"load_state_dict: the state is of rank {state.get('rank')} of {state.get('world_size')}, "
                f"this dataset is rank {self.rank} of {self.world_size}; load each rank's own state")
        self.check_job(state)
        if state.get("hosts") != self.hosts:
            raise InvalidArgumentError(
                f"load_state_dict: the state was saved with its ranks on hosts {state.get('hosts')}, this "
                f"rank's host is {self.hosts} (each host's joaderd serves its part of the items, cut by "
                f"the layout); {ANOTHER_LAYOUT}")

    def check_job(self, state: dict[str, Any]) -> None:
        """Refuses `state` if another job saved it: another source, other indices or seed."""
        # A job without a seed gets a new one each run: resuming it is fine.
        problems = []
        if "source" in state and state["source"] != self.source:
            problems.append(f"source {state['source']!r}, not {self.source!r}")
        if "dataset" in state and state["dataset"] != self.dataset:
            problems.append(f"other indices: dataset {state['dataset']!r}, not {self.dataset!r}")
        if state.get("seed_given") and self.seed_given and state.get("seed") != self.seed:
            problems.append(f"seed {state.get('seed')}, not {self.seed}")
        if problems:
            raise InvalidArgumentError(
                f"load_state_dict: the state is of another job ({'; '.join(problems)}); {FIX_OWN} "
                "(or build the dataset with the same source, indices and seed)")


@dataclass(frozen=True)
class Checkpoint:
    """`consumed`: the ids `owner` yielded of `epoch`; `parts`: how many readers of the rank
    reported (DataLoader workers each save their own, torchdata's StatefulDataLoader collects
    them)."""

    owner: Owner
    epoch: int
    consumed: BitMap
    parts: int = 1
    rest: RestShare | None = None  # in an elastic resume's epoch: this rank's share of its rest

    @staticmethod
    def check_tag(state: Any) -> None:
        """Refuses what is not a JoaderDataset state at all (checked before anything else)."""
        if not isinstance(state, dict) or state.get("job") != JOB_TAG:
            raise InvalidArgumentError(
                "load_state_dict: this is not a JoaderDataset state (from JoaderDataset.state_dict())")

    def state_dict(self) -> dict[str, Any]:
        """The saved form: picklable, small, version-tagged. Keys and values must not change."""
        owner = self.owner
        rest = {} if self.rest is None else {"rest_share": self.rest.share, "rest_base": self.rest.base}
        return {
            "version": STATE_VERSION,
            "job": JOB_TAG,
            "epoch": self.epoch,
            "consumed": self.consumed.serialize(),
            "seed": owner.seed,
            "seed_given": owner.seed_given,
            "source": owner.source,
            "dataset": owner.dataset,
            "rank": owner.rank,
            "world_size": owner.world_size,
            "parts": self.parts,
            "hosts": owner.hosts,
            **rest,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], expected: Owner, share: Share | None = None) -> Checkpoint:
        """`state` read back, for `expected` to resume; raises `InvalidArgumentError` naming
        the field that is wrong and the fix, checked in this order: the tag, the version, the
        keys, the owner's types, another rank or job, the epoch, the parts, the consumed set,
        an epoch 0 with ids consumed, and with `share` the ids, their count and the readers."""
        cls.check_tag(state)
        version = state.get("version")
        if not checks.is_int(version) or version != STATE_VERSION:
            raise InvalidArgumentError(
                f"load_state_dict: state version {version!r}; this joader reads version "
                f"{STATE_VERSION}. Resume with the joader version that saved it.")
        checks.check_keys(state)
        checks.check_owner_types(state)
        expected.check(state)
        epoch = checks.check_epoch(state["epoch"], MAX_EPOCH)
        parts = checks.check_parts(state.get("parts", 1), MAX_PARTS)
        consumed = checks.read_consumed(state["consumed"])
        checks.check_coherent(epoch, consumed)
        rest = checks.read_rest(state)
        if share is not None:
            checks.check_share(consumed, parts, share, whole_job=rest is not None)
        owner = Owner(source=state.get("source", expected.source), dataset=state.get("dataset", expected.dataset),
                      seed=state["seed"], seed_given=bool(state.get("seed_given")), rank=state["rank"],
                      world_size=state["world_size"], hosts=state.get("hosts"))
        return cls(owner, epoch, consumed, parts,
                   RestShare(*rest) if rest is not None else None)

    @property
    def resume_point(self) -> ResumePoint | None:
        """What the next pass carries to joaderd; None for epoch 0 (nothing to resume: the job's
        first epoch starts whole)."""
        if self.epoch <= 0:
            return None
        offer = secrets.randbits(63) | 1 if not self.parts else 0
        return ResumePoint(self.epoch, self.consumed, self.parts, self.rest, offer)
