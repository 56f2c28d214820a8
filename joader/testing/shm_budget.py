"""Do a user's auto-sized joaderds leave room for the training process's own shared memory?

    sudo python -m bench.system.shm_budget [--shm-size 1g] [--items 100] [--stages resize:512,resize:640,resize:768,resize:896]
                                    [--batch-mib 64] [--no-budget] [--together] [--auto]

Question (issue 36): jobs that start their own joaderd (`JoaderDataset(root=...)`) start one per
spec, each with `--cache-size auto`. Each used to take half of what /dev/shm had free, so four
took 960 of 1,024 MiB, and the training process's `DataLoader(num_workers=2)` then failed with
"unable to allocate shared memory". With `--cache-budget-dir` (server/cache_budget.py) they share
one budget: half of /dev/shm's size and a quarter of the RAM (or cgroup limit), all together.

What it does: in a private mount namespace (`unshare -m`, so root) with a tmpfs of `--shm-size`
at /dev/shm, starts one joaderd per stage over the same small demo folder, one after the other,
each `--cache-size auto --cache-budget-dir DIR` (`--no-budget`: without the flag, as before); reads
each arena's size (its file in /dev/shm) against the budget; then runs a torch DataLoader with 2
workers whose batches are `--batch-mib` MiB tensors (the worker's batch goes through /dev/shm), and
checks every batch's bytes; stops the servers and checks that the ledger is empty again. Also
prints what the same rule gives a 5-resolution ImageNet sweep (1,281,167 items; resize
224/256/288/320/384, RGB uint8) on this host's real /dev/shm and RAM.

Writes bench/results/shm_budget[-no-budget][-together].json. Exits 1 if the DataLoader failed or the
arenas' total exceeds the budget (with the budget on).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from joader.cache.arena import format_size
from joader.server.cache_sizing import (
    CacheSize,
    PreparedSource,
    SharedBudget,
    auto_cache_size,
    budget_bytes,
    memory_limit,
    shm_size_bytes,
)
from joader.stages import build_stage

INSIDE_ENV = "JOADER_SHM_BUDGET_INSIDE"  # set in the private mount namespace
IMAGENET_ITEMS = 1_281_167
IMAGENET_SIZES = (224, 256, 288, 320, 384)
LOADER_TIMEOUT_S = 120
DEMO_ITEMS = 100  # resize:512's bound is 6 MiB an item: 600 MiB, more than the whole budget

_LOADER = r"""
import json, sys, time, torch
from torch.utils.data import DataLoader, Dataset
nbytes, batches = int(sys.argv[1]), int(sys.argv[2])

class Big(Dataset):
    def __len__(self): return batches
    def __getitem__(self, i):  # one batch: a tensor of `nbytes`, made in the worker, sent through /dev/shm
        t = torch.empty(nbytes, dtype=torch.uint8)
        t.view(-1, 1024)[:, :] = torch.arange(1024, dtype=torch.int32).add(i).remainder(251).to(torch.uint8)
        return t

start, seen, bad = time.monotonic(), [], 0
try:
    for i, t in enumerate(DataLoader(Big(), batch_size=None, num_workers=2, prefetch_factor=2, timeout=30)):
        want = torch.arange(1024, dtype=torch.int32).add(i).remainder(251).to(torch.uint8)
        rows = t.view(-1, 1024)
        bad += int(t.numel() != nbytes or not bool((rows[::97] == want).all()) or not torch.equal(rows[-1], want))
        seen.append(i)
    print(json.dumps({"ok": bad == 0 and seen == list(range(batches)), "batches": len(seen), "wrong": bad,
                      "seconds": round(time.monotonic() - start, 2)}))
except Exception as error:
    print(json.dumps({"ok": False, "batches": len(seen), "error": f"{type(error).__name__}: {str(error)[:400]}"}))
