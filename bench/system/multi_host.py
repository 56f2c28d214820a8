"""Issue 20's bench: jobs whose ranks span hosts, one joaderd per host, on one machine.

Each simulated host is a joaderd of its own (own socket, own arena, `--workers 1`, a cache that
holds the host's part of the dataset plus a little); each node is a torchrun agent
(`--nnodes H --rdzv-backend c10d`) whose ranks find their host's joaderd through JOADER_ADDRESS,
as on a real node. Every rank runs the plain DDP loop: `DataLoader(JoaderDataset("demo"),
batch_size=B)`, gloo, an all_reduce and a `--step-s` sleep (an emulated GPU step) per batch.

Scenarios, for each H in `--hosts`:
- one job across H hosts (one rank per host), and two such jobs at once on the same hosts;
- the same jobs on one joaderd (all H ranks on one node, one cache as large as the H caches
  together): the single-host figure to compare with.

Reported (medians of `--reps`), from each joaderd's status after the jobs have gone:
- decodes per host against the host's part (|D| x its ranks / W) x epochs... over all epochs:
  with a cache that holds the part, a host decodes its part once, and `decodes / part` is 1;
- items per rank per epoch (the same on every rank: no hang at an epoch's end);
- jobs served per decode, per host and overall;
- each job's rate (samples/s over its ranks, first batch to last) against the same job on one
  joaderd.

    python -m bench.system.multi_host            # about 6 minutes
    python -m bench.system.multi_host --quick    # 2 hosts, 1 repetition
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
from typing import Any

from bench.common import ITEM_NBYTES, Server, demo_data, machine, median, print_table, write_json

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ one rank

def job_main(args: argparse.Namespace) -> int:
    """One rank of the plain DDP script (torchrun sets RANK, WORLD_SIZE, LOCAL_*)."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from joader import JoaderDataset

    dataset = JoaderDataset("demo", indices=range(args.items))
    dist.init_process_group("gloo")
    loader = DataLoader(dataset, batch_size=args.batch_size)
    counts = []
    started = time.perf_counter()
    for _ in range(args.epochs):
        count = 0
        for _images, labels in loader:
            time.sleep(args.step_s)
            dist.all_reduce(torch.ones(1))
            count += len(labels)
        counts.append(count)
    wall_s = time.perf_counter() - started
    report = {"rank": dist.get_rank(), "items": counts, "wall_s": wall_s, "len_loader": len(loader),
              "hosts": dataset.hosts.as_dict() if dataset.hosts is not None else None}
    Path(args.out.format(rank=dist.get_rank())).write_text(json.dumps(report))
    dataset.close()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------ one scenario

def _torchrun(nnodes: int, nproc: int, endpoint: str, run_id: str, args: argparse.Namespace, out: str,
              address: str, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, JOADER_ADDRESS=address, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node",
               str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
               "--max-restarts", "0", "-m", "bench.system.multi_host", "job", "--items", str(args.items),
               "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--step-s", repr(args.step_s),
               "--out", out]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                            start_new_session=True)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_scenario(root: Path, hosts: int, jobs: int, spread: bool, args: argparse.Namespace) -> dict[str, Any]:
    """`jobs` jobs of `hosts` ranks each, either spread over `hosts` joaderds (one rank per
    host) or all on one joaderd (`spread` False, its cache the sum of the hosts')."""
    work = Path(tempfile.mkdtemp(prefix="jbmh-", dir="/tmp"))
    part_items = args.items // hosts
    host_cache = (part_items + 16) * ITEM_NBYTES
    servers = [Server(root, host_cache if spread else host_cache * hosts, workers=1)
               for _ in range(hosts if spread else 1)]
    procs = []
    try:
        for j in range(jobs):
            endpoint = f"127.0.0.1:{_free_port()}"
            out = str(work / f"job{j}-{{rank}}.json")
            if spread:
                procs += [_torchrun(hosts, 1, endpoint, f"job{j}", args, out, server.address,
                                    work / f"job{j}-node{h}.err") for h, server in enumerate(servers)]
            else:
                procs.append(_torchrun(1, hosts, endpoint, f"job{j}", args, out, servers[0].address,
                                       work / f"job{j}.err"))
        deadline = time.monotonic() + args.timeout_s
        for proc in procs:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                errors = "\n".join(p.read_text(errors="replace")[-3000:] for p in work.glob("*.err"))
                raise RuntimeError(f"a torchrun exited with {code}:\n{errors}")
        reports = [[json.loads((work / f"job{j}-{r}.json").read_text()) for r in range(hosts)] for j in range(jobs)]
        statuses = [server.status() for server in servers]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    part = args.items * (1 if not spread else 1) // (hosts if spread else 1)
    decodes = [s["items_decoded"] for s in statuses]
    delivered = [s["items_delivered"] for s in statuses]
    return {
        "hosts": hosts, "jobs": jobs, "spread": spread,
        "part_items": part, "decodes_per_host": decodes, "deliveries_per_host": delivered,
        "decodes_over_part": [round(d / part, 3) for d in decodes],
        "served_per_decode": round(sum(delivered) / max(1, sum(decodes)), 3),
        "items_per_rank_per_epoch": [[r["items"] for r in job] for job in reports],
        "len_loader": sorted({r["len_loader"] for job in reports for r in job}),
        "samples_per_s": [round(sum(sum(r["items"]) for r in job) / max(r["wall_s"] for r in job), 1)
                          for job in reports],
    }


