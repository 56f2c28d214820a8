"""The control plane at ImageNet scale (issue 37): joaderd's main-process CPU, waits and memory per item.

Question: what does joaderd's MAIN process (one Python process under one GIL) cost per item when
the source has ImageNet's 1,281,167 items (or a 128k subset), for 1-16 jobs, decoding and warm?

The data (`bench.system.scale_data`): an ImageFolder of N tiny distinct JPEGs (24-40 px) in 1,000
classes, served with `--image-size 16` so decoding is cheap and the control plane shows. Each
image's colours encode its class and its place in the class, so every delivered batch is checked
by a pixel oracle (mean colours -> exactly one item, and its label) without decoding the file
again; the oracle's power is checked at the start on real stage outputs (each sample passes for
its own index and fails for its neighbours, its class-mates and random others). Every job's
epoch is checked exactly-once (a partial epoch: at most once, only its own items).

Measured (each a function, all written to bench/results/scale-<items>[-quick].json):
- start-up: joaderd's ready time (launch to ready file) and its main RSS / RssAnon;
- epochs (the issue's "must show"): J batched jobs (default 4) x E epochs (3) over all items, a
  cache that holds them all, the jobs started together at each epoch (a barrier). Per epoch:
  joaderd's main-process CPU (psutil cpu_times user+system of joaderd's pid only, without its
  decode workers), sampled right before and after the epoch, per decode and per delivery; the
  workers' CPU share and the main process's cores; each job's wait for its epoch's first batch
  and its longest wait for any batch, and at which batch. The epoch-boundary stall of the issue
  comes in the LAST batches of an epoch (batch 1,995 or 1,996 of 2,000 at 128k, every job at
  once), when joaderd starts the job's next epoch ahead of it, not at the next epoch's first
  batch (queued before the boundary): the longest wait of epochs 2-3 is the figure to compare;
  main RssAnon per cached item (delta from start-up); a Status call's latency with the jobs
  still attached;
- status: latency of a Status call (in-process gRPC) with every item cached, median of 5; and
  `joader status --json` as a user runs it (a new process), at start-up and after the phases;
- attach: a job over half the items: attach (construction), first batch, close, and until
  joaderd's status no longer lists it; with the main CPU each cost;
- rates: deliveries/s and main CPU per delivery for 1, 4, 8 and 16 batched jobs over all
  items, warm, each for a window of `--window-s`;
- halves: a second joaderd with a 20% cache, 16 jobs each over its own random half, for a
  window: deliveries/s, decodes, main CPU per delivery, and joaderd's counted round sharing per
  pair beside two bounds: the pair's Theorem 1 bound (|D1 n D2| / max(|D1|, |D2|) = 0.5) and
  what joader's DependentSampler itself gives these 16 datasets with every job in every round
  (`sampler_lockstep`: per-pair shared rounds and deliveries per distinct item, no cache, no
  pacing; with 16 random halves DSA shares almost nothing round by round, so that, not 0.5 nor
  the epoch ideal of 16 x n/2 / |union| = 8 deliveries per decode, is what joaderd can match);
- decoding (not in the default phases): J jobs from a cold cache for a window, for the 1.28M
  tree whose whole decoding epoch takes tens of minutes today: main CPU per decode and per
  delivery, the workers' and the main process's cores.
The client process's own CPU per delivery is recorded beside joaderd's (`client_us_per_delivery`):
when the main process is not busy, the clients or the machine were the limit of a wall rate.

Jobs are `JoaderDataset(..., batched=True, return_index=True)` in threads of ONE client process
(`python -m bench.system.scale --phase ...`, one torch import for all jobs); this driver process never
holds a gRPC channel (it starts joaderd, then the client process). The machine has 2 cores and
is shared: CPU per item is the figure, wall rates only say how this machine did.

Usage: python -m bench.system.scale [--items 128000] [--quick] [--reps 3] [--data DIR]
                             [--phases startup,epochs,status,attach,rates,halves] [--window-s 20]
The 1.28M tree (start-up, a 3-minute cold window of 4 jobs, status, attach):
       python -m bench.system.scale --reps 1 --phases decoding,status,attach --window-s 180
Writes bench/results/scale-<items>[-quick].json and prints a table per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import bench_env, machine, median, print_table, write_json
from bench.system.scale_client import (
    BATCH,
    IMAGE_SIZE,
    RATE_JOBS,
    SOURCE,
    client_main,
    main_cpu_s,
    memory,
    random_halves,
    sampler_lockstep,
)
from bench.system.scale_data import IMAGENET_ITEMS, Layout, check_batch, make_tree, sample_means
from joader.launch import JoaderdProcess

ITEM_NBYTES = 3 * IMAGE_SIZE * IMAGE_SIZE
PHASES = ("startup", "epochs", "decoding", "status", "attach", "rates", "halves")


# ----------------------------------------------------------------------------- joaderd's process

def start_joaderd(root: Path, cache_bytes: int, workers: str, log: Path,
                  fronts: str = "auto") -> tuple[JoaderdProcess, float]:
    """joaderd serving `root` as `imagenet` at S=16; returns it and its launch-to-ready seconds."""
    sock = Path(tempfile.mkdtemp(prefix="jsc-", dir="/tmp")) / "j.sock"
    args = ["--listen", f"unix:{sock}", "--source", f"{SOURCE}={root}", "--image-size", str(IMAGE_SIZE),
            "--cache-size", str(cache_bytes), "--workers", workers, "--fronts", fronts, "--log-level", "INFO"]
    started = time.perf_counter()
    proc = JoaderdProcess.start(args, env=bench_env(), stdout=log, ready_timeout_s=600)
    return proc, time.perf_counter() - started


# ----------------------------------------------------------------------------- driver

def run_client(phase: str, joaderd: JoaderdProcess, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """One client process for `phase`; its JSON."""
    with tempfile.TemporaryDirectory(prefix="jscc-") as tmp:
        out = Path(tmp) / "out.json"
        command = [sys.executable, "-m", "bench.system.scale", "--phase", phase, "--address", joaderd.address,
                   "--pid", str(joaderd.pid), "--items", str(args.items), "--out", str(out),
                   "--jobs", str(extra.get("jobs", args.jobs)), "--epochs", str(extra.get("epochs", args.epochs)),
                   "--reps", str(extra.get("reps", args.reps)), "--window-s", str(args.window_s)]
        started = time.perf_counter()
        done = subprocess.run(command, env=bench_env(), capture_output=True, text=True, timeout=7200)
        if done.returncode != 0:
            raise RuntimeError(f"phase {phase} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        result = json.loads(out.read_text())
        result["phase_wall_s"] = round(time.perf_counter() - started, 1)
        return result


def check_listing(root: Path, layout: Layout) -> dict[str, Any]:
    """joader's own listing of the tree: 1,000 classes, and item i's label is layout's."""
    from joader.sources.imagefolder import list_image_folder

    started = time.perf_counter()
    listing = list_image_folder(root)
    seconds = time.perf_counter() - started
    ok = len(listing.classes) == 1000 and len(listing.paths) == layout.n and bool(
        (listing.labels == layout.labels).all())
    if not ok:
        raise SystemExit(f"{root}: joader lists {len(listing.classes)} classes, {len(listing.paths)} items; "
                         f"expected 1000 and {layout.n} with the layout's labels: remove the tree and run again")
    return {"listing_s": round(seconds, 2), "classes": len(listing.classes), "items": len(listing.paths)}