"""


def main(argv: list[str] | None = None, results: Path | None = None) -> int:
    """The scenario's command line; `results`: the default folder of `--out` (bench/results)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shm-size", default="1g", help="the private /dev/shm's size (tmpfs size=)")
    parser.add_argument("--stages", default="resize:512,resize:640,resize:768,resize:896")
    parser.add_argument("--batch-mib", type=int, default=64)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--items", type=int, default=DEMO_ITEMS, help="demo JPEGs in the served folder")
    parser.add_argument("--no-budget", action="store_true", help="start the servers without --cache-budget-dir")
    parser.add_argument("--together", action="store_true",
                        help="start the servers at the same instant (a sweep's first jobs), not one after the other")
    parser.add_argument("--auto", action="store_true",
                        help="start the servers as jobs with root= do (ensure_server), not as plain joaderds")
    parser.add_argument("--out", type=Path, help="the JSON (default bench/results/shm_budget[-no-budget].json)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    out = args.out
    if out is None:
        if results is None:
            parser.error("--out FILE is needed here (python -m bench.system.shm_budget writes to bench/results)")
        out = results / (f"shm_budget{'-no-budget' if args.no_budget else ''}{'-together' if args.together else ''}"
                         f"{'-auto' if args.auto else ''}.json")
    if args.auto and args.no_budget:
        parser.error("--auto servers always share the budget (autostart passes --cache-budget-dir)")
    if os.environ.get(INSIDE_ENV) == "1":
        result = run_inside(args.stages.split(","), batch_bytes=args.batch_mib << 20, batches=args.batches,
                            budget=not args.no_budget, items=args.items,
                            together=args.together, auto=args.auto)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        _print(result)
        return 0 if result["ok"] else 1
    sweep = imagenet_sweep()  # on the host's own /dev/shm, before the private one
    code = _reexec_in_namespace(args.shm_size, out, argv)
    if code == 2 or not out.exists():
        return 2
    result = json.loads(out.read_text())
    result["imagenet_sweep"] = sweep
    result["command"] = "python -m bench.system.shm_budget " + " ".join(argv)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _print_sweep(sweep)
    print(f"wrote {out}")
    return code


def _reexec_in_namespace(shm_size: str, out: Path, argv: list[str]) -> int:
    """This script again, in a mount namespace of its own with a `shm_size` tmpfs at /dev/shm."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("bench.system.shm_budget needs root and unshare(1): it mounts a private /dev/shm", file=sys.stderr)
        return 2
    inner = [sys.executable, "-m", "joader.testing.shm_budget", *_without_out(argv), "--out", str(out)]
    script = f'mount -t tmpfs -o size={shm_size} tmpfs /dev/shm && exec "$@"'
    env = {**os.environ, INSIDE_ENV: "1"}
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *inner], env=env, check=False).returncode


def _without_out(argv: list[str]) -> list[str]:
    if "--out" in argv:
        at = argv.index("--out")
        return argv[:at] + argv[at + 2:]
    return argv


def run_inside(stages: list[str], *, batch_bytes: int, batches: int, budget: bool,
               items: int = DEMO_ITEMS, together: bool = False, auto: bool = False) -> dict[str, Any]:
    """The servers, the DataLoader, the ledger: in this process's /dev/shm (the private one)."""
    from joader.client.tools.demo_data import make_demo_data
    from joader.launch import JoaderdProcess

    work = Path(tempfile.mkdtemp(prefix="shm-budget-"))  # 0700: the budget's directory too
    servers: list[JoaderdProcess] = []
    try:
        make_demo_data(work / "photos", items, progress=False)
        shm_size = shm_size_bytes()
        ram, ram_what = memory_limit()
        total, why = budget_bytes(shm_size, ram, ram_what)
        started: list[dict[str, Any]] = []

        def start(stage: str) -> Any:
            if auto:
                return _start_auto(stage, work)
            args = ["--source", f"photos={work / 'photos'}", "--stage", stage, "--cache-size", "auto",
                    "--workers", "1", "--listen", f"unix:{work / stage.replace(':', '-')}.sock"]
            if budget:
                args += ["--cache-budget-dir", str(work)]
            return JoaderdProcess.start(args, stdout=work / f"{stage.replace(':', '-')}.log", ready_timeout_s=60)

        if together:
            with ThreadPoolExecutor(len(stages)) as pool:
                futures = [pool.submit(start, stage) for stage in stages]
                for future in futures:  # every one, so that none is left running if one failed
                    with contextlib.suppress(Exception):
                        servers.append(future.result())
                for future in futures:
                    future.result()  # raises the first failure
        else:
            for stage in stages:
                servers.append(start(stage))
        for stage, server in zip(stages, servers, strict=True):
            log = server.log_path if auto else work / f"{stage.replace(':', '-')}.log"
            assert log is not None  # every server here logs to a file
            arena_bytes = os.stat(str(server.arena_path)).st_size
            sizing = next((line.split("--cache-size auto: ", 1)[1] for line in log.read_text().splitlines()
                           if "--cache-size auto: " in line), "")
            started.append({"stage": stage, "pid": server.pid, "arena_bytes": arena_bytes,
                            "arena": format_size(arena_bytes), "sizing": sizing})
        held = sum(s["arena_bytes"] for s in started)
        ledger = _ledger(work / "joader" if auto else work) if budget else None
        loader = _run_loader(batch_bytes, batches)
        for server in servers:
            server.stop()
        servers.clear()
        return {
            "budget_on": budget, "started_together": together, "shm_size_bytes": shm_size, "shm_size": format_size(shm_size),
            "memory_limit": f"{format_size(ram)} ({ram_what})",
            "budget_bytes": total, "budget": f"{format_size(total)} = {why}",
            "servers": started, "total_bytes": held, "total": format_size(held),
            "total_share_of_shm": round(held / shm_size, 4),
            "within_budget": held <= total,
            "ledger_entries_while_serving": None if ledger is None else len(ledger),
            "ledger_entries_after_stop": None if ledger is None else len(_ledger(work / "joader" if auto else work)),
            "started_as": "jobs start them (ensure_server of a root= spec)" if auto else "joaderd --cache-size auto",
            "dataloader": {"workers": 2, "batch_bytes": batch_bytes, "batches": batches, **loader},
            "ok": bool(loader.get("ok")) and (held <= total or not budget),
        }
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


class _AutoServer:
    """A joaderd started as a job with `root=` starts it (`ensure_server`), for `--auto`."""

    def __init__(self, spec: Any, work: Path) -> None:
        from joader.client.autostart import ensure_server
        from joader.launch import read_ready_file

        _address, started = ensure_server(spec)
        assert started is not None, "a server of this spec was already running"
        self.started = started
        self.pid = started.pid
        self.log_path = spec.socket_path().with_suffix(".log")
        info = read_ready_file(spec.socket_path().with_suffix(".ready"))
        self.arena_path = info["arena_path"] if info else None

    def stop(self) -> None:
        self.started.stop(timeout_s=30)


def _start_auto(stage: str, work: Path) -> _AutoServer:
    from joader.client.autostart import ServerSpec

    os.environ["XDG_RUNTIME_DIR"] = str(work)  # the servers' files and the budget's ledger: work/joader
    os.environ.pop("JOADER_CACHE_SIZE", None)
    return _AutoServer(ServerSpec.make("photos", work / "photos", stage=stage, idle_exit_s=600), work)


def _ledger(directory: Path) -> list[dict[str, Any]]:
    path = directory / "budget.json"
    return json.loads(path.read_text())["servers"] if path.exists() else []


def _run_loader(batch_bytes: int, batches: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    before = shutil.disk_usage("/dev/shm")
    proc = subprocess.Popen([sys.executable, "-c", _LOADER, str(batch_bytes), str(batches)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LOADER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the loader and its workers: the session this started
        stdout, stderr = proc.communicate()
        stderr = f"no batch within {LOADER_TIMEOUT_S} s; killed. " + stderr
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    report: dict[str, Any] = json.loads(lines[-1]) if lines else {"ok": False}
    if not report.get("ok"):
        report["stderr_tail"] = stderr[-800:]
    report["shm_free_before"] = format_size(before.free)
    return report


def imagenet_sweep(items: int = IMAGENET_ITEMS, sizes: tuple[int, ...] = IMAGENET_SIZES) -> dict[str, Any]:
    """The rule's figures for a 5-resolution ImageNet sweep on this host's /dev/shm and memory,
    started in order, each server seeing the others' arenas (and /dev/shm free shrinking by them)."""
    shm_size = shm_size_bytes()
    free_now = shutil.disk_usage("/dev/shm").free
    ram, ram_what = memory_limit()
    total, why = budget_bytes(shm_size, ram, ram_what)
    held: list[tuple[str, int]] = []
    rows = []
    for size in sizes:
        stage = build_stage("resize", size=size)
        source = PreparedSource("imagenet", items, stage.spec.max_nbytes, exact=False)
        choice: CacheSize = auto_cache_size(
            [source], shm_free_bytes=free_now - sum(n for _, n in held), ram_bytes=ram, min_bytes=stage.spec.max_nbytes,
            ram_what=ram_what, budget=SharedBudget(shm_size, tuple(held)))
        held.append((stage.name, choice.size_bytes))
        rows.append({"stage": stage.name, "arena_bytes": choice.size_bytes, "arena": format_size(choice.size_bytes),
                     "reason": choice.reason})
    legacy: list[int] = []
    for size in sizes:  # each alone: half of what is free, a quarter of the RAM (before issue 36)
        stage = build_stage("resize", size=size)
        source = PreparedSource("imagenet", items, stage.spec.max_nbytes, exact=False)
        legacy.append(auto_cache_size([source], shm_free_bytes=free_now - sum(legacy), ram_bytes=ram,
                                      min_bytes=stage.spec.max_nbytes, ram_what=ram_what).size_bytes)
    used = sum(n for _, n in held)
    return {"items": items, "shm_size": format_size(shm_size), "memory_limit": f"{format_size(ram)} ({ram_what})",
            "budget_bytes": total, "budget": f"{format_size(total)} = {why}", "servers": rows,
            "total_bytes": used, "total": format_size(used), "within_budget": used <= total,
            "without_budget_total": format_size(sum(legacy)),
            "without_budget": [format_size(n) for n in legacy]}


def _print(result: dict[str, Any]) -> None:
    print(f"/dev/shm {result['shm_size']}, budget {result['budget']} (budget {'on' if result['budget_on'] else 'OFF'})")
    for server in result["servers"]:
        print(f"  {server['stage']:<12} {server['arena']:>11}  {server['sizing']}")
    print(f"  total {result['total']} ({result['total_share_of_shm']:.1%} of /dev/shm), within budget: "
          f"{result['within_budget']}")
    print(f"  DataLoader(2 workers, {result['dataloader']['batch_bytes'] >> 20} MiB batches): {result['dataloader']}")
    if result["budget_on"]:
        print(f"  ledger entries while serving {result['ledger_entries_while_serving']}, after stop "
              f"{result['ledger_entries_after_stop']}")


def _print_sweep(sweep: dict[str, Any]) -> None:
    print(f"ImageNet sweep on this host (/dev/shm {sweep['shm_size']}, {sweep['memory_limit']}), budget {sweep['budget']}:")
    for server in sweep["servers"]:
        print(f"  {server['stage']:<12} {server['arena']:>11}")
    print(f"  total {sweep['total']} (without the budget: {sweep['without_budget_total']}: {sweep['without_budget']})")


if __name__ == "__main__":
    sys.exit(main())
