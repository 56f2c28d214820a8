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
import copy
import logging
import os
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
from joader.client import frameworks, placement
from joader.client.batchpool import BatchPool
from joader.client.board import Board
from joader.client.checkpoint import Checkpoint, Owner, ResumePoint, indices_digest
from joader.client.connection import BATCHES_PER_REQUEST, Connection, Identity
from joader.client.delivery import Reader
from joader.client.handoff import Receipts
from joader.client.keeper import Keeper
from joader.client.passes import Pass, Progress
from joader.errors import InvalidArgumentError, JoaderError
from joader.sampling import hosts

logger = logging.getLogger(__name__)

__all__ = ["BATCHES_PER_REQUEST", "JoaderDataset", "to_bitmap"]

DEFAULT_BATCH_SIZE = 64  # items per request when no DataLoader says otherwise

_NOTICE_WORKERS = 0  # board notice: "workers without a transform only add a copy"


_threads_warned = False


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
        # A warning, once per process: at INFO nobody saw it, and a CPU-bound training loop
        # (no GPU) runs its model on these threads too.
        global _threads_warned
        if not _threads_warned:
            _threads_warned = True
            logger.warning(
                "joader: torch.set_num_threads(%d) in this process (it was %d), because joaderd's "
                "decoders keep the cores busy; a model trained on the CPU then runs on %d thread(s). "
                "Pass JoaderDataset(threads=N) for N threads, or threads=None to keep torch's setting.",
                wanted, current, wanted)


_ordinals: dict[tuple[str, str], int] = {}


