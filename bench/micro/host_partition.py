"""Issue 20's statistics: a fixed host partition against a new one each epoch, and against one
global shuffle (DistributedSampler's), by simulation (numpy, no joaderd).

A job of W ranks on H hosts reads N items of C classes (an ImageFolder's labels, sorted by
class: the order a keyed hash must break). Per epoch each scheme gives every rank its items in
order; a global batch is the ranks' next B/W items each. Three schemes:

- fixed: `joader.sampling.hosts.host_part` once (the source's keyed order, cut per rank), each
  host's part shuffled uniformly every epoch and dealt round-robin to its ranks (what each
  host's joaderd does);
- per epoch: the same, but the keyed order re-drawn every epoch (a new partition per epoch,
  what a `host_shuffle="epoch"` would do);
- global: one uniform permutation of all N per epoch, cut into W contiguous chunks
  (DistributedSampler with shuffle=True).

Figures (means over `--epochs` epochs and `--trials` runs):
- same host next epoch: the share of items read on the same host in consecutive epochs (what a
  host's cache can reuse across epochs: fixed 1; otherwise 1/H);
- same rank next epoch: the same for ranks;
- class spread: the standard deviation of one class's count in a global batch, against the
  binomial-like spread of a uniform global shuffle (stratified batches are, if anything, more even);
- pair co-occurrence: how often two items share a global batch when they are in the same host
  part / in different parts in an epoch, over the rate of a uniform shuffle cut into the same
  whole batches, S B (B - 1) / (N (N - 1)): 1.0 is "as a global shuffle".

    python -m bench.micro.host_partition
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
from pyroaring import BitMap

from bench.common import print_table, write_json
from joader.sampling.hosts import HostLayout, host_part


def _host_parts(n: int, sizes: list[int], salt: int) -> list[np.ndarray]:
    world, first, parts = sum(sizes), 0, []
    for local in sizes:
        parts.append(np.fromiter(host_part(BitMap(range(n)), salt, HostLayout(world, first, local, 0), drop_last=True),
                                 dtype=np.int64))
        first += local
    return parts


def _epoch_ranks(scheme: str, n: int, sizes: list[int], rng: np.random.Generator, fixed: list[np.ndarray]
                 ) -> list[np.ndarray]:
    """Each rank's items, in order, for one epoch."""
    world = sum(sizes)
    per = n // world
    if scheme == "global":
        order = rng.permutation(n)
        return [order[r * per:(r + 1) * per] for r in range(world)]
    parts = fixed if scheme == "fixed" else _host_parts(n, sizes, int(rng.integers(1 << 62)))
    ranks = []
    for part, local in zip(parts, sizes, strict=True):
        order = rng.permutation(part)
        ranks += [order[k::local][:per] for k in range(local)]
    return ranks


def measure(scheme: str, n: int, sizes: list[int], classes: int, batch: int, epochs: int, trials: int,
            seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    world = sum(sizes)
    per_rank_batch = batch // world
    labels = np.arange(n) * classes // n  # sorted by class, as an ImageFolder lists them
    host_of_rank = np.repeat(np.arange(len(sizes)), sizes)
    fixed = _host_parts(n, sizes, 12345)
    fixed_host = np.empty(n, dtype=np.int64)
    for h, part in enumerate(fixed):
        fixed_host[part] = h
    same_host = same_rank = 0.0
    pairs = 0
    class_counts: list[int] = []
    co_same = co_diff = tot_same = tot_diff = 0.0
    for _ in range(trials):
        last_host = last_rank = None
        for _ in range(epochs):
            ranks = _epoch_ranks(scheme, n, sizes, rng, fixed)
            host = np.full(n, -1)
            rank = np.full(n, -1)
            for r, items in enumerate(ranks):
                host[items] = host_of_rank[r]
                rank[items] = r
            if last_host is not None:
                read = (host >= 0) & (last_host >= 0)
                same_host += float(np.mean(host[read] == last_host[read]))
                same_rank += float(np.mean(rank[read] == last_rank[read]))
                pairs += 1
            last_host, last_rank = host, rank
            steps = min(len(items) for items in ranks) // per_rank_batch
            for s in range(steps):
                members = np.concatenate([items[s * per_rank_batch:(s + 1) * per_rank_batch] for items in ranks])
                class_counts.append(int(np.sum(labels[members] == 0)))
                part_of = fixed_host[members]
                same = np.equal.outer(part_of, part_of)
                np.fill_diagonal(same, False)
                co_same += same.sum() / 2
                co_diff += (len(members) * (len(members) - 1) / 2) - same.sum() / 2
            # the pairs that could meet this epoch (each meets in at most one batch of it)
            sizes_parts = np.array([len(p) for p in fixed], dtype=float)
            tot_same += float(np.sum(sizes_parts * (sizes_parts - 1) / 2))
            tot_diff += float((sizes_parts.sum() ** 2 - np.sum(sizes_parts ** 2)) / 2)
    steps = (n // world) // per_rank_batch  # whole global batches per epoch
    uniform = steps * batch * (batch - 1) / (n * (n - 1))  # P(a pair meets) under a uniform shuffle
    return {
        "same_host_next_epoch": round(same_host / pairs, 4),
        "same_rank_next_epoch": round(same_rank / pairs, 4),
        "class0_count_sd": round(float(np.std(class_counts)), 4),
        "co_occurrence_same_part": round(co_same / tot_same / uniform, 4),
        "co_occurrence_other_part": round(co_diff / tot_diff / uniform, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--layout", default="4,4", help="ranks per host, comma-separated")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="the global batch (W x per-rank)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.layout.split(",")]
    started = time.monotonic()
    results: dict[str, Any] = {}
    for scheme in ("fixed", "per epoch", "global"):
        results[scheme] = measure(scheme, args.items, sizes, args.classes, args.batch, args.epochs, args.trials, 7)
    print(f"{args.items} items of {args.classes} classes, ranks per host {sizes}, global batch {args.batch}, "
          f"{args.epochs} epochs x {args.trials} runs:")
    keys = list(next(iter(results.values())))
    print_table(["scheme", *keys], [[scheme, *(r[k] for k in keys)] for scheme, r in results.items()])
    data = {"command": "python -m bench.micro.host_partition " + " ".join(argv or sys.argv[1:]), "items": args.items,
            "layout": sizes, "classes": args.classes, "batch": args.batch, "epochs": args.epochs,
            "trials": args.trials, "results": results, "elapsed_s": round(time.monotonic() - started, 1)}
    print(f"\nwrote {write_json('host_partition', data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
