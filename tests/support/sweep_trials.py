"""Sweeps as people launch them, for tests/integration/test_sweeps.py: Ray Tune trials and Optuna
trials (threads of one study, or processes sharing a SQLite study), each a tiny training loop on
a `JoaderDataset` of its own, recording what it received.

    python -m tests.support.sweep_trials ray --out DIR [--epochs 2]
    python -m tests.support.sweep_trials optuna-threads --out DIR
    python -m tests.support.sweep_trials optuna-create --storage URL --study NAME
    python -m tests.support.sweep_trials optuna-process --out DIR --storage URL --study NAME

joaderd's address is `JOADER_ADDRESS` (Ray's workers get it through the runtime_env); Ray is a
local cluster of 2 CPUs that the driver starts. Each trial writes `DIR/trial-<key>.jsonl`, one JSON
object a line: `attached` (its trial, job id, the name `joader status` shows for the job, the
process), one `sample` per item (epoch, index, label, crc32 of its pixels: what
`integrity.check_records` reads), `epoch` after each whole epoch. The driver writes
`DIR/driver-<pid>.jsonl`: `gone` (a finished trial's job left `joader status`, how long after)
and `after` (the jobs attached once the sweep returned, the process still alive; `all`: the
whole sweep is over, not only this process's part of a shared study).

Trials do not pass `name=`: their default names are what is tested. How each trial ends is set
by its number (Optuna: `PLAN`) or its learning rate (Ray: the stopper ends the trial of
`EARLY_LR` after its first epoch). Optuna's callbacks wait for the trial's job to go, in the
trial's thread; Ray's must not (its controller stops a stopped trial's actor only after the
callbacks returned: waiting there held the job up for as long as it waited), so a thread polls
joaderd's status meanwhile (`Watcher`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from joader.client.tools.cli import fetch_status

if TYPE_CHECKING:
    import torch

    from joader import JoaderDataset

# NOTE [ Drivers import no torch ]
# torch (and JoaderDataset, which imports it) is imported where a trial runs, not at the top:
# the processes that only create a study or drive Ray Tune (its trials run in Ray's workers)
# spent 1.5-2 CPU-s importing it for nothing.

SOURCE = "demo"
BATCH = 16
EARLY_LR = 0.05  # the Ray trial the stopper ends after its first epoch
GONE_TIMEOUT_S = 10.0  # the test asserts the lease bound; this only keeps a driver from hanging

# Optuna trial number -> how it ends: `with` closes the dataset at the block's end; "scope"
# lets it go out of scope when the objective returns; "pruned" raises TrialPruned after its
# first epoch, inside a `with` block (NOTE [ A sweep's trial ends its job ] in dataset.py).
PLAN = {0: "with", 1: "pruned", 2: "scope"}


class Record:
    """One JSON object a line, appended to `path`; the file is opened at the first write (a
    Tune callback is pickled with the Tuner's state before the sweep starts)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: Any = None

    def write(self, **fields: Any) -> None:
        if self.file is None:
            self.file = open(self.path, "a")  # noqa: SIM115  closed by `close`
        self.file.write(json.dumps(fields) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def status_names() -> dict[str, str]:
    return {job["job_id"]: job["name"] for job in fetch_status()["jobs"]}


def net(channels: int, classes: int) -> torch.nn.Module:
    """A small convolutional classifier of uint8 images (`train_epoch` scales them to [0, 1])."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Conv2d(channels, 8, 3, stride=2), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, classes))


def attached(ds: JoaderDataset, record: Record, trial: str) -> None:
    record.write(kind="attached", trial=trial, job_id=ds.job_id, status_name=status_names().get(ds.job_id),
                 pid=os.getpid(), script=os.path.basename(sys.argv[0]))


def train_epoch(ds: JoaderDataset, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                record: Record) -> float:
    """One epoch, every sample recorded; the mean loss."""
    import torch

    losses = []
    for indices, images, labels in torch.utils.data.DataLoader(ds, batch_size=BATCH):
        for index, image, label in zip(indices.tolist(), images, labels.tolist(), strict=True):
            record.write(kind="sample", epoch=epoch, index=index, label=label,
                         crc=zlib.crc32(image.contiguous().numpy().tobytes()))
        loss = torch.nn.functional.cross_entropy(model(images.float() / 255), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    record.write(kind="epoch", epoch=epoch)
    return sum(losses) / max(1, len(losses))


def wait_gone(job_id: str) -> float | None:
    """Seconds until `job_id` left joaderd's status (None: still there after GONE_TIMEOUT_S)."""
    start = time.monotonic()
    while job_id in status_names():
        if time.monotonic() - start > GONE_TIMEOUT_S:
            return None
        time.sleep(0.05)
    return time.monotonic() - start


# ------------------------------------------------------------------------------------ Ray Tune

def ray_sweep(out: Path, epochs: int) -> None:
    import ray
    from ray import tune

    def trainable(config: dict[str, Any]) -> None:
        import torch

        from joader import JoaderDataset

        context = tune.get_context()
        trial = context.get_trial_name()
        record = Record(out / f"trial-{context.get_trial_id()}.jsonl")
        torch.manual_seed(0)
        with JoaderDataset(SOURCE, return_index=True, batch_size=BATCH) as ds:  # JOADER_ADDRESS
            attached(ds, record, trial)
            # Not len(ds.classes): see the NOTE in examples/ray_tune_sweep.py.
            model = net(ds.item_shape[0], len(ds.class_to_idx))
            optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
            for epoch in range(1, epochs + 1):
                loss = train_epoch(ds, model, optimizer, epoch, record)
                # A trial the stopper ends never comes back from this call: Ray ends its process.
                tune.report({"epoch": epoch, "loss": loss, "early": config["lr"] == EARLY_LR})
        record.close()

    class Completed(tune.Callback):
        """When each trial ended, as Tune's controller saw it. It must not wait here: the
        controller stops a trial's actor only after its callbacks returned."""

        def __init__(self) -> None:
            self.at: dict[str, float] = {}

        def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
            self.at[trial.trial_id] = time.monotonic()

    address = os.environ["JOADER_ADDRESS"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JOADER_ADDRESS": address}})
    completed = Completed()
    watcher = Watcher()
    # The trial of EARLY_LR is stopped after its first epoch's report; the others run every epoch.
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search([EARLY_LR, 0.1, 0.2])},
        tune_config=tune.TuneConfig(max_concurrent_trials=2),
        run_config=tune.RunConfig(name="sweep", storage_path=str(out / "ray_results"), verbose=0,
                                  stop=lambda trial_id, result: bool(result["early"]) and result["epoch"] >= 1,
                                  callbacks=[completed]),
    )
    results = tuner.fit()
    watcher.stop()
    driver = Record(out / f"driver-{os.getpid()}.jsonl")
    for trial_id, ended in completed.at.items():
        path = out / f"trial-{trial_id}.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        job = next((line["job_id"] for line in lines if line["kind"] == "attached"), None)
        missing = watcher.missing_since.get(job) if job else None
        driver.write(kind="gone", trial=trial_id, job_id=job, after_s=None if missing is None else missing - ended)
    driver.write(kind="after", jobs=sorted(status_names()), pid=os.getpid(), all=True,
                 errors=[str(result.error) for result in results if result.error])
    driver.close()
    ray.shutdown()


class Watcher(threading.Thread):
    """Polls joaderd's status every 0.1 s while a sweep runs: when each job that was seen
    attached was first seen gone (`missing_since`, time.monotonic())."""

    def __init__(self) -> None:
        super().__init__(name="status-watcher", daemon=True)
        self.missing_since: dict[str, float] = {}
        self._seen: set[str] = set()
        self._stop_event = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stop_event.wait(0.1):
            now, live = time.monotonic(), set(status_names())
            for job in self._seen - live:
                self.missing_since.setdefault(job, now)
            self._seen |= live

    def stop(self, timeout_s: float = GONE_TIMEOUT_S) -> None:
        """Stops once every job seen attached was seen gone (or after `timeout_s`): the last
        trial's job leaves up to a lease after `fit` returned, and a watcher stopped at once
        recorded it as never gone on a loaded host."""
        deadline = time.monotonic() + timeout_s
        while self._seen - set(self.missing_since) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop_event.set()
        self.join()


# ------------------------------------------------------------------------------------ Optuna

def objective_for(out: Path, epochs: int, driver: Record) -> Any:
    import optuna

    def objective(trial: optuna.Trial) -> float:
        import torch

        from joader import JoaderDataset

        plan = PLAN[trial.number]
        record = Record(out / f"trial-{trial.number}.jsonl")
        lr = trial.suggest_float("lr", 0.01, 0.2, log=True)
        torch.manual_seed(trial.number)
        if plan == "scope":  # no `with`, no close(): it goes out of scope when this returns
            ds = JoaderDataset(SOURCE, return_index=True, batch_size=BATCH)
            trial.set_user_attr("job_id", ds.job_id)
            attached(ds, record, str(trial.number))
            model = net(ds.item_shape[0], len(ds.classes))
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            loss = 0.0
            for epoch in range(1, epochs + 1):
                loss = train_epoch(ds, model, optimizer, epoch, record)
            record.close()
            return loss
        with JoaderDataset(SOURCE, return_index=True, batch_size=BATCH) as ds:
            trial.set_user_attr("job_id", ds.job_id)
            attached(ds, record, str(trial.number))
            model = net(ds.item_shape[0], len(ds.classes))
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            loss = 0.0
            for epoch in range(1, epochs + 1):
                loss = train_epoch(ds, model, optimizer, epoch, record)
                trial.report(loss, epoch)
                if plan == "pruned":
                    record.close()
                    raise optuna.TrialPruned()
        record.close()
        return loss

    def gone(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        # Called in the trial's thread once its objective returned or raised.
        job = frozen.user_attrs.get("job_id")
        driver.write(kind="gone", trial=str(frozen.number), job_id=job, state=frozen.state.name,
                     after_s=wait_gone(job) if job else None)

    return objective, gone


def optuna_sweep(out: Path, epochs: int, *, storage: str | None, study_name: str | None) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    driver = Record(out / f"driver-{os.getpid()}.jsonl")
    objective, gone = objective_for(out, epochs, driver)
    if storage is None:  # one process, three threads
        study = optuna.create_study(direction="minimize")
        study.optimize(objective, n_trials=3, n_jobs=3, callbacks=[gone])
    else:  # one of three processes on one study
        study = optuna.load_study(study_name=study_name, storage=rdb(storage))
        study.optimize(objective, n_trials=1, callbacks=[gone])
    driver.write(kind="after", jobs=sorted(status_names()), pid=os.getpid(), all=storage is None)
    driver.close()


def rdb(url: str) -> Any:
    """SQLite shared by processes: a busy database waits (up to 60 s) instead of failing with
    "database is locked" (optuna/optuna#820; Optuna's FAQ on SQLite concurrency)."""
    import optuna

    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("ray", "optuna-threads", "optuna-create", "optuna-process"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--storage")
    parser.add_argument("--study")
    args = parser.parse_args()
    if args.mode == "optuna-create":
        import optuna

        optuna.create_study(study_name=args.study, storage=rdb(args.storage), direction="minimize")
    elif args.mode == "ray":
        ray_sweep(args.out, args.epochs)
    else:
        optuna_sweep(args.out, args.epochs, storage=args.storage if args.mode == "optuna-process" else None,
                     study_name=args.study)


if __name__ == "__main__":
    main()
