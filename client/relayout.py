"""An elastic resume: a checkpoint saved by W1 ranks (on H1 hosts) resumed by W2 ranks (on H2).

Each rank's state (`joader.client.checkpoint`) is its part of the epoch as dealt to the saving
job's ranks, so one rank's state cannot resume on another layout: the items rank 0 of 2 did not
consume include rank 1's, and rank 2 of 3 had no part at all. What can resume is the union:
from EVERY rank's state (every DataLoader worker's too) the epoch's *rest*, the job's items no
old rank consumed, is dealt anew among the new ranks, each getting an equal share, as
DistributedSampler deals a fresh epoch (`ceil(|rest| / W2)` with padding copies, or
`floor(|rest| / W2)` under drop_last). Later epochs are whole epochs on the new layout. Every rank
computes the same shares from the same states, with no message (`rest_checkpoint`).

Across hosts each host's joaderd serves its part of the items (`joader.sampling.hosts`), cut by
the NEW layout: a host's rest is its part less the union, so each host decodes only its part. The
parts' rests differ in size by chance, and every rank must get the same count (a DDP step needs
a batch on every rank): each rank's share is the largest rest of one rank's chunk of the keyed
order (the smallest under drop_last), which no host's ranks fall short of; a host with fewer
pads with copies of its epoch's first items (or drops, under drop_last), as DistributedSampler
pads. joaderd takes the share as given (NOTE [ An elastic resume ] in server/registry/resumes.py).

Pure: the states, the job and the new layout in, a `Checkpoint` out.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pyroaring import BitMap

from joader.client.checkpoint import Checkpoint, Owner, RestShare, Share
from joader.errors import InvalidArgumentError
from joader.sampling import hosts

__all__ = ["NewLayout", "rest_checkpoint"]

logger = logging.getLogger("joader.client.dataset")  # NOTE [ The dataset's logger ]

_FIX = ("pass every rank's JoaderDataset.state_dict() of the saving job (JoaderDataLoader.state_dict() "
        "gathers them), or start without a state")


@dataclass(frozen=True)
class NewLayout:
    """The job that resumes: its items, its ranks and, across hosts, this rank's host."""

    items: BitMap  # the job's items (on every host)
    world_size: int
    drop_last: bool
    salt: int  # the source's keyed-order salt (`hosts.source_salt`)
    hosts: hosts.HostLayout | None = None


def _refuse(what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"load_state_dict: {what}; {_FIX}")


def _read(states: Sequence[Any], owner: Owner) -> list[Checkpoint]:
    """Each state checked as its own rank's (tag, version, fields) and as this job's."""
    if not isinstance(states, (list, tuple)) or not states:
        raise _refuse(f"expected a non-empty list of JoaderDataset states, got {type(states).__name__}")
    read = []
    for state in states:
        Checkpoint.check_tag(state)
        as_saved = dataclasses.replace(owner, rank=state.get("rank"), world_size=state.get("world_size"),
                                       hosts=state.get("hosts"))
        read.append(Checkpoint.from_state_dict(state, as_saved))
    return read


def _check_complete(read: list[Checkpoint]) -> int:
    """Every rank of the saving job is there, with every reader's part; its world size."""
    sizes = {checkpoint.owner.world_size for checkpoint in read}
    if len(sizes) != 1:
        raise _refuse(f"the states are of jobs of world sizes {sorted(sizes)}, not of one job")
    world_size = sizes.pop()
    by_rank: dict[int, list[Checkpoint]] = {}
    for checkpoint in read:
        by_rank.setdefault(checkpoint.owner.rank or 0, []).append(checkpoint)
    missing = [rank for rank in range(world_size) if rank not in by_rank]
    if missing:
        raise _refuse(f"no state of rank(s) {missing[:8]} of the saving job's {world_size}: what they "
                      "consumed would be dealt again")
    for rank, parts in sorted(by_rank.items()):
        expected = max(checkpoint.parts for checkpoint in parts)
        if len(parts) != expected:
            raise _refuse(f"rank {rank} has {len(parts)} state(s), and they say {expected} readers (DataLoader "
                          "workers) saved their parts: a missing part's items would be dealt again")
    return world_size


def _share(rest: BitMap, layout: NewLayout) -> int:
    """Each new rank's share of the rest (module docstring)."""
    w = layout.world_size
    if layout.hosts is None:
        return len(rest) // w if layout.drop_last else -(-len(rest) // w)
    chunks = hosts.rank_chunks(layout.items, layout.salt, w, drop_last=layout.drop_last)
    per_chunk = np.isin(chunks, np.fromiter(rest, dtype=np.uint64, count=len(rest))).sum(axis=1)
    return int(per_chunk.min() if layout.drop_last else per_chunk.max())


def rest_checkpoint(states: Sequence[Any], owner: Owner, share: Share, layout: NewLayout) -> Checkpoint | None:
    """What this rank resumes of the saving job's states: the newest epoch any rank saved, less
    the union of what every rank consumed of it, as this rank's share (module docstring); None
    if no rank had read anything (a fresh start). Refuses states of another job, or not every
    rank's. Its `parts` is 0: every reader of the pass that resumes it reports it, however
    many there are (`Pass.take`), since the states were loaded before the DataLoader's workers
    exist."""
    read = _read(states, owner)
    saved_size = _check_complete(read)
    epoch = max(checkpoint.epoch for checkpoint in read)
    if epoch <= 0:
        return None
    union = BitMap()
    for checkpoint in read:
        if checkpoint.epoch == epoch:
            union |= checkpoint.consumed
    behind = sorted({checkpoint.owner.rank or 0 for checkpoint in read if checkpoint.epoch < epoch})
    if behind:
        logger.warning("joader: rank(s) %s of the saving job had saved an older epoch than %d (finished "
                       "with it); epoch %d resumes from the other ranks' states", behind, epoch, epoch)
    union &= layout.items
    rest = layout.items - union
    mine = share.items if share.items is not None else layout.items
    each = _share(rest, layout)
    logger.info("joader: epoch %d of a job of %d ranks resumes on %d: %d of its %d items left, %d for each "
                "rank", epoch, saved_size, layout.world_size, len(rest), len(layout.items), each)
    return Checkpoint(owner, epoch, union, 0, RestShare(each, len(union & mine)))
