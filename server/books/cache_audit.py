"""The item cache's books checked and repaired against the jobs' own books.

`check` raises AssertionError where the cache's books disagree with themselves or with the jobs'
queues and copies (tests call it after every step: `Registry.check_invariants`); `resync`
rewrites the counts a job whose bookkeeping broke left behind (`Registry._contain`), from the
jobs' queues and samplers, which are the truth. Both read the cache whole: O(items).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from joader.server.books.records import Item, ItemState

if TYPE_CHECKING:
    from joader.server.books.item_cache import ItemCache


def resync(cache: ItemCache, expected_pins: dict[int, int], planned: dict[int, int], needed: Callable[[Item], int]) -> int:
    """Rewrites every item's pins, the planned reads, and every cached item's refcount, from
    the jobs' own books (`expected_pins`: key -> pinned queue entries and copies out;
    `planned`: key -> queue entries; `needed(item)`: its refcount, the jobs that still need
    it plus its planned reads). After a job whose bookkeeping broke was ended
    (`Registry._contain`), the counts it left behind are wrong; the jobs' queues and
    samplers are the truth. Returns how many items were corrected."""
    cache.planned = Counter({key: count for key, count in planned.items() if count})
    corrected = 0
    policy = cache.policy
    for key, item in cache.items.items():
        pins = expected_pins.get(key, 0)
        if item.state is ItemState.READY:
            refcount = needed(item)
            if (key not in policy or policy.pin_count(key) != pins
                    or policy.refcount(key) != refcount or item.pins != pins):
                corrected += 1
                if key in policy:
                    policy.remove(key)
                policy.insert(key, refcount, pinned=pins)
        elif item.pins != pins:
            corrected += 1
        item.pins = pins
    cache.num_pins = sum(expected_pins.get(key, 0) for key in cache.items)
    cache.num_pinned = sum(1 for key in cache.items if expected_pins.get(key, 0))
    return corrected


def check(cache: ItemCache, expected_pins: dict[int, int] | None = None,
          needed: Callable[[Item], int] | None = None,
          planned: dict[int, int] | None = None) -> None:
    """Raises AssertionError if the cache's books disagree (tests call it after every step).

    - every READY item is in the policy with the same pin count and is listed in its
      source's cached ids; no other item is in the policy;
    - allocations are exactly the READY items' (their size, rounded) and the DECODING
      items' (what each was given: its exact size or its source's bound, rounded), and the
      allocator's books tile the arena; a known size is never above its source's bound;
    - `expected_pins` (key -> pins, from the jobs' queues and outstanding copies), if given,
      equals every item's pin count; `needed(item)`, if given, equals each READY item's
      refcount; `planned` (key -> queue entries), if given, equals the planned reads.
    """
    allocator = cache.allocator
    allocator.check()
    wanted: dict[int, int] = {}
    for key, item in cache.items.items():
        assert item.key == key, (key, item.key)
        assert item.pins >= 0, (item.item_id, item.pins)
        if item.state is ItemState.READY:
            assert key in cache.policy, f"READY item {item.item_id} is not in the policy"
            assert cache.policy.pin_count(key) == item.pins, (
                f"item {item.item_id}: {item.pins} pins, the policy has {cache.policy.pin_count(key)}")
            assert item.item_id in item.source.cached_ids, item.item_id
            if needed is not None:
                assert cache.policy.refcount(key) == needed(item), (
                    f"item {item.item_id}: refcount {cache.policy.refcount(key)}, "
                    f"{needed(item)} jobs need it")
            wanted[item.offset] = allocator.rounded(max(item.nbytes, 1))
        else:
            assert key not in cache.policy, f"{item.state.name} item {item.item_id} is in the policy"
            assert item.item_id not in item.source.cached_ids, item.item_id
            if item.state is ItemState.DECODING and cache.capacities[key]:
                capacity = cache.capacities[key]
                assert 0 < capacity <= item.source.max_item_bytes, (item.item_id, capacity)
                wanted[item.offset] = allocator.rounded(capacity)
            else:  # WAITING, FAILED, or DECODING size first (no range yet)
                assert item.offset == -1, (item.item_id, item.state, item.offset)
    assert allocator.allocations() == wanted, "the allocator's ranges are not the items'"
    decoding = {key for key, item in cache.items.items() if item.state is ItemState.DECODING}
    assert set(cache.capacities) == decoding, "the decodes in flight are not the DECODING items"
    assert len(cache.policy) == sum(1 for i in cache.items.values() if i.state is ItemState.READY)
    accounted = cache.items_decoded + cache.decode_failures + cache.decodes_cancelled + cache.decodes_in_flight()
    assert cache.decodes_requested == accounted, (
        f"{cache.decodes_requested} decodes requested, {accounted} decoded, failed, cancelled or in flight")
    if planned is not None:
        wanted_plans = {key: n for key, n in planned.items() if n}
        assert cache.planned == wanted_plans, f"planned reads differ: cache {cache.planned}, queues {wanted_plans}"
    items = cache.items.values()
    assert cache.ready_bytes == sum(i.nbytes for i in items if i.state is ItemState.READY), "ready bytes"
    assert cache.decodes_in_flight() == sum(1 for i in items if not i.state.settled), "items not settled"
    assert cache.num_failed == sum(1 for i in items if i.state is ItemState.FAILED), "failed items"
    failed = {key for key, item in cache.items.items() if item.state is ItemState.FAILED}
    assert set(cache.failed_at) == failed, "`failed_at` is not the FAILED items"
    awaited = {key for key, item in cache.items.items() if not item.state.settled}
    assert set(cache.waiters) <= awaited, f"waiters of settled or dropped items: {set(cache.waiters) - awaited}"
    assert cache.num_pins == sum(i.pins for i in items), "pins"
    assert cache.num_pinned == sum(1 for i in items if i.pins), "pinned items"
    if expected_pins is not None:
        actual = {key: item.pins for key, item in cache.items.items() if item.pins}
        wanted = {key: n for key, n in expected_pins.items() if n}
        assert actual == wanted, f"pins differ: cache {actual}, jobs {wanted}"
