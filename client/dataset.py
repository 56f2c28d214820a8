"""`JoaderDataset`: what a training script uses in place of its ImageFolder.

The dataset holds no sampling logic: like a FUSE mount, the data simply looks local. Each
`iter()` is one epoch of this job, in the order joaderd's dependent sampler chose, with every
index exactly once, also when a DataLoader spreads the epoch over worker processes (the workers
of one pass share a token, so they read one epoch between them).

Pixels are copied out of joaderd's shared-memory arena, mapped read-only; the copy is
acknowledged in the next request, which lets the server reuse the slot. The job itself is
registered, and its lease held, by a small child process (`joader.client.keeper`), so this process
creates gRPC channels only where it reads, lazily, after any fork.

Real jobs (docs in the README, "Running real jobs"):
- ranks: the processes of one DDP job attach as ranks of ONE job, and joaderd splits each epoch
  between them (`len(ds)` items each);
- resume: `state_dict()` records the items this process (or DataLoader worker) yielded in its
  epoch; `load_state_dict()` makes the next pass deliver exactly the rest;
- restart: every reader marks what it received on the client board (`joader.client.board`); when
  joaderd restarts, the keeper attaches again and the readers resume their epoch without it;
- audit: `epoch_order(epoch)` is the order this process yielded.
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
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from pyroaring import BitMap
from torch.utils.data import IterableDataset, get_worker_info

from joader.address import resolve_address
from joader.cache.arena import ArenaReader
from joader.client.batchpool import BatchPool
from joader.client.board import Board
from joader.client.channel import PendingCall, call_async, reset_channel
from joader.client.handoff import Arena, ArenaBatch, Layout, Receipts
from joader.errors import (
    ERROR_CLASSES,
    DecodeError,
    InvalidArgumentError,
    JoaderError,
    PassSupersededError,
    UnknownJobError,
    superseded_message,
)
from joader.proto import DTYPES, joader_pb2
from joader.sources.safe_open import display_path

logger = logging.getLogger(__name__)

_TOKEN_MASK = (1 << 63) - 1
STATE_VERSION = 1
_UNREACHABLE_GRACE_S = 5.0
# Whole batches one Next reply may carry when they are ready at once (a warm cache): one round
# trip, one protobuf and one acknowledgement per several batches (bench/delivery.py). joaderd
# still waits only for the first; the others are handed out only if already prepared.
BATCHES_PER_REQUEST = 4
_NOTICE_WORKERS = 0  # board notice: "workers without a transform only add a copy"


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): as given, else from an initialized torch.distributed, else from the
    RANK / WORLD_SIZE environment that torchrun sets, else (0, 1)."""
    if rank is not None and world_size is not None:
        found_rank, found_size = rank, world_size
    else:
        found_rank, found_size = 0, 1
        distributed = getattr(torch, "distributed", None)
        if distributed is not None and distributed.is_available() and distributed.is_initialized():
            found_rank, found_size = distributed.get_rank(), distributed.get_world_size()
        elif "WORLD_SIZE" in os.environ:
            try:
                found_rank = int(os.environ.get("RANK", "0"))
                found_size = int(os.environ["WORLD_SIZE"])
            except ValueError:
                raise InvalidArgumentError(
                    f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                    "are not integers; fix the environment or pass rank= and world_size="
                ) from None
        found_rank = found_rank if rank is None else rank
        found_size = found_size if world_size is None else world_size
    if found_size < 1 or not 0 <= found_rank < found_size:
        raise InvalidArgumentError(
            f"rank {found_rank} is not in 0..{found_size - 1} (world_size {found_size}); pass "
            "rank= and world_size= consistently (torch.distributed.get_rank() / get_world_size())"
        )
    return found_rank, found_size


def _set_threads(threads: int | str | None) -> None:
    """torch's intra-op threads in the training process (see `JoaderDataset`'s `threads`)."""
    current = torch.get_num_threads()
    if threads == "auto":
        wanted = 1
    elif threads is None:
        if current > 1:
            logger.warning(
                "torch uses %d intra-op threads in this process while joaderd's decoders keep the "
                "CPUs busy: collation and transforms can run tens of times slower. Leave "
                "JoaderDataset(threads='auto') (the default), or call torch.set_num_threads(1).",
                current,
            )
        return
    elif isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1:
        wanted = threads
    else:
        raise InvalidArgumentError(f"threads must be 'auto', None or a positive int, got {threads!r}")
    if current != wanted:
        torch.set_num_threads(wanted)
        logger.info("joader: torch.set_num_threads(%d) in this process (it was %d); pass "
                    "threads=None to JoaderDataset to keep torch's own setting", wanted, current)


