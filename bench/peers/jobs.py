"""The processes of the peers bench: one training job (any side) and the TensorSocket producer, and
the pieces they share with the bench (a counting ImageFolder, CPU-seconds of a process tree)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

from bench.peers.tensorsocket import tensorsocket_classes

IMAGE_SIZE = 256


def tree_cpu(pid: int) -> float:
    """CPU-seconds (user + system, and reaped children's) of `pid` and every live descendant."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def counted_folder(root: str, transform: Any = None) -> Any:
    """A map-style ImageFolder doing joaderd's shared stage (turbo decoder) in whichever process
    reads it, then `transform`; yields (image, label, index); counts its reads across workers."""
    import multiprocessing as mp

    import torch
    from torch.utils.data import Dataset

    class Folder(Dataset):
        def __init__(self) -> None:
            from joader.sources.imagefolder import list_image_folder

            self.listing = list_image_folder(root)
            self.reads = mp.get_context("fork").Value("q", 0)  # inherited by forked workers
            self._stage: Any = None

        def __len__(self) -> int:
            return len(self.listing.paths)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
            if self._stage is None:  # built in the worker
                from joader.stages import build_stage

                self._stage = build_stage("center-crop", size=IMAGE_SIZE, decoder="turbo")
            image = torch.from_numpy(self._stage.prepare(self.listing.read(i), self.listing.paths[i]))
            with self.reads.get_lock():
                self.reads.value += 1
            if transform is not None:
                image = transform(image)
            return image, int(self.listing.labels[i]), i

    return Folder()


def producer_main(args: argparse.Namespace) -> int:
    """The TensorSocket producer process: a DataLoader doing the shared stage in its workers."""
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=False)  # the harness asks where a hung producer is
    FairProducer, _, pack_fn, _ = tensorsocket_classes(set(args.fixes.split(",")) - {""})
    dataset = counted_folder(args.root)
    options = {"prefetch_factor": args.prefetch_factor} if args.prefetch_factor else {}
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0, **options)
    ports = [int(p) for p in args.ports.split(",")]
    producer = FairProducer(loader, port=ports[0], ack_port=ports[1], heart_ports=(ports[2], ports[3]),
                            pack_fn=pack_fn)
    args.ready_file.touch()
    deadline = time.monotonic() + 300
    while len(producer.live()) < args.min_consumers:  # every consumer registered (together), or one
        if time.monotonic() > deadline:
            raise TimeoutError("consumers did not register")
        time.sleep(0.01)
    producer.announce(args.batch_size)
    last = time.monotonic()
    while args.go_file is not None and not args.go_file.exists():  # the start barrier
        if time.monotonic() - last > 0.5:  # a consumer that missed it
            producer.announce(args.batch_size)
            last = time.monotonic()
        time.sleep(0.002)
    epochs = 0
    while not args.stop_file.exists():
        for _ in producer:
            if args.stop_file.exists():
                break
        epochs += 1
    report = {"reads": dataset.reads.value, "epochs_started": producer.epoch, "broadcasts": producer.broadcasts,
              "broadcast_bytes": producer.broadcast_bytes, "ack_wait_s": round(producer.ack_wait_s, 3),
              "ack_timeouts": producer.ack_timeouts, "epoch_start_wait_s": round(producer.spin_s, 3),
              "heart_failures": producer.hb.failures, "heart_joins": producer.hb.joins, "events": producer.events}
    args.out.write_text(json.dumps(report))
    if loader._iterator is not None:  # the persistent workers
        loader._iterator._shutdown_workers()
    os._exit(0)  # the heartbeat's IOLoop thread and ZMQ contexts: nothing to flush


def job_main(args: argparse.Namespace) -> int:
    """One training job (its own process): build its loader, read `--epochs` epochs recording
    the order, a sleep per batch as the GPU step."""
    import torch
    from torch.utils.data import DataLoader

    from joader.testing.simjob import RandomCropFlip

    launched_cpu = tree_cpu(os.getpid())
    transform = RandomCropFlip(args.augment)
    dataset: Any = None
    consumer: Any = None

    def build() -> Any:
        nonlocal dataset, consumer
        if args.side == "joader":
            from joader import JoaderDataset

            dataset = JoaderDataset("demo", address=args.address, transform=transform, return_index=True)
            return DataLoader(dataset, batch_size=args.batch_size)
        torch.set_num_threads(1)  # what a careful user sets beside busy workers
        if args.side == "dataloaders":
            dataset = counted_folder(args.root, transform)
            return DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers,
                              persistent_workers=args.num_workers > 0)
        _, FairConsumer, _, _ = tensorsocket_classes(set(args.fixes.split(",")) - {""})
        ports = [int(p) for p in args.ports.split(",")]
        consumer = FairConsumer(port=ports[0], ack_port=ports[1], heart_ports=(ports[2], ports[3]),
                                batch_size=args.batch_size)
        return consumer

    def batches(loader: Any) -> Any:
        """(indices, images) for one epoch, whatever the side."""
        if args.side == "joader":
            for indices, images, _labels in loader:
                yield indices, images
        elif args.side == "dataloaders":
            for images, _labels, indices in loader:
                yield indices, images
        else:
            for images, _labels, indices in loader:  # the job stage, in this process
                yield indices, torch.stack([transform(image) for image in images])

    loader = build() if args.build_first else None
    args.ready_file.touch()
    deadline = time.monotonic() + 600
    while not args.go_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {args.go_file}")
        time.sleep(0.002)
    arrived_at, arrived_cpu = time.time(), tree_cpu(os.getpid())
    if loader is None:
        loader = build()
    built_at = time.time()
    first_batch_at = None
    batch_times: list[float] = []
    epochs = []
    count_all = 0
    half_written = False
    for _ in range(args.epochs):
        started_at = time.time()
        order: list[int] = []
        for indices, images in batches(loader):
            if first_batch_at is None:
                first_batch_at = time.time()
            if len(batch_times) < 200:
                batch_times.append(round(time.time(), 3))
            if images.shape[1:] != (3, args.augment, args.augment):
                raise RuntimeError(f"unexpected batch {tuple(images.shape)}")
            order.extend(int(i) for i in indices)
            count_all += len(indices)
            if not half_written and args.half_file and count_all * 2 >= args.items:
                args.half_file.touch()
                half_written = True
            time.sleep(args.step_s)  # the emulated GPU step
        epochs.append({"started_at": started_at, "ended_at": time.time(), "order": order})
    ended_at, ended_cpu = time.time(), tree_cpu(os.getpid())
    report = {"side": args.side, "arrived_at": arrived_at, "built_at": built_at, "first_batch_at": first_batch_at,
              "ended_at": ended_at, "samples": count_all, "epochs": epochs,
              "cpu_s": ended_cpu - arrived_cpu, "cpu_total_s": ended_cpu, "cpu_before_start_s": arrived_cpu,
              "cpu_at_launch_s": launched_cpu, "batch_times": batch_times,
              "reads": dataset.reads.value if args.side == "dataloaders" else None,
              "job_id": dataset.job_id if args.side == "joader" else None}
    args.out.write_text(json.dumps(report))
    if args.side == "joader":
        dataset.close()
    if consumer is not None:
        consumer.goodbye()
        os._exit(0)  # TensorConsumer's threads never end
    return 0
