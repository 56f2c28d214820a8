"""Benchmark of the built-in stages (joader.stages): images/s per core and with every core, by decoder.

(a) Images/s in one process (one core) for each decoder (pil, which is torchvision's
    ImageFolder + Resize + CenterCrop exactly; pil-draft; turbo with simplejpeg's fast integer
    DCT; turbo with the exact one; the default is joader.stages.image.TURBO_OPTIONS)
    x stage (center-crop:256, resize:256, max-side:512), on the 500x375 demo JPEGs
    (joader.client.tools.demo_data, quality 90, about 100 KB) and on large 2000x1500 photo-like JPEGs
    (quality 90, about 650 KB; generated once). The encoded files are read into memory first:
    this is the stage alone. Median of several repetitions, decoders interleaved.
(b) Pixel differences pil-draft and turbo vs pil per stage and data set: mean, 99th percentile
    and max of |decoder - pil| in grey levels, over every pixel of every image (per format and
    against torchvision's output: bench/micro/decoders.py).
(c) Decode capacity with all workers, the figure joaderd's throughput follows: N processes
    (N = the CPUs this process may run on, os.sched_getaffinity), each reading its share of the
    500x375 files from the (warm) page cache and running center-crop:256 in a loop; images/s of
    all of them together, for pil, pil-draft and turbo (default options). Median of several
    repetitions.

(d) Where a 2000x1500 decode's time goes: the DCT-scaled decode both decoders make, in RGB and in
    grayscale, the resize after it, OpenCV's reduced decode, Pillow's draft and full decodes.

Usage: python -m bench.micro.stage [--quick] [--reps N] [--out PATH]. --quick (under a minute or
two) uses fewer images, repetitions and seconds. Prints tables and writes JSON (default
bench/results/stage.json, or stage-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import DATA_DIR, RESULTS, demo_data, machine, median, print_table
from joader.stages import build_stage
from joader.stages.image import TURBO_OPTIONS

STAGES = [("center-crop", 256), ("resize", 256), ("max-side", 512)]
# (label, decoder, options)
DECODERS = [("pil", "pil", None), ("pil-draft", "pil-draft", None), ("turbo fast-dct", "turbo", {"fastdct": True}),
            ("turbo exact-dct", "turbo", {"fastdct": False})]  # fmt: skip
TURBO_DEFAULT = "turbo fast-dct" if TURBO_OPTIONS["fastdct"] else "turbo exact-dct"
DEMO_ITEMS = 600  # the cached demo folder; --quick uses a part of it
PHOTO_SIZE = (2000, 1500)
PHOTO_QUALITY = 90


def large_photos(count: int) -> list[Path]:
    """`count` photo-like 2000x1500 JPEGs (quality 90), generated once under DATA_DIR."""
    from PIL import Image

    root = DATA_DIR / f"photos-{PHOTO_SIZE[0]}x{PHOTO_SIZE[1]}-q{PHOTO_QUALITY}"
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"photo_{i:04d}.jpg" for i in range(count)]
    todo = [p for p in paths if not p.exists()]
    if todo:
        print(f"generating {len(todo)} {PHOTO_SIZE[0]}x{PHOTO_SIZE[1]} JPEGs in {root} ...",
              flush=True)  # fmt: skip
    for path in todo:
        seed = int(path.stem.split("_")[1])
        tmp = path.with_name(f".{path.name}.tmp")
        Image.fromarray(_photo_pixels(seed)).save(tmp, "JPEG", quality=PHOTO_QUALITY)
        os.replace(tmp, path)
    for path in paths:
        path.read_bytes()  # warm the page cache
    return paths


def _photo_pixels(seed: int) -> np.ndarray:
    """Photo-like content: smooth 1/f-ish structure over several octaves, soft edges, texture
    and sensor noise, so the JPEG is about as large and as slow to decode as a real photo."""
    import cv2

    width, height = PHOTO_SIZE
    rng = np.random.default_rng(1000 + seed)
    img = np.zeros((height, width, 3), np.float32)
    for octave in range(2, 9):  # cells of 4 .. 256 pixels
        cell = 2**octave
        coarse = rng.normal(0, 1, (height // cell + 2, width // cell + 2, 3)).astype(np.float32)
        up = cv2.resize(coarse, (width + 2 * cell, height + 2 * cell),
                        interpolation=cv2.INTER_CUBIC)[cell:cell + height, cell:cell + width]  # fmt: skip
        img += up * (cell**0.8)
    img = (img - img.mean()) / img.std() * 45 + rng.uniform(90, 160, 3).astype(np.float32)
    # a few hard-edged shapes (objects), then sensor noise
    for _ in range(12):
        cx, cy = rng.integers(0, width), rng.integers(0, height)
        axes = (int(rng.integers(40, 400)), int(rng.integers(40, 300)))
        colour = tuple(float(c) for c in rng.uniform(-50, 50, 3))
        overlay = np.zeros_like(img)
        cv2.ellipse(overlay, (int(cx), int(cy)), axes, float(rng.uniform(0, 180)), 0, 360,
                    colour, -1, cv2.LINE_AA)  # fmt: skip
        img += overlay
    img += rng.normal(0, 5, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def phases(blobs: list[bytes], reps: int) -> list[dict[str, Any]]:
    """Where a 2000x1500 decode's time goes, ms per image (best of `reps`): the DCT-scaled
    decode both joader decoders make (libjpeg-turbo's entropy decoding of the whole file is
    most of it: a grayscale decode skips only colour conversion and upsampling), the resize
    after it, and the alternatives."""
    import io

    import cv2
    import simplejpeg
    from PIL import Image

    quarter = simplejpeg.decode_jpeg(blobs[0], min_height=256, min_width=341)

    def pil_draft(data: bytes) -> Any:
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (341, 256))
        return np.asarray(image.convert("RGB"))

    steps = {
        "simplejpeg, 1/4 scale, RGB": lambda d: simplejpeg.decode_jpeg(d, min_height=256, min_width=341),
        "simplejpeg, 1/4 scale, grayscale": lambda d: simplejpeg.decode_jpeg(d, colorspace="Gray", min_height=256,
                                                                             min_width=341),
        "simplejpeg, full size": lambda d: simplejpeg.decode_jpeg(d),
        "OpenCV IMREAD_REDUCED_COLOR_4": lambda d: cv2.imdecode(np.frombuffer(d, np.uint8),
                                                                cv2.IMREAD_REDUCED_COLOR_4),
        "cv2.resize 1/4-scale decode -> 341x256 (INTER_AREA)": lambda d: cv2.resize(
            quarter, (341, 256), interpolation=cv2.INTER_AREA),
        "Pillow draft 1/4 + convert": pil_draft,
        "Pillow full size + convert": lambda d: np.asarray(Image.open(io.BytesIO(d)).convert("RGB")),
    }
    rows = []
    for label, step in steps.items():
        best = min(_per_image_s(step, blobs) for _ in range(reps))
        rows.append({"step": label, "ms_per_image": round(best * 1e3, 2)})
    return rows


def _per_image_s(step: Any, blobs: list[bytes]) -> float:
    start = time.perf_counter()
    for data in blobs:
        step(data)
    return (time.perf_counter() - start) / len(blobs)


def images_per_s(stage: Any, blobs: list[bytes]) -> float:
    start = time.perf_counter()
    for i, data in enumerate(blobs):
        stage.prepare(data, str(i))
    return len(blobs) / (time.perf_counter() - start)


def bench_single(datasets: dict[str, list[bytes]], reps: int) -> list[dict[str, Any]]:
    rows = []
    for dataset, blobs in datasets.items():
        for kind, size in STAGES:
            stages: dict[str, Any] = {label: build_stage(kind, size=size, upscale=kind == "center-crop",
                                                         decoder=decoder, options=options)
                                      for label, decoder, options in DECODERS}  # fmt: skip
            for stage in stages.values():
                stage.prepare(blobs[0], "warm-up")
            rates: dict[str, list[float]] = {label: [] for label in stages}
            for _ in range(reps):  # interleaved: drift on a shared machine hits all alike
                for label, stage in stages.items():
                    rates[label].append(images_per_s(stage, blobs))
            pil = median(rates["pil"])
            for label, stage in stages.items():
                rate = median(rates[label])
                rows.append({"dataset": dataset, "stage": f"{kind}:{size}", "decoder": label,
                             "name": stage.name, "images": len(blobs),
                             "images_per_s": round(rate, 1),
                             "all_reps": [round(r, 1) for r in rates[label]],
                             "ms_per_image": round(1e3 / rate, 3),
                             "speedup_vs_pil": round(rate / pil, 3)})  # fmt: skip
    return rows


def bench_diff(datasets: dict[str, list[bytes]], limit: int) -> list[dict[str, Any]]:
    rows = []
    for dataset, blobs in datasets.items():
        for kind, size in STAGES:
            pil = build_stage(kind, size=size, upscale=kind == "center-crop", decoder="pil")
            for label, decoder, options in DECODERS[1:]:
                other = build_stage(kind, size=size, upscale=kind == "center-crop",
                                    decoder=decoder, options=options)  # fmt: skip
                diffs = []
                for i, data in enumerate(blobs[:limit]):
                    a, b = pil.prepare(data, str(i)), other.prepare(data, str(i))
                    assert a.shape == b.shape, (a.shape, b.shape)
                    diffs.append(np.abs(a.astype(np.int16) - b).ravel())
                diff = np.concatenate(diffs)
                rows.append({"dataset": dataset, "stage": f"{kind}:{size}", "decoder": label,
                             "images": len(diffs), "mean_abs_diff": round(float(diff.mean()), 3),
                             "p99_abs_diff": int(np.percentile(diff, 99)),
                             "max_abs_diff": int(diff.max()),
                             "share_within_1": round(float((diff <= 1).mean()), 4)})  # fmt: skip
    return rows


def _capacity_worker(decoder: str, paths: list[str], barrier: Any, seconds: float, out: Any) -> None:
    stage = build_stage("center-crop", size=256, upscale=True, decoder=decoder)
    for path in paths[:5]:
        stage.prepare(Path(path).read_bytes(), path)  # warm up
    barrier.wait()
    count, start, i = 0, time.perf_counter(), 0
    deadline = start + seconds
    while time.perf_counter() < deadline:
        path = paths[i % len(paths)]
        with open(path, "rb") as file:  # as joaderd: read the item's bytes, then the stage
            stage.prepare(file.read(), path)
        count += 1
        i += 1
    out.put((count, time.perf_counter() - start))


def bench_capacity(paths: list[Path], decoders: list[str], processes: int, seconds: float,
                   reps: int) -> list[dict[str, Any]]:  # fmt: skip
    ctx = mp.get_context("fork")
    results: dict[str, list[float]] = {d: [] for d in decoders}
    for _ in range(reps):
        for decoder in decoders:
            barrier, out = ctx.Barrier(processes), ctx.Queue()
            shares = [[str(p) for p in paths[k::processes]] for k in range(processes)]
            workers = [ctx.Process(target=_capacity_worker,
                                   args=(decoder, shares[k], barrier, seconds, out))
                       for k in range(processes)]  # fmt: skip
            for worker in workers:
                worker.start()
            done = [out.get(timeout=seconds + 120) for _ in workers]
            for worker in workers:
                worker.join(timeout=30)
            results[decoder].append(sum(c for c, _ in done) / max(s for _, s in done))
    pil = median(results[decoders[0]])
    return [{"decoder": d, "stage": "center-crop:256", "processes": processes,
             "seconds": seconds, "images_per_s": round(median(results[d]), 1),
             "all_reps": [round(r, 1) for r in results[d]],
             "per_process": round(median(results[d]) / processes, 1),
             "vs_pil": round(median(results[d]) / pil, 3)} for d in decoders]  # fmt: skip


def versions() -> dict[str, str]:
    import cv2
    import PIL
    import simplejpeg

    return {"pillow": PIL.__version__, "simplejpeg": simplejpeg.__version__,
            "opencv": cv2.__version__, "numpy": np.__version__}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer images and repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3 / 5)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    quick = args.quick
    reps = args.reps or (3 if quick else 5)
    out_path = args.out or RESULTS / ("stage-quick.json" if quick else "stage.json")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    demo_root = demo_data(DEMO_ITEMS)
    demo_paths = sorted(demo_root.rglob("*.jpg"))
    photos = large_photos(8 if quick else 24)
    datasets = {
        "500x375": [p.read_bytes() for p in demo_paths[: 100 if quick else 600]],
        "2000x1500": [p.read_bytes() for p in photos],
    }
    for name, blobs in datasets.items():
        print(f"{name}: {len(blobs)} JPEGs, mean {np.mean([len(b) for b in blobs]) / 1e3:.0f} KB")

    print(f"\n(a) images/s in one process, median of {reps}")
    single = bench_single(datasets, reps)
    print_table(["dataset", "stage", "decoder", "images/s", "ms/image", "x pil"],
                [[r["dataset"], r["stage"], r["decoder"], r["images_per_s"], r["ms_per_image"],
                  r["speedup_vs_pil"]] for r in single])  # fmt: skip

    print("\n(b) |decoder - pil| in grey levels (pil: torchvision's output), every pixel of every image")
    diffs = bench_diff(datasets, 60 if quick else 200)
    print_table(["dataset", "stage", "decoder", "mean", "p99", "max", "share <= 1"],
                [[r["dataset"], r["stage"], r["decoder"], r["mean_abs_diff"], r["p99_abs_diff"],
                  r["max_abs_diff"], r["share_within_1"]] for r in diffs])  # fmt: skip

    processes = len(os.sched_getaffinity(0))
    seconds = 3.0 if quick else 10.0
    print(f"\n(c) decode capacity: {processes} processes x center-crop:256 on the 500x375 "
          f"files (read + stage), {seconds:.0f} s, median of {reps}")  # fmt: skip
    capacity = bench_capacity(demo_paths, ["pil", "pil-draft", "turbo"], processes, seconds, reps)
    print_table(["decoder", "processes", "images/s", "per process", "x pil"],
                [[r["decoder"], r["processes"], r["images_per_s"], r["per_process"],
                  r["vs_pil"]] for r in capacity])  # fmt: skip

    print(f"\n(d) where a 2000x1500 decode's time goes, ms per image, best of {reps}")
    steps = phases(datasets["2000x1500"], reps)
    print_table(["step", "ms/image"], [[r["step"], r["ms_per_image"]] for r in steps])

    def pick(dataset: str, stage: str, decoder: str) -> dict[str, Any]:
        return next(r for r in single if (r["dataset"], r["stage"], r["decoder"]) == (dataset, stage, decoder))

    summary = {
        "capacity_pil_images_per_s": capacity[0]["images_per_s"],
        "capacity_pil_draft_images_per_s": capacity[1]["images_per_s"],
        "capacity_turbo_images_per_s": capacity[2]["images_per_s"],
        "capacity_gain": capacity[2]["vs_pil"],
        "per_core_speedup_center_crop_500x375": pick("500x375", "center-crop:256", TURBO_DEFAULT)["speedup_vs_pil"],
        "per_core_speedup_center_crop_2000x1500": pick("2000x1500", "center-crop:256", TURBO_DEFAULT)["speedup_vs_pil"],
        "per_core_speedup_resize_2000x1500": pick("2000x1500", "resize:256", TURBO_DEFAULT)["speedup_vs_pil"],
        "max_mean_abs_diff_turbo": max(r["mean_abs_diff"] for r in diffs if r["decoder"] == TURBO_DEFAULT),
        "turbo_default_options": TURBO_OPTIONS,
    }  # fmt: skip
    print(f"\nsummary: {json.dumps(summary)}")
    result = {
        "mode": "quick" if quick else "full",
        "reps": reps,
        "machine": machine(),
        "versions": versions(),
        "summary": summary,
        "single_process": single,
        "pixel_diff_vs_pil": diffs,
        "capacity_all_workers": capacity,
        "phases_2000x1500": steps,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
