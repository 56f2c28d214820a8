"""The cache's books at ImageNet scale (issue 37): refcount changes and memory per cached item.

Calls `ItemCache` in-process, no joaderd: N items are decoded into the cache through its real
path (want, dispatch to a fake pool, file_result, release), then:

- an epoch boundary: `add_refcount(source, dataset, +1)` over a job's whole dataset (a 640k
  half of the items at 1.28M, all of them at 128k), and the first victim after it;
- a close: `add_refcount(source, remaining, -1)` over the same ids;
- evictions: 1,000 victims chosen and evicted one by one after the boundary (plain RefCnt);
- memory: the main process's RSS per cached item (bytes beyond the arrays counted too), and its
  growth after `--jobs` jobs each received every item once.

    .venv/bin/python -m bench.cache_books --items 128000
    .venv/bin/python -m bench.cache_books --items 1281167 --half

CPU times (time.process_time) are what count: the machine is shared.
"""

from __future__ import annotations

import argparse
import gc
import time
from types import SimpleNamespace

import numpy as np
import psutil
from pyroaring import BitMap

from joader.server.item_cache import ItemCache
from joader.server.records import Source
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


def _fill(num_items: int) -> tuple[ItemCache, Source]:
    listing = SimpleNamespace(paths=range(num_items), labels=np.zeros(num_items, np.int64))
    source = Source("scale", listing, _Stage(), 0, seed=1)
    nbytes = _Stage.spec.max_nbytes
    cache = ItemCache(num_items * 1024, retry_failed_s=60.0, clock=lambda: 0.0)
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


def _deliver(cache: ItemCache, job_id: str, keys: range) -> None:
    items = cache.items
    deliver = getattr(cache, "deliver", None)
    for key in keys:
        item = items[key]
        if deliver is not None:
            deliver(job_id, key)
        else:  # the code before issue 37: a set per item
            if job_id not in item.served:
                item.served.add(job_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=128_000)
    parser.add_argument("--half", action="store_true", help="the job's dataset is every second item")
    parser.add_argument("--jobs", type=int, default=8, help="jobs that each receive every item once")
    args = parser.parse_args()
    base = _rss()
    fill_s = _timed(lambda: None)
    start = time.process_time()
    cache, source = _fill(args.items)
    fill_s = time.process_time() - start
    rss_filled = _rss()
    n = len(cache.policy)
    print(f"{n} items cached in {fill_s:.1f} s CPU; RSS {(rss_filled - base) / n:.0f} bytes per cached item")
    dataset = BitMap(range(0, args.items, 2)) if args.half else BitMap(range(args.items))
    figures = {
        "epoch boundary (+1)": _timed(lambda: cache.add_refcount(source, dataset, 1)),
        "first victim after it": _timed(lambda: cache.policy.victim()),
        "1000 evictions": _timed(lambda: [cache._evict(cache.policy.victim()) for _ in range(1000)]),
        "close (-1)": _timed(lambda: cache.add_refcount(source, dataset & source.cached_ids, -1)),
        "first victim after the close": _timed(lambda: cache.policy.victim()),
    }
    for name, seconds in figures.items():
        print(f"{name:32s} {seconds * 1000:9.1f} ms CPU  ({len(dataset)} ids)")
    keys = range(min(cache.items), min(cache.items) + len(cache.items))
    keys = [k for k in keys if k in cache.items]
    before = _rss()
    start = time.process_time()
    for j in range(args.jobs):
        _deliver(cache, f"job-{j}", keys)  # type: ignore[arg-type]
    per = (time.process_time() - start) / (args.jobs * len(keys)) * 1e6
    after = _rss()
    print(f"{args.jobs} jobs each served every item: RSS +{(after - before) / 2**20:.1f} MiB "
          f"({(after - before) / len(keys):.0f} bytes per cached item), {per:.2f} us CPU per delivery book")
    print(f"RSS per cached item after: {(after - base) / len(keys):.0f} bytes")


if __name__ == "__main__":
    main()
