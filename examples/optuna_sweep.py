"""An Optuna study on joader: three trials of a small CNN at once, all reading one folder of images.

    joader make-demo-data demo-data --items 1200
    python examples/optuna_sweep.py --root demo-data

No joaderd to start: the first trial's `JoaderDataset(..., root=...)` starts one for the folder
(detached, shared by every later trial with the same root and image size), and it exits by
itself 10 minutes after the last trial (`JOADER_IDLE_EXIT_S`; `joader servers --stop` at once).
The trials run in threads of this process (`n_jobs`); torch's thread setting is the process's,
one thread by default (JoaderDataset's threads="auto"). For processes sharing one study, run it
once per process with a storage, e.g. three times at once:

    optuna create-study --study-name cnn --storage sqlite:///study.db --direction minimize
    python examples/optuna_sweep.py --root demo-data --storage sqlite:///study.db --trials 1 --jobs 1

(creating the study first: processes that all create a new SQLite study at once can collide on
its tables, optuna/optuna#4621).

Each trial builds its own `JoaderDataset` in a `with` block: one job of joaderd's, named after
the study and the trial in `joader status`, ended at the block's end, also when the pruner stops
the trial (without `with`, a pruned trial's dataset lives until Python's cycle collector runs).
"""

from __future__ import annotations

import argparse
import os

import optuna
import torch

from joader import JoaderDataset


def small_cnn(channels: int, classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(channels, 16, 3, stride=2), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes))


def make_objective(root: str, image_size: int, epochs: int):
    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", 0.003, 0.3, log=True)
        with JoaderDataset("photos", root=root, image_size=image_size,
                           name=f"{trial.study.study_name}-{trial.number}") as ds:
            model = small_cnn(ds.item_shape[0], len(ds.classes))
            optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            loader = torch.utils.data.DataLoader(ds, batch_size=32)
            loss_mean = float("inf")
            for epoch in range(epochs):
                loss_sum, total = 0.0, 0
                for images, labels in loader:
                    loss = torch.nn.functional.cross_entropy(model(images.float() / 255), labels)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    loss_sum += loss.item() * len(labels)
                    total += len(labels)
                loss_mean = loss_sum / total
                trial.report(loss_mean, epoch)
                if trial.should_prune():
                    raise optuna.TrialPruned()  # the `with` block ends the job
        return loss_mean

    return objective


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the images: class subfolders of JPEG/PNG files")
    parser.add_argument("--image-size", type=int, default=64, help="the side joaderd crops and resizes to")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=3, help="trials at once, in threads of this process")
    parser.add_argument("--study", default="cnn", help="the study's name (the jobs are named after it)")
    parser.add_argument("--storage", default=None, help="a study shared by processes, e.g. sqlite:///study.db")
    args = parser.parse_args()

    storage = None
    if args.storage:  # SQLite busy with another process's write: wait, rather than "database is locked"
        storage = optuna.storages.RDBStorage(args.storage, engine_kwargs={"connect_args": {"timeout": 60}})
    study = optuna.create_study(study_name=args.study, storage=storage, load_if_exists=True, direction="minimize",
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
    objective = make_objective(os.path.abspath(args.root), args.image_size, args.epochs)
    study.optimize(objective, n_trials=args.trials, n_jobs=args.jobs)
    for trial in study.trials:
        print(f"trial {trial.number}: {trial.state.name}, lr {trial.params['lr']:.3g}, loss {trial.value}")
    print(f"best: trial {study.best_trial.number}, lr {study.best_params['lr']:.3g}")


if __name__ == "__main__":
    main()
