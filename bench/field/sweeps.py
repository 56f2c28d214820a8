"""Sweeps as people launch them: Ray Tune and Optuna trials on joader with no joaderd started by
hand, against the same sweeps on a plain folder dataset running the same decoder.

Each sweep is 3 trials of an lr search, a small CNN (bench.field.field's, one torch thread per trial)
trained for E epochs on the demo JPEGs at 64 px, batch 32. On the joader side every trial builds
`JoaderDataset("demo", root=..., image_size=64, return_index=True, name=<trial>)` in a `with`
block: the first trial to get there starts joaderd (`joader.client.autostart`), the others find
it, and it exits by itself once the sweep is over (`JOADER_IDLE_EXIT_S`, 15 s here). On the
folder side each trial reads `bench.field.field_job.StageFolder` (joaderd's stage, same decoder and
parameters) through a shuffling DataLoader with one worker, as a trial would read an
ImageFolder; on the `pil-folder` side the same with Pillow's decoder (torchvision's).

Tools: `ray` (tune.Tuner, 3 trials at 0.5 CPU each so all run at once), `optuna-threads`
(study.optimize(n_jobs=3)) and `optuna-procs` (3 processes, one SQLite study). Every trial
checks each of its epochs: every item exactly once, with its label. Reported per sweep: the
sweep's wall (from launch to the last trial's end), jobs served per decode (joaderd's status,
read before it exits), and what is left once it is over: joaderd and lease keeper processes,
joader arenas in /dev/shm. `--kill-after-s T` kills the auto-started joaderd (-9) T seconds after
it first serves in each joader sweep: a trial's lease keeper starts it again and the epochs must stay exact.

Usage: python -m bench.field.sweeps [--items 1200] [--epochs 3] [--reps 3] [--tools ray,optuna-threads,optuna-procs]
       [--sides joader,folder,pil-folder] [--image-size 64] [--kill-after-s T] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "demo"
IMAGE_SIZE = 64
BATCH_SIZE = 32
LRS = (0.01, 0.03, 0.1)
IDLE_EXIT_S = 15  # longer than a trial takes from starting joaderd to attaching on a busy host
TOOLS = ("ray", "optuna-threads", "optuna-procs")


# ------------------------------------------------------------------------------------- a trial

def train(config: dict[str, Any], report: Any = None) -> dict[str, Any]:
    """One trial: `config["epochs"]` epochs on joader or the folder; writes its record."""
    import torch
    from torch.utils.data import DataLoader

    from bench.field.field_job import StageFolder, small_cnn
    from joader.sources.imagefolder import list_image_folder

    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])
    labels = list_image_folder(config["root"]).labels
    name = config["name"]
    size = config.get("image_size", IMAGE_SIZE)
    record: dict[str, Any] = {"name": name, "side": config["side"], "epochs": [], "started": time.time()}
    if config["side"] == "joader":
        from joader import JoaderDataset

        dataset: Any = JoaderDataset(SOURCE, root=config["root"], image_size=size, return_index=True, name=name)
        loader = DataLoader(dataset, batch_size=BATCH_SIZE)
    else:  # "folder": joaderd's decoder (turbo); "pil-folder": Pillow, as a torchvision ImageFolder decodes
        decoder = "pil" if config["side"] == "pil-folder" else config["decoder"]
        dataset = StageFolder(config["root"], size, "RGB", False, decoder)
        loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=1, persistent_workers=True,
                            generator=torch.Generator().manual_seed(config["seed"]))
    model = small_cnn(3, size)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    try:
        for epoch in range(config["epochs"]):
            seen: list[int] = []
            wrong_labels = 0
            loss_sum = 0.0
            for ids, images, targets in loader:
                loss = torch.nn.functional.cross_entropy(model(images.float().div_(255)), targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                loss_sum += float(loss) * len(targets)
                seen.extend(int(i) for i in ids)
                wrong_labels += sum(int(t) != int(labels[int(i)]) for i, t in zip(ids, targets, strict=True))
            exact = sorted(seen) == list(range(len(labels))) and wrong_labels == 0
            record["epochs"].append({"items": len(seen), "distinct": len(set(seen)), "wrong_labels": wrong_labels,
                                     "exact": exact, "loss": loss_sum / max(1, len(seen))})
            if report is not None:
                report({"loss": loss_sum / max(1, len(seen)), "epoch": epoch})
    finally:
        if config["side"] == "joader":
            dataset.close()
    record["ended"] = time.time()
    Path(config["records"], f"{name}.json").write_text(json.dumps(record))
    return record


def ray_trial(config: dict[str, Any]) -> None:
    from ray import tune

    name = tune.get_context().get_trial_name()
    train(dict(config, name=name, seed=LRS.index(config["lr"])), report=tune.report)


def optuna_objective(base: dict[str, Any]) -> Any:
    def objective(trial: Any) -> float:
        lr = trial.suggest_categorical("lr", list(LRS))
        record = train(dict(base, lr=lr, seed=trial.number, name=f"{trial.study.study_name}-{trial.number}"))
        return record["epochs"][-1]["loss"]

    return objective


# --------------------------------------------------------------------------------- one sweep

def _env(runtime: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JOADER_ADDRESS"}
    env.update(XDG_RUNTIME_DIR=str(runtime), JOADER_IDLE_EXIT_S=str(IDLE_EXIT_S), PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return env


def run_sweep(tool: str, side: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One sweep in a process of its own (Ray and Optuna keep state per process), in a private
    XDG_RUNTIME_DIR (its auto-started joaderd is its own)."""
    runtime = Path(tempfile.mkdtemp(prefix="jsw-", dir="/tmp"))
    runtime.chmod(0o700)
    records = runtime / "records"
    records.mkdir()
    config = {"side": side, "root": str(root), "epochs": args.epochs, "records": str(records),
              "image_size": args.image_size,
              "decoder": "turbo", "tool": tool}
    before = _leftovers()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "bench.field.sweeps", "driver", json.dumps(config)],
                            env=_env(runtime), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status: dict[str, Any] | None = None
    killed = None
    seen = 0.0  # when the auto-started joaderd was first seen
    try:
        while proc.poll() is None:
            time.sleep(0.2)
            if side != "joader":
                continue
            servers = _servers(runtime)
            if servers:
                seen = seen or time.monotonic()
                status = _status(servers[0]["address"], runtime) or status
                if args.kill_after_s and killed is None and time.monotonic() - seen > args.kill_after_s:
                    killed = servers[0]["pid"]
                    os.kill(int(killed), signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} {side} sweep failed ({proc.returncode}):\n{err[-4000:]}")
    trials = [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]
    trials_wall = max(t["ended"] for t in trials) - min(t["started"] for t in trials) if trials else 0.0
    # The auto-started joaderd exits IDLE_EXIT_S after the last trial closed its dataset.
    deadline = time.monotonic() + IDLE_EXIT_S + 30
    while True:
        after = _leftovers()
        left = {k: sorted(set(after[k]) - set(before[k])) for k in after}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    log = "".join(p.read_text(errors="replace") for p in (runtime / "joader").glob("*.log")) \
        if (runtime / "joader").exists() else ""
    shutil.rmtree(runtime, ignore_errors=True)
    exact = len(trials) == len(LRS) and all(e["exact"] for t in trials for e in t["epochs"]) \
        and all(len(t["epochs"]) == args.epochs for t in trials)  # a trial that failed wrote no record
    result: dict[str, Any] = {
        "tool": tool, "side": side, "wall_s": round(wall, 2), "trials_wall_s": round(trials_wall, 2),
        "trials": len(trials), "exact": exact, "epochs": [len(t["epochs"]) for t in trials],
        "names": [t["name"] for t in trials], "left_running": left,
        "servers_started": log.count(" started by pid "), "killed_server": killed,
    }
    if status is not None:
        decoded, delivered = status.get("items_decoded", 0), status.get("items_delivered", 0)
        result |= {"items_decoded": decoded, "items_delivered": delivered,
                   "served_per_decode": round(delivered / decoded, 3) if decoded else None,
                   "sharing": status.get("sharing"),  # within epochs (jobs per decode) and cross-epoch reuse
                   "cache_bytes": status.get("cache", {}).get("capacity_bytes")}
    return result


