"""Issue 19, item 3 ("a cache that fills"): how full joaderd's cache gets with variable-size items.

A `resize:S` (or `max-side:S`) item's size follows from its image's width and height. Before,
a decode was given its source's upper bound (3 x S x 8S for resize) and shrunk when it landed;
with decodes in flight at once the freed tails became holes too small for the next bound, so the
cache evicted long before it was full and decoded some items several times an epoch. This bench
runs one plain job (`JoaderDataset`, items mode, no DataLoader workers) over 2-3 epochs against a
real joaderd (`joader.launch.JoaderdProcess`) for a few (stage, cache size) scenarios, and reads
the Status RPC after every few items and at the end of each epoch.

Data: `--items` (400) photo-like JPEGs of varied sizes and aspect ratios (the demo generator's
content, `joader.client.tools.demo_data`, resized with Pillow to a mix of landscape, portrait, square and
panorama shapes, short sides 120 to 640 px), generated once under $JOADER_BENCH_DATA
(/tmp/joader-bench-data).

Per scenario it reports: decodes per item, the decodes of each epoch after the first (redecodes:
items evicted and needed again), evictions, the items held and the cache's fill (bytes of items
over capacity) and fragmentation at the end of each epoch, and the fill at the last status read
before the first eviction.

Usage:
    python -m bench.system.cache_fill [--items 400] [--epochs 3] [--workers 2] [--label after]

The label names the code measured. Results go to bench/results/cache_fill.json, one entry per
label (other labels' entries are kept), each with the path of the code it ran. To measure
another commit (the "before" of issue 19 item 3 is 38f3a00), run this script with that commit's
packages first on the path (and this repository after them, for `bench`); joaderd and the job
inherit it:

    git worktree add /tmp/before 38f3a00
    mkdir -p /tmp/before-site/joader && ln -s /tmp/before/joader/* /tmp/before-site/joader/
    ln -s /tmp/before/server /tmp/before-site/joader/server
    ln -s /tmp/before/client /tmp/before-site/joader/client
    cd /tmp && PYTHONPATH=/tmp/before-site:/path/to/joader /path/to/joader/.venv/bin/python -m bench.system.cache_fill --label before

(from a directory without a `joader` folder: `python -m joader.server` puts the current
directory first on its path).

`--job` is the job's own entry point (run by the bench as a subprocess, so that the bench process
never holds a gRPC channel).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
DATA_DIR = Path(os.environ.get("JOADER_BENCH_DATA", "/tmp/joader-bench-data"))
MiB = 1 << 20

# (name, stage, cache bytes): the two cases; a cache just larger than the prepared data
# (42.4 MiB of resize:160), which must hold every item; and caches smaller than the data, where
# evictions must start only once the cache is nearly full (8 MiB: 19% of the data, so the first
# epoch runs long past full with a job whose share of the cache is a dozen items).
SCENARIOS = (
    ("resize160-64MiB", "resize:160", 64 * MiB),
    ("resize64-8MiB", "resize:64", 8 * MiB),
    ("resize160-44MiB", "resize:160", 44 * MiB),
    ("resize160-24MiB", "resize:160", 24 * MiB),
    ("resize160-8MiB", "resize:160", 8 * MiB),
)
# Image shapes (aspect width:height) of the varied data, with weights: mostly landscape and
# portrait photos, some squares, a few panoramas and tall strips.
ASPECTS = ((4, 3, 5), (3, 2, 4), (16, 9, 2), (1, 1, 2), (3, 4, 3), (2, 3, 2), (21, 9, 1), (9, 21, 1))
SAMPLE_EVERY = 4  # status reads during an epoch: one after every this many items


def env() -> dict[str, str]:
    out = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        out[var] = "1"
    out.setdefault("PYTHONWARNINGS", "ignore")
    return out


# ----------------------------------------------------------------------------- data


def varied_data(num_items: int, seed: int = 0) -> Path:
    """An ImageFolder of `num_items` photo-like JPEGs of varied sizes (made once, then reused)."""
    from PIL import Image

    from joader.client.tools.demo_data import make_demo_data

    root = DATA_DIR / f"varied-{num_items}-{seed}"
    marker = root / ".complete"
    if marker.exists():
        return root
    base = DATA_DIR / f"demo-{num_items}"
    if not (base / ".complete").exists():
        make_demo_data(base, num_items, progress=False)
        (base / ".complete").touch()
    print(f"generating {num_items} varied JPEGs in {root} ...", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(seed)
    sources = sorted(base.rglob("*.jpg"))
    weights = [w for _, _, w in ASPECTS]
    for index, path in enumerate(sources):
        aw, ah, _ = rng.choices(ASPECTS, weights)[0]
        short = rng.randint(120, 640)
        width, height = (short * aw // ah, short) if aw >= ah else (short, short * ah // aw)
        with Image.open(path) as img:
            picture = img.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
        out = root / path.parent.name / f"img_{index:05d}.jpg"
        out.parent.mkdir(parents=True, exist_ok=True)
        picture.save(out, quality=90)
    marker.touch()
    return root


# ----------------------------------------------------------------------------- the job


def snapshot(status: dict[str, Any], read: int) -> dict[str, Any]:
    cache = status["cache"]
    return {
        "read": read,
        "decoded": status["items_decoded"],
        "evictions": cache["evictions"],
        "items": cache["items"],
        "items_bytes": cache["items_bytes"],
        "used_bytes": cache["used_bytes"],
        "capacity_bytes": cache["capacity_bytes"],
        "largest_free_bytes": cache["largest_free_bytes"],
        "fragmentation": cache["fragmentation"],
        # decodes given exactly their bytes / their stage's bound (absent before exact sizes)
        "exact": status["decodes"].get("exact"),
        "at_bound": status["decodes"].get("at_bound"),
        "sized_first": status["decodes"].get("sized_first"),
    }


def run_job(args: argparse.Namespace) -> int:
    """One plain job: `--epochs` passes over the whole source, status read as it goes."""
    from joader.client.dataset import JoaderDataset
    from joader.client.tools.cli import fetch_status

    dataset = JoaderDataset(args.source, address=args.address, name="cache-fill", return_index=True,
                            batch_size=32, verify=True, threads=1)
    report: dict[str, Any] = {"num_items": len(dataset), "epochs": []}
    sizes: dict[int, int] = {}
    for epoch in range(args.epochs):
        started = time.perf_counter()
        seen: set[int] = set()
        samples = []
        for read, (index, image, _label) in enumerate(dataset, 1):
            seen.add(int(index))
            sizes[int(index)] = image.numel() * image.element_size()
            if read % SAMPLE_EVERY == 0:
                samples.append(snapshot(fetch_status(args.address), read))
        wall_s = time.perf_counter() - started
        end = snapshot(fetch_status(args.address), len(seen))
        report["epochs"].append({"epoch": epoch + 1, "wall_s": round(wall_s, 3), "items_read": len(seen),
                                 "exactly_once": sorted(seen) == list(range(len(dataset))),
                                 "end": end, "samples": samples})
    report["data_bytes"] = sum(sizes.values())
    report["item_bytes_min"] = min(sizes.values())
    report["item_bytes_max"] = max(sizes.values())
    dataset.close()
    Path(args.out).write_text(json.dumps(report))
    return 0


# ----------------------------------------------------------------------------- the bench


def run_scenario(root: Path, name: str, stage: str, cache_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    from joader.launch import JoaderdProcess

    workdir = Path(tempfile.mkdtemp(prefix="jcf-", dir="/tmp"))  # short: sun_path is 108 bytes
    log = workdir / "joaderd.log"
    server = JoaderdProcess.start(
        ["--listen", f"unix:{workdir / 'j.sock'}", "--source", f"photos={root}", "--stage", stage,
         "--cache-size", str(cache_bytes), "--workers", str(args.workers), "--log-level", "INFO"],
        env=env(), stdout=log, ready_timeout_s=120)
    try:
        out = workdir / "job.json"
        job = subprocess.run(
            [sys.executable, "-m", "bench.system.cache_fill", "--job", "--address", server.address, "--source", "photos",
             "--epochs", str(args.epochs), "--out", str(out)],
            env=env(), capture_output=True, text=True, timeout=900)
        if job.returncode != 0:
            raise RuntimeError(f"job failed ({job.returncode}):\n{job.stderr[-3000:]}\n{server.log()[-3000:]}")
        report = json.loads(out.read_text())
    finally:
        server.stop(timeout_s=30)
        shutil.rmtree(workdir, ignore_errors=True)
    return summarize(name, stage, cache_bytes, report)


def summarize(name: str, stage: str, cache_bytes: int, report: dict[str, Any]) -> dict[str, Any]:
    n = report["num_items"]
    epochs = report["epochs"]
    ends = [e["end"] for e in epochs]
    capacity = ends[0]["capacity_bytes"]
    per_epoch = [ends[0]["decoded"]] + [b["decoded"] - a["decoded"] for a, b in zip(ends, ends[1:], strict=False)]
    trace = [s for e in epochs for s in e["samples"]] + ends
    before_eviction = [s for s in trace if s["evictions"] == 0]
    fill_before = max((s["items_bytes"] for s in before_eviction), default=0) / capacity
    first_evicted = next((s for s in trace if s["evictions"] > 0), None)
    return {
        "scenario": name,
        "stage": stage,
        "cache_bytes": cache_bytes,
        "capacity_bytes": capacity,
        "items": n,
        "data_bytes": report["data_bytes"],
        "item_bytes_range": [report["item_bytes_min"], report["item_bytes_max"]],
        "epochs": len(epochs),
        "exactly_once": all(e["exactly_once"] for e in epochs),
        "decodes_total": ends[-1]["decoded"],
        "decodes_per_item": round(ends[-1]["decoded"] / n, 3),
        "decodes_per_epoch": per_epoch,
        "redecodes_per_epoch_after_first": round(sum(per_epoch[1:]) / max(1, len(per_epoch) - 1), 1),
        "evictions": ends[-1]["evictions"],
        "decodes_exact": ends[-1]["exact"],
        "decodes_at_bound": ends[-1]["at_bound"],
        "decodes_sized_first": ends[-1]["sized_first"],
        "fill_before_first_eviction": round(fill_before, 4),
        "first_eviction_after_items_read": None if first_evicted is None else first_evicted["read"],
        "end_of_epoch": [{
            "items_held": e["items"],
            "fill": round(e["items_bytes"] / capacity, 4),
            "used": round(e["used_bytes"] / capacity, 4),
            "fragmentation": e["fragmentation"],
            "largest_free_bytes": e["largest_free_bytes"],
        } for e in ends],
        "epoch_wall_s": [e["wall_s"] for e in epochs],
    }


def describe(result: dict[str, Any]) -> str:
    ends = result["end_of_epoch"]
    last = ends[-1]
    return (f"{result['scenario']}: {result['items']} items, {result['data_bytes'] / MiB:.1f} MiB prepared, cache "
            f"{result['capacity_bytes'] / MiB:.0f} MiB | decodes/item {result['decodes_per_item']}, per epoch "
            f"{result['decodes_per_epoch']}, at bound {result['decodes_at_bound']}, size first {result['decodes_sized_first']}, evictions {result['evictions']} | held {last['items_held']} items, "
            f"fill {last['fill']:.0%}, fragmentation {last['fragmentation']:.0%}, largest free "
            f"{last['largest_free_bytes'] / 1024:.0f} KiB | "
            + (f"fill before first eviction {result['fill_before_first_eviction']:.0%}" if result["evictions"]
               else f"no eviction, fullest {result['fill_before_first_eviction']:.0%}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--label", default="after", help="which code this measures (the results' key)")
    parser.add_argument("--scenario", action="append", help="run only these (by name)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cache_fill.json")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        return run_job(args)
    import joader

    root = varied_data(args.items)
    results = []
    for name, stage, cache_bytes in SCENARIOS:
        if args.scenario and name not in args.scenario:
            continue
        result = run_scenario(root, name, stage, cache_bytes, args)
        print(f"[{args.label}] {describe(result)}", flush=True)
        results.append(result)
    merged: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    merged[args.label] = {
        "code": str(Path(joader.__file__).resolve().parent.parent),
        "command": f"python -m bench.system.cache_fill --items {args.items} --epochs {args.epochs} "
                   f"--workers {args.workers} --label {args.label}",
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