def oracle_power(root: Path, layout: Layout, samples: int, seed: int = 0) -> dict[str, Any]:
    """Real files through joaderd's stage: each passes for itself and fails for its neighbours
    (i +- 1), a class-mate, the same place in another class, and a random other item."""
    from joader.stages import build_stage

    rng = np.random.default_rng(seed)
    ids = rng.choice(layout.n, min(samples, layout.n), replace=False)
    result: dict[str, Any] = {"samples": len(ids)}
    for decoder in ("turbo", "pil"):
        stage = build_stage("center-crop", size=IMAGE_SIZE, decoder=decoder)
        images = np.stack([stage.prepare((root / _path(layout, int(i))).read_bytes(), "") for i in ids])
        own = len(check_batch(layout, ids, layout.labels[ids], images))
        error = float(np.abs(sample_means(images) - layout.expected(ids)).max())
        decoded = float((layout.decode(sample_means(images)) == ids).mean())
        others = _others(layout, ids, rng)
        passed_wrong = {name: int(len(ids) - len(check_batch(layout, o, layout.labels[o], images)))
                        for name, o in others.items()}
        result[decoder] = {"own_failures": own, "max_channel_error": round(error, 2), "decoded_exactly": decoded,
                           "wrong_index_passes": passed_wrong}
        if own or any(passed_wrong.values()) or decoded < 1.0:
            raise SystemExit(f"the pixel oracle is not sound on this tree ({decoder}): {result[decoder]}; "
                             "fix bench/system/scale_data.py's encoding or tolerance")
    return result