def _default_name(world_size: int) -> str:
    script = os.path.basename(sys.argv[0] or "python")
    if world_size == 1:
        return f"{script}-{os.getpid()}"
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run in ("", "none"):  # torchrun without --rdzv-id says "none"; its master port is unique
        run = os.environ.get("MASTER_PORT", "")
    if not run:
        raise InvalidArgumentError(
            f"the {world_size} ranks of a job find each other by name; pass the same name= in "
            "every rank (under torchrun, TORCHELASTIC_RUN_ID or MASTER_PORT names the job)"
        )
    return f"{script}-{run}"


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
        timeout_s: raise `TimeoutError` if no item arrives for this long; also how long the
            job waits for a restarted joaderd.
        rank, world_size: this process's place in a DDP job (default: from torch.distributed,
            else RANK / WORLD_SIZE, else 0 and 1). The ranks of one job (same name, source,
            indices and world_size on one joaderd) share ONE job: each epoch is split between
            them, `len(ds)` = ceil(N / world_size) items each, padded by repeating items of the
            epoch as DistributedSampler does. Ranks on several hosts are not supported yet.
        drop_last: with ranks, floor(N / world_size) items each instead (no padding).
        seed: the job's seed. A job alone on its joaderd with a seed gets the same order in
            every run; beside other jobs the order also depends on when each job reads.
        threads: torch's intra-op threads in this process. "auto" (default) sets one, once:
            joaderd's decoders keep this host's cores busy, and a collate or transform that runs
            as a multi-threaded parallel region on busy cores is tens of times slower (OpenMP
            threads spin waiting for each other). An int sets that many; None leaves torch's
            setting alone (joader then warns when it is more than one).
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
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        seed: int | None = None,
        threads: int | str | None = "auto",
    ) -> None:
        super().__init__()
        _set_threads(threads)
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
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.drop_last = drop_last
        if seed is not None and not 0 <= seed < 2**64:
            raise InvalidArgumentError(f"seed must be in 0..2**64-1, got {seed}")
        bitmap = to_bitmap(indices)
        board = Board.create()
        registration = {
            "address": self.address,
            "source": source,
            "indices": base64.b64encode(bitmap.serialize() if bitmap is not None else b"").decode(),
            "name": name or _default_name(self.world_size),
            "batch_size": batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
            "drop_last": drop_last,
            "seed": seed,
            "timeout_s": timeout_s,
            "board_fd": board.fd,
        }
        try:
            self._keeper, info = _start_keeper(registration, timeout_s=60.0, pass_fds=(board.fd,))
        except BaseException:
            board.close()
            raise
        self._finalizer = weakref.finalize(self, _stop_keeper, self._keeper, os.getpid(), board)
        self.job_id: str = info["job_id"]
        self._secret: bytes = base64.b64decode(info["job_secret"])
        self._server_uid: int | None = info.get("server_uid")
        self.classes: list[str] = list(info["classes"])
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self.image_size: int = int(info["image_size"])
        self.stage: str = info.get("stage", "")
        self.item_shape: tuple[int, ...] | None = tuple(info.get("item_shape") or ()) or None
        self.item_dtype: str = info.get("item_dtype") or ""
        if batched and (self.item_shape is None or not self.item_dtype):
            self._finalizer()
            raise InvalidArgumentError(
                f"batched=True needs a fixed-size stage, and source {source!r} uses {self.stage!r}, "
                "whose items vary in size; use batched=False (each item its own tensor), or serve "
                "the source with a fixed-size stage (center-crop, or a user stage with a spec)")
        self.seed: int = int(info["seed"])
        self.num_job_items = int(info["num_items"])
        self._num_items = int(info["num_rank_items"])
        self.targets: list[int] = np.frombuffer(base64.b64decode(info["targets"]), dtype="<i4").tolist()
        self._arena_path: str = info["arena_path"]
        self._reader: tuple[int, ArenaReader] | None = None
        self._pool: tuple[int, BatchPool] | None = None  # batched: reused batch buffers
        board.size_for(int(info["num_source_items"]))
        self._board: Board | None = board
        self._generation = 0
        self._passes = 0
        self._current: _Pass | None = None  # the newest pass in this process
        self._warned: set[int] = set()
        # What this process (or DataLoader worker) yielded: for state_dict and epoch_order.
        self._epoch = 0
        self._consumed = BitMap()
        self._finished = False
        self._orders: dict[int, list[int]] = {}
        self._resume: dict[str, Any] | None = None

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
        # Only for the spawn start method: the lease stays with the process that created it, and
        # the client board (a forked mapping) does not travel, so a spawned worker cannot resume
        # after a joaderd restart.
        state = dict(self.__dict__)
        state["_keeper"] = None
        state["_finalizer"] = None
        state["_reader"] = None
        state["_pool"] = None
        state["_board"] = None
        return state

    # ----------------------------------------------------------------------------- real jobs

    def state_dict(self) -> dict[str, Any]:
        """Where this reader is in its epoch: picklable, small, version-tagged.

        `epoch`: the epoch of this process's newest pass; `consumed`: the ids it yielded of that
        epoch (a serialized pyroaring BitMap), so a checkpoint taken between steps is exact.
        Under a DataLoader with workers each worker has its own (torchdata's StatefulDataLoader
        collects them); `parts` says how many readers reported, so that joaderd resumes with
        all of them. A finished epoch read by one process is saved as the start of the next.
        """
        worker = get_worker_info()
        parts = worker.num_workers if worker is not None else 1
        epoch, consumed = self._epoch, self._consumed
        if self._finished and parts == 1:
            epoch, consumed = epoch + 1, BitMap()
        return {
            "version": STATE_VERSION,
            "job": "joader",
            "epoch": epoch,
            "consumed": consumed.serialize(),
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "parts": parts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next `iter()` resume `state`'s epoch: exactly the items not consumed in it
        (in a uniform random order), then whole epochs."""
        if not isinstance(state, dict) or state.get("job") != "joader":
            raise InvalidArgumentError(
                "load_state_dict: this is not a JoaderDataset state (from JoaderDataset.state_dict())")
        if state.get("version") != STATE_VERSION:
            raise InvalidArgumentError(
                f"load_state_dict: state version {state.get('version')!r}; this joader reads version "
                f"{STATE_VERSION}. Resume with the joader version that saved it.")
        if state.get("world_size") != self.world_size or state.get("rank") != self.rank:
            raise InvalidArgumentError(
                f"load_state_dict: the state is of rank {state.get('rank')} of {state.get('world_size')}, "
                f"this dataset is rank {self.rank} of {self.world_size}; load each rank's own state")
        try:
            consumed = BitMap.deserialize(state["consumed"])
        except Exception as error:
            raise InvalidArgumentError(f"load_state_dict: its consumed set is unreadable ({error})") from error
        self._epoch = int(state["epoch"])
        self._consumed = consumed
        self._finished = False
        self._resume = dict(state, consumed=consumed) if self._epoch > 0 else None

    def epoch_order(self, epoch: int) -> list[int]:
        """The indices this process yielded in `epoch`, in order (for epochs it read)."""
        order = self._orders.get(epoch)
        if order is None:
            known = ", ".join(str(e) for e in sorted(self._orders)) or "none yet"
            raise InvalidArgumentError(
                f"epoch_order({epoch}): this process read no items of epoch {epoch} (epochs read: "
                f"{known}); with DataLoader workers, each worker process records its own")
        return list(order)

    def _start_epoch(self, stream: _Pass, epoch: int) -> None:
        """The first reply of a pass names its epoch: this process's records follow it."""
        stream.epoch = epoch
        if stream.resume is not None and int(stream.resume["epoch"]) == epoch:
            consumed = stream.resume["consumed"]
        else:
            consumed = BitMap()
        stream.resume = None
        if self._current is stream:
            self._epoch = epoch
            self._consumed = BitMap(consumed)
            self._finished = False
            self._orders.setdefault(epoch, [])
            while len(self._orders) > 1000:
                del self._orders[min(self._orders)]

    def _yielded(self, stream: _Pass, indices: list[int]) -> None:
        stream.items += len(indices)
        if self._current is stream and stream.epoch:
            self._consumed.update(indices)
            self._orders[stream.epoch].extend(indices)

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
        stream = _Pass(token, worker_id, worker.num_workers if worker is not None else 1)
        stream.resume, self._resume = self._resume, None
        self._current = stream
        board = self._board
        if (worker is not None and self.transform is None and not self.batched and board is not None
                and board.first_notice(_NOTICE_WORKERS)):
            logger.warning(
                "JoaderDataset in DataLoader workers without a transform: the workers only copy what "
                "joaderd prepared, and each batch then crosses to the training process once more "
                "(a shared-memory copy and a file-descriptor hand-off). num_workers=0 is faster here, "
                "or batched=True with DataLoader(batch_size=None), whose workers hand over only "
                "where each batch is; keep workers for a heavy per-job transform.")
        if board is not None and board.generation != self._generation:
            # joaderd restarted since this process last read (a DataLoader worker forked from a
            # main process that never reads itself): take the job's new identity first.
            self._adopt_identity(board)
            if stream.resume is None:
                stream.resume = self._resume_point(board, stream)
        if not self.batched:
            readings: Iterator[Any] = self._items(stream)
        elif worker is not None and self.transform is None and Receipts.possible(board, worker.id):
            assert board is not None
            return self._handed_off(stream, Receipts(board, worker.id, stream.token))
        else:
            readings = self._batches(stream)
        return readings if worker is not None else self._timed(stream, readings)

    def _timed(self, stream: _Pass, readings: Iterator[Any]) -> Iterator[Any]:
        """`readings`, timing the training loop around them: seconds inside `next()` (the data
        stall) and between calls (the step). Each request reports them; the last one, once the
        loop asks past the end (after its last step), goes alone."""
        stream.measured = True
        clock = time.perf_counter
        started = clock()
        try:
            for reading in readings:
                yielded = clock()
                stream.wait_s += yielded - started
                yield reading
                started = clock()
                stream.step_s += started - yielded
        finally:
            readings.close()  # type: ignore[attr-defined]  # a generator: its cleanup runs now
        stream.wait_s += clock() - started
        if stream.epoch and self._current is stream:
            try:
                self._next(stream, [], 0).result()
            except Exception as error:  # noqa: BLE001  a lost figure must not fail the epoch
                logger.debug("job %s: stall report not delivered: %s", self.job_id, error)

    def _arena(self) -> ArenaReader:
        pid = os.getpid()
        if self._reader is None or self._reader[0] != pid:
            self._reader = (pid, ArenaReader(self._arena_path, expected_uid=self._server_uid))
        return self._reader[1]

    def _next(self, stream: _Pass, acks: list[int], max_items: int) -> PendingCall:
        request = joader_pb2.NextRequest(
            job_id=self.job_id, job_secret=self._secret, token=stream.token, max_items=max_items,
            acks=acks, worker_id=stream.worker_id, pid=os.getpid(), rank=self.rank,
            max_batches=BATCHES_PER_REQUEST if max_items else 0,
        )
        if stream.measured and stream.epoch:
            request.stall_epoch = stream.epoch
            request.stall_wait_s = stream.wait_s
            request.stall_step_s = stream.step_s
            request.stall_items = stream.items
        if max_items and stream.resume is not None:  # until the pass's first reply
            request.resume_epoch = int(stream.resume["epoch"])
            request.resume_consumed = stream.resume["consumed"].serialize()
            request.resume_parts = int(stream.resume.get("parts", 1))
        return call_async(self.address, "Next", request, timeout_s=self.timeout_s + 30)

    def _result(self, pending: PendingCall, stream: _Pass) -> Any:
        """The reply; None when the caller should ask again: joaderd restarted meanwhile and
        the job was attached again (the pass then resumes its epoch), or joaderd was briefly
        unreachable."""
        try:
            response = pending.result()
        except (ConnectionError, UnknownJobError) as error:
            if self._await_reconnect(stream, error):
                return None
            if isinstance(error, UnknownJobError):
                raise UnknownJobError(f"{error}{self._keeper_note()}") from None
            raise
        stream.unreachable_since = None
        return response

    def _await_reconnect(self, stream: _Pass, error: Exception) -> bool:
        """Whether to ask again after `error`: waits while the lease keeper attaches the job to
        a restarted joaderd (then this pass resumes its epoch there), and retries a refused
        connection for a few seconds (the first call after a restart can race the server's
        start). False: joaderd did not go away, the error stands."""
        board = self._board
        if board is None:
            return False
        now = time.monotonic()
        if board.generation == self._generation and not board.reconnecting:
            if stream.unreachable_since is None:
                stream.unreachable_since = now
            if now - stream.unreachable_since < _UNREACHABLE_GRACE_S:
                # The keeper's stream breaks as soon as joaderd dies; until it says so, or
                # after joaderd came back, a refused call is worth repeating.
                time.sleep(0.2)
                reset_channel(self.address)
                return True
            return False
        deadline = now + self.timeout_s
        logger.debug("job %s: waiting for the lease keeper to attach the job again", self.job_id)
        while board.generation == self._generation:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {self.job_id}: joaderd at {self.address} did not come back within "
                    f"{self.timeout_s:g} s (timeout_s); restart it (`joaderd --source ...`) and the job")
            if not board.reconnecting and board.generation == self._generation:
                return False  # the keeper gave up (its stderr says why)
            time.sleep(0.05)
        self._adopt_identity(board)
        stream.unreachable_since = None
        if stream.resume is None:  # else: the pass's checkpoint was not delivered yet; again
            stream.resume = self._resume_point(board, stream)
        return True

    def _adopt_identity(self, board: Board) -> None:
        """The job as the keeper attached it again: its id, secret and the new server's arena
        (never the old one's)."""
        identity = board.identity()
        self._generation = board.generation
        self.job_id = identity["job_id"]
        self._secret = base64.b64decode(identity["job_secret"])
        self._server_uid = identity.get("server_uid")
        self._arena_path = identity["arena_path"]
        self._reader = None
        reset_channel(self.address)
        logger.debug("job %s: attached again to the restarted joaderd", self.job_id)

    def _resume_point(self, board: Board, stream: _Pass) -> dict[str, Any] | None:
        """What `stream` tells a restarted joaderd: its epoch, without what this rank received
        of it (from every reader, on the board); for a pass with no item yet, the next epoch."""
        epoch, token = board.current_pass()
        if stream.epoch:
            return {"epoch": stream.epoch, "consumed": board.received(stream.epoch), "parts": 1}
        if epoch and token == stream.token:  # another reader of this pass got its first items
            return {"epoch": epoch, "consumed": board.received(epoch), "parts": 1}
        if epoch:  # a new pass: the next epoch, whole, keeping the numbering
            return {"epoch": epoch + 1, "consumed": BitMap(), "parts": 1}
        return None

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

    def _stream(self, stream: _Pass, place: Callable[[Any], None],
                copied: Callable[[list[int]], list[int]] | None = None) -> Iterator[None]:
        """One epoch of responses. `place(response)` copies the response's items out of the
        arena; each batch is then acknowledged at once, in the request that fetches the next
        batch, so that request travels while this one is consumed. Yields after each placing.
        `copied(ids)`, if given, says what to acknowledge instead of the placed `ids`: items
        another process copies out (`joader.client.handoff`)."""
        pending: PendingCall | None = self._next(stream, [], self.batch_size)
        idle_s = 0.0
        try:
            while pending is not None:
                response = self._result(pending, stream)
                if response is None:  # joaderd restarted; the job is attached again
                    pending = self._next(stream, [], self.batch_size)
                    continue
                pending = None
                if not stream.epoch:
                    self._start_epoch(stream, response.epoch)
                place(response)
                ids = list(response.item_ids)
                board = self._board
                if board is not None and (ids or response.failed):
                    board.note_pass(response.epoch, stream.token)
                    board.mark(ids + [f.item_id for f in response.failed], response.epoch)
                if response.failed and self.on_error == "raise":
                    self._next(stream, ids, 0).result()  # nothing of this batch stays pinned
                    self._raise_failure(response.failed[0])
                for failed in response.failed:
                    self._warn_failure(failed)
                acks = ids if copied is None else copied(ids)
                if response.end_of_epoch:
                    if acks:
                        self._next(stream, acks, 0).result()  # acknowledge only
                else:
                    pending = self._next(stream, acks, self.batch_size)
                if ids:
                    idle_s = 0.0
                elif not response.end_of_epoch:
                    idle_s += 1.0  # the server waited about a second for a ready item
                    if idle_s > self.timeout_s:
                        waiting = (
                            f" A job of {self.world_size} ranks starts once all of them attached."
                            if self.world_size > 1 else ""
                        )
                        raise TimeoutError(
                            f"job {self.job_id}: no item from joaderd for {self.timeout_s:g} s; "
                            "see `joader status` (is the cache too small, or a decode worker stuck?)"
                            + waiting
                        )
                yield
            if self._current is stream:
                self._finished = True
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
        placed: list[tuple[int, torch.Tensor, int]] = []

        def place(response: Any) -> None:
            # One tensor per item, not views of one batch tensor: torch.stack (in the
            # DataLoader's collate) is ~30x slower on views that share a storage.
            arrays = [np.empty(shape, dtype=dtype) for shape, dtype in zip(_shapes(response), _dtypes(response),
                                                                             strict=True)]
            arena.copy_many(response.offsets, response.lengths, arrays)
            placed.extend(zip(response.item_ids, map(torch.from_numpy, arrays), response.labels, strict=True))

        for _ in self._stream(stream, place):
            items, placed[:] = list(placed), []
            for index, image, label in items:
                if self.transform is not None:
                    image = self.transform(image)
                self._check_current(stream)
                self._yielded(stream, [index])
                yield (index, image, label) if self.return_index else (image, label)

    def _batches(self, stream: _Pass) -> Iterator[Any]:
        arena = self._arena()
        assert self.item_shape is not None
        shape = self.item_shape
        dtype = np.dtype(self.item_dtype)
        size = self.batch_size
        # In a DataLoader worker, each batch is made in shared memory, as the DataLoader's own
        # collate does there: handing it to the main process then passes a file descriptor
        # instead of copying the batch once more. Elsewhere batches fill pooled buffers
        # (joader.client.batchpool), which fresh allocations' page faults made twice as slow.
        shared = get_worker_info() is not None
        pool = None if shared else self._batch_pool(size * int(np.prod(shape)) * dtype.itemsize)
        done: list[tuple[torch.Tensor, list[int], list[int]]] = []

        def fresh() -> list[Any]:
            if pool is None:
                return [_shared_batch_tensor((size, *shape), dtype), [], []]
            return [torch.from_numpy(pool.take().view(dtype).reshape(size, *shape)), [], []]

        current: list[Any] = fresh()

        def place(response: Any) -> None:
            self._check_shapes(response)
            at, count = 0, len(response.item_ids)
            while at < count:
                images, indices, labels = current
                take = min(size - len(indices), count - at)
                rows = images.numpy()[len(indices):len(indices) + take]
                arena.copy_many(response.offsets[at:at + take], response.lengths[at:at + take], rows)
                indices.extend(response.item_ids[at:at + take])
                labels.extend(response.labels[at:at + take])
                at += take
                if len(indices) == size:
                    done.append((images, indices, labels))
                    current[:] = fresh()

        for _ in self._stream(stream, place):
            while done:
                self._check_current(stream)
                images, indices, labels = done.pop(0)
                self._yielded(stream, indices)
                yield self._emit(images, indices, labels)
        images, indices, labels = current
        if indices:
            self._check_current(stream)
            self._yielded(stream, indices)
            yield self._emit(images[: len(indices)], indices, labels)

    def _handed_off(self, stream: _Pass, receipts: Receipts) -> Iterator[ArenaBatch]:
        """`batched=True` in a forked DataLoader worker without a transform: batches as arena
        offsets, which the training process copies out (`joader.client.handoff`). Their items
        are acknowledged once its receipts cover them."""
        assert self.item_shape is not None
        layout = Layout(self.item_shape, self.item_dtype, self.batch_size, self.return_index)
        done: list[ArenaBatch] = []
        current = [ArenaBatch(layout)]

        def arena() -> Arena:  # a new one after joaderd restarted
            return Arena(self._arena_path, self._server_uid)

        def place(response: Any) -> None:
            self._check_shapes(response)
            where = arena()
            for offset, length, index, label in zip(response.offsets, response.lengths, response.item_ids,
                                                    response.labels, strict=True):
                current[0].add(where, offset, length, index, label)
                if len(current[0]) == self.batch_size:
                    done.append(current[0])
                    current[0] = ArenaBatch(layout)

        for _ in self._stream(stream, place, copied=lambda _: receipts.copied(arena())):
            while done:
                self._check_current(stream)
                batch = done.pop(0)
                self._yielded(stream, batch.item_ids)
                yield receipts.hand(batch)
        if len(current[0]):
            self._check_current(stream)
            self._yielded(stream, current[0].item_ids)
            yield receipts.hand(current[0])
        # Asked for more after the last batch: acknowledge the rest once the training process
        # copied it (it reads this worker's batches in order, before this worker's end).
        deadline = time.monotonic() + self.timeout_s
        while receipts.outstanding and time.monotonic() < deadline:
            ids = receipts.copied(arena())
            if ids:
                self._next(stream, ids, 0).result()
            else:
                time.sleep(0.002)

    def _check_shapes(self, response: Any) -> None:
        for index, item_shape in zip(response.item_ids, _shapes(response), strict=True):
            if item_shape != self.item_shape:
                raise InvalidArgumentError(
                    f"job {self.job_id}: item {index} of {self.source!r} has shape {item_shape}, "
                    f"not the stage's {self.item_shape} (an image smaller than the stage's size is "
                    "served as it is); set upscale = true for the source, or use batched=False")

    def _batch_pool(self, nbytes: int) -> BatchPool:
        """This process's pool of batch buffers (`joader.client.batchpool`)."""
        pid = os.getpid()
        if self._pool is None or self._pool[0] != pid or self._pool[1].nbytes != nbytes:
            self._pool = (pid, BatchPool(nbytes))
        return self._pool[1]

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


