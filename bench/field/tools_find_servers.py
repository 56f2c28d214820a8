"""What a bare `joader status`, `top --once` and `analyze` print while `root=` jobs train (issue
38's "Must show"): one auto-started server, then two.

Four training scripts read `JoaderDataset("photos", root=A, image_size=64)` (a sleep per batch
for the GPU step), and the tools run as a user types them, with no address and no
`JOADER_ADDRESS`; then two more scripts read `JoaderDataset("cifar", root=B, ...)`, a second
server, and the tools run again, bare and with `--source`. Everything runs in a private
XDG_RUNTIME_DIR; the servers are stopped at the end.

Usage: python -m bench.field.tools_find_servers [--items 400] [--out bench/results/tools_find_servers.txt]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from joader.client.autostart import stop_servers
from joader.client.tools.demo_data import make_demo_data

_JOB = """
import sys, time, torch
from joader import JoaderDataset
name, source, root = sys.argv[1:4]
ds = JoaderDataset(source, root=root, image_size=64, name=name)
loader = torch.utils.data.DataLoader(ds, batch_size=32)
for epoch in range(int(sys.argv[4])):
    for images, labels in loader:
        time.sleep(float(sys.argv[5]))  # the GPU step
"""


def _tool(env: dict[str, str], *args: str) -> str:
    command = ["joader", *args]
    done = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    return f"$ {' '.join(command)}\n{done.stdout}(exit {done.returncode})\n"


def _wait_jobs(env: dict[str, str], source: str, jobs: int, deadline_s: float = 120.0) -> None:
    """Until the server of `source` has `jobs` jobs attached that read."""
    import json

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        done = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "status", "--json", "--source", source],
                              env=env, capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            status = json.loads(done.stdout)
            if sum(1 for j in status["jobs"] if j["items_delivered"] > 0) >= jobs:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{jobs} jobs of {source} did not start reading within {deadline_s:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=100)  # killed once the tools ran
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--out", default="bench/results/tools_find_servers.txt")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jb-", dir="/tmp"))
    runtime = work / "run"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in ("JOADER_ADDRESS", "JOADER_SERVE_OWNER")}
    env["XDG_RUNTIME_DIR"] = str(runtime)
    os.environ.pop("JOADER_ADDRESS", None)
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    photos, cifar = work / "photos", work / "cifar"
    make_demo_data(photos, args.items, num_classes=4, seed=1, progress=False)
    make_demo_data(cifar, args.items // 2, num_classes=4, seed=2, progress=False)
    out: list[str] = [f"# bench.field.tools_find_servers: {args.items} photos, 4 jobs; {args.items // 2} cifar, 2 jobs; "
                      f"step {args.step_s} s per batch of 32\n"]
    jobs: list[subprocess.Popen[bytes]] = []
    try:
        out.append("## nothing running\n" + _tool(env, "status"))
        for k in range(4):
            jobs.append(subprocess.Popen([sys.executable, "-c", _JOB, f"train.py-{k}", "photos", str(photos),
                                          str(args.epochs), str(args.step_s)], env=env))
        _wait_jobs(env, "photos", 4)
        time.sleep(8.0)  # a few epochs' worth of sharing
        out.append("## one server (4 root= jobs on photos)\n" + _tool(env, "status") + _tool(env, "top", "--once")
                   + _tool(env, "analyze", "--interval", "2") + _tool(env, "servers"))
        for k in range(2):
            jobs.append(subprocess.Popen([sys.executable, "-c", _JOB, f"cifar-{k}", "cifar", str(cifar),
                                          str(args.epochs), str(args.step_s)], env=env))
        _wait_jobs(env, "cifar", 2)
        out.append("## two servers (and 2 root= jobs on cifar)\n" + _tool(env, "status") + _tool(env, "top", "--once")
                   + _tool(env, "analyze", "--interval", "2") + _tool(env, "top", "--once", "--source", "cifar"))
    finally:
        for job in jobs:
            job.kill()
            job.wait()
        stop_servers()
        shutil.rmtree(work, ignore_errors=True)
    text = "\n".join(out)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
