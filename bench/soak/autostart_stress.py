"""Simultaneous auto-starts under load: does exactly one joaderd start, and does every job get it?

Issue 36, item 7: "once in 9 runs one of 4 jobs starting together failed with 'joaderd ...
exited'". Two scenarios, each repeated, on a CPU kept busy by `--load` busy-loop processes:

- cold: no server runs; `--procs` plain Python processes (no torch) call
  `joader.client.autostart.ensure_server` for one spec at one instant (a go file they poll).
  Checked: no caller failed, every caller got the spec's address, exactly one says it started
  the server, that server is the one in the ready file, it listens, and it is the only joaderd
  of the spec.
- idle: `JOADER_IDLE_EXIT_S` small (1 s); a server is started and left idle, and the callers
  arrive spread around the moment it decides to exit. Each does what a job does: finds or starts
  the server, attaches a job over gRPC (retrying as the lease keeper does while a server exits:
  `ServerExitingError`, a socket that refuses or is gone), holds its lease a moment, closes.
  Checked: every caller attached, none failed to start a server, and no joaderd of the spec
  runs unreachable (alive, but its socket file gone or another's: an orphan that holds an arena
  until its own idle exit).

Run: `python -m bench.soak.autostart_stress --rounds 30 --procs 6 --load 2` (JSON in bench/results/).
Everything runs in a private XDG_RUNTIME_DIR, so the user's own auto-started servers are not
touched.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "stress"
IMAGE_SIZE = 32

_CALLER = r"""
import json, os, sys, time, traceback
from joader.client.autostart import ServerSpec, ensure_server, listening

root, go, delay_s, attach_s, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
spec = ServerSpec.make("stress", root, image_size=32, cache_size="4194304")
if attach_s > 0:
    import grpc
    from joader.proto import joader_pb2, joader_pb2_grpc