def _shared_batch_tensor(shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
    """An uninitialized batch tensor in shared memory (no copy of its garbage, unlike
    `share_memory_()`), for a DataLoader worker to hand to the training process."""
    torch_dtype = _TORCH_DTYPES[dtype]
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # what torch's own collate uses
    if new_shared is None:  # not in this torch: a shared copy of an empty tensor
        return torch.empty(shape, dtype=torch_dtype).share_memory_()
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return torch.empty(0, dtype=torch_dtype).set_(new_shared(nbytes), 0, shape)


def _shapes(response: Any) -> list[tuple[int, ...]]:
    """Each item's shape, from the response's flat `dims` and per-item `ndims`."""
    dims, shapes, at = response.dims, [], 0
    for ndim in response.ndims:
        shapes.append(tuple(dims[at:at + ndim]))
        at += ndim
    return shapes


def _dtypes(response: Any) -> list[np.dtype]:
    return [_NUMPY_DTYPES[code] for code in response.dtypes]


_NUMPY_DTYPES = [np.dtype(name) for name in DTYPES]
_TORCH_DTYPES = {dtype: torch.from_numpy(np.empty(0, dtype)).dtype for dtype in _NUMPY_DTYPES}


class _Pass:
    """One pass in this process: its token and DataLoader worker id (what names it on the
    wire), its epoch once the first reply named it, and the checkpoint it resumes, if any."""

    __slots__ = ("epoch", "items", "measured", "num_workers", "resume", "step_s", "token",
                 "unreachable_since", "wait_s", "worker_id")

    def __init__(self, token: int, worker_id: int, num_workers: int) -> None:
        self.token = token
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.epoch = 0
        self.resume: dict[str, Any] | None = None
        self.unreachable_since: float | None = None
        # The training loop's time inside next() and between calls, in this pass's epoch
        # (measured only by a reader in the training process: `JoaderDataset._timed`).
        self.measured = False
        self.wait_s = 0.0
        self.step_s = 0.0
        self.items = 0  # yielded in this pass


def _start_keeper(registration: dict[str, Any], timeout_s: float,
                  pass_fds: tuple[int, ...] = ()) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    keeper = subprocess.Popen(
        [sys.executable, "-m", "joader.client.keeper"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=pass_fds,
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


def _stop_keeper(keeper: subprocess.Popen[str], owner_pid: int, board: Board | None = None) -> None:
    if os.getpid() != owner_pid:  # a forked copy of the dataset: the lease is the parent's
        return
    if board is not None:
        board.close()
    try:
        if keeper.stdin is not None:
            keeper.stdin.write("close\n")  # a clean end: the job's other ranks go on
            keeper.stdin.close()
        keeper.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        keeper.kill()
        keeper.wait()
    if keeper.stdout is not None:
        keeper.stdout.close()

