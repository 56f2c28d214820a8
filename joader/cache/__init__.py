"""The cache: the RefCnt eviction policy (pure) and the shared-memory arena holding the samples."""

from joader.cache.arena import Arena, ArenaReader, SlotAllocator, parse_size, remove_stale_arenas
from joader.cache.policy import PolicyStats, RefCntPolicy

__all__ = [
    "Arena",
    "ArenaReader",
    "PolicyStats",
    "RefCntPolicy",
    "SlotAllocator",
    "parse_size",
    "remove_stale_arenas",
]
