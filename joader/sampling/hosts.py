"""A job's ranks on several hosts: which part of the dataset each host's joaderd serves.

One joaderd per host, and the daemons never talk to each other. A job of W ranks spread over
hosts is, on each host, a joaderd job of that host's ranks over that host's *part* of the
dataset; every rank computes the parts itself, the same way, from what torchrun tells it
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`), with no message.

The cut. The job's items are put in a *keyed order*: sorted by a 64-bit hash of (the source's
salt, item id). The order depends on the source, not on the job, so two jobs over the same items
on the same hosts get the same parts (and share each host's cache and decodes), and jobs over
overlapping items get nearly the same ones. The order is cut into W consecutive chunks of m
items, m = ceil(|D| / W) (floor under drop_last), one per global rank; a host's part is the
chunks of its ranks, which torchrun numbers consecutively on a host (ranks RANK - LOCAL_RANK ..
RANK - LOCAL_RANK + LOCAL_WORLD_SIZE - 1). So a host with L ranks has L x m items, its joaderd
gives each of them m, and every rank of the job has the same number of items (and batches) per
epoch, whatever the number of ranks per host (2 + 1 included), with no collective.

Padding and dropping. Without drop_last, W x m may exceed |D| by up to W - 1: the order wraps,
and its first items also end the last chunks (on another host: a few items twice per epoch,
as DistributedSampler pads). Under drop_last the last |D| - W x m (< W) items of the keyed order
are in no part: fixed items (for this source, dataset and world size) that the job never reads,
where DistributedSampler drops other ones each epoch.

Statistics. Each host's joaderd runs DSA over its part: per rank, each epoch is a uniform
permutation of the rank's share of its host's part; the global epoch is exactly once; a global
batch is a stratified sample (each host's ranks draw from their host's part). The partition is
fixed for the job's life (what lets each host's cache hold only its part across epochs).

Pure: numpy and pyroaring only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from pyroaring import BitMap

from joader.errors import InvalidArgumentError

__all__ = ["HostLayout", "host_part", "keyed_order", "layout_from_env", "rank_chunks", "source_salt"]

_MASK = (1 << 64) - 1


def source_salt(source: str) -> int:
    """The keyed order's salt for a source: the same on every host and for every job."""
    return int.from_bytes(hashlib.blake2b(source.encode(), digest_size=8, person=b"joader-hosts").digest(), "little")


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized (uint64 arithmetic wraps, as the mix wants)."""
    z = values.copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def keyed_order(items: BitMap, salt: int) -> np.ndarray:
    """`items` sorted by a keyed hash of each id (ties, which need a 64-bit collision, by id)."""
    ids = np.fromiter(items, dtype=np.uint64, count=len(items))
    with np.errstate(over="ignore"):
        keys = _mix(ids ^ np.uint64(salt & _MASK))
    return ids[np.lexsort((ids, keys))]


@dataclass(frozen=True)
class HostLayout:
    """This rank's host in its job: the host's ranks are `first_rank` .. `first_rank +
    local_ranks - 1` of `world_size`; this rank is the `local_rank`-th of them."""

    world_size: int
    first_rank: int
    local_ranks: int
    local_rank: int

    @property
    def rank(self) -> int:
        return self.first_rank + self.local_rank

    @property
    def label(self) -> str:
        """The host's name within the job (its ranks): the joaderd job's name suffix."""
        return f"ranks{self.first_rank}-{self.first_rank + self.local_ranks - 1}of{self.world_size}"

    def as_dict(self) -> dict[str, int]:
        return {"world_size": self.world_size, "first_rank": self.first_rank, "local_ranks": self.local_ranks}


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key, "")
    try:
        return int(value) if value != "" else None
    except ValueError:
        raise InvalidArgumentError(f"{key}={value!r} is not an integer; fix the environment (torchrun sets it)") from None


def layout_from_env(rank: int, world_size: int, env: Mapping[str, str]) -> HostLayout | None:
    """The host layout torchrun's environment gives rank `rank` of `world_size`, or None when
    all the job's ranks are on this host (or the environment does not say: a single host)."""
    local_size, local_rank = _env_int(env, "LOCAL_WORLD_SIZE"), _env_int(env, "LOCAL_RANK")
    env_rank, env_size = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    if local_size is None or local_rank is None or (env_rank, env_size) != (rank, world_size):
        return None
    if local_size >= world_size:
        return None
    first = rank - local_rank
    if not (0 <= local_rank < local_size and first >= 0 and first + local_size <= world_size):
        raise InvalidArgumentError(
            f"RANK={rank}, LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_size}, WORLD_SIZE={world_size} "
            "do not describe consecutive ranks on this host (torchrun numbers a node's ranks "
            "consecutively); run under torchrun, or fix the environment")
    return HostLayout(world_size, first, local_size, local_rank)


def rank_chunks(items: BitMap, salt: int, world_size: int, *, drop_last: bool) -> np.ndarray:
    """The keyed order cut into one chunk of m items per global rank (the module docstring):
    a (world_size, m) array; without drop_last the order wraps to fill the last chunks."""
    n = len(items)
    m = n // world_size if drop_last else -(-n // world_size)
    if m == 0:
        raise InvalidArgumentError(
            f"{n} items for {world_size} ranks: every rank needs at least one item per epoch; use more items "
            "or fewer ranks" + (" (or drop_last=False)" if drop_last else ""))
    order = keyed_order(items, salt)
    if world_size * m > n:  # padding: the order wraps
        order = np.concatenate([order] * (-(-(world_size * m) // n)))
    return order[: world_size * m].reshape(world_size, m)


def host_part(items: BitMap, salt: int, layout: HostLayout, *, drop_last: bool) -> BitMap:
    """The items this host's joaderd serves the job: its ranks' chunks of the keyed order (module
    docstring). Every rank of the host then gets `rank_items` of them per epoch."""
    chunks = rank_chunks(items, salt, layout.world_size, drop_last=drop_last)
    mine = chunks[layout.first_rank:layout.first_rank + layout.local_ranks]
    part = BitMap(mine.ravel().astype(np.uint32))
    if len(part) != mine.size:
        raise InvalidArgumentError(
            f"{len(items)} items are too few for this host's {layout.local_ranks} ranks of {layout.world_size} "
            f"({mine.shape[1]} each, with padding some would repeat on one rank); use more items or fewer ranks")
    return part
