"""joader beside TensorSocket: four jobs sharing one host's data preparation, two ways.

TensorSocket (PyPI `tensorsocket` 0.0.5) shares ONE data loader among several training jobs: a
producer process runs a DataLoader and publishes each batch over ZMQ to every consumer (a job);
all jobs see the same order, in lock-step with the slowest, and a job that arrives mid-epoch
waits for the next one. joader prepares each item once into a shared cache and gives each job
its own exactly-once, uniformly shuffled epoch at its own speed. This bench runs both, and four
independent DataLoaders, side by side in each repetition (their order rotated).

The run (as `bench/system/four_jobs.py`): 4 jobs x 2 epochs over the 1,200 demo JPEGs (500x375), batch
25, an emulated GPU step of 0.08 s per batch (a sleep), a random 224 crop + flip per image in the
job's own process (its job stage). Two scenarios:
- together: the jobs build their loaders, then start reading at once (a start file);
- staggered: each job arrives (builds its loader) once the previous one has read half an epoch
  (600 samples) of its own reading, as `bench/field/sweep_trace.py`'s staggered schedule.
Sides:
- joader: joaderd with the README's defaults (`--workers auto`), a cache of a quarter of the
  prepared dataset; each job `DataLoader(JoaderDataset("demo", transform=crop_flip,
  return_index=True), batch_size=25)` (the plain script; `return_index` to record the order);
- TensorSocket: a producer process running a DataLoader over an ImageFolder that does joaderd's
  shared stage with joaderd's decoder (`joader.stages`, turbo: simplejpeg with DCT scaling +
  OpenCV) in 2 DataLoader workers (joaderd's `auto` pool grows to 2 here), batch 25, shuffled;
  each job a `TensorConsumer(batch_size=25)` that applies its crop + flip to what it receives;
- DataLoaders: 4 independent DataLoaders over the same ImageFolder and decoder, 1 worker each
  (four_jobs' "turbo DataLoaders"), one torch thread in the training process.
The index of every item travels with it (TensorSocket: a third tensor in the batch), so each
job's order per epoch is recorded: exactly-once per epoch is checked, and two jobs' orders are
compared position by position.

What is reported, per scenario and side (medians over `--reps` repetitions):
- throughput: all samples over the span (first arrival to last job's end); share of the ideal:
  the GPU-bound span (every job steps back to back: 96 x 0.08 = 7.68 s together; staggered, each
  job arriving 24 steps after the previous, 3 x 1.92 + 7.68 = 13.44 s) over the measured span;
- CPU-seconds of every process of the side from the start (each job from its arrival) to the
  end (psutil, process trees): joaderd + its decode workers + forker and the jobs (their lease
  keepers); the producer + its DataLoader workers and the consumers; the jobs and their workers.
  Imports before the start are left out on every side;
- decodes: joaderd's `items_decoded`; the producer's dataset reads; the DataLoaders' reads
  (counted in the datasets, across their workers);
- exactly-once: every epoch of every job holds each of the 1,200 items once;
- order overlap: for two jobs, the share of positions where both got the same item, in the
  pairing of their epochs that matches most (TensorSocket staggered: a job's second epoch is the
  next job's first) - the mean over the 6 pairs and the largest pair; 1 means the jobs see one
  order, 1/1200 is independent shuffles;
- the wait from a job's arrival to its first batch (the largest over jobs): a TensorSocket job
  that arrives mid-epoch waits for the next producer epoch.

Fairness. Both sharing sides decode with the same code (`joader.stages`, turbo) on the same 2
cores; the job stage runs in the job's process on every side; TensorSocket's producer does not
read before the start (its DataLoader iterator is made on the first batch, as the baselines'
workers start on `iter()`), and in the together scenario it waits, as the other sides' jobs do,
until every consumer is built (all 4 registered) before the start file. TensorSocket 0.0.5 is
written for CUDA (it shares CUDA IPC handles); on this CPU-only machine it needs the
work-arounds below to run correctly and at a sensible cost. Each one is in this file (a subclass
or a pack function; site-packages is not edited), each can be turned off (`--ts-fixes`) to see
what it fixes, and each keeps TensorSocket's design (one shared order, lock-step, late joiners
wait for the next epoch):

1. last batch (`tensorsocket/producer.py:391`): `get_sample` resets the epoch as soon as the
   loader's last batch has been *read* into the rubber-band buffer, before that producer batch
   (up to `producer_batch_size` = 8 loader batches) is broadcast: here 200 of every 1,200 items
   are never sent (each job's epoch: 1,000 items). Fix: the epoch ends once every live consumer
   has been sent every batch; the last, possibly partial, producer batch is broadcast first
   (`FairProducer.get_sample`; the pool's slots are replaced when a partial batch's shape differs,
   `producer.py:200`).
2. pickled storages (`tensorsocket/payload.py:83-94`, `producer.py:535,549`): on a CPU tensor
   `TensorPayload` calls `share_memory_()` and pickles the *storage*; `send_pyobj` is plain
   pickle, which writes a storage's whole bytes, so each consumer's slice of 25 carries the whole
   collated producer batch of 200: 8 slices x 4 consumers = 32x the data, 1,258 MB per broadcast
   here (measured: `pickle.dumps` of that payload). Fix: `pack_fn` sends each slice as a numpy
   view of just its rows, one object per slice shared by every consumer that gets it, so pickle's
   memo writes it once: a broadcast is its 39 MB of data, which each consumer receives once (a
   PUB message goes to all); `unpack_fn` makes tensors of them.
3. a consumer that leaves (`tensorsocket/producer.py:568`, `heartbeat.py:64-72`,
   `producer.py:351-359`): a job that has finished its epochs and exits still counts among the
   expected acks of the next broadcast (the producer waits 10 s for it), and at the next epoch
   `__iter__` waits for its progress to read 0, which a job that exited after its last pong never
   reports (a hang: `__iter__` looks only at `self.consumers`, which only `get_sample` prunes).
   TensorConsumer has no close. Fix: the job sends a goodbye on the ack channel when it is done
   (a separate PUB socket, made at start); the producer forgets it at once (acks, consumers,
   hearts), waits for acks in short polls, and drops an expected ack once the heartbeat has lost
   its consumer.
4. heartbeats (`tensorsocket/heartbeat.py:24,46,64-72,97`): a consumer counts as gone if its pong
   does not answer the *latest* ping of a 0.5 s period; a pong late under load is discarded, the
   consumer is dropped (`producer.py:387-389`) and re-added with no progress, and then counts as
   too far behind (`producer.py:428-432,518`): it gets nothing more in that epoch and its epoch ends
   short. Fix: `TolerantHeartBeater` accepts a pong for any ping and drops a heart after 3 s of
   silence.
5. a busy wait (`tensorsocket/producer.py:352-359`): at each epoch's start `__iter__` spins without
   sleeping until every consumer has drained its buffer (up to 10 batches, 0.8 s here), a core
   taken from the decoders and the GIL from the heartbeat thread. Fix: the same wait, polling
   every 2 ms.
TensorSocket's other defaults are kept: `producer_batch_size` 8, a rubber band of 0.5% (at least
one producer batch), consumer buffers of 10 batches, a 0.5 s idle poll with no consumers; and so
is its design, which costs it here and is not worked around: the producer reads the next
producer batch (8 loader batches) only once every consumer has acknowledged the previous one
(`producer.py:449-471`; the DataLoader's workers prefetch 2 batches each: half of one with 2
workers, `--ts-prefetch-factor` to change), every consumer receives the whole published message,
and a job arriving mid-epoch is "too far behind" (`producer.py:518-519`) and skips the rest of
the epoch (`consumer.py:181-189`): it reads whole epochs, but the producer's, from the next one.

Usage: python -m bench.peers.peers [--reps 3] [--quick] [--scenarios together,staggered]
       [--sides joader,tensorsocket,dataloaders] [--ts-fixes all|none|-name,...]
Writes bench/results/peers-<timestamp>.json and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIDES = ("joader", "tensorsocket", "dataloaders")
LABELS = {"joader": "joader", "tensorsocket": "TensorSocket", "dataloaders": "DataLoaders (1 worker/job)"}
SCENARIOS = ("together", "staggered")
FIXES = ("lastbatch", "pickle", "leave", "heartbeat", "spin")
IMAGE_SIZE = 256


# ------------------------------------------------------------------------------ shared pieces


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


# ----------------------------------------------------------- TensorSocket and its work-arounds


def _tensorsocket_classes(fixes: set[str]) -> tuple[type, type, Any, Any]:
    """FairProducer, FairConsumer, pack_fn, unpack_fn for the work-arounds in `fixes`."""
    import numpy as np
    import torch
    import zmq
    from tensorsocket.consumer import TensorConsumer
    from tensorsocket.consumer import unpack as stock_unpack
    from tensorsocket.heartbeat import HeartBeater
    from tensorsocket.producer import ConsumerProgress, TensorPool, TensorProducer
    from tensorsocket.producer import pack as stock_pack
    from zmq.eventloop import zmqstream

    class TolerantHeartBeater(HeartBeater):
        """Work-around 4 (heartbeat.py:64-72,97): a pong answering any ping counts, and a
        heart is dropped after `grace_s` of silence, not after one late pong. Counts drops."""

        def __init__(self, *args: Any, tolerant: bool, departed: set[bytes], grace_s: float = 3.0,
                     **kwargs: Any) -> None:
            self.tolerant = tolerant
            self.departed = departed  # said goodbye (work-around 3): never re-added
            self.grace_s = grace_s
            self.last_seen: dict[bytes, float] = {}
            self.failures = 0
            self.joins = 0
            super().__init__(*args, **kwargs)

        def beat(self) -> None:
            if not self.tolerant:
                self.responses -= self.departed
                self.hearts -= self.departed
                return super().beat()
            now = time.monotonic()
            self.lifetime += now - self.tic
            self.tic = now
            for heart in self.responses - self.departed:
                self.last_seen[heart] = now
                if heart not in self.hearts:
                    self.handle_new_heart(heart)
            for heart in list(self.hearts):
                if heart in self.departed:
                    self.hearts.discard(heart)
                elif now - self.last_seen.get(heart, now) > self.grace_s:
                    self.handle_heart_failure(heart)
            self.responses = set()
            self.pingstream.send(str(self.lifetime).encode("utf-8"))

        def handle_new_heart(self, heart: bytes) -> None:
            self.joins += 1
            super().handle_new_heart(heart)

        def handle_heart_failure(self, heart: bytes) -> None:
            self.failures += 1
            super().handle_heart_failure(heart)

        def handle_pong(self, msg: list) -> None:
            if not self.tolerant:
                return super().handle_pong(msg)
            self.responses.add(msg[0])  # any ping's answer: the consumer is alive
            self.heart_progress[str(msg[0])] = int.from_bytes(msg[1], "big")
            self.heart_batch_size[str(msg[0])] = int.from_bytes(msg[2], "big")

    class SafePool(TensorPool):
        def assign(self, data: tuple) -> Any:  # a partial last batch (work-around 1) has another shape
            slot = self.pool[(self.index + 1) % self.max_size]
            if slot is not None and any(d.shape != s.shape for d, s in zip(slot, data, strict=False)
                                        if isinstance(s, torch.Tensor)):
                self.pool[(self.index + 1) % self.max_size] = None
            return super().assign(data)

    class LazyLoader:
        """The DataLoader, its iterator made on the first batch: no reading before the start."""

        def __init__(self, loader: Any) -> None:
            self.loader = loader

        def __len__(self) -> int:
            return len(self.loader)

        def __iter__(self) -> Any:
            return LazyIterator(self.loader)

    class LazyIterator:
        def __init__(self, loader: Any) -> None:
            self.loader, self.it = loader, None

        def __next__(self) -> Any:
            if self.it is None:
                self.it = iter(self.loader)
            return next(self.it)

    class FairProducer(TensorProducer):
        def __init__(self, data_loader: Any, *args: Any, **kwargs: Any) -> None:
            self.fixes = fixes
            self.departed: set[bytes] = set()
            self.pending: list[list[bytes]] = []
            self.broadcasts = 0
            self.broadcast_bytes = 0
            self.ack_wait_s = 0.0
            self.ack_timeouts = 0
            self.spin_s = 0.0
            self.events: list[tuple[Any, ...]] = []
            super().__init__(LazyLoader(data_loader), *args, **kwargs)
            self.pool = SafePool(self.pool.max_size)
            stock_send = self.socket.send_pyobj

            def send_pyobj(obj: Any, flags: int = 0, protocol: int = pickle.DEFAULT_PROTOCOL) -> Any:
                message = pickle.dumps(obj, protocol)  # what send_pyobj does, measured
                if isinstance(obj, dict) and not ({"stop_iteration", "data_loader_len"} & obj.keys()):
                    self.broadcasts += 1
                    self.broadcast_bytes += len(message)
                return self.socket.send(message, flags=flags)

            self.socket.send_pyobj = send_pyobj  # type: ignore[method-assign]
            del stock_send

        def _start_heartbeat(self) -> None:  # producer.py:304-322, with the tolerant heart beater
            from tornado import ioloop

            self.loop = ioloop.IOLoop()
            context = zmq.Context()
            pub = context.socket(zmq.PUB)
            pub.bind(f"tcp://*:{self.heart_ports[0]}")
            sub = context.socket(zmq.SUB)
            sub.bind(f"tcp://*:{self.heart_ports[1]}")
            sub.subscribe(b"")
            self.hb = TolerantHeartBeater(self.loop, zmqstream.ZMQStream(pub, self.loop),
                                          zmqstream.ZMQStream(sub, self.loop),
                                          tolerant="heartbeat" in fixes, departed=self.departed)
            self.loop.start()

        # -- the start barrier: consumers are built once they have the loader's length
        def announce(self, batch_size: int) -> None:
            self.loader_batch_size = batch_size
            self._send_consumer_len()

        def live(self) -> list[str]:
            for _ in range(10):
                try:
                    return [str(x) for x in list(self.hb.hearts)]
                except RuntimeError:  # the heartbeat thread changed the set
                    time.sleep(0.001)
            return []

        # -- work-around 3: goodbyes
        def _forget(self, consumer: str) -> None:
            heart = consumer[2:-1].encode()
            self.departed.add(heart)
            self.consumers.pop(consumer, None)
            self.loop.add_callback(self.hb.hearts.discard, heart)

        def _read_goodbyes(self) -> None:
            while self.ack_socket.poll(0, zmq.POLLIN):
                message = self.ack_socket.recv_multipart()
                if message[2] == b"bye":
                    self._forget(str(message[0]))
                else:
                    self.pending.append(message)

        def _prune(self) -> None:  # producer.py:387-389
            live = self.live()
            for consumer in list(self.consumers):
                if consumer not in live:
                    self.consumers.pop(consumer)

        def __iter__(self) -> Any:
            if "spin" not in fixes and "leave" not in fixes:
                return super().__iter__()
            started = time.monotonic()
            while True:  # producer.py:352-359: wait until every consumer has finished the epoch
                if "leave" in fixes:
                    self._read_goodbyes()
                    self._prune()
                if all(self.hb.heart_progress.get(k, 0) == 0 for k in list(self.consumers)):
                    for v in self.consumers.values():
                        v.reset()
                    break
                if "spin" in fixes:
                    time.sleep(0.002)
            self.spin_s += time.monotonic() - started
            self.events.append((round(time.time(), 3), "epoch starts", round(time.monotonic() - started, 3)))
            return self

        # -- work-around 1: the last producer batch of an epoch
        def _unsent(self) -> bool:
            if not self.rb_buffer:
                return False
            behind = [x.batch_max for x in self.consumers.values()
                      if x.batch_max >= self.index - len(self.rb_buffer)]
            return bool(behind) and min(behind) < self.index

        def get_sample(self) -> Any:
            if "lastbatch" not in fixes:
                return super().get_sample()
            # producer.py:371-475, two lines changed (marked)
            self._prune()
            if self.index >= self.data_loader_len and not self._unsent():  # CHANGED: and nothing unsent
                self._reset_producer()
                return None
            elif not len(self.hb.consumers):
                time.sleep(0.5)
                return None
            current_batch_index = self.index
            try:
                expected = [str(x) for x in self.hb.consumers]
                for consumer in expected:
                    if str(consumer) not in self.consumers:
                        self.consumers[str(consumer)] = ConsumerProgress(
                            __import__("collections").deque(maxlen=self.consumer_max_buffer_size + 1),
                            __import__("collections").deque(maxlen=self.consumer_max_buffer_size + 1),
                            self.loader_batch_size, self.hb.heart_batch_size[str(consumer)])
                        self.send_len = True
                if self.send_len and self.loader_batch_size:
                    self.send_len = False
                    self._send_consumer_len()
                if self.rb_buffer:
                    try:
                        min_batch = min(x.batch_max for x in self.consumers.values()
                                        if x.batch_max >= self.index - len(self.rb_buffer))
                        if min_batch not in [x[0] for x in self.rb_buffer]:
                            current_batch_index, buffer_index = -1, -1
                        else:
                            buffer_index = [x[0] for x in self.rb_buffer].index(min_batch)
                            current_batch_index, _ = self.rb_buffer[buffer_index]
                    except ValueError:
                        raise StopIteration from None
                else:
                    current_batch_index, buffer_index = 0, 0
                batch_length = len(self.rb_buffer[buffer_index:])
                # CHANGED: at the epoch's end, broadcast what is left instead of reading on
                if batch_length < self.producer_batch_size and self.index < self.data_loader_len:
                    self.rb_buffer.append((self.index, next(self.data_loader_iter)))
                    if self.loader_batch_size == 0:
                        self.loader_batch_size = len(self.rb_buffer[-1][1][0])
                        for consumer in self.consumers:
                            self.consumers[consumer].loader_batch_size = self.loader_batch_size
                    if len(self.rb_buffer) > self.rb_max_len:
                        self.rb_buffer.pop(0)
                    self.index += 1
                    return None
                payload = self._broadcast(self.epoch, current_batch_index, buffer_index)
                self._handle_acks(expected, payload)
            except StopIteration:
                self._reset_producer()
            return None

        def _broadcast(self, *args: Any) -> dict:
            pack_memo.clear()  # a slice shared by every consumer that gets it, in this broadcast only
            self.events.append((round(time.time(), 3), "broadcast", *args[:2], len(self.consumers)))
            payload = super()._broadcast(*args)
            self.events.append((round(time.time(), 3), "sent"))
            return payload

        def _handle_acks(self, expected: list, payload: dict) -> None:
            started = time.monotonic()
            try:
                if "leave" not in fixes:
                    before = time.monotonic()
                    super()._handle_acks(expected, payload)
                    if time.monotonic() - before > 9.5:
                        self.ack_timeouts += 1
                    return
                # producer.py:563-598, in 50 ms polls; goodbyes and consumers the heartbeat lost
                expected = list(expected)
                deadline = time.monotonic() + 10.0
                while expected:
                    if self.pending:
                        message = self.pending.pop(0)
                    elif self.ack_socket.poll(50, zmq.POLLIN):
                        message = self.ack_socket.recv_multipart()
                    else:
                        live = self.live()
                        expected = [c for c in expected if c in live and c in self.consumers]
                        if time.monotonic() > deadline:
                            self.ack_timeouts += 1
                            expected = []
                        continue
                    consumer, batch_max, accepted = message
                    consumer = str(consumer)
                    if accepted == b"bye":
                        self._forget(consumer)
                    if consumer in expected:
                        expected.remove(consumer)
                    if accepted == b"1" and consumer in self.consumers:
                        self.consumers[consumer].add_batch(int(batch_max), payload)
            finally:
                self.ack_wait_s += time.monotonic() - started
                self.events.append((round(time.time(), 3), "acked", round(time.monotonic() - started, 3)))

    pack_memo: dict[Any, Any] = {}

    def pack_fn(data: tuple) -> tuple:
        """Work-around 2: each slice as numpy views of its own rows (not the whole storage), one
        object per slice per broadcast, so that pickle's memo writes it once for all consumers."""
        if "pickle" not in fixes:
            return stock_pack(data)
        key = tuple((t.data_ptr(), tuple(t.shape)) if isinstance(t, torch.Tensor) else id(t) for t in data)
        packed = pack_memo.get(key)
        if packed is None:
            packed = pack_memo[key] = tuple(t.numpy() if isinstance(t, torch.Tensor) else t for t in data)
        return packed

    def unpack_fn(data: tuple) -> tuple:
        if "pickle" not in fixes:
            return stock_unpack(data)
        return tuple(torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in data)

    class FairConsumer(TensorConsumer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, unpack_fn=unpack_fn, **kwargs)
            if "leave" in fixes:  # its own socket: the fetch thread owns the ack socket
                self.bye_socket = self.context.socket(zmq.PUB)
                self.bye_socket.connect(f"tcp://localhost:{self.ack_port}")

        def goodbye(self) -> None:
            if "leave" in fixes:
                self.bye_socket.send_multipart([str(self.consumer_id).encode(), str(self.batch_max).encode(), b"bye"])
                time.sleep(0.2)  # let ZMQ's I/O thread send it before the process exits

    return FairProducer, FairConsumer, pack_fn, unpack_fn


