"""The cache's books at ImageNet scale (issue 37): refcount changes and memory per cached item.

Calls `ItemCache` in-process, no joaderd: N items are decoded into the cache through its real
path (want, dispatch to a fake pool, file_result, release), then:

- an epoch boundary: `add_refcount(source, dataset, +1)` over a job's whole dataset (a 640k
  half of the items at 1.28M, all of them at 128k), and the first victim after it;
- a close: `add_refcount(source, remaining, -1)` over the same ids;
- evictions: 1,000 victims chosen and evicted one by one after the boundary (plain RefCnt);
- memory: the main process's RSS per cached item (bytes beyond the arrays counted too), and its
  growth after `--jobs` jobs each received every item once;
- `--registry`: the same cache inside a `Registry`, and an attach and a close of a job over
  the dataset (`Registry.attach`, `Registry.remove_job`): a first job, a second beside it.

    .venv/bin/python -m bench.micro.cache_books --items 128000
    .venv/bin/python -m bench.micro.cache_books --items 1281167 --half
    .venv/bin/python -m bench.micro.cache_books --items 1281167 --half --registry

CPU times (time.process_time) are what count: the machine is shared.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
from pyroaring import BitMap

from joader.server.books.item_cache import ItemCache
from joader.server.books.records import Source
from joader.server.registry.registry import Registry, RegistryConfig
from joader.sources.imagefolder import SourceListing
from joader.stages import ItemSpec


class _Stage:
    name = "fixed:16"
    spec = ItemSpec.fixed((16, 16, 3), "uint8")


class _Pool:
    """Takes every task at once; `finish` files them all."""

    num_workers = 1

    def __init__(self) -> None:
        self.tasks: list[tuple[int, int]] = []

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    def submit(self, task_id: int, source_index: int, item_id: int, offset: int, capacity: int) -> None:
        self.tasks.append((task_id, capacity))


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _fill(num_items: int, registry: Registry | None = None) -> tuple[ItemCache, Source]:
    if registry is None:
        listing = SimpleNamespace(paths=range(num_items), labels=np.zeros(num_items, np.int64))
        source = Source("scale", listing, _Stage(), 0, seed=1)
        cache = ItemCache(num_items * 1024, retry_failed_s=60.0, clock=lambda: 0.0)
    else:
        source, cache = registry.source("scale"), registry.cache
    nbytes = _Stage.spec.max_nbytes
    pool = _Pool()
    chunk = 10_000
    for start in range(0, num_items, chunk):
        ids = range(start, min(num_items, start + chunk))
        for item_id in ids:
            cache.want(source, item_id, item_id, consumed=False, due_s=float(item_id))
        cache.dispatch(pool, 1 << 30, lambda s: 0)
        for key, _ in pool.tasks:
            # a shape and a dtype of their own per result, as a decode result's message gives them
            cache.file_result(key, True, None, 0.0, lambda item: 0, shape=tuple([16, 16, 3]), dtype="".join("uint8"),
                              nbytes=int(str(nbytes)), checksum=key * 2654435761 % (1 << 32))
            cache.release(key)
        pool.tasks.clear()
    return cache, source


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.process_time()
    fn()
    return time.process_time() - start


def _deliver(cache: ItemCache, job_id: str, keys: list[int]) -> None:
    items = cache.items
    deliver = getattr(cache, "deliver", None)
    for key in keys:
        item = items[key]
        if deliver is not None:
            deliver(job_id, key)
        else:  # the code before issue 37: a set per item
            if job_id not in item.served:
                item.served.add(job_id)


def _registry(num_items: int) -> Registry:
    listing = SourceListing(root=Path("/nonexistent"), classes=("a",), class_to_idx={"a": 0},
                            paths=tuple(f"a/{i:07d}.jpg" for i in range(num_items)),
                            labels=np.zeros(num_items, np.int32))
    source = Source("scale", listing, _Stage(), 0, seed=1)
    return Registry([source], num_items * 1024, _Pool(), RegistryConfig(start_grace_s=0.0), time.monotonic)


def _attach_close(registry: Registry, dataset: BitMap) -> None:
    registry.source("scale").fingerprint  # noqa: B018 (computed once, at the first attach ever)
    for name in ("first", "second"):
        start = time.process_time()
        registry.attach("scale", dataset, name, 64, seed=1)
        attach_s = time.process_time() - start
        print(f"attach of job {name} ({len(dataset)} ids) {attach_s * 1000:9.1f} ms CPU")
    for job_id in list(registry.jobs.jobs):
        start = time.process_time()
        registry.remove_job(job_id, "bench")
        print(f"close of a job ({len(dataset)} ids)      {(time.process_time() - start) * 1000:9.1f} ms CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=128_000)
    parser.add_argument("--half", action="store_true", help="the job's dataset is every second item")
    parser.add_argument("--jobs", type=int, default=8, help="jobs that each receive every item once")
    parser.add_argument("--registry", action="store_true", help="time an attach and a close in a Registry")
    args = parser.parse_args()
    registry = _registry(args.items) if args.registry else None
    base = _rss()
    start = time.process_time()
    cache, source = _fill(args.items, registry)
    fill_s = time.process_time() - start
    rss_filled = _rss()
    n = len(cache.policy)
    print(f"{n} items cached in {fill_s:.1f} s CPU; RSS {(rss_filled - base) / n:.0f} bytes per cached item")
    dataset = BitMap(range(0, args.items, 2)) if args.half else BitMap(range(args.items))
    if registry is not None:
        _attach_close(registry, dataset)
        return
    figures = {
        "epoch boundary (+1)": _timed(lambda: cache.add_refcount(source, dataset, 1)),
        "first victim after it": _timed(lambda: cache.policy.victim()),
        "1000 evictions": _timed(lambda: [cache._evict(cache.policy.victim()) for _ in range(1000)]),
        "close (-1)": _timed(lambda: cache.add_refcount(source, dataset & source.cached_ids, -1)),
        "first victim after the close": _timed(lambda: cache.policy.victim()),
    }
    for name, seconds in figures.items():
        print(f"{name:32s} {seconds * 1000:9.1f} ms CPU  ({len(dataset)} ids)")
    keys = np.array(sorted(cache.items), dtype=np.int64)  # 8 bytes a key, not a list of ints
    before = _rss()
    start = time.process_time()
    for j in range(args.jobs):
        _deliver(cache, f"job-{j}", keys.tolist())
    per = (time.process_time() - start) / (args.jobs * len(keys)) * 1e6
    after = _rss()
    print(f"{args.jobs} jobs each served every item: RSS +{(after - before) / 2**20:.1f} MiB "
          f"({(after - before) / len(keys):.0f} bytes per cached item), {per:.2f} us CPU per delivery book")
    print(f"RSS per cached item after: {(after - base) / len(keys):.0f} bytes")


if __name__ == "__main__":
    main()