# ------------------------------------------------------------------------------ the bench

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        parser = argparse.ArgumentParser(prog="python -m bench.system.multi_host job")
        parser.add_argument("--items", type=int, required=True)
        parser.add_argument("--epochs", type=int, required=True)
        parser.add_argument("--batch-size", type=int, required=True)
        parser.add_argument("--step-s", type=float, required=True)
        parser.add_argument("--out", required=True)
        return job_main(parser.parse_args(argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hosts", default="2,4", help="comma-separated numbers of simulated hosts")
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--reps", type=int)
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args(argv)
    if args.quick:
        args.hosts, args.reps = "2", args.reps or 1
    args.reps = args.reps or 3
    root = demo_data(args.items)
    started = time.monotonic()
    results = []
    for hosts in [int(h) for h in args.hosts.split(",")]:
        for jobs in (1, 2):
            for spread in (True, False):
                reps = []
                for rep in range(args.reps):
                    reps.append(run_scenario(root, hosts, jobs, spread, args))
                    r = reps[-1]
                    print(f"[{time.monotonic() - started:6.1f} s] {hosts} hosts, {jobs} job(s), "
                          f"{'one joaderd per host' if spread else 'one joaderd'}, rep {rep}: decodes/part "
                          f"{r['decodes_over_part']}, served/decode {r['served_per_decode']}, "
                          f"samples/s {r['samples_per_s']}", flush=True)
                results.append({**reps[-1], "reps": reps,
                                "decodes_over_part": [median([r["decodes_over_part"][h] for r in reps])
                                                      for h in range(len(reps[0]["decodes_over_part"]))],
                                "served_per_decode": median([r["served_per_decode"] for r in reps]),
                                "samples_per_s": [median([r["samples_per_s"][j] for r in reps]) for j in range(jobs)]})
    single = {(r["hosts"], r["jobs"]): r for r in results if not r["spread"]}
    rows = []
    for r in results:
        if not r["spread"]:
            continue
        base = single[(r["hosts"], r["jobs"])]
        rows.append([r["hosts"], r["jobs"], r["part_items"], r["decodes_over_part"],
                     r["items_per_rank_per_epoch"][0][0], r["served_per_decode"], base["served_per_decode"],
                     r["samples_per_s"], base["samples_per_s"],
                     [round(a / b, 2) for a, b in zip(r["samples_per_s"], base["samples_per_s"], strict=True)]])
    print(f"\n{args.items} images, {args.epochs} epochs, batch {args.batch_size}, {args.step_s} s step, one rank per "
          f"host, each host's cache its part + 16 items; medians of {args.reps}:")
    print_table(["hosts", "jobs", "part", "decodes / part per host", "items per rank per epoch (job 0, rank 0)",
                 "served/decode", "one joaderd", "samples/s per job", "one joaderd", "x one joaderd"], rows)
    data = {"command": "python -m bench.system.multi_host " + " ".join(argv), "machine": machine(),
            "items": args.items, "epochs": args.epochs, "batch_size": args.batch_size, "step_s": args.step_s,
            "reps": args.reps, "results": results, "elapsed_s": round(time.monotonic() - started, 1)}
    path = write_json("multi_host" + ("-quick" if args.quick else ""), data)
    print(f"\nwrote {path} ({data['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
