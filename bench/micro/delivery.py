"""Warm-cache delivery: samples/s from joaderd's cache to one client and to four, beside the raw copy.

A joaderd with a cache that holds the whole dataset is warmed by one epoch of a throw-away job;
then every sample is a cache hit and no decode runs. Measured, 256x256x3 uint8, batch 64, no
emulated step (the job only iterates its DataLoader):
- one client (num_workers 0, the fastest for warm data; and num_workers 2 for comparison):
  samples/s of each epoch, several epochs in one process, the median reported;
- four clients at once: aggregate samples/s (all samples over the span of all four);
- the same with `JoaderDataset(batched=True)` and `DataLoader(batch_size=None)`: each batch is
  copied straight out of shared memory into one tensor, without the per-sample tensors and the
  collate's second copy;
- raw: in this process, copying the same bytes out of the same shared-memory arena (mapped
  read-only, as the client maps it): (1) into one preallocated sample-sized array (it stays in
  the CPU's caches: the reference the targets use); (1b) into one reused batch-sized array (the
  memory-bandwidth limit of filling batches); (2) into a new tensor per sample; (3) plus
  torch.stack of each batch of 64 (the DataLoader's collate).
Targets (the fast-by-default issue): one client with num_workers 0 >= 40% of raw (1), with
num_workers 2 >= 20%; both batched and not are reported. A warm job asks for up to
`BATCHES_PER_REQUEST` whole batches per Next (joader.client.dataset), so a round trip serves
several batches; joaderd's CPU per warm delivered sample is printed.

Usage: python -m bench.micro.delivery [--quick] [--items 2000] [--epochs 10] [--reps 3]
Writes bench/results/delivery[-quick].json and .png and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

from bench.common import (
    IMAGE_SIZE,
    ITEM_NBYTES,
    Server,
    demo_data,
    full_cache_bytes,
    machine,
    median,
    plt,
    print_table,
    run_jobs,
    save_figure,
    simjob_command,
    start_margin_s,
    write_json,
)

# (clients, num_workers, batched)
CASES = ((1, 0, False), (1, 0, True), (1, 2, False), (1, 2, True), (4, 0, False), (4, 0, True))


def raw_copy_rates(arena_path: str, num_items: int, batch_size: int, repeats: int) -> dict[str, float]:
    import torch

    from joader.cache.arena import ArenaReader

    torch.set_num_threads(1)
    reader = ArenaReader(arena_path)
    count = min(num_items, reader.size_bytes // ITEM_NBYTES)
    offsets = [i * ITEM_NBYTES for i in range(count)]
    shape = (3, IMAGE_SIZE, IMAGE_SIZE)
    out = np.empty(shape, np.uint8)

    def preallocated() -> None:
        for offset in offsets:
            reader.copy_into(offset, out)

    batch_out = np.empty((batch_size, *shape), np.uint8)

    def preallocated_batch() -> None:
        # the same copies into one reused batch-sized array: 12 MiB does not stay in the CPU's
        # caches, so this is the memory-bandwidth limit of filling batches (faults excluded)
        for start in range(0, count, batch_size):
            for row, offset in enumerate(offsets[start:start + batch_size]):
                reader.copy_into(offset, batch_out[row])

    def new_tensors() -> None:
        for offset in offsets:
            reader.copy_into(offset, torch.empty(shape, dtype=torch.uint8).numpy())

    def with_collate() -> None:
        for start in range(0, count, batch_size):
            images = [torch.empty(shape, dtype=torch.uint8) for _ in offsets[start:start + batch_size]]
            for image, offset in zip(images, offsets[start:start + batch_size], strict=True):
                reader.copy_into(offset, image.numpy())
            torch.stack(images)

    rates = {}
    for name, fn in (("preallocated", preallocated), ("preallocated_batch", preallocated_batch),
                     ("new_tensor_per_sample", new_tensors),
                     ("new_tensors_and_collate", with_collate)):
        fn()  # fault the pages in
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        rates[name] = round(count / median(times), 1)
    reader.close()
    return rates


def client_rates(address: str, num_clients: int, num_workers: int, epochs: int, batch_size: int,
                 batched: bool = False) -> dict[str, Any]:
    start_at = time.time() + start_margin_s(num_clients)
    reports = run_jobs([simjob_command(f"d{i}", address=address, epochs=epochs, batch_size=batch_size,
                                       num_workers=num_workers, start_at=start_at, batched=batched)
                        for i in range(num_clients)])
    per_epoch = [[e["num_samples"] / e["wall_s"] for e in r["epochs"]] for r in reports]
    # aggregate over the epochs all clients ran at the same time: from the latest first-epoch
    # start to the earliest last-epoch end would drop samples; use each epoch index's span instead
    aggregate = []
    for k in range(epochs):
        epochs_k = [r["epochs"][k] for r in reports]
        span = max(e["ended_at"] for e in epochs_k) - min(e["started_at"] for e in epochs_k)
        aggregate.append(sum(e["num_samples"] for e in epochs_k) / span)
    cpu = sum(e["cpu_s"] for r in reports for e in r["epochs"])
    samples = sum(e["num_samples"] for r in reports for e in r["epochs"])
    return {
        "num_clients": num_clients, "num_workers": num_workers, "batched": batched,
        "per_client_epoch_samples_per_s": [[round(x, 1) for x in p] for p in per_epoch],
        "aggregate_per_epoch": [round(x, 1) for x in aggregate],
        # the first epoch includes DataLoader start-up; later epochs are steady state
        "aggregate_samples_per_s": round(median(aggregate[1:] if epochs > 1 else aggregate), 1),
        "client_cpu_ms_per_sample": round(1000 * cpu / samples, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="600 images, one repetition")
    parser.add_argument("--items", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--reps", type=int)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    n = args.items or (600 if args.quick else 2000)
    epochs = args.epochs or 10
    reps = args.reps or (1 if args.quick else 3)
    name = "delivery-quick" if args.quick else "delivery"
    root = demo_data(n)
    info = machine()
    runs: list[dict[str, Any]] = []
    raws: list[dict[str, float]] = []
    with Server(root, full_cache_bytes(n), workers=2) as server:
        run_jobs([simjob_command("warmup", address=server.address, batch_size=args.batch_size)])
        warm = server.status()
        print(f"warm-up: {warm['items_decoded']} decoded, cache holds {warm['cache']['items']} items", flush=True)
        decoded_before = warm["items_decoded"]
        server_cpu_before = server.cpu_s()
        for rep in range(reps):
            raw = raw_copy_rates(server.arena_path, n, args.batch_size, 5)
            raws.append(raw)
            for clients, workers, reuse in CASES:
                result = client_rates(server.address, clients, workers, epochs, args.batch_size, reuse)
                result["rep"] = rep
                result["raw_preallocated"] = raw["preallocated"]
                result["fraction_of_raw"] = round(result["aggregate_samples_per_s"] / raw["preallocated"], 4)
                result["fraction_of_raw_batch"] = round(result["aggregate_samples_per_s"] / raw["preallocated_batch"], 4)
                runs.append(result)
                print(f"rep {rep}: {clients} client(s), num_workers {workers}{', batched' if reuse else ''}: "
                      f"{result['aggregate_samples_per_s']:.0f} samples/s ({result['fraction_of_raw']:.1%} of raw "
                      f"{raw['preallocated']:.0f}/s)", flush=True)
        server_cpu = server.cpu_s() - server_cpu_before
        status = server.status()
    info["loadavg_at_end"] = list(os.getloadavg())
    delivered = status["items_delivered"] - warm["items_delivered"]

    def pick(clients: int, workers: int, reuse: bool, key: str) -> float:
        return median([r[key] for r in runs if r["num_clients"] == clients and r["num_workers"] == workers
                       and r["batched"] == reuse])

    table = [
        {"case": f"{c} client{'s' if c > 1 else ''}, num_workers {w}{', batched' if m else ''}",
         "num_clients": c, "num_workers": w, "batched": m,
         "samples_per_s": pick(c, w, m, "aggregate_samples_per_s"),
         "fraction_of_raw": pick(c, w, m, "fraction_of_raw"),
         "fraction_of_raw_batch": pick(c, w, m, "fraction_of_raw_batch"),
         "client_cpu_ms_per_sample": pick(c, w, m, "client_cpu_ms_per_sample")}
        for c, w, m in CASES
    ]
    raw = {k: median([r[k] for r in raws]) for k in raws[0]}
    print(f"\ndelivery: {n} items of {IMAGE_SIZE}x{IMAGE_SIZE}x3 in a warm cache, batch {args.batch_size}, "
          f"{epochs} epochs per client, {reps} repetition(s)")
    print_table(["case", "samples/s", "of raw (1)", "of raw batch (1b)", "client cpu ms/sample"],
                [[t["case"], t["samples_per_s"], f"{t['fraction_of_raw']:.1%}", f"{t['fraction_of_raw_batch']:.1%}",
                  t["client_cpu_ms_per_sample"]] for t in table])
    print_table(["raw copy in one process", "samples/s", "GB/s"],
                [[k, v, round(v * ITEM_NBYTES / 1e9, 2)] for k, v in raw.items()])
    print(f"server CPU during the measured runs: {1000 * server_cpu / max(1, delivered):.3f} ms per delivered "
          f"sample; decodes after warm-up: {status['items_decoded'] - decoded_before}")
    def case(workers: int, batched: bool) -> dict[str, Any]:
        return next(t for t in table if t["num_clients"] == 1 and t["num_workers"] == workers
                    and t["batched"] == batched)

    checks = {}
    for workers, target in ((0, 0.40), (2, 0.20)):
        for batched in (False, True):
            t = case(workers, batched)
            checks[f"one_client_w{workers}{'_batched' if batched else ''}_fraction_of_raw"] = {
                "measured": t["fraction_of_raw"], "target": target, "ok": t["fraction_of_raw"] >= target}
    for key, check in checks.items():
        print(f"check {key}: {check}")
    data = {"machine": info, "num_items": n, "batch_size": args.batch_size, "epochs": epochs, "reps": reps,
            "table": table, "raw": raw, "raw_reps": raws, "runs": runs,
            "server_cpu_ms_per_sample": round(1000 * server_cpu / max(1, delivered), 4),
            "decodes_after_warmup": status["items_decoded"] - decoded_before, "checks": checks,
            "command": "python -m bench.micro.delivery" + (" --quick" if args.quick else "")}
    print(f"wrote {write_json(name, data)}")
    plot(name, data)
    return 0


def plot(name: str, data: dict[str, Any]) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(8, 4.2))
    labels = [t["case"] for t in data["table"]] + [f"raw: {k.replace('_', ' ')}" for k in data["raw"]]
    values = [t["samples_per_s"] for t in data["table"]] + list(data["raw"].values())
    colors = ["C0"] * len(data["table"]) + ["C7"] * len(data["raw"])
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels)
    ax.invert_yaxis()
    ax.axvline(0.4 * data["raw"]["preallocated"], color="r", linestyle="--", label="40% of raw copy")
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:,.0f}", va="center")
    ax.set_xlabel(f"samples/s (256x256x3 uint8, batch {data['batch_size']})")
    ax.set_title("Warm-cache delivery vs. copying the same bytes out of shared memory")
    ax.legend(loc="lower right")
    save_figure(fig, name)


if __name__ == "__main__":
    sys.exit(main())
