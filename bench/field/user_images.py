"""What a `JoaderDataset(root=...)` user sees (issue 38's "Must show", the client's part):

1. a 10x10 and a 40x3000 photo among 64 px ones: one epoch through a DataLoader with the
   defaults (every image served at S), then `upscale=False` and its error text;
2. a folder with one corrupt file: what one epoch yields against `len(ds)`, before and after;
3. a bash loop of four trials (`train.py --lr X`, one of them twice): the job names in
   `joader status`.

Everything runs in a private XDG_RUNTIME_DIR; the servers are stopped at the end.

Usage: python -m bench.field.user_images [--out bench/results/user_images.txt]
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
from pathlib import Path

import numpy as np
from PIL import Image

from joader.client.autostart import stop_servers

_TRIAL = """
import sys, threading, time
from torch.utils.data import DataLoader
from joader import JoaderDataset
with JoaderDataset("photos", root=sys.argv[-1], image_size=64) as ds:  # no name=
    print(ds.job_id, flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():  # trains (a 50 ms step per batch) until its stdin closes
        for images, labels in DataLoader(ds, batch_size=8):
            time.sleep(0.05)
            if stop.is_set():
                break
"""


def _photos(root: Path, sizes: dict[str, tuple[int, int]]) -> Path:
    rng = np.random.default_rng(38)
    for name, (width, height) in sizes.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(root / name, quality=90)
    return root


def odd_sizes(base: Path, say: list[str]) -> None:
    import torch

    from joader import JoaderDataset

    sizes = {f"{c}/{c}{i}.jpg": (64 + 8 * i, 64 + 4 * i) for c in ("cat", "dog") for i in range(31)}
    root = _photos(base / "odd", {**sizes, "cat/tiny.jpg": (10, 10), "dog/tall.jpg": (40, 3000)})
    say.append(f"## 1. {len(sizes)} photos of 64-184 px, cat/tiny.jpg (10x10) and dog/tall.jpg (40x3000), S = 64\n")
    with JoaderDataset("odd", root=root, image_size=64) as ds:
        shapes: dict[tuple[int, ...], int] = {}
        for images, _labels in torch.utils.data.DataLoader(ds, batch_size=16):
            shapes[tuple(images.shape[1:])] = shapes.get(tuple(images.shape[1:]), 0) + len(images)
        say.append(f"defaults: one epoch, {sum(shapes.values())} samples, shapes {shapes}\n")
    with JoaderDataset("odd", root=root, image_size=64, upscale=False) as ds:
        try:
            for _ in torch.utils.data.DataLoader(ds, batch_size=16):
                pass
            say.append("upscale=False: no error (the odd images fell in batches of their own)\n")
        except Exception as error:  # noqa: BLE001  printed as the user sees it
            say.append(f"upscale=False: {type(error).__name__}: {error}\n")


def corrupt_file(base: Path, say: list[str]) -> None:
    import torch

    from joader import JoaderDataset

    root = _photos(base / "broken", {f"{c}/{c}{i}.jpg": (80, 64) for c in ("cat", "dog") for i in range(12)})
    data = (root / "dog" / "dog0.jpg").read_bytes()
    (root / "dog" / "broken.jpg").write_bytes(data[: len(data) // 3])
    say.append("## 2. 25 files, dog/broken.jpg truncated\n")
    with JoaderDataset("broken", root=root, image_size=64) as ds:
        say.append(f"before any epoch: len(ds) = {len(ds)}\n")
        for epoch in (1, 2):
            loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
            count = sum(len(labels) for _images, labels in loader)
            say.append(f"epoch {epoch} (2 DataLoader workers): {count} samples; after it len(ds) = {len(ds)}, "
                       f"len(loader) = {len(loader)}\n")


def bash_loop(base: Path, say: list[str]) -> None:
    root = _photos(base / "loop", {f"{c}/{c}{i}.jpg": (80, 64) for c in ("cat", "dog") for i in range(20)})
    script = base / "train.py"
    script.write_text(_TRIAL)
    trials = []
    here = str(Path(__file__).resolve().parents[2])  # the project, for a script run from elsewhere
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    say.append("## 3. for lr in 0.1 0.01 0.001 0.1; do python train.py --lr $lr --data ROOT & done\n")
    try:
        for lr in ("0.1", "0.01", "0.001", "0.1"):
            trial = subprocess.Popen([sys.executable, str(script), "--lr", lr, "--data", str(root)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            trials.append(trial)
            assert trial.stdout is not None
            trial.stdout.readline()
        time.sleep(4.0)  # a few epochs of each
        for command in (["status"], ["top", "--once"]):
            done = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", *command],
                                  capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "140"})
            say.append(f"$ joader {' '.join(command)}\n{done.stderr}{done.stdout}")
        listed = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "status", "--json", "--source", "photos"],
                                capture_output=True, text=True, timeout=60)
        names = [job["name"] for job in json.loads(listed.stdout)["jobs"]]
        say.append(f"the job names (joader status --json): {names}; the trials' pids {[t.pid for t in trials]}\n")
    finally:
        for trial in trials:
            assert trial.stdin is not None
            trial.stdin.close()
            trial.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/user_images.txt"))
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="jbu-", dir="/tmp"))
    os.chmod(base, 0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(base)
    os.environ.pop("JOADER_ADDRESS", None)
    say: list[str] = []
    started = time.monotonic()
    try:
        for part in (odd_sizes, corrupt_file, bash_loop):
            part(base, say)
            say.append("\n")
    finally:
        stop_servers(timeout_s=30)
        shutil.rmtree(base, ignore_errors=True)
    text = "".join(say).replace(str(base), "/tmp/jbu-XXXX") + f"({time.monotonic() - started:.0f} s)\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