open(out + ".armed", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
time.sleep(delay_s)
report = {"t0": time.time(), "errors": [], "attempts": 0}


def attach_once(address):
    # A job's first attach and a lease held for attach_s, then closed: what JoaderDataset does.
    with grpc.insecure_channel(address) as channel:
        stub = joader_pb2_grpc.JoaderStub(channel)
        closing = []

        def requests():
            yield joader_pb2.AttachRequest(source="stress", name=f"caller-{os.getpid()}", batch_size=4)
            end = time.monotonic() + attach_s
            while time.monotonic() < end:
                time.sleep(0.1)
                yield joader_pb2.AttachRequest(heartbeat=True)
            yield joader_pb2.AttachRequest(closing=True)

        stream = stub.Attach(requests(), timeout=attach_s + 20)
        first = next(stream)
        for _ in stream:
            pass
        return first.server_pid


deadline = time.monotonic() + 30  # the keeper's grace is 15 s; more, to see what happens after
while True:
    report["attempts"] += 1
    try:
        address, started = ensure_server(spec, timeout_s=60)
        report["address"] = address
        report["started"] = str(started) if started is not None else report.get("started")
        report["ensure_s"] = time.time() - report["t0"]
        if attach_s <= 0:
            break
        report["server_pid"] = attach_once(address)
        break
    except Exception as error:
        report["errors"].append(f"{type(error).__name__}: {str(error)[:1500]}")
        if "JoaderdStartError" in report["errors"][-1] or time.monotonic() > deadline:
            break
        time.sleep(0.25)
report["t1"] = time.time()
with open(out, "w") as f:
    json.dump(report, f)
"""


def _spec_processes(address: str) -> list[psutil.Process]:
    """The joaderd processes of the spec (not their decode workers: those are forked, with the
    same command line, by joaderd's forker; joaderd is the one whose parent is not a joaderd)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        cmd = proc.info["cmdline"] or []
        if "joader.server" in cmd and address in cmd:
            found.append(proc)
    pids = {p.pid for p in found}
    return [p for p in found if p.info["ppid"] not in pids]


def _wait(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


class Stress:
    def __init__(self, workdir: Path, root: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.root = root
        self.env = env
        from joader.client.autostart import ServerSpec  # after XDG_RUNTIME_DIR is set

        self.spec = ServerSpec.make(SOURCE, root, image_size=IMAGE_SIZE, cache_size="4194304")
        self.path = self.spec.socket_path()
        self.boot_times: set[int] = set()

    def callers(self, tag: str, delays: list[float], attach_s: float, env: dict[str, str]) -> list[dict[str, Any]]:
        go = self.workdir / f"{tag}.go"
        outs = [self.workdir / f"{tag}-{i}.json" for i in range(len(delays))]
        procs = [subprocess.Popen([sys.executable, "-c", _CALLER, str(self.root), str(go), f"{d:.3f}",
                                   str(attach_s), str(out)], env=env, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=open(f"{out}.err", "wb"))
                 for d, out in zip(delays, outs, strict=True)]
        _wait(lambda: all(Path(f"{o}.armed").exists() for o in outs), 60)
        go.touch()
        t_go = time.time()
        for proc in procs:
            proc.wait(timeout=120)
        reports = []
        for out in outs:
            report = json.loads(out.read_text()) if out.exists() else {"errors": [Path(f"{out}.err").read_text()[-2000:]]}
            report["start_offset_s"] = report.get("t0", t_go) - t_go
            reports.append(report)
        return reports

    def stop_all(self) -> None:
        for proc in _spec_processes(self.spec.address):
            proc.terminate()
        _wait(lambda: not _spec_processes(self.spec.address), 30)

    def cold_round(self, i: int, procs: int) -> dict[str, Any]:
        self.stop_all()
        reports = self.callers(f"cold{i}", [0.0] * procs, 0.0, self.env)
        from joader.client.autostart import listening
        from joader.launch import read_ready_file

        started = [r["started"] for r in reports if r.get("started")]
        ready = read_ready_file(self.path.with_suffix(".ready")) or {}
        servers = _spec_processes(self.spec.address)
        problems = []
        if any(r["errors"] for r in reports):
            problems.append("a caller failed")
        if any(r.get("address") != self.spec.address for r in reports):
            problems.append("a caller got no address")
        if len(started) != 1:
            problems.append(f"{len(started)} callers say they started the server")
        elif int(started[0].split(":")[0]) != ready.get("pid"):
            problems.append("the server started is not the ready file's")
        if not listening(self.path):
            problems.append("nothing listens")
        if len(servers) != 1:
            problems.append(f"{len(servers)} joaderds of the spec run")
        return {"round": i, "ok": not problems, "problems": problems, "reports": reports,
                "servers": [p.pid for p in servers]}

    def idle_round(self, i: int, procs: int, idle_exit_s: float, rng: random.Random) -> dict[str, Any]:
        self.stop_all()
        env = {**self.env, "JOADER_IDLE_EXIT_S": f"{idle_exit_s:g}"}
        [first] = self.callers(f"idle{i}-first", [0.0], 0.0, env)  # a server, left idle
        # Callers arrive spread around the exit decision (idle_exit_s after it serves, checked
        # every 0.2 s) and the shutdown after it.
        delays = [rng.uniform(0.5 * idle_exit_s, idle_exit_s + 1.0) for _ in range(procs)]
        seen: dict[int, float] = {}
        orphans: dict[int, float] = {}  # pid -> seconds seen alive without its socket
        reports = self._with_watch(lambda: self.callers(f"idle{i}", delays, 1.5, env), seen, orphans)
        problems = []
        if first["errors"]:
            problems.append("the first start failed")
        failed = [r["errors"] for r in reports if not r.get("server_pid")]
        if failed:
            problems.append(f"{len(failed)} callers never attached")
        if any(any("JoaderdStartError" in e for e in r["errors"]) for r in reports):
            problems.append("a start failed (JoaderdStartError)")
        lasting = {pid: round(s, 2) for pid, s in orphans.items() if s >= 3.0}
        if lasting:
            problems.append("the ready file's joaderd alive but not answering on the socket for 3 s or more")
        starts = [r["started"] for r in reports if r.get("started")]
        return {"round": i, "ok": not problems, "problems": problems, "delays": delays, "reports": reports,
                "servers_seen": sorted(seen), "starts": len(starts), "unanswered_s": lasting,
                "retries": sum(len(r["errors"]) for r in reports)}

    def _with_watch(self, run: Any, seen: dict[int, float], orphans: dict[int, float]) -> Any:
        """Runs `run()` while a thread notes each joaderd of the spec, and for how long the server
        of the ready file was alive while its socket answered nothing or another process (its
        socket file removed, or replaced): `orphans`, pid -> the longest such stretch. The
        /proc/stat boot time is sampled too (ProcessRef's start times depend on it)."""
        import threading

        done = threading.Event()
        ready_path = self.path.with_suffix(".ready")

        def watch() -> None:
            from joader.launch import read_ready_file

            since: dict[int, float] = {}
            while not done.is_set():
                now = time.monotonic()
                for proc in _spec_processes(self.spec.address):
                    seen.setdefault(proc.pid, now)
                info = read_ready_file(ready_path) or {}
                pid = info.get("pid")
                if pid and psutil.pid_exists(pid) and _answering_pid(self.path) != pid:
                    start = since.setdefault(pid, now)
                    orphans[pid] = max(orphans.get(pid, 0.0), now - start)
                else:
                    since.clear()
                self.boot_times.add(_boot_time())
                time.sleep(0.05)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            return run()
        finally:
            done.set()
            thread.join()


def _answering_pid(path: Path) -> int | None:
    """The pid of the process listening on the Unix socket `path` (SO_PEERCRED), or None."""
    import socket
    import struct

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(str(path))
        except OSError:
            return None
        creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[0])


def _boot_time() -> int:
    with open("/proc/stat", "rb") as stat:
        for line in stat:
            if line.startswith(b"btime"):
                return int(line.split()[1])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--idle-rounds", type=int, default=None, help="default: --rounds")
    parser.add_argument("--procs", type=int, default=6)
    parser.add_argument("--load", type=int, default=2, help="busy-loop processes")
    parser.add_argument("--idle-exit-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "autostart_stress.json")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="jas-", dir="/tmp"))
    run_dir = workdir / "run"
    run_dir.mkdir(mode=0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(run_dir)
    os.environ.pop("JOADER_IDLE_EXIT_S", None)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    from joader.client.tools.demo_data import make_demo_data

    root = workdir / "images"
    make_demo_data(root, 24, num_classes=3, seed=1, progress=False)
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    stress = Stress(workdir, root, env)
    rng = random.Random(args.seed)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "cold": [], "idle": []}
    try:
        for i in range(args.rounds):
            result = stress.cold_round(i, args.procs)
            results["cold"].append(result)
            print(f"cold {i}: {'ok' if result['ok'] else result['problems']}", flush=True)
        for i in range(args.rounds if args.idle_rounds is None else args.idle_rounds):
            result = stress.idle_round(i, args.procs, args.idle_exit_s, rng)
            results["idle"].append(result)
            print(f"idle {i}: {'ok' if result['ok'] else result['problems']}", flush=True)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
        stress.stop_all()
    for kind in ("cold", "idle"):
        rounds = results[kind]
        results[f"{kind}_failed"] = sum(not r["ok"] for r in rounds)
        results[f"{kind}_problems"] = sorted({p for r in rounds for p in r["problems"]})
    results["boot_times"] = sorted(stress.boot_times)
    results["idle_starts"] = sum(r["starts"] for r in results["idle"])
    results["idle_retries"] = sum(r["retries"] for r in results["idle"])
    results["log_tail"] = _log_tail(stress.path.with_suffix(".log"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items()
                      if k.endswith(("_failed", "_problems", "_starts", "_retries", "boot_times"))}))
    return 0


def _log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-6000:]
    except OSError:
        return ""


if __name__ == "__main__":
    raise SystemExit(main())
