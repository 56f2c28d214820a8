"""The cache: the RefCnt eviction policy and the byte allocator (pure), and the shared-memory
arena holding the prepared items."""

from joader.cache.allocator import AllocatorStats, ByteAllocator
from joader.cache.arena import Arena, ArenaReader, parse_size, remove_stale_arenas
from joader.cache.policy import PolicyStats, RefCntPolicy

__all__ = [
    "AllocatorStats",
    "Arena",
    "ArenaReader",
    "ByteAllocator",
    "PolicyStats",
    "RefCntPolicy",
    "parse_size",
    "remove_stale_arenas",
]
