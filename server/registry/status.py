"""joaderd's status snapshot: what `joader status`, `joader top`, `joader analyze` and the
Prometheus exporter read. The schema is documented in docs/status.md; `SCHEMA` is bumped when a
field changes meaning or goes.

Each figure is named for what it counts, so that it reads right without the docs:
- *sharing* is split in two. `sharing.within_epoch` is deliveries per decode counting each job
  at most once per decoded copy: how many jobs one decode served (at most the number of jobs).
  `sharing.cross_epoch_reuse` is the further deliveries of a copy to a job that already had it
  (a later epoch, from a cache that kept it; or a DDP padding copy), per decode. Their sum is
  all deliveries per decode (the old, misleading "sharing factor" of 15 for three jobs).
- *lookups* are what a queue entry found when a job's queue took an item: a cached copy (hit),
  a decode already requested (joined), nothing (miss: a decode is requested) or a failure not
  due for a retry. Entries for an epoch after the one their job reads are `lookahead` and are
  counted apart; every miss of both is a requested decode, and `decodes` accounts for each:
  requested = items_decoded + failures + cancelled + in_flight.
- a job's `epoch` is the one its readers are in (0 before its first read), with
  `epoch_delivered` of `epoch_items` so far; `epochs_completed` counts whole ones.

Pure: reads the registry's records under its lock (the caller holds it). O(jobs, sources and
pairs of jobs): the cache's figures are counters it keeps as items change (item_cache.py), never
a walk of the cached items (0.58 s at 128k items, issue 37); tests/unit/server/registry/
test_status_counters.py recounts them from scratch.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

from joader.server.books.records import Job, stall_fraction
from joader.sources.safe_open import display_path

if TYPE_CHECKING:
    from joader.server.registry.registry import Registry

SCHEMA = 2
_FAILED_SHOWN = 50  # failures listed by name (`items_failed` counts them all)


def snapshot(registry: Registry, now: float) -> dict[str, Any]:
    """A JSON-ready snapshot of `registry` at `now` (its clock)."""
    cache = registry.cache
    allocation = cache.allocator.stats()
    sources = registry._sources.values()
    # The first failures by source and item id, described; the count from the sources' books
    # (a dict each: no walk of the cache's items, and no description of every failure).
    failed = [
        {"source": s.name, "item_id": i, "path": display_path(s.listing.paths[i]), "reason": display_path(s.failed[i])}
        for s in sources
        for i in heapq.nsmallest(_FAILED_SHOWN, s.failed)
    ][:_FAILED_SHOWN]
    items_failed = sum(len(s.failed) for s in sources)
    decoded = cache.items_decoded
    delivered = registry.items_delivered
    reused = registry.items_reused
    lookups = cache.lookups
    return {
        "schema": SCHEMA,
        "uptime_s": round(now - registry._started_s, 3),
        # --idle-exit-s (server/registry/idle_exit.py): the setting (0: never), and the seconds with no job
        # attached (null while one is)
        "idle_exit_s": registry.idle.idle_exit_s,
        "idle_s": None if (idle := registry.idle.idle_s(now)) is None else round(idle, 3),
        "sources": [
            {
                "name": s.name,
                "root": display_path(str(s.listing.root)),
                "num_items": s.num_items,
                "num_classes": len(s.listing.classes),
                "kind": getattr(s.listing, "kind", "imagefolder"),
                "stage": s.stage.name,
                "image_size": getattr(s.stage, "size", None),
                "small_items": s.small_items,
                "num_jobs": len(s.job_ids),
                # rounds held for a CPU-bound job behind (server/scheduling/in_step.py): episodes, seconds
                "holds": s.holds,
                "held_s": round(s.held_s + (now - s.held_since_s if s.held_since_s is not None else 0.0), 3),
                # on disk (server/books/source_watch.py): ok, away (folder gone), changed (refused)
                "health": s.watch.status(now) if s.watch is not None else {"state": "ok"},
            }
            for s in sources
        ],
        "jobs": [_job(job, now, cache.with_others.get(job.job_id, 0)) for job in registry.jobs.jobs.values()],
        "sharing_pairs": _pairs(registry),
        "max_jobs": registry.config.max_jobs,
        "cache": {
            "capacity_bytes": cache.capacity_bytes,
            "used_bytes": allocation.used_bytes,
            "items_bytes": cache.items_bytes(),
            "free_bytes": allocation.free_bytes,
            "largest_free_bytes": allocation.largest_free_bytes,
            "fragmentation": round(allocation.fragmentation, 4),
            "items": len(cache.policy),
            "pinned_items": cache.pinned_items(),  # items with at least one pin
            "pins": cache.pins(),  # queue entries plus handed-out, unacknowledged copies
            "evictions": cache.evictions,
            "lookups": lookups.as_dict(),  # entries for the epoch their job reads
            "lookahead": cache.lookahead.as_dict(),  # entries for a later epoch
            # of the entries for the epoch being read: found cached, or already being decoded
            "hit_rate": round((lookups.hits + lookups.joined) / lookups.total, 4) if lookups.total else None,
        },
        "decodes": {
            "requested": cache.decodes_requested,
            "failures": cache.decode_failures,
            "cancelled": cache.decodes_cancelled,  # every job that wanted it left first
            "in_flight": cache.decodes_in_flight(),
            "retried": cache.items_retried,  # requests for an item that had failed
            # how each decode's range was chosen (server/books/item_sizes.py): exactly
            # its item's bytes, known from a probe or an earlier decode (or a fixed-size stage);
            # size first (no range: the worker kept the item and said its size, then it was
            # placed); its stage's bound (shrunk when it landed). Refitted: outgrew an exact
            # size (the file changed since) and was placed again.
            "exact": cache.decodes_exact,
            "sized_first": cache.decodes_sized_first,
            "at_bound": cache.decodes_at_bound,
            "refitted": cache.decodes_refitted,
            "decode_s": round(cache.decode_s, 3),  # decode workers' busy seconds
        },
        "items_decoded": decoded,
        "items_delivered": delivered,
        "items_failed": items_failed,  # distinct items failing now
        "failed": failed,
        "sharing": {
            "within_epoch": round((delivered - reused) / decoded, 4) if decoded else None,
            "cross_epoch_reuse": round(reused / decoded, 4) if decoded else None,
            "deliveries_per_decode": round(delivered / decoded, 4) if decoded else None,
            "items_reused": reused,
        },
    }


def _job(job: Job, now: float, with_others: int) -> dict[str, Any]:
    epoch = job.claimed_epoch
    share = job.shares.get(epoch)
    epoch_items = sum(share.target) if share is not None else job.per_rank * job.world_size
    epoch_delivered = sum(rank.handed[epoch] for rank in job.ranks) if epoch else 0
    rate = job.rate.rate(now)
    stall_epoch = job.stall.latest
    wait, step, items = job.stall.epoch(stall_epoch)
    total_wait, total_step, total_items = job.stall.total()
    return {
        "job_id": job.job_id,
        "name": job.name,
        "source": job.source.name,
        "num_items": job.num_items,
        "world_size": job.world_size,
        "order": job.order,  # "shared" or "independent" (joader.sampling.ORDERS)
        "ranks_attached": sum(1 for r in job.ranks if r.attached),
        "epoch": epoch,
        "epoch_items": epoch_items,
        "epoch_delivered": epoch_delivered,
        "epochs_completed": max(0, epoch - 1) + (1 if epoch and epoch_delivered >= epoch_items else 0),
        "items_delivered": job.items_delivered,
        "items_reused": job.items_reused,
        "items_shared": job.items_shared,
        # of its copies (first deliveries), those another job received too, either first or
        # after it (server/books/item_cache.py): `joader top`'s SHARED, both ways
        "items_with_others": with_others,
        "items_skipped": job.items_skipped,
        "samples_per_s": round(rate, 2) if rate is not None else None,
        "server_wait_s": round(job.wait_s, 3),  # its Next calls waiting in joaderd for items
        "stall": None if not stall_epoch else {
            "epoch": stall_epoch, "wait_s": round(wait, 3), "step_s": round(step, 3), "items": items,
            "fraction": stall_fraction(wait, step)},
        "stall_total": {"wait_s": round(total_wait, 3), "step_s": round(total_step, 3), "items": total_items,
                        "fraction": stall_fraction(total_wait, total_step)},
        # the processes reading it now (training processes, or their DataLoader workers)
        "pids": sorted({pid for r in job.ranks if r.current is not None for pid in r.current.members.values() if pid}),
        "queued": sum(len(r.queue) for r in job.ranks),
        "queue_capacity": job.queue_capacity * job.world_size,
        "age_s": round(now - job.created_s, 3),
    }


def _pairs(registry: Registry) -> list[dict[str, Any]]:
    """Per pair of jobs on one source: the share of rounds (both taking part) that gave both
    the same item, beside its Theorem 1 bound |D1 ∩ D2| / max(|D1|, |D2|); live pairs first,
    then recent pairs with a job that has gone."""
    jobs = registry.jobs.jobs
    pairs = []
    for source in registry._sources.values():
        for (a, b), (rounds, shared) in sorted(source.pair_rounds.items()):
            da, db = jobs[a].dataset, jobs[b].dataset
            bound = da.intersection_cardinality(db) / max(len(da), len(db))
            pairs.append(_pair(source.name, a, b, jobs[a].name, jobs[b].name, rounds, shared, bound, True))
        for (a, b), (name_a, name_b, rounds, shared, bound) in reversed(source.pair_history.items()):
            pairs.append(_pair(source.name, a, b, name_a, name_b, rounds, shared, bound, False))
    return pairs


def _pair(source: str, a: str, b: str, name_a: str, name_b: str, rounds: int, shared: int,
          bound: float, live: bool) -> dict[str, Any]:
    return {
        "source": source, "a": a, "b": b, "name_a": name_a, "name_b": name_b, "live": live,
        "rounds": rounds, "shared": shared, "rate": round(shared / rounds, 4) if rounds else None,
        "bound": round(bound, 4),
    }
