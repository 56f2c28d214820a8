"""`JoaderDataset`: what a training script uses in place of its ImageFolder.

The dataset holds no sampling logic: like a FUSE mount, the data simply looks local. Each
`iter()` is one epoch of this job, in the order joaderd's dependent sampler chose, with every
index exactly once, also when a DataLoader spreads the epoch over worker processes (the workers
of one pass share a token, so they read one epoch between them).

Pixels are copied out of joaderd's shared-memory arena, mapped read-only; the copy is
acknowledged in the next request, which lets the server reuse the slot. The job itself is
registered, and its lease held, by a small child process (`joader.client.keeper`), so this process
creates gRPC channels only where it reads, lazily, after any fork.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import select
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from pyroaring import BitMap
from torch.utils.data import IterableDataset, get_worker_info

from joader.address import resolve_address
from joader.cache.arena import ArenaReader
from joader.client.channel import PendingCall, call_async
from joader.errors import (
    ERROR_CLASSES,
    DecodeError,
    InvalidArgumentError,
    JoaderError,
    PassSupersededError,
    UnknownJobError,
    superseded_message,
)
from joader.proto import joader_pb2
from joader.sources.safe_open import display_path

logger = logging.getLogger(__name__)

_TOKEN_MASK = (1 << 63) - 1


def to_bitmap(indices: Any) -> BitMap | None:
    """A BitMap of `indices` (range, iterable of ints, numpy array, BitMap); None means all."""
    if indices is None:
        return None
    if isinstance(indices, BitMap):
        return BitMap(indices)
    if isinstance(indices, range):
        if indices.step == 1 and indices.start >= 0:
            return BitMap(indices)
        indices = list(indices)
    array = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices))
    if array.size == 0:
        raise InvalidArgumentError("indices is empty: pass at least one item index of the source")
    if not np.issubdtype(array.dtype, np.integer):
        raise InvalidArgumentError(f"indices must be integers, got {array.dtype}")
    if array.min() < 0 or array.max() > np.iinfo(np.uint32).max:
        raise InvalidArgumentError(
            f"indices must be in 0..{np.iinfo(np.uint32).max}, got {array.min()}..{array.max()}"
        )
    bitmap = BitMap(array.astype(np.uint32, copy=False))
    if len(bitmap) != array.size:
        values, counts = np.unique(array, return_counts=True)
        repeated = ", ".join(f"{v} ({c} times)" for v, c in zip(values[counts > 1][:5], counts[counts > 1][:5], strict=True))
        raise InvalidArgumentError(
            f"indices repeat items: {repeated}; a job's dataset is a set, and each epoch delivers "
            "every item once. Pass unique indices (e.g. numpy.unique(indices))."
        )
    return bitmap


class JoaderDataset(IterableDataset):
    """Samples of a joaderd source, prepared once and shared with every job that needs them.

    Args:
        source: the source's name on the server (`joaderd --source NAME=PATH`).
        indices: the items of the source this job trains on (range, ints, numpy array or
            pyroaring BitMap); None for all of them.
        transform: applied in this process to each uint8 CHW tensor (the per-job stage).
        return_index: yield `(index, image, label)` instead of `(image, label)`.
        address: joaderd's address; default `$JOADER_ADDRESS`, else the per-user socket.
        name: a name for this job in `joader status`.
        batch_size: items per request; match the DataLoader's batch size.
        batched: yield whole batches of `batch_size` (the last one of an epoch may be smaller),
            copied straight out of shared memory into one `(B, 3, S, S)` tensor, with a label
            tensor (and an index tensor under `return_index`). Use it with
            `DataLoader(ds, batch_size=None)`: it skips one copy per sample (the collate).
            `transform`, if given, is applied to each image and the results are stacked.
        on_error: "skip" (default) skips files that fail to decode, logging them (the server
            counts them in its status); "raise" raises `DecodeError` naming the file.
        timeout_s: raise `TimeoutError` if no item arrives for this long.
    """

    def __init__(
        self,
        source: str,
        indices: Any = None,
        transform: Callable[[torch.Tensor], Any] | None = None,
        return_index: bool = False,
        *,
        address: str | None = None,
        name: str | None = None,
        batch_size: int = 64,
        batched: bool = False,
        on_error: str = "skip",
        timeout_s: float = 300.0,
    ) -> None:
        super().__init__()
        if on_error not in ("skip", "raise"):
            raise InvalidArgumentError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
        if batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")
        self.source = source
        self.transform = transform
        self.return_index = return_index
        self.on_error = on_error
        self.batch_size = batch_size
        self.batched = batched
        self.timeout_s = timeout_s
        self.address = resolve_address(address)
        bitmap = to_bitmap(indices)
        registration = {
            "address": self.address,
            "source": source,
            "indices": base64.b64encode(bitmap.serialize() if bitmap is not None else b"").decode(),
            "name": name or f"{os.path.basename(sys.argv[0] or 'python')}-{os.getpid()}",
            "batch_size": batch_size,
        }
        self._keeper, info = _start_keeper(registration, timeout_s=60.0)
        self._finalizer = weakref.finalize(self, _stop_keeper, self._keeper, os.getpid())
        self.job_id: str = info["job_id"]
        self._secret: bytes = base64.b64decode(info["job_secret"])
        self._server_uid: int | None = info.get("server_uid")
        self.classes: list[str] = list(info["classes"])
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self.image_size: int = int(info["image_size"])
        self._num_items = int(info["num_items"])
        self._arena_path: str = info["arena_path"]
        self._reader: tuple[int, ArenaReader] | None = None
        self._passes = 0
        self._current: _Pass | None = None  # the newest pass in this process
        self._warned: set[int] = set()

    def __len__(self) -> int:
        return self._num_items

    def close(self) -> None:
        """Ends this job on the server now (otherwise: when the dataset is collected or the
        process exits)."""
        self._finalizer()

    def __enter__(self) -> JoaderDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Only for the spawn start method: the lease stays with the process that created it.
        state = dict(self.__dict__)
        state["_keeper"] = None
        state["_finalizer"] = None
        state["_reader"] = None
        return state

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        if worker is None:
            token, worker_id = secrets.randbits(63), 0
        else:
            # Every worker of one DataLoader pass has the same base seed; persistent workers
            # reuse it, so the pass count tells their passes apart. The base seed repeats when
            # the user re-seeds torch, so it is no nonce: the server also tells passes apart by
            # the worker's pid (fresh workers are new processes).
            token, worker_id = hash((worker.seed - worker.id, self._passes)) & _TOKEN_MASK, worker.id
        self._passes += 1
        stream = _Pass(token, worker_id)
        self._current = stream
        return self._batches(stream) if self.batched else self._items(stream)

    def _arena(self) -> ArenaReader:
        pid = os.getpid()
        if self._reader is None or self._reader[0] != pid:
            self._reader = (pid, ArenaReader(self._arena_path, expected_uid=self._server_uid))
        return self._reader[1]

    def _next(self, stream: _Pass, acks: list[int], max_items: int) -> PendingCall:
        request = joader_pb2.NextRequest(
            job_id=self.job_id, job_secret=self._secret, token=stream.token, max_items=max_items,
            acks=acks, worker_id=stream.worker_id, pid=os.getpid(),
        )
        return call_async(self.address, "Next", request, timeout_s=self.timeout_s + 30)

    def _result(self, pending: PendingCall) -> Any:
        try:
            return pending.result()
        except UnknownJobError as error:
            raise UnknownJobError(f"{error}{self._keeper_note()}") from None

    def _keeper_note(self) -> str:
        keeper = self._keeper
        if keeper is None or keeper.pid is None:
            return ""
        try:
            os.kill(keeper.pid, 0)
        except ProcessLookupError:
            return (
                f" (this process's lease keeper, pid {keeper.pid}, has exited: it was killed, "
                "or could not reach joaderd; its stderr says why)"
            )
        except PermissionError:
            pass
        return ""

    def _stream(self, stream: _Pass, place: Callable[[Any], None]) -> Iterator[None]:
        """One epoch of responses. `place(response)` copies the response's items out of the
        arena; each batch is then acknowledged at once, in the request that fetches the next
        batch, so that request travels while this one is consumed. Yields after each placing."""
        pending: PendingCall | None = self._next(stream, [], self.batch_size)
        idle_s = 0.0
        try:
            while pending is not None:
                response = self._result(pending)
                pending = None
                place(response)
                ids = list(response.item_ids)
                if response.failed and self.on_error == "raise":
                    self._next(stream, ids, 0).result()  # nothing of this batch stays pinned
                    self._raise_failure(response.failed[0])
                for failed in response.failed:
                    self._warn_failure(failed)
                if response.end_of_epoch:
                    if ids:
                        self._next(stream, ids, 0).result()  # acknowledge only
                else:
                    pending = self._next(stream, ids, self.batch_size)
                if ids:
                    idle_s = 0.0
                elif not response.end_of_epoch:
                    idle_s += 1.0  # the server waited about a second for a ready item
                    if idle_s > self.timeout_s:
                        raise TimeoutError(
                            f"job {self.job_id}: no item from joaderd for {self.timeout_s:g} s; "
                            "see `joader status` (is the cache too small, or a decode worker stuck?)"
                        )
                yield
        finally:
            if pending is not None:  # the loop broke out early with a batch on its way
                self._acknowledge_leftover(stream, pending)

    def _acknowledge_leftover(self, stream: _Pass, pending: PendingCall) -> None:
        """Best effort: give back a prefetched batch nobody will read (the lease's end would
        release it anyway). At interpreter exit, grpc may already be torn down: skip it."""
        if sys.is_finalizing():
            return
        try:
            leftover = list(pending.result().item_ids)
            if leftover:
                self._next(stream, leftover, 0).result()
        except Exception as error:  # noqa: BLE001  a failed courtesy call must not mask anything
            logger.debug("job %s: leftover batch not acknowledged: %s", self.job_id, error)

    def _items(self, stream: _Pass) -> Iterator[Any]:
        arena = self._arena()
        shape = (3, self.image_size, self.image_size)
        placed: list[tuple[int, torch.Tensor, int]] = []

        def place(response: Any) -> None:
            # One tensor per item, not views of one batch tensor: torch.stack (in the
            # DataLoader's collate) is ~30x slower on views that share a storage.
            for index, label, offset in zip(response.item_ids, response.labels, response.offsets, strict=True):
                image = torch.empty(shape, dtype=torch.uint8)
                arena.copy_into(offset, image.numpy())
                placed.append((index, image, label))

        for _ in self._stream(stream, place):
            items, placed[:] = list(placed), []
            for index, image, label in items:
                if self.transform is not None:
                    image = self.transform(image)
                self._check_current(stream)
                yield (index, image, label) if self.return_index else (image, label)

    def _batches(self, stream: _Pass) -> Iterator[Any]:
        arena = self._arena()
        shape = (3, self.image_size, self.image_size)
        size = self.batch_size
        done: list[tuple[torch.Tensor, list[int], list[int]]] = []
        current: list[Any] = [torch.empty((size, *shape), dtype=torch.uint8), [], []]

        def place(response: Any) -> None:
            for index, label, offset in zip(response.item_ids, response.labels, response.offsets, strict=True):
                images, indices, labels = current
                arena.copy_into(offset, images[len(indices)].numpy())
                indices.append(index)
                labels.append(label)
                if len(indices) == size:
                    done.append((images, indices, labels))
                    current[:] = [torch.empty((size, *shape), dtype=torch.uint8), [], []]

        for _ in self._stream(stream, place):
            while done:
                self._check_current(stream)
                yield self._emit(*done.pop(0))
        images, indices, labels = current
        if indices:
            self._check_current(stream)
            yield self._emit(images[: len(indices)], indices, labels)

    def _emit(self, images: torch.Tensor, indices: list[int], labels: list[int]) -> Any:
        if self.transform is not None:
            images = torch.stack([self.transform(image) for image in images])
        label_tensor = torch.tensor(labels, dtype=torch.int64)
        if self.return_index:
            return torch.tensor(indices, dtype=torch.int64), images, label_tensor
        return images, label_tensor

    def _check_current(self, stream: _Pass) -> None:
        """A newer iter() in this process took the epoch: items this one still holds (prefetched
        before) must not be yielded as if its epoch went on. joaderd tells the same to readers in
        other processes (DataLoader workers) at their next request."""
        if self._current is not stream:
            raise PassSupersededError(superseded_message(self.job_id))

    def _raise_failure(self, failed: joader_pb2.FailedItem) -> None:
        raise DecodeError(
            f"job {self.job_id}: item {failed.item_id} ({display_path(failed.path)}) of source "
            f"{self.source!r} could not be decoded: {failed.reason}. Fix or remove the file "
            "(joaderd retries it after --retry-failed-s), or pass on_error='skip' to train "
            "without it."
        )

    def _warn_failure(self, failed: joader_pb2.FailedItem) -> None:
        if failed.item_id not in self._warned:
            self._warned.add(failed.item_id)
            logger.warning(
                "job %s: skipping item %d (%s): %s", self.job_id, failed.item_id, display_path(failed.path), failed.reason
            )


class _Pass:
    """What names one pass on the wire: its token and this process's DataLoader worker id."""

    __slots__ = ("token", "worker_id")

    def __init__(self, token: int, worker_id: int) -> None:
        self.token = token
        self.worker_id = worker_id