def _others(layout: Layout, ids: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    klass = layout.labels[ids].astype(np.int64)
    j = ids - layout.offsets[klass]
    mate = layout.offsets[klass] + (j + 1 + rng.integers(0, layout.sizes[klass] - 1)) % layout.sizes[klass]
    other_class = (klass + 1 + rng.integers(0, 999, len(ids))) % 1000
    same_place = layout.offsets[other_class] + np.minimum(j, layout.sizes[other_class] - 1)
    shift = rng.integers(1, layout.n, len(ids))
    return {"next": (ids + 1) % layout.n, "previous": (ids - 1) % layout.n, "class_mate": mate,
            "same_place_other_class": same_place, "random": (ids + shift) % layout.n}


def _path(layout: Layout, i: int) -> str:
    klass = int(layout.labels[i])
    return f"c{klass:04d}/{i - int(layout.offsets[klass]):05d}.JPEG"


def warm_page_cache(root: Path, layout: Layout) -> float:
    """Reads every file once (cold disk reads are not the control plane's cost)."""
    started = time.perf_counter()
    for i in range(layout.n):
        (root / _path(layout, i)).read_bytes()
    return round(time.perf_counter() - started, 1)


def run_server(root: Path, cache_bytes: int, args: argparse.Namespace, phases: Sequence[str],
               log: Path) -> dict[str, Any]:
    """One joaderd: start-up, then each client phase against it; stopped at the end."""
    joaderd, ready_s = start_joaderd(root, cache_bytes, args.workers, log, args.fronts)
    try:
        out: dict[str, Any] = {"startup": {"ready_s": round(ready_s, 2), **memory(joaderd.pid),
                                           "main_cpu_s": round(main_cpu_s(joaderd.pid), 2)}}
        print(f"  joaderd ready in {ready_s:.2f} s, RSS {out['startup']['VmRSS'] / 2**20:.0f} MiB", flush=True)
        out["startup"]["cli_status_s"] = cli_status_s(joaderd.address)
        for phase in phases:
            out[phase] = run_client(phase, joaderd, args)
            print(f"  {phase}: done in {out[phase]['phase_wall_s']} s", flush=True)
        if phases:
            out["cli_status_s"] = cli_status_s(joaderd.address)
        return out
    finally:
        joaderd.stop(timeout_s=60)
        shutil.rmtree(Path(joaderd.address.removeprefix("unix:")).parent, ignore_errors=True)


def cli_status_s(address: str, calls: int = 3) -> float:
    """Median wall time of `joader status --json` as a user runs it (a new Python process:
    its start-up is most of it when the call itself is fast). From this driver, which holds no
    gRPC channel."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "status", "--json", "--address", address],
                       capture_output=True, check=True, env=bench_env(), timeout=120)
        times.append(time.perf_counter() - started)
    return round(median(times), 3)


def one_rep(root: Path, layout: Layout, args: argparse.Namespace, phases: Sequence[str], rep: int) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="jscl-", dir="/tmp"))
    full = [p for p in phases if p in ("epochs", "decoding", "status", "attach", "rates")]
    out = run_server(root, layout.n * ITEM_NBYTES + 4096 * ITEM_NBYTES, args, full, log_dir / f"full-{rep}.log")
    if "halves" in phases:
        small = run_server(root, layout.n * ITEM_NBYTES // 5, args, ["halves"], log_dir / f"halves-{rep}.log")
        out["halves"] = small["halves"]
        out["halves"]["sampler_lockstep"] = sampler_lockstep(random_halves(layout.n), 500 if args.quick else 2000)
    return out


def _per_decode(epoch: dict[str, Any], per_delivery: str) -> float | None:
    """A per-delivery figure of an epoch, per decode instead."""
    if epoch.get(per_delivery) is None or not epoch["decodes"]:
        return None
    return float(epoch[per_delivery] * epoch["deliveries"] / epoch["decodes"])


def summarize(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's headline figures, medians over reps."""
    def med(get: Any) -> float | None:
        values = [v for v in (get(r) for r in reps) if v is not None]
        if not values:
            return None
        value = median(values)
        return round(value, 4) if abs(value) < 10 else round(value, 1)

    out: dict[str, Any] = {"reps": len(reps), "ready_s": med(lambda r: r["startup"]["ready_s"]),
                           "ready_rss_mib": med(lambda r: r["startup"]["VmRSS"] / 2**20)}
    if "epochs" in reps[0]:
        out.update(
            epoch1_main_us_per_decode=med(lambda r: r["epochs"]["epochs"][0]["main_us_per_decode"]),
            epoch1_main_us_per_delivery=med(lambda r: r["epochs"]["epochs"][0]["main_us_per_delivery"]),
            epoch1_workers_cores=med(lambda r: r["epochs"]["epochs"][0]["workers_cores"]),
            epoch1_main_cores=med(lambda r: r["epochs"]["epochs"][0]["main_cores"]),
            epoch1_fronts_cores=med(lambda r: r["epochs"]["epochs"][0].get("fronts_cores")),
            epoch1_fronts_us_per_decode=med(lambda r: _per_decode(r["epochs"]["epochs"][0], "fronts_us_per_delivery")),
            epoch1_worker_private_mib=med(lambda r: max(r["epochs"]["epochs"][0].get("workers_private_mib") or [0])),
            bytes_per_cached_item=med(lambda r: r["epochs"]["epochs"][0]["rss_anon_per_cached_item"]),
            oracle_failures=sum(e["oracle_failures"] for r in reps for e in r["epochs"]["epochs"]),
            exactly_once=all(e["exactly_once"] for r in reps for e in r["epochs"]["epochs"]))
    if "epochs" in reps[0] and len(reps[0]["epochs"]["epochs"]) > 1:
        warm = lambda r: r["epochs"]["epochs"][1:]  # noqa: E731
        out.update(
            warm_main_us_per_delivery=med(lambda r: median([e["main_us_per_delivery"] for e in warm(r)])),
            warm_deliveries_per_main_cpu_s=med(lambda r: 1e6 / median([e["main_us_per_delivery"] for e in warm(r)])),
            warm_fronts_us_per_delivery=med(lambda r: median([e.get("fronts_us_per_delivery", 0) for e in warm(r)])),
            first_batch_wait_max_s=med(lambda r: max(max(e["first_batch_wait_s"]) for e in warm(r))),
            longest_batch_wait_s=med(lambda r: max(max(e["max_batch_wait_s"]) for e in warm(r))),
            longest_wait_at_batch=med(lambda r: max(max(e["max_wait_at_batch"]) for e in warm(r))),
            bytes_per_cached_item_after_epochs=med(lambda r: r["epochs"]["epochs"][-1]["rss_anon_per_cached_item"]))
    def from_phase(phase: str, **fields: str) -> None:
        """out[name] = the median over reps of reps[i][phase][field], for each name=field."""
        if phase in reps[0]:
            out.update({name: med(lambda r, field=field: r[phase][field]) for name, field in fields.items()})

    from_phase("decoding", decoding_main_us_per_decode="main_us_per_decode",
               decoding_main_us_per_delivery="main_us_per_delivery", decoding_per_s="deliveries_per_s",
               decoding_workers_cores="workers_cores", decoding_main_cores="main_cores")
    if "decoding" in reps[0]:
        out["decoding_status_with_jobs_s"] = med(lambda r: r["decoding"].get("status_with_jobs", {}).get("median_s"))
    out["cli_status_at_start_s"] = med(lambda r: r["startup"].get("cli_status_s"))
    if "cli_status_s" in reps[0]:
        out["cli_status_at_end_s"] = med(lambda r: r["cli_status_s"])
    if "epochs" in reps[0]:
        out["status_with_jobs_s"] = med(lambda r: r["epochs"].get("status_with_jobs", {}).get("median_s"))
    if "status" in reps[0]:
        out["status_s"] = med(lambda r: r["status"]["median_s"])
    from_phase("attach", attach_half_s="median_attach_s", first_batch_half_s="median_first_batch_s",
               close_half_s="median_close_s", gone_half_s="median_gone_s")
    if "rates" in reps[0]:
        for k, count in enumerate(RATE_JOBS):
            out[f"rate_{count}_jobs_per_s"] = med(lambda r, k=k: r["rates"]["cases"][k]["deliveries_per_s"])
            out[f"rate_{count}_jobs_main_us"] = med(lambda r, k=k: r["rates"]["cases"][k]["main_us_per_delivery"])
            out[f"rate_{count}_jobs_fronts_us"] = med(lambda r, k=k: r["rates"]["cases"][k].get("fronts_us_per_delivery"))
    from_phase("halves", halves_per_s="deliveries_per_s", halves_main_us_per_delivery="main_us_per_delivery",
               halves_pair_rate="pair_rate_median", halves_pair_bound="pair_bound_median",
               halves_deliveries_per_decode="deliveries_per_decode",
               halves_deliveries_per_decode_bound="deliveries_per_decode_bound")
    if "halves" in reps[0]:
        out.update(halves_sampler_pair_rate=med(lambda r: r["halves"]["sampler_lockstep"]["pair_rate_median"]),
                   halves_sampler_deliveries_per_decode=med(
                       lambda r: r["halves"]["sampler_lockstep"]["deliveries_per_decode"]))
    return out


def print_summary(summary: dict[str, Any]) -> None:
    print_table(["figure", "value"], [[k, v] for k, v in summary.items()])


def commit() -> str:
    """The commit of the joaderd that ran: $JOADER_BENCH_COMMIT (a `git archive` of an older
    main has no .git), else HEAD of the tree joader.server comes from."""
    import joader.server

    if os.environ.get("JOADER_BENCH_COMMIT"):
        return os.environ["JOADER_BENCH_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(joader.server.__file__).resolve().parent)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "server", "joader", "client"], capture_output=True,
                           text=True, cwd=Path(joader.server.__file__).resolve().parent.parent)
    return done.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")


def driver_main(args: argparse.Namespace) -> None:
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phase(s) {sorted(unknown)}: choose from {','.join(PHASES)}")
    root = args.data / f"imagenet-{args.items}"
    layout = Layout.of(args.items)
    print(f"tree {root} ({args.items} items) ...", flush=True)
    tree = make_tree(root, args.items, processes=2)
    print(f"  {'reused' if tree['reused'] else 'generated'}: generation took {tree.get('generation_s')} s", flush=True)
    listing = check_listing(root, layout)
    power = oracle_power(root, layout, 500 if args.quick else 3000)
    print(f"  oracle: {power['samples']} samples x 5 wrong indices, none passed; max channel error "
          f"{power['turbo']['max_channel_error']} (tolerance 8)", flush=True)
    page_cache_s = warm_page_cache(root, layout)
    reps = []
    for rep in range(args.reps):
        print(f"rep {rep + 1} of {args.reps}", flush=True)
        reps.append(one_rep(root, layout, args, phases, rep))
    summary = summarize(reps)
    result = {"question": "joaderd's main-process CPU, waits and memory per item at ImageNet scale (issue 37)",
              "command": " ".join(["python -m bench.system.scale", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M"),
              "commit": commit(), "items": args.items, "jobs": args.jobs, "epochs": args.epochs,
              "image_size": IMAGE_SIZE, "batch_size": BATCH, "workers": args.workers, "tree": tree,
              "listing": listing, "oracle_power": power, "page_cache_warm_s": page_cache_s, "machine": machine(),
              "summary": summary, "reps": reps}
    if args.out:  # a trial run: not over the recorded results
        path = Path(args.out)
        path.write_text(json.dumps(result, indent=1) + "\n")
    else:
        path = write_json(f"scale-{args.items}{'-quick' if args.quick else ''}", result)
    print_summary(summary)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=IMAGENET_ITEMS)
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("JOADER_SCALE_DATA", "/tmp/joader-scale-data")))
    parser.add_argument("--quick", action="store_true", help="20k items, 1 rep, 2 epochs, 4 s windows")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=4, help="jobs of the epochs phase")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=20.0, help="seconds of each rates/halves case")
    parser.add_argument("--workers", default="auto", help="joaderd --workers")
    parser.add_argument("--fronts", default="auto", help="joaderd --fronts (Next fronts: server/fronts/)")
    parser.add_argument("--phases", default=",".join(p for p in PHASES if p != "decoding"),
                        help="startup is always measured; decoding (a windowed cold run of --jobs jobs) is for "
                             "trees whose whole epoch takes too long")
    # the client process (internal)
    parser.add_argument("--phase", choices=PHASES[1:])
    parser.add_argument("--address")
    parser.add_argument("--pid", type=int)
    parser.add_argument("--out", help="write the results here instead of bench/results/scale-<items>.json "
                        "(a trial run); the client process's output file")
    args = parser.parse_args()
    if args.phase:
        client_main(args)
        return
    if args.quick:
        args.items = 20_000 if args.items == IMAGENET_ITEMS else args.items
        args.reps, args.epochs, args.window_s = 1, 2, 4.0
    driver_main(args)


if __name__ == "__main__":
    main()