def _next_ordinal(source: str, digest: str) -> str:
    """This dataset's place among the process's datasets of the same source and indices: the
    same on every rank of a job (each runs the same script), so it keys the job's name there."""
    count = _ordinals.get((source, digest), 0)
    _ordinals[(source, digest)] = count + 1
    return f"{source}/{digest}/{count}"


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
        name: a name for this job in `joader status`. Default: `<script>-<pid>` for one
            process; for ranks, one name per run that every rank agrees on (through the process
            group's store when torch.distributed is initialized, else torchrun's run id).
        batch_size: items per request. Default: the batch size of the DataLoader that collates
            the items (joaderd replies in whole batches, so every worker collates whole ones and
            an epoch has exactly `len(loader)` batches), else 64; and the batch size of
            `batched=True`.
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
            else RANK / WORLD_SIZE, else 0 and 1), looked up again when iteration starts: a
            dataset built before `trainer.fit` attaches as the rank Lightning makes it. With
            WORLD_SIZE set but not RANK, it attaches once torch.distributed is initialized. The
            ranks of one job (same name, source, indices and world_size on one joaderd) share
            ONE job: each epoch is split between them, `len(ds)` = ceil(N / world_size) items
            each, padded by repeating items of the epoch as DistributedSampler does. Ranks on
            several hosts are not supported yet.
        drop_last: with ranks, floor(N / world_size) items each instead (no padding).
        seed: the job's seed. A job alone on its joaderd with a seed gets the same order in
            every run; beside other jobs the order also depends on when each job reads.
        threads: torch's intra-op threads in this process. "auto" (default) sets one, once:
            joaderd's decoders keep this host's cores busy, and a collate or transform that runs
            as a multi-threaded parallel region on busy cores is tens of times slower (OpenMP
            threads spin waiting for each other). An int sets that many; None leaves torch's
            setting alone (joader then warns when it is more than one).
        verify: check every item copied out of the arena against the crc32 its decode wrote
            (about 0.03 ms per 196 KB item) and raise `IntegrityError` on a mismatch. Default:
            on when the environment has JOADER_VERIFY=1.
        prefetch: without DataLoader workers (the plain script), a thread of the training
            process reads this many replies (batches) ahead: it waits for joaderd, copies the
            items out and runs `transform` while the loop steps (`joader.client.prefetch`). 0:
            all of that runs inside the loop's `next()`. 1, the default, measured best on four
            plain jobs started together (bench/four_jobs.py): 93-94% of the GPU-bound ideal
            against 86-89% with 0, and as few decodes; 2 decoded up to 30% more (a job far ahead
            stopped waiting for the decodes the others then found cached, and the jobs drifted
            apart) for no gain in speed. The transform then draws its random
            numbers in that thread, so augmentations do not follow torch.manual_seed exactly
            (joader's order never did: it depends on the other jobs). DataLoader workers and
            `batched=True` read as before.
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
        batch_size: int | None = None,
        batched: bool = False,
        on_error: str = "skip",
        timeout_s: float = 300.0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        seed: int | None = None,
        threads: int | str | None = "auto",
        verify: bool | None = None,
        prefetch: int = 1,
    ) -> None:
        super().__init__()
        _set_threads(threads)
        if on_error not in ("skip", "raise"):
            raise InvalidArgumentError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise InvalidArgumentError(f"prefetch must be an int >= 0 (replies read ahead; 0: none), got {prefetch!r}")
        self.prefetch = prefetch
        if batch_size is not None and batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")
        self.source = source
        self.transform = transform
        self.return_index = return_index
        self.on_error = on_error
        # Requests ask for the DataLoader's batch size when it shows (`frameworks`), else this.
        self._batch_size_given = batch_size is not None
        self.batch_size = batch_size if batch_size is not None else DEFAULT_BATCH_SIZE
        self.batched = batched
        self.timeout_s = timeout_s
        self.address = resolve_address(address)
        self.drop_last = drop_last
        if seed is not None and not 0 <= seed < 2**64:
            raise InvalidArgumentError(f"seed must be in 0..2**64-1, got {seed}")
        self._seed_given = seed is not None
        self._asked = (rank, world_size)
        bitmap = to_bitmap(indices)
        self._dataset_digest = indices_digest(bitmap)
        self._ordinal = _next_ordinal(source, self._dataset_digest)
        self._registration: dict[str, Any] = {
            "address": self.address,
            "source": source,
            "indices": base64.b64encode(bitmap.serialize() if bitmap is not None else b"").decode(),
            "batch_size": self.batch_size,
            "drop_last": drop_last,
            "seed": seed,
            "timeout_s": timeout_s,
        }
        self._name_given = name
        if verify is None:
            verify = os.environ.get("JOADER_VERIFY", "") not in ("", "0")
        self._verify = bool(verify)
        self._placement: placement.Placement | None = None  # where the job is attached; None: not yet
        self.hosts: hosts.HostLayout | None = None  # this rank's host, when the job spans hosts
        self._all_items: BitMap | None = bitmap
        self._dispatched = False  # accelerate's DataLoaderDispatcher: rank 0 reads the whole job
        self._keeper: Keeper | None = None
        self._finalizer: Callable[[], Any] | None = None
        self._connection: Connection | None = None
        self._pool: tuple[int, BatchPool] | None = None  # batched: reused batch buffers
        self._passes = 0
        self._job_name = ""
        self._warned: set[int] = set()
        self._progress = Progress()  # what this process yielded: state_dict, epoch_order
        self._resume: ResumePoint | None = None
        self.seed: int | None = seed
        found = placement.find(rank, world_size, distributed=torch.distributed)
        if found is None:
            # A rank whose place is not known yet (Lightning's spawned ranks before fit): what
            # it trains on now, the job once iteration starts (`_settle`).
            self.rank: int | None = None
            self.world_size: int = int(os.environ.get("WORLD_SIZE", "1"))
            self._describe(self._ask_description())
        else:
            self._attach(found, self._default_name(found))

    # ----------------------------------------------------------------------------- attaching

    def _default_name(self, found: placement.Placement) -> str:
        if self._name_given:
            return self._name_given
        return placement.job_name(found, ordinal=self._ordinal, distributed=torch.distributed)

    def _describe(self, info: dict[str, Any]) -> None:
        """What the job trains on, from joaderd's reply: classes, labels, sizes, the stage."""
        self.classes: list[str] = list(info["classes"])
        # Integer labels are delivered as written, and their classes are the labels that occur:
        # a class's label is then not its position (joaderd says which, `class_labels`).
        labels = info.get("class_labels") or range(len(self.classes))
        self.class_to_idx: dict[str, int] = dict(zip(self.classes, labels, strict=True))
        self.image_size: int = int(info["image_size"])
        self.stage: str = info.get("stage", "")
        self.item_shape: tuple[int, ...] | None = tuple(info.get("item_shape") or ()) or None
        self.item_dtype: str = info.get("item_dtype") or ""
        if self.batched and (self.item_shape is None or not self.item_dtype):
            self.close()
            raise InvalidArgumentError(
                f"batched=True needs a fixed-size stage, and source {self.source!r} uses {self.stage!r}, "
                "whose items vary in size; use batched=False (each item its own tensor), or serve "
                "the source with a fixed-size stage (center-crop, or a user stage with a spec)")
        self.num_job_items = int(info["num_items"])
        self._num_source_items = int(info["num_source_items"])
        self.targets: list[int] = np.frombuffer(base64.b64decode(info["targets"]), dtype="<i4").tolist()

    def _attach(self, found: placement.Placement, name: str) -> None:
        """Registers this process as rank `found.rank` of job `name`, through a new lease keeper.

        A job whose ranks span hosts (torchrun's LOCAL_WORLD_SIZE < WORLD_SIZE) is, on this
        host's joaderd, the job `name@ranksA-BofW` of this host's ranks over this host's part of
        the items (`joader.sampling.hosts`)."""
        layout = hosts.layout_from_env(found.rank, found.world_size, os.environ)
        registration = dict(self._registration, name=name, rank=found.rank, world_size=found.world_size)
        if layout is not None:
            part = hosts.host_part(self._items(), hosts.source_salt(self.source), layout, drop_last=self.drop_last)
            registration.update(name=f"{name}@{layout.label}", rank=layout.local_rank,
                                world_size=layout.local_ranks,
                                indices=base64.b64encode(part.serialize()).decode())
            logger.info("joader: rank %d of %d reads %d items of %s through this host's joaderd "
                        "(its ranks %d-%d)", found.rank, found.world_size, len(part), self.source,
                        layout.first_rank, layout.first_rank + layout.local_ranks - 1)
        self.hosts = layout
        board = Board.create()
        keeper = Keeper.spawn(registration, board)
        info = keeper.info
        self._keeper = keeper
        self._finalizer = weakref.finalize(self, keeper.stop)
        try:  # mapped and let go: a process that reads no items must not hold it (a restart's dead arena)
            ArenaReader(info["arena_path"], expected_uid=info.get("server_uid")).close()
        except JoaderError as error:
            # NOTE: a client that cannot read joaderd's arena (another user's, over TCP) kept
            # its job registered, holding a --max-jobs slot and a share of the cache (issue 27).
            self.close()
            raise type(error)(
                f"job {info['job_id']}: this process cannot read joaderd's cache arena ({error}); "
                "joaderd serves the user that runs it: run the job as that user, or start a joaderd "
                "of your own (its default Unix socket is private to you). The job was removed."
            ) from None
        self._placement = found
        self._job_name = name
        self.rank, self.world_size = found.rank, found.world_size
        self._describe(info)
        self.seed = int(info["seed"])
        self._num_items = int(info["num_rank_items"])
        board.size_for(int(info["num_source_items"]))
        # The one owner of the job's identity (id, secret, arena, generation) in this process.
        self._connection = Connection(self.address, Identity.from_keeper(info, board.generation), board,
                                      timeout_s=self.timeout_s, verify=self._verify,
                                      keeper_note=keeper.exit_note)
        self._passes = 0

    def _items(self) -> BitMap:
        """The job's items (all the source's when no indices were given: asked of joaderd)."""
        if self._all_items is None:
            encoded = self._registration["indices"]
            if encoded:
                self._all_items = BitMap.deserialize(base64.b64decode(encoded))
            else:
                self._all_items = BitMap(range(int(self._ask_description()["num_source_items"])))
        return self._all_items

    def _ask_description(self) -> dict[str, Any]:
        """joaderd's description of the source and dataset (an `Attach` that registers nothing)."""
        return Keeper.describe(self._registration)

    def _detach(self) -> None:
        """Ends this process's part of the job (its other ranks go on)."""
        if self._finalizer is not None:
            self._finalizer()
        self._keeper = self._finalizer = self._connection = None
        self._placement = None

    def _settle(self) -> None:
        """Attaches, or attaches again, where this process is now.

        Looked up when iteration starts, `len()` is taken or a state is saved or loaded, since
        frameworks set ranks up late: Lightning's launcher built the dataset as a plain process
        and became rank 0 of 2 in `trainer.fit`; its spawned ranks knew WORLD_SIZE but not their
        rank. A DataLoader worker cannot attach (the lease belongs to the training process): it
        only checks, and says what to do.
        """
        if self._dispatched or (self._placement is not None and self._placement.how == placement.GIVEN):
            return
        found = placement.find(*self._asked, distributed=torch.distributed)
        attached = self._placement
        if attached is not None and (found is None or found.same_place(attached)):
            return
        if found is None:
            raise InvalidArgumentError(f"JoaderDataset({self.source!r}): {placement.unsettled_message()}")
        if get_worker_info() is not None:
            was = (f"attached as rank {attached.rank} of {attached.world_size}" if attached
                   else "not attached to a job yet")
            raise InvalidArgumentError(
                f"JoaderDataset({self.source!r}) in a DataLoader worker is {was}, but this process is "
                f"rank {found.rank} of {found.world_size} ({found.how}); the dataset attaches in the "
                "training process, which forked the workers before it knew its rank. Take len(loader) "
                "once after torch.distributed.init_process_group and before iterating (trainer.fit "
                "does), build the dataset after init_process_group, or pass rank= and world_size=")
        if attached is not None:
            logger.info("joader: %s is now rank %d of %d (%s); attaching as that rank",
                        self.source, found.rank, found.world_size, found.how)
            if self._passes:
                logger.warning(
                    "JoaderDataset(%r) was read as rank %d of %d, and is now rank %d of %d: it "
                    "starts a new job as that rank, from a new epoch", self.source,
                    attached.rank, attached.world_size, found.rank, found.world_size)
            self._detach()
        self._attach(found, self._default_name(found))

    @property
    def _conn(self) -> Connection:
        """The connection of the job this process is attached to now (attaching if it can)."""
        self._settle()
        if self._connection is None:
            raise InvalidArgumentError(
                f"JoaderDataset({self.source!r}) is not attached to a job on this rank (accelerate "
                "dispatches the data from rank 0, which alone reads it)")
        return self._connection

    @property
    def job_id(self) -> str:
        """The job's id on the joaderd it is attached to now (a restart gives a new one)."""
        return self._conn.job_id

    def __len__(self) -> int:
        """Items per epoch of this rank; batches under `batched=True` (what the loop receives
        from `DataLoader(ds, batch_size=None)`). Under accelerate's dispatcher, the whole job's."""
        self._framework_check()
        try:
            self._settle()
        except InvalidArgumentError:
            if self._connection is not None or get_worker_info() is not None:
                raise
            # Not attached yet (WORLD_SIZE known, this rank not): every rank has the same length.
        items = self._rank_items()
        return -(-items // self.batch_size) if self.batched else items

    def _rank_items(self) -> int:
        if self._dispatched:
            return self.num_job_items
        if self._connection is not None:
            return self._num_items
        size = self.world_size
        return self.num_job_items // size if self.drop_last else -(-self.num_job_items // size)

    def set_epoch(self, epoch: int) -> None:
        """Accepted, for the frameworks that call it on a dataset (accelerate's loaders, at the
        start of each epoch). joaderd counts a job's epochs itself: each `iter()` is the next."""
        self._framework_check()

    def _framework_check(self) -> None:
        """accelerate's wrappers, seen on the call stack (`joader.client.frameworks`): under its
        DataLoaderDispatcher rank 0 reads the whole job and the other ranks nothing (the
        dispatcher slices rank 0's batches for them); under an IterableDatasetShard, refuse."""
        found = frameworks.accelerate_wrapper(skip=2)
        if found is None or self._dispatched:
            return
        kind, owner = found
        if kind == frameworks.SHARD:
            raise InvalidArgumentError(frameworks.SHARD_MESSAGE.format(
                n=getattr(owner, "num_processes", "num_processes")))
        if get_worker_info() is not None:
            return  # the training process saw it first (set_epoch), or does next
        index = frameworks.process_index(owner, self.rank or 0)
        self._dispatched = True
        if self._placement is not None and self._placement.world_size == 1:
            return  # one process: it reads the whole job already
        self._detach()
        if index == 0:
            whole = placement.Placement(0, 1, placement.GIVEN)
            name = f"{self._job_name}-dispatched"
            logger.info("joader: accelerate dispatches this loader's batches from rank 0, which "
                        "reads the whole job %r", name)
            self._attach(whole, name)
        else:
            self.rank = index
            self._connection = None

    def close(self) -> None:
        """Ends this job on the server now (otherwise: when the dataset is collected or the
        process exits)."""
        if self._finalizer is not None:
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
        state["_pool"] = None
        if self._connection is not None:
            connection = copy.copy(self._connection)
            connection.board = None
            connection._readers = (0, {})
            state["_connection"] = connection
        return state

    # ----------------------------------------------------------------------------- real jobs

    def state_dict(self) -> dict[str, Any]:
        """Where this reader is in its epoch: picklable, small, version-tagged
        (`joader.client.checkpoint`).

        `epoch`: the epoch of this process's newest pass; `consumed`: the ids it yielded of that
        epoch (a serialized pyroaring BitMap), so a checkpoint taken between steps is exact.
        Under a DataLoader with workers each worker has its own (torchdata's StatefulDataLoader
        collects them); `parts` says how many readers reported, so that joaderd resumes with
        all of them. A finished epoch read by one process is saved as the start of the next.
        `source`, `dataset` (a digest of the indices) and `seed` say whose state it is.
        """
        self._settle()
        worker = get_worker_info()
        parts = worker.num_workers if worker is not None else 1
        epoch, consumed = self._progress.saved(parts)
        return Checkpoint(self._owner(), epoch, consumed, parts).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next `iter()` resume `state`'s epoch: exactly the items not consumed in it
        (in a uniform random order), then whole epochs."""
        Checkpoint.check_tag(state)
        self._settle()
        checkpoint = Checkpoint.from_state_dict(state, self._owner())
        self._progress.restore(checkpoint.epoch, checkpoint.consumed)
        self._resume = checkpoint.resume_point

    def _owner(self) -> Owner:
        return Owner(self.source, self._dataset_digest, self.seed, self._seed_given, self.rank, self.world_size,
                     self.hosts.as_dict() if self.hosts is not None else None)

    def epoch_order(self, epoch: int) -> list[int]:
        """The indices this process yielded in `epoch`, in order (for epochs it read)."""
        order = self._progress.orders.get(epoch)
        if order is None:
            known = ", ".join(str(e) for e in sorted(self._progress.orders)) or "none yet"
            raise InvalidArgumentError(
                f"epoch_order({epoch}): this process read no items of epoch {epoch} (epochs read: "
                f"{known}); with DataLoader workers, each worker process records its own")
        return list(order)

    # ----------------------------------------------------------------------------- reading

    def __iter__(self) -> Iterator[Any]:
        self._framework_check()
        if self._dispatched and self._connection is None:
            return iter(())  # accelerate: rank 0 reads for this rank
        worker = get_worker_info()
        connection = self._conn
        board = connection.board
        stream = Pass.start(worker, self._passes, board, os.getpid())
        self._passes += 1
        stream.resume, self._resume = self._resume, None
        self._progress.current = stream
        if (worker is not None and self.transform is None and not self.batched and board is not None
                and board.first_notice(_NOTICE_WORKERS)):
            logger.warning(
                "JoaderDataset in DataLoader workers without a transform: the workers only copy what "
                "joaderd prepared, and each batch then crosses to the training process once more "
                "(a shared-memory copy and a file-descriptor hand-off). num_workers=0 is faster here, "
                "or batched=True with DataLoader(batch_size=None), whose workers hand over only "
                "where each batch is; keep workers for a heavy per-job transform.")
        # joaderd restarted since this process last read (a DataLoader worker forked from a
        # training process that never reads itself): the job's new identity. Nothing else: a
        # pass that starts now is a new pass (`continued_epoch`), whatever the epochs were.
        connection.refresh()
        reader = Reader(self, stream)
        if not self.batched:
            readings: Iterator[Any] = reader.items()
        elif worker is not None and self.transform is None and Receipts.possible(board, worker.id):
            assert board is not None
            return reader.handed_off(Receipts(board, worker.id, stream.token))
        else:
            readings = reader.batches()
        return readings if worker is not None else self._timed(reader, readings)

    def _timed(self, reader: Reader, readings: Iterator[Any]) -> Iterator[Any]:
        """`readings`, timing the training loop around them: seconds inside `next()` (the data
        stall) and between calls (the step). Each request reports them; the last one, once the
        loop asks past the end (after its last step), goes alone."""
        stream = reader.stream
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
        if stream.epoch and self._progress.current is stream:
            try:
                reader.report()
            except Exception as error:  # noqa: BLE001  a lost figure must not fail the epoch
                logger.debug("job %s: stall report not delivered: %s", self.job_id, error)

    def _batch_pool(self, nbytes: int) -> BatchPool:
        """This process's pool of batch buffers (`joader.client.batchpool`)."""
        pid = os.getpid()
        if self._pool is None or self._pool[0] != pid or self._pool[1].nbytes != nbytes:
            self._pool = (pid, BatchPool(nbytes))
        return self._pool[1]