def _servers(runtime: Path) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "servers", "--json"], env=_env(runtime),
                         capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []


def _status(address: str, runtime: Path) -> dict[str, Any] | None:
    out = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "status", "--json", "--address", address],
                         env=_env(runtime), capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _leftovers() -> dict[str, list[Any]]:
    """joaderd and lease keeper processes, and joader arenas in /dev/shm, now."""
    procs: dict[str, list[Any]] = {"joaderd": [], "keepers": [], "arenas": []}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "-m joader.server" in cmdline:
            procs["joaderd"].append(int(entry.name))
        elif "joader.client.keeper_process" in cmdline:
            procs["keepers"].append(int(entry.name))
    procs["arenas"] = sorted(p.name for p in Path("/dev/shm").glob("joader-*"))
    return procs


# ------------------------------------------------------------------------------ the drivers

def driver(config: dict[str, Any]) -> int:
    """Runs one sweep with `config["tool"]` (in its own process)."""
    tool = config["tool"]
    if tool == "ray":
        import ray
        from ray import tune

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=bool(os.environ.get("BENCH_RAY_LOGS")), logging_level="ERROR",
                 runtime_env={"env_vars": {k: os.environ[k] for k in ("XDG_RUNTIME_DIR", "JOADER_IDLE_EXIT_S",
                                                                     "PYTHONPATH")}})
        trainable = tune.with_resources(ray_trial, {"cpu": 0.5})
        tuner = tune.Tuner(trainable, param_space=dict(config, lr=tune.grid_search(list(LRS))),
                           tune_config=tune.TuneConfig(max_concurrent_trials=3),
                           run_config=tune.RunConfig(name="bench-sweeps", verbose=0,
                                                     storage_path=str(Path(config["records"]).parent / "ray")))
        results = tuner.fit()
        ray.shutdown()
        return 0 if not results.errors else 1
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.GridSampler({"lr": list(LRS)})
    if tool == "optuna-threads":
        study = optuna.create_study(study_name="threads", sampler=sampler)
        study.optimize(optuna_objective(config), n_trials=3, n_jobs=3)
        return 0
    storage = f"sqlite:///{Path(config['records']).parent / 'study.db'}"
    optuna.create_study(study_name="procs", storage=storage, sampler=sampler)
    procs = [subprocess.Popen([sys.executable, "-m", "bench.field.sweeps", "optuna-proc", json.dumps(config), storage])
             for _ in range(3)]
    return max(p.wait() for p in procs)