def _start_keeper(registration: dict[str, Any], timeout_s: float) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    keeper = subprocess.Popen(
        [sys.executable, "-m", "joader.client.keeper"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert keeper.stdin is not None and keeper.stdout is not None
    keeper.stdin.write(json.dumps(registration) + "\n")
    keeper.stdin.flush()
    ready, _, _ = select.select([keeper.stdout], [], [], timeout_s)
    line = keeper.stdout.readline() if ready else ""
    if not line:
        _stop_keeper(keeper, os.getpid())
        raise ConnectionError(
            f"joader could not register with joaderd at {registration['address']} within "
            f"{timeout_s:g} s. Start one with `joaderd --source NAME=PATH`, or set JOADER_ADDRESS."
        )
    reply = json.loads(line)
    if reply.get("ok"):
        return keeper, reply
    _stop_keeper(keeper, os.getpid())
    kind, message = reply.get("kind", "JoaderError"), reply.get("message", "unknown error")
    if kind == "ConnectionError":
        raise ConnectionError(message)
    if kind == "TimeoutError":
        raise TimeoutError(message)
    raise ERROR_CLASSES.get(kind, JoaderError)(message)


def _stop_keeper(keeper: subprocess.Popen[str], owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked copy of the dataset: the lease is the parent's
        return
    try:
        if keeper.stdin is not None:
            keeper.stdin.close()
        keeper.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        keeper.kill()
        keeper.wait()
    if keeper.stdout is not None:
        keeper.stdout.close()

