"""TensorSocket 0.0.5 with the peers bench's work-arounds: its producer and consumer classes, and pack
and unpack functions, each work-around a subclass or a function (site-packages is not edited),
each one turned off by `--ts-fixes -name`. TensorSocket is written for CUDA (it shares CUDA IPC
handles); on a CPU-only machine it needs these to run correctly and at a sensible cost, and each
keeps its design (one shared order, lock-step, late joiners wait for the next epoch):

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
"""

from __future__ import annotations

import pickle
import time
from typing import Any


def tensorsocket_classes(fixes: set[str]) -> tuple[type, type, Any, Any]:
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
