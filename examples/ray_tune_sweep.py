"""A Ray Tune sweep on joader: three trials of a small CNN, all reading one folder of images.

    joader make-demo-data demo-data --items 1200
    python examples/ray_tune_sweep.py --root demo-data

No joaderd to start: the driver's `joader.serve(...)` starts one for the folder (or finds the
one running), and stops it when the sweep is over. Each trial builds its own `JoaderDataset`
with the same `root=` and `image_size=`, which finds that server (a trial run without the
driver's block would start it itself), in a `with` block: one job of joaderd's, named after the
trial in `joader status`, ended at the block's end, or with the trial's process when ASHA stops
the trial early. joaderd decodes each image once for all the trials that read it.
"""

from __future__ import annotations

import argparse
import os

import ray
import torch
from ray import tune
from ray.tune.schedulers import ASHAScheduler

import joader
from joader import JoaderDataset


def small_cnn(channels: int, classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(channels, 16, 3, stride=2), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes))


def train_cnn(config: dict) -> None:
    trial = tune.get_context().get_trial_name()
    with JoaderDataset("photos", root=config["root"], image_size=config["image_size"], name=trial) as ds:
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
    parser.add_argument("--root", required=True, help="the images: class subfolders of JPEG/PNG files")
    parser.add_argument("--image-size", type=int, default=64, help="the side joaderd crops and resizes to")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cpus-per-trial", type=float, default=1.0, help="Ray's CPUs per trial (0.5: 3 at once on 2 cores)")
    parser.add_argument("--storage", default=None, help="Ray Tune's results folder (default ~/ray_results)")
    args = parser.parse_args()
    root = os.path.abspath(args.root)

    # The sweep's joaderd: started here (or found running), stopped at the end of the block.
    with joader.serve("photos", root=root, image_size=args.image_size):
        ray.init(include_dashboard=False)  # RAY_ADDRESS: an existing cluster
        tuner = tune.Tuner(
            tune.with_resources(train_cnn, {"cpu": args.cpus_per_trial}),
            param_space={"lr": tune.grid_search([0.01, 0.03, 0.1]), "root": root,
                          "image_size": args.image_size, "epochs": args.epochs},
            tune_config=tune.TuneConfig(scheduler=ASHAScheduler(metric="loss", mode="min", max_t=args.epochs,
                                                                grace_period=1, reduction_factor=2)),
            run_config=tune.RunConfig(name="joader-sweep", storage_path=args.storage, verbose=0),
        )
        results = tuner.fit()
        ray.shutdown()
    for result in results:
        print(f"lr {result.config['lr']:g}: {result.metrics['training_iteration']} epochs, "
              f"loss {result.metrics['loss']:.3f}, accuracy {result.metrics['accuracy']:.2f}")
    best = results.get_best_result(metric="loss", mode="min")
    print(f"best: lr {best.config['lr']:g}")


if __name__ == "__main__":
    main()
