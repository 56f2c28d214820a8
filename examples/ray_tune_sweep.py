"""A Ray Tune sweep on joader: three trials of a small CNN, all reading one source of joaderd's.

Start joaderd on the host first, then the sweep beside it (one shell):

    joader make-demo-data demo-data --items 1200
    joaderd --source demo=demo-data --cache-size 256MiB --listen unix:/tmp/joaderd.sock &
    JOADER_ADDRESS=unix:/tmp/joaderd.sock python examples/ray_tune_sweep.py --source demo

Each trial builds its own `JoaderDataset` inside the trial, in a `with` block: one job of
joaderd's, named after the trial in `joader status`, ended at the block's end, or with the
trial's process when ASHA stops the trial early. joaderd decodes each image once for all the
trials that read it. JOADER_ADDRESS reaches the trials through Ray's runtime_env.
"""

from __future__ import annotations

import argparse
import os

import ray
import torch
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from joader import JoaderDataset


def small_cnn(channels: int, classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(channels, 16, 3, stride=2), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes))


def train_cnn(config: dict) -> None:
    trial = tune.get_context().get_trial_name()
    # With auto-start (to come), `root=` goes here: JoaderDataset(config["source"], root=
    # "/data/photos", image_size=64, name=trial) finds or starts the host's joaderd itself.
    with JoaderDataset(config["source"], name=trial) as ds:
        # NOTE: len(ds.class_to_idx), not len(ds.classes). Ray pickles this function by value
        # (cloudpickle), and a function of a script that uses the global `torch` and the name
        # `classes` is taken to use the module torch.classes, which cannot be pickled ("cannot
        # pickle '_Classes' object"; the same trap as cloudpipe/cloudpickle#405).
        model = small_cnn(ds.item_shape[0], len(ds.class_to_idx))
        optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
        loader = torch.utils.data.DataLoader(ds, batch_size=32)
        for _epoch in range(config["epochs"]):
            total = correct = 0
            loss_sum = 0.0
            for images, labels in loader:
                logits = model(images.float() / 255)
                loss = torch.nn.functional.cross_entropy(logits, labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                loss_sum += loss.item() * len(labels)
                correct += int((logits.argmax(1) == labels).sum())
                total += len(labels)
            tune.report({"loss": loss_sum / total, "accuracy": correct / total})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="demo", help="the joaderd source to train on")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--storage", default=None, help="Ray Tune's results folder (default ~/ray_results)")
    args = parser.parse_args()

    env = {"JOADER_ADDRESS": os.environ["JOADER_ADDRESS"]} if "JOADER_ADDRESS" in os.environ else {}
    ray.init(include_dashboard=False, runtime_env={"env_vars": env})  # RAY_ADDRESS: an existing cluster
    tuner = tune.Tuner(
        train_cnn,
        param_space={"lr": tune.grid_search([0.01, 0.03, 0.1]), "source": args.source, "epochs": args.epochs},
        tune_config=tune.TuneConfig(scheduler=ASHAScheduler(metric="loss", mode="min", max_t=args.epochs,
                                                            grace_period=1, reduction_factor=2)),
        run_config=tune.RunConfig(name="joader-sweep", storage_path=args.storage, verbose=0),
    )
    results = tuner.fit()
    for result in results:
        print(f"lr {result.config['lr']:g}: {result.metrics['training_iteration']} epochs, "
              f"loss {result.metrics['loss']:.3f}, accuracy {result.metrics['accuracy']:.2f}")
    best = results.get_best_result(metric="loss", mode="min")
    print(f"best: lr {best.config['lr']:g}")


if __name__ == "__main__":
    main()