def optuna_proc(config: dict[str, Any], storage_url: str) -> int:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(storage_url, engine_kwargs={"connect_args": {"timeout": 60}})
    study = optuna.load_study(study_name="procs", storage=storage,
                              sampler=optuna.samplers.GridSampler({"lr": list(LRS)}))
    study.optimize(optuna_objective(config), n_trials=1)
    return 0


# --------------------------------------------------------------------------------- the bench

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["driver"]:
        return driver(json.loads(argv[1]))
    if argv[:1] == ["optuna-proc"]:
        return optuna_proc(json.loads(argv[1]), argv[2])
    from bench.common import demo_data, machine, median, print_table, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=IMAGE_SIZE, help="the shared stage's S (center-crop)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--sides", default="joader,folder")
    parser.add_argument("--kill-after-s", type=float, default=0.0)
    parser.add_argument("--name", default="sweeps")
    args = parser.parse_args(argv)
    root = Path(demo_data(args.items))
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    for rep in range(args.reps):
        for tool in args.tools.split(","):
            sides = args.sides.split(",")
            for side in sides if rep % 2 == 0 else sides[::-1]:
                result = run_sweep(tool, side, root, args) | {"rep": rep}
                results.append(result)
                print(f"[{time.monotonic() - started:6.0f} s] rep {rep} {tool} {side}: wall {result['wall_s']} s, "
                      f"trials {result['trials']} exact {result['exact']}, served/decode "
                      f"{result.get('served_per_decode', '-')}, servers started {result['servers_started']}, "
                      f"left {result['left_running']}", flush=True)
    rows = []
    sides = args.sides.split(",")
    for tool in args.tools.split(","):
        by = {s: [r for r in results if r["tool"] == tool and r["side"] == s] for s in sides}
        walls = {s: median([r["wall_s"] for r in by[s]]) if by[s] else None for s in sides}
        spans = {s: median([r["trials_wall_s"] for r in by[s]]) if by[s] else None for s in sides}
        j = by.get("joader", [])
        row: list[Any] = [tool]
        for s in sides:
            ratio = f" ({walls[s] / walls['joader']:.2f}x)" if s != "joader" and walls.get("joader") and walls[s] else ""
            row.append(f"{walls[s]} / {spans[s]}{ratio}" if walls[s] is not None else "-")
        within = [r["sharing"]["within_epoch"] for r in j if r.get("sharing")]
        row += [median([r["served_per_decode"] for r in j if r.get("served_per_decode")]) if j else "-",
                median(within) if within else "-",
                all(r["exact"] for s in sides for r in by[s]), max((r["servers_started"] for r in j), default=0),
                sum(len(v) for s in sides for r in by[s] for v in r["left_running"].values())]
        rows.append(row)
    print(f"\n{args.items} demo JPEGs at {args.image_size} px, 3 trials x {args.epochs} epochs, medians of {args.reps}"
          + (f", joaderd killed -9 {args.kill_after_s:g} s after it started, in each joader sweep"
             if args.kill_after_s else "")
          + ". Wall s: the sweep / the trials' span (x: against joader's sweep):")
    print_table(["sweep", *[f"{s} wall s" for s in sides], "deliveries/decode", "jobs/decode (within epochs)",
                 "every epoch exact", "servers started", "left running"], rows)
    path = write_json(args.name, {"command": "python -m bench.field.sweeps " + " ".join(argv), "machine": machine(),
                                  "items": args.items, "epochs": args.epochs, "reps": args.reps,
                                  "image_size": args.image_size,
                                  "kill_after_s": args.kill_after_s, "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