def producer_main(args: argparse.Namespace) -> int:
    """The TensorSocket producer process: a DataLoader doing the shared stage in its workers."""
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=False)  # the harness asks where a hung producer is
    FairProducer, _, pack_fn, _ = _tensorsocket_classes(set(args.fixes.split(",")) - {""})
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


# ------------------------------------------------------------------------------------- a job


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
        _, FairConsumer, _, _ = _tensorsocket_classes(set(args.fixes.split(",")) - {""})
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


# ---------------------------------------------------------------------------------- the bench


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_side(side: str, scenario: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of `args.jobs` jobs on one side in one scenario: reports and accounting."""
    from bench.common import Server, quarter_cache_bytes

    work = Path(tempfile.mkdtemp(prefix="peers-", dir="/tmp"))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}  # the plain script's environment
    together = scenario == "together"
    server = Server(root, quarter_cache_bytes(args.items), workers=args.server_workers) if side == "joader" else None
    producer = None
    procs: list[subprocess.Popen[bytes]] = []
    go = work / "go"
    ports = ",".join(map(str, free_ports(4)))
    started = time.monotonic()
    try:
        if side == "tensorsocket":
            command = [sys.executable, "-m", "bench.peers.peers", "producer", "--root", str(root), "--ports", ports,
                       "--workers", str(args.ts_workers), "--batch-size", str(args.batch_size),
                       "--prefetch-factor", str(args.ts_prefetch_factor),
                       "--min-consumers", str(args.jobs if together else 1), "--fixes", args.ts_fixes,
                       "--ready-file", str(work / "pready"), "--stop-file", str(work / "stop"),
                       "--out", str(work / "producer.json")]
            if together:
                command += ["--go-file", str(go)]
            producer = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(work / "producer.err", "wb"),
                                        env=env)
            wait_for([work / "pready"], [producer], work, "the producer")
        for i in range(args.jobs):
            command = [sys.executable, "-m", "bench.peers.peers", "job", side, "--epochs", str(args.epochs),
                       "--batch-size", str(args.batch_size), "--step-s", str(args.step_s), "--augment",
                       str(args.augment), "--items", str(args.items), "--ready-file", str(work / f"ready{i}"),
                       "--go-file", str(go if together or i == 0 else work / f"half{i - 1}"),
                       "--half-file", str(work / f"half{i}"), "--out", str(work / f"job{i}.json"),
                       "--fixes", args.ts_fixes]
            if together:
                command.append("--build-first")
            if side == "joader":
                command += ["--address", server.address]
            elif side == "dataloaders":
                command += ["--root", str(root), "--num-workers", str(args.dl_workers)]
            else:
                command += ["--ports", ports]
            procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                          stderr=open(work / f"job{i}.err", "wb"), env=env))
        wait_for([work / f"ready{i}" for i in range(args.jobs)], procs + ([producer] if producer else []), work,
                 "the jobs")
        time.sleep(0.3)  # every job now waits on its start file
        tree = server.proc.pid if server is not None else producer.pid if producer is not None else None
        before = tree_cpu(tree) if tree is not None else 0.0
        go.touch()
        deadline = time.monotonic() + args.timeout_s
        for i, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if producer is not None and producer.poll() is None:
                    producer.send_signal(signal.SIGUSR1)  # its main thread's stack, into producer.err
                    time.sleep(1.0)
                raise RuntimeError(f"{side} {scenario}: job {i} timed out:\n" + tails(work)) from None
            if code != 0:
                raise RuntimeError(f"{side} {scenario}: job {i} failed ({code}):\n" + tails(work))
        after = tree_cpu(tree) if tree is not None else 0.0
        status = server.status() if server is not None else None
        produced = None
        if producer is not None:
            (work / "stop").touch()
            producer.wait(timeout=60)
            produced = json.loads((work / "producer.json").read_text())
        reports = [json.loads((work / f"job{i}.json").read_text()) for i in range(args.jobs)]
    finally:
        for proc in procs + ([producer] if producer is not None else []):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    out = account(side, scenario, reports, after - before, status, produced, args)
    out["run_s"] = round(time.monotonic() - started, 1)
    out["loadavg"] = list(os.getloadavg())
    return out


def wait_for(files: list[Path], procs: list[subprocess.Popen[bytes]], work: Path, what: str) -> None:
    deadline = time.monotonic() + 300
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{what} did not get ready:\n" + tails(work))
        time.sleep(0.01)


def tails(work: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(work.glob("*.err")))


def overlap(a: list[int], b: list[int]) -> float:
    n = min(len(a), len(b))
    return sum(1 for x, y in zip(a[:n], b[:n], strict=True) if x == y) / max(len(a), len(b), 1)


def ideal_span_s(scenario: str, args: argparse.Namespace) -> float:
    steps = args.epochs * args.items // args.batch_size
    per_job = steps * args.step_s
    if scenario == "together":
        return per_job
    return (args.jobs - 1) * (args.items // 2 // args.batch_size) * args.step_s + per_job


def account(side: str, scenario: str, reports: list[dict[str, Any]], server_cpu: float,
            status: dict[str, Any] | None, produced: dict[str, Any] | None, args: argparse.Namespace
            ) -> dict[str, Any]:
    first = min(r["arrived_at"] for r in reports)
    last = max(r["ended_at"] for r in reports)
    span = last - first
    samples = sum(r["samples"] for r in reports)
    items = set(range(args.items))
    exact = [[len(e["order"]) == args.items and set(e["order"]) == items for e in r["epochs"]] for r in reports]
    pairs = []
    for i in range(len(reports)):
        for j in range(i + 1, len(reports)):
            grid = [[overlap(ea["order"], eb["order"]) for eb in reports[j]["epochs"]] for ea in reports[i]["epochs"]]
            same_index = [grid[e][e] for e in range(min(len(grid), len(grid[0])))]
            pairs.append({"jobs": [i, j], "best": round(max(max(row) for row in grid), 4),
                          "same_index": round(sum(same_index) / len(same_index), 4)})
    jobs_cpu = sum(r["cpu_s"] for r in reports)
    decodes = (status["items_decoded"] if status is not None else produced["reads"] if produced is not None
               else sum(r["reads"] for r in reports))
    out: dict[str, Any] = {
        "side": side, "scenario": scenario, "samples": samples, "span_s": round(span, 3),
        "samples_per_s": round(samples / span, 1), "ideal_span_s": round(ideal_span_s(scenario, args), 3),
        "of_ideal": round(ideal_span_s(scenario, args) / span, 3),
        "cpu_s": round(jobs_cpu + server_cpu, 2), "cpu_jobs_s": round(jobs_cpu, 2),
        "cpu_shared_s": round(server_cpu, 2),  # joaderd's tree, or the producer's
        "decodes": decodes, "exact": all(all(e) for e in exact), "exact_per_job": exact,
        "epoch_sizes": [[len(e["order"]) for e in r["epochs"]] for r in reports],
        "overlap_best_mean": round(sum(p["best"] for p in pairs) / len(pairs), 4),
        "overlap_best_max": max(p["best"] for p in pairs),
        "overlap_same_index_mean": round(sum(p["same_index"] for p in pairs) / len(pairs), 4),
        "pairs": pairs,
        "arrived_s": [round(r["arrived_at"] - first, 3) for r in reports],
        "first_batch_wait_s": [round(r["first_batch_at"] - r["arrived_at"], 3) for r in reports],
        "job_span_s": [round(r["ended_at"] - r["arrived_at"], 3) for r in reports],
        "jobs_cpu_before_start_s": round(sum(r["cpu_before_start_s"] for r in reports), 2),
    }
    if status is not None:
        out.update({"items_delivered": status["items_delivered"], "workers": status["workers"].get("configured"),
                    "pair_sharing": [round(p["rate"], 3) for p in status.get("sharing_pairs", [])]})
    out["batch_times_s"] = [[round(t - first, 3) for t in r["batch_times"]] for r in reports]
    if produced is not None:
        produced["events"] = [(round(e[0] - first, 3), *e[1:]) for e in produced["events"]]
        out["producer"] = produced
        if produced["broadcasts"]:
            out["producer"]["mb_per_broadcast"] = round(produced["broadcast_bytes"] / produced["broadcasts"] / 1e6, 1)
    return out


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    from bench.common import median

    out: dict[str, Any] = {}
    for t in trials:
        out.setdefault(t["scenario"], {}).setdefault(t["side"], []).append(t)
    summary: dict[str, Any] = {}
    for scenario, sides in out.items():
        summary[scenario] = {}
        for side, runs in sides.items():
            s = {"runs": len(runs)}
            for key in ("samples_per_s", "of_ideal", "span_s", "cpu_s", "cpu_jobs_s", "cpu_shared_s", "decodes",
                        "overlap_best_mean", "overlap_best_max", "overlap_same_index_mean"):
                s[key] = round(median([r[key] for r in runs]), 4)
            s["exact"] = all(r["exact"] for r in runs)
            s["exact_runs"] = sum(r["exact"] for r in runs)
            s["epoch_sizes"] = runs[0]["epoch_sizes"]
            s["first_batch_wait_max_s"] = round(median([max(r["first_batch_wait_s"]) for r in runs]), 3)
            s["job_span_s"] = [round(median([r["job_span_s"][i] for r in runs]), 2)
                               for i in range(len(runs[0]["job_span_s"]))]
            if side == "tensorsocket":
                p = [r["producer"] for r in runs]
                s["producer"] = {k: median([x[k] for x in p]) for k in p[0] if isinstance(p[0][k], int | float)}
            summary[scenario][side] = s
    return summary


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] in ("job", "producer"):
        return sub_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repetition")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--step-s", type=float, default=0.08)
    parser.add_argument("--augment", type=int, default=224)
    parser.add_argument("--server-workers", default="auto", help="joaderd --workers (the README's default: auto)")
    parser.add_argument("--ts-workers", type=int, default=2, help="the TensorSocket producer's DataLoader workers")
    parser.add_argument("--ts-prefetch-factor", type=int, default=0,
                        help="the producer DataLoader's prefetch_factor (0: PyTorch's default, 2)")
    parser.add_argument("--dl-workers", type=int, default=1, help="workers per independent DataLoader")
    parser.add_argument("--ts-fixes", default="all",
                        help=f"TensorSocket work-arounds: all, none, or a list of {', '.join(FIXES)} "
                             "(-name: all but it)")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--timeout-s", type=float, default=240.0)
    parser.add_argument("--name", default="peers")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps = 1
    args.ts_fixes = parse_fixes(args.ts_fixes)
    sides = [s for s in args.sides.split(",") if s]
    scenarios = [s for s in args.scenarios.split(",") if s]
    if any(s not in SIDES for s in sides) or any(s not in SCENARIOS for s in scenarios):
        parser.error(f"--sides: some of {SIDES}; --scenarios: some of {SCENARIOS}")
    from bench.common import demo_data, machine, write_json

    root = demo_data(args.items)
    info = machine()
    began = time.monotonic()
    trials: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for scenario in scenarios:
            order = sides[rep % len(sides):] + sides[:rep % len(sides)]
            for side in order:
                try:
                    t = run_side(side, scenario, root, args)
                except RuntimeError as error:  # recorded (a work-around turned off may hang a job)
                    if args.ts_fixes == parse_fixes("all"):
                        raise
                    print(f"rep {rep} {scenario} {LABELS[side]}: FAILED {str(error)[:3000]}", flush=True)
                    trials.append({"side": side, "scenario": scenario, "rep": rep, "error": str(error)[-6000:]})
                    continue
                t["rep"] = rep
                trials.append(t)
                extra = ""
                if side == "tensorsocket":
                    p = t["producer"]
                    extra = (f", {p.get('mb_per_broadcast')} MB/broadcast, ack wait {p['ack_wait_s']} s, "
                             f"{p['ack_timeouts']} ack timeouts, {p['heart_failures']} heart drops")
                print(f"rep {rep} {scenario:9s} {LABELS[side]}: span {t['span_s']:.2f} s, {t['samples_per_s']:.0f}/s "
                      f"({100 * t['of_ideal']:.0f}% of ideal), CPU {t['cpu_s']:.1f} s, decodes {t['decodes']}, "
                      f"exact {t['exact']} {t['epoch_sizes'] if not t['exact'] else ''}, overlap "
                      f"{t['overlap_best_mean']:.3f}/{t['overlap_best_max']:.3f}, first batch wait "
                      f"{max(t['first_batch_wait_s']):.2f} s{extra}; load {t['loadavg'][0]:.2f}", flush=True)
    info["loadavg_at_end"] = list(os.getloadavg())
    info["wall_s"] = round(time.monotonic() - began, 1)
    summary = summarize([t for t in trials if "error" not in t])
    print_tables(summary, args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{args.name}-quick-{stamp}" if args.quick else f"{args.name}-{stamp}"
    path = write_json(name, {"machine": info, "args": vars(args), "summary": summary, "trials": trials,
                             "commit": git_commit()})
    print(f"\nwrote {path} ({info['wall_s']:.0f} s)")
    return 0


def print_tables(summary: dict[str, Any], args: argparse.Namespace) -> None:
    from bench.common import print_table

    for scenario, sides in summary.items():
        ideal = ideal_span_s(scenario, args)
        print(f"\n{scenario}: {args.jobs} jobs x {args.epochs} epochs x {args.items} items, batch {args.batch_size}, "
              f"step {args.step_s} s; ideal span {ideal:.2f} s "
              f"({args.jobs * args.epochs * args.items / ideal:.0f} samples/s); medians of {args.reps}")
        print_table(["side", "samples/s", "of ideal", "span s", "CPU-s", "decodes", "exact epochs",
                     "order overlap mean (max)", "first batch wait s (max)"],
                    [[LABELS[s], v["samples_per_s"], f"{100 * v['of_ideal']:.0f}%", v["span_s"], v["cpu_s"],
                      int(v["decodes"]), f"{v['exact_runs']}/{v['runs']}" + ("" if v["exact"] else
                                                                            f" {v['epoch_sizes']}"),
                      f"{v['overlap_best_mean']:.3f} ({v['overlap_best_max']:.3f})", v["first_batch_wait_max_s"]]
                     for s, v in sides.items()])


def parse_fixes(spec: str) -> str:
    chosen: set[str] = set()
    for part in spec.split(","):
        if part == "all":
            chosen |= set(FIXES)
        elif part == "none" or not part:
            continue
        elif part.startswith("-"):
            chosen.discard(part[1:])
        elif part in FIXES:
            chosen.add(part)
        else:
            raise SystemExit(f"--ts-fixes: unknown {part!r} (all, none, {', '.join(FIXES)})")
    return ",".join(f for f in FIXES if f in chosen)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def sub_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.peers job|producer")
    parser.add_argument("role", choices=("job", "producer"))
    parser.add_argument("side", nargs="?", choices=SIDES)
    parser.add_argument("--address")
    parser.add_argument("--root")
    parser.add_argument("--ports")
    parser.add_argument("--fixes", default="")
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--min-consumers", type=int, default=1)
    parser.add_argument("--prefetch-factor", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--items", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--step-s", type=float, default=0.08)
    parser.add_argument("--augment", type=int, default=224)
    parser.add_argument("--build-first", action="store_true")
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--go-file", type=Path)
    parser.add_argument("--half-file", type=Path)
    parser.add_argument("--stop-file", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return job_main(args) if args.role == "job" else producer_main(args)


if __name__ == "__main__":
    sys.exit(main())
