"""Where a `JoaderDataset` is attached: the job, this process's place in it, what joaderd said.

An `Attachment` holds what attaching needs (the registration: source, indices, batch size,
seed, ...) and what attaching gave: the placement (rank, world size, how it was found), the
lease keeper (`joader.client.keeper.Keeper`), the connection that owns the job's identity in
this process (`joader.client.connection`), and joaderd's `Description` of the job. It settles
again when frameworks set ranks up late (`settle`), and gives way to accelerate's dispatcher
(`dispatch`). Index validation (`to_bitmap`) and the default name's ordinal live here too: they
are what a registration is made of.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pyroaring import BitMap
from torch.utils.data import get_worker_info

from joader.cache.arena import ArenaReader
from joader.client import frameworks, placement, relayout
from joader.client.board import Board
from joader.client.checkpoint import Checkpoint, Owner, Share, indices_digest
from joader.client.connection import Connection, Identity
from joader.client.keeper import Keeper
from joader.client.undecodable import Undecodable
from joader.errors import InvalidArgumentError, JoaderError
from joader.sampling import hosts

# NOTE [ The dataset's logger ]
# Attaching is the dataset's business to its users: its messages keep the logger name they
# filter on (and tests read), `joader.client.dataset`.
logger = logging.getLogger("joader.client.dataset")

# Datasets are built in threads too (an Optuna study's `n_jobs`): the counts below are taken
# under this lock, so that no two datasets get the same place.
_counts_lock = threading.Lock()
_ordinals: dict[tuple[str, str], int] = {}
_solo_names: dict[str, int] = {}


def next_ordinal(source: str, digest: str) -> str:
    """This dataset's place among the process's datasets of the same source and indices: the
    same on every rank of a job (each runs the same script), so it keys the job's name there."""
    with _counts_lock:
        count = _ordinals.get((source, digest), 0)
        _ordinals[(source, digest)] = count + 1
    return f"{source}/{digest}/{count}"


def next_solo_name(base: str) -> str:
    """The default name of a job of one process: `base` (`placement.process_name`) for the
    process's first dataset under it, `base-2`, `base-3`, ... for the later ones, of any source
    (NOTE [ Default names that tell trials apart ] in placement.py). Counted per base: a Ray
    actor reused for the next trial names that trial's first job after the trial alone."""
    with _counts_lock:
        serial = _solo_names.get(base, 0) + 1
        _solo_names[base] = serial
    return placement.numbered(base, serial)


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


@dataclass(frozen=True)
class Description:
    """What the job trains on, from joaderd's reply: classes, labels, sizes, the stage."""

    classes: list[str]
    class_to_idx: dict[str, int]
    image_size: int
    stage: str
    item_shape: tuple[int, ...] | None  # None: items vary in size
    item_dtype: str
    num_job_items: int
    num_source_items: int
    # the labels of the job's items in index order: an int64 array (8 bytes an item; a list of
    # Python ints took about 380 bytes an item, 488 MiB for a job over ImageNet's 1.28M)
    targets: np.ndarray

    @classmethod
    def from_keeper(cls, info: dict[str, Any]) -> Description:
        classes = list(info["classes"])
        # Integer labels are delivered as written, and their classes are the labels that occur:
        # a class's label is then not its position (joaderd says which, `class_labels`).
        labels = info.get("class_labels") or range(len(classes))
        return cls(
            classes=classes, class_to_idx=dict(zip(classes, labels, strict=True)),
            image_size=int(info["image_size"]), stage=info.get("stage", ""),
            item_shape=tuple(info.get("item_shape") or ()) or None, item_dtype=info.get("item_dtype") or "",
            num_job_items=int(info["num_items"]), num_source_items=int(info["num_source_items"]),
            targets=np.frombuffer(base64.b64decode(info["targets"]), dtype="<i4").astype(np.int64),
        )


STAGE_KINDS = ("center-crop", "resize", "max-side")


@dataclass(frozen=True)
class Expected:
    """What a job expects the shared stage to serve (`JoaderDataset(image_size=, mode=,
    stage=)`), checked against joaderd's description of the source before the job reads.

    NOTE [ Declaring the stage in the client ]
    The stage is the server's option, and the model is the job's: a model built for 64 px fed
    by a server at the default 256 failed deep in torch ("mat1 and mat2 shapes cannot be
    multiplied"), nothing pointing at `--image-size`. A job that says what it expects gets the
    mismatch at attach time, named with the option that fixes it."""

    source: str
    image_size: int | None = None
    mode: str | None = None
    stage: str | None = None
    decoder: str | None = None
    upscale: bool | None = None
    exif_transpose: bool | None = None

    @classmethod
    def make(cls, source: str, *, image_size: int | None, mode: str | None, stage: str | None,
             decoder: str | None = None, upscale: bool | None = None,
             exif_transpose: bool | None = None) -> Expected:
        if image_size is not None and (isinstance(image_size, bool) or not isinstance(image_size, int)
                                       or image_size < 1):
            raise InvalidArgumentError(f"image_size must be a positive int, got {image_size!r}")
        if mode is not None and mode not in ("RGB", "L"):
            raise InvalidArgumentError(f"mode must be 'RGB' or 'L', got {mode!r}")
        if stage is not None and stage not in STAGE_KINDS:
            raise InvalidArgumentError(
                f"stage must be one of {', '.join(STAGE_KINDS)} (a user stage is the server's "
                f"--stage package.module:factory, not declared here), got {stage!r}")
        if decoder is not None and decoder not in _decoders()[0]:
            raise InvalidArgumentError(f"decoder must be one of {', '.join(_decoders()[0])}, got {decoder!r}")
        for flag, value in (("upscale", upscale), ("exif_transpose", exif_transpose)):
            if value is not None and not isinstance(value, bool):
                raise InvalidArgumentError(f"{flag} must be True or False, got {value!r}")
        return cls(source, image_size, mode, stage, decoder, upscale, exif_transpose)

    def mismatches(self, served: str, image_size: int, address: str) -> list[str]:
        """What the served stage (its name, e.g. "center-crop:256/L") gets wrong, each with its fix."""
        kind, _, rest = served.partition(":")
        parts = rest.split("/")
        mode = next((p for p in parts[1:] if p in ("RGB", "L")), "RGB")
        where = f"joaderd at {address} serves source {self.source!r} with stage {served!r}"
        found = []
        if self.image_size is not None and kind in STAGE_KINDS and image_size != self.image_size:
            found.append(
                f"{where}: {image_size} px, and this job expects image_size={self.image_size}. Start "
                f"joaderd with --image-size {self.source}={self.image_size}, or pass image_size={image_size} "
                "and build the model for it (or pass root= and joader starts a server for this size)")
        if self.mode is not None and kind in STAGE_KINDS and mode != self.mode:
            found.append(
                f"{where}: mode {mode}, and this job expects mode={self.mode!r}. Start joaderd with "
                f"--mode {self.source}={self.mode}, or pass mode={mode!r}")
        if self.stage is not None and kind != self.stage:
            found.append(
                f"{where}: the {kind!r} stage, and this job expects stage={self.stage!r}. Start "
                f"joaderd with --stage {self.source}={self.stage}, or pass stage={kind!r}")
        if kind in STAGE_KINDS:
            found += self._decoding_mismatches(kind, parts[1:], where)
        return found

    def _decoding_mismatches(self, kind: str, parts: list[str], where: str) -> list[str]:
        """decoder=, upscale= and exif_transpose= against the stage's name, which says what
        differs from joaderd's defaults ("/pil", "/no-upscale", "/exif-transpose")."""
        decoders, default = _decoders()
        decoder = next((p for p in parts if p in decoders), default)
        upscale = "no-upscale" not in parts
        exif = "exif-transpose" in parts
        found, fix = [], "(or pass root= and joader starts a server with these options)"
        if self.decoder is not None and decoder != self.decoder:
            found.append(f"{where}: decoder {decoder!r}, and this job expects decoder={self.decoder!r}. Start "
                         f"joaderd with --decoder {self.decoder}, or pass decoder={decoder!r} {fix}")
        if self.upscale is not None and kind != "max-side" and upscale != self.upscale:
            flag = "--upscale" if self.upscale else "--no-upscale"
            found.append(f"{where}: images smaller than S {'upscaled' if upscale else 'served small'}, and this "
                         f"job expects upscale={self.upscale}. Start joaderd with {flag} {self.source}, or pass "
                         f"upscale={upscale} {fix}")
        if self.exif_transpose is not None and exif != self.exif_transpose:
            flag = f"--exif-transpose {self.source}" if self.exif_transpose else "no --exif-transpose"
            found.append(f"{where}: EXIF orientation {'applied' if exif else 'not applied'}, and this job "
                         f"expects exif_transpose={self.exif_transpose}. Start joaderd with {flag}, or pass "
                         f"exif_transpose={exif} {fix}")
        return found


def _decoders() -> tuple[tuple[str, ...], str]:
    """joaderd's decoders and its default (Pillow is imported only when a job names one)."""
    from joader.stages.image import DECODERS, DEFAULT_DECODER

    return DECODERS, DEFAULT_DECODER


class Attached:
    """A public attribute of the dataset that its attachment owns: where this rank is, or
    (`described`) what joaderd described of the job."""

    def __init__(self, described: bool = False) -> None:
        self.described = described

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, dataset: Any, owner: type | None = None) -> Any:
        if dataset is None:
            return self
        attachment = dataset._attachment
        return getattr(attachment.description if self.described else attachment, self.name)


class Attachment:
    """The job one `JoaderDataset` reads, as this process is attached to it (or not yet)."""

    def __init__(self, source: str, bitmap: BitMap | None, *, address: str, name: str | None, batch_size: int,
                 batched: bool, timeout_s: float, drop_last: bool, seed: int | None, crc_check: bool,
                 rank: int | None, world_size: int | None, order: str = "shared",
                 expected: Expected | None = None, autostart: dict[str, Any] | None = None) -> None:
        self.source = source
        self.batched = batched
        self.timeout_s = timeout_s
        self.drop_last = drop_last
        self.crc_check = crc_check
        self.digest = indices_digest(bitmap)
        self.ordinal = next_ordinal(source, self.digest)
        self.registration: dict[str, Any] = {
            "address": address,
            "source": source,
            "indices": base64.b64encode(bitmap.serialize() if bitmap is not None else b"").decode(),
            "batch_size": batch_size,
            "drop_last": drop_last,
            "seed": seed,
            "order": order,
            "timeout_s": timeout_s,
        }
        if autostart is not None:  # a keeper that finds joaderd dead starts it again
            self.registration["autostart"] = autostart
        self.expected = expected
        self.asked = (rank, world_size)
        self.name_given = name
        self.all_items = bitmap
        self.placement: placement.Placement | None = None  # where the job is attached; None: not yet
        self.hosts: hosts.HostLayout | None = None  # this rank's host, when the job spans hosts
        self.dispatched = False  # accelerate's DataLoaderDispatcher: rank 0 reads the whole job
        self.keeper: Keeper | None = None
        self.finalizer: Callable[[], Any] | None = None
        self.connection: Connection | None = None
        self.passes = 0  # started in this process on the job attached now
        self.job_name = ""
        self.solo_name: str | None = None  # its default name as one process, once given (`default_name`)
        self.noticed = False  # joaderd's notice (a name another live job has) was logged
        self.seed = seed
        self.order = order
        self.num_items = 0  # this rank's items per epoch, once attached
        found = placement.find(rank, world_size, distributed=torch.distributed)
        if found is None:
            # A rank whose place is not known yet (Lightning's spawned ranks before fit): what
            # it trains on now, the job once iteration starts (`settle`).
            self.rank: int | None = None
            self.world_size: int = int(os.environ.get("WORLD_SIZE", "1"))
            self.description = self._described(Keeper.describe(self.registration))
        else:
            self.attach(found, self.default_name(found))

    def default_name(self, found: placement.Placement) -> str:
        if self.name_given:
            return self.name_given
        if found.world_size > 1:
            return placement.job_name(found, ordinal=self.ordinal, distributed=torch.distributed)
        if self.solo_name is None:  # one per dataset: attaching again (`settle`) keeps it
            self.solo_name = next_solo_name(placement.process_name())
        return self.solo_name

    def _default_solo(self, found: placement.Placement, name: str) -> bool:
        """Whether `name` is this dataset's default name as one process, not yet given a pid."""
        return (self.name_given is None and found.world_size == 1 and name == self.solo_name
                and not name.endswith(f"(pid {os.getpid()})"))

    def _described(self, info: dict[str, Any]) -> Description:
        description = Description.from_keeper(info)
        wrong = self.expected.mismatches(description.stage, description.image_size, self.registration["address"]) \
            if self.expected is not None else []
        if wrong:
            self.close()
            raise InvalidArgumentError("; ".join(wrong))
        if self.batched and (description.item_shape is None or not description.item_dtype):
            self.close()
            raise InvalidArgumentError(
                f"batched=True needs a fixed-size stage, and source {self.source!r} uses {description.stage!r}, "
                "whose items vary in size; use batched=False (each item its own tensor), or serve "
                "the source with a fixed-size stage (center-crop, or a user stage with a spec)")
        return description

    def attach(self, found: placement.Placement, name: str) -> None:
        """Registers this process as rank `found.rank` of job `name`, through a new lease keeper.

        A job whose ranks span hosts (torchrun's LOCAL_WORLD_SIZE < WORLD_SIZE) is, on this
        host's joaderd, the job `name@ranksA-BofW` of this host's ranks over this host's part of
        the items (`joader.sampling.hosts`)."""
        layout = hosts.layout_from_env(found.rank, found.world_size, os.environ)
        registration = dict(self.registration, name=name, rank=found.rank, world_size=found.world_size)
        if layout is not None:
            part = hosts.host_part(self.items(), hosts.source_salt(self.source), layout, drop_last=self.drop_last)
            registration.update(name=f"{name}@{layout.label}", rank=layout.local_rank,
                                world_size=layout.local_ranks,
                                indices=base64.b64encode(part.serialize()).decode())
            logger.info("joader: rank %d of %d reads %d items of %s through this host's joaderd "
                        "(its ranks %d-%d)", found.rank, found.world_size, len(part), self.source,
                        layout.first_rank, layout.first_rank + layout.local_ranks - 1)
        self.hosts = layout
        board = Board.create()
        keeper = self.keeper = Keeper.spawn(registration, board)
        info = keeper.info
        if info.get("notice") and layout is None and self._default_solo(found, name):
            # The same command run twice (a bash loop's identical trials): this job takes the
            # pid, so that `joader status` tells the two apart (NOTE [ Default names that tell
            # trials apart ] in placement.py). Said once at debug level: nothing for the user to do.
            keeper.stop()
            self.keeper = None
            self.solo_name = placement.with_pid(name)
            logger.debug("joader: a live job is named %r already; this one is %r", name, self.solo_name)
            self.attach(found, self.solo_name)
            return
        self.finalizer = weakref.finalize(self, keeper.stop)
        try:  # mapped and let go: a process that reads no items must not hold it (a restart's dead arena)
            ArenaReader(info["arena_path"], expected_uid=info.get("server_uid")).close()
        except JoaderError as error:
            # NOTE [ A client that cannot read the arena ends its job ]
            # Such a client (another user's, over TCP) would keep its job registered, holding a
            # --max-jobs slot and a share of the cache for as long as it lives.
            self.close()
            raise type(error)(
                f"job {info['job_id']}: this process cannot read joaderd's cache arena ({error}); "
                "joaderd serves the user that runs it: run the job as that user, or start a joaderd "
                "of your own (its default Unix socket is private to you). The job was removed."
            ) from None
        self.placement = found
        self.job_name = name
        if info.get("notice") and not self.noticed:
            # NOTE [ Two live jobs of one name ] in server/registry/jobs.py: said where the user looks.
            self.noticed = True
            logger.warning("JoaderDataset(%r), job %s: %s", self.source, info["job_id"], info["notice"])
        self.rank, self.world_size = found.rank, found.world_size
        self.description = self._described(info)
        self.seed = int(info["seed"])
        self.num_items = int(info["num_rank_items"])
        board.size_for(int(info["num_source_items"]))
        # The one owner of the job's identity (id, secret, arena, generation) in this process.
        self.connection = Connection(self.registration["address"], Identity.from_keeper(info, board.generation),
                                     board, timeout_s=self.timeout_s, crc_check=self.crc_check,
                                     keeper_note=keeper.exit_note)
        self.passes = 0

    def items(self) -> BitMap:
        """The job's items (all the source's when no indices were given: asked of joaderd)."""
        if self.all_items is None:
            encoded = self.registration["indices"]
            if encoded:
                self.all_items = BitMap.deserialize(base64.b64decode(encoded))
            else:
                self.all_items = BitMap(range(int(Keeper.describe(self.registration)["num_source_items"])))
        return self.all_items

    def close(self) -> None:
        """Ends this process's part of the job now (its other ranks go on)."""
        if self.finalizer is not None:
            self.finalizer()

    def detach(self) -> None:
        self.close()
        self.keeper = self.finalizer = self.connection = None
        self.placement = None

    def settle(self) -> None:
        """Attaches, or attaches again, where this process is now.

        Looked up when iteration starts, `len()` is taken or a state is saved or loaded, since
        frameworks set ranks up late: Lightning's launcher built the dataset as a plain process
        and became rank 0 of 2 in `trainer.fit`; its spawned ranks knew WORLD_SIZE but not their
        rank. A DataLoader worker cannot attach (the lease belongs to the training process): it
        only checks, and says what to do.
        """
        if self.dispatched or (self.placement is not None and self.placement.how == placement.GIVEN):
            return
        found = placement.find(*self.asked, distributed=torch.distributed)
        attached = self.placement
        if attached is not None and (found is None or found.same_place(attached)):
            return
        if found is None:
            raise InvalidArgumentError(f"JoaderDataset({self.source!r}): {placement.unsettled_message()}")
        if get_worker_info() is not None:
            now = (f"attached as rank {attached.rank} of {attached.world_size}" if attached
                   else "not attached to a job yet")
            raise InvalidArgumentError(
                f"JoaderDataset({self.source!r}) in a DataLoader worker is {now}, but this process is "
                f"rank {found.rank} of {found.world_size} ({found.how}); the dataset attaches in the "
                "training process, which forked the workers before it knew its rank. Take len(loader) "
                "once after torch.distributed.init_process_group and before iterating (trainer.fit "
                "does), build the dataset after init_process_group, or pass rank= and world_size=")
        if attached is not None:
            logger.info("joader: %s is now rank %d of %d (%s); attaching as that rank",
                        self.source, found.rank, found.world_size, found.how)
            if self.passes:
                logger.warning(
                    "JoaderDataset(%r) was read as rank %d of %d, and is now rank %d of %d: it "
                    "starts a new job as that rank, from a new epoch", self.source,
                    attached.rank, attached.world_size, found.rank, found.world_size)
            self.detach()
        self.attach(found, self.default_name(found))

    def connected(self) -> Connection:
        """The connection of the job this process is attached to now (attaching if it can)."""
        self.settle()
        if self.connection is None:
            raise InvalidArgumentError(
                f"JoaderDataset({self.source!r}) is not attached to a job on this rank (accelerate "
                "dispatches the data from rank 0, which alone reads it)")
        return self.connection

    def check_framework(self) -> None:
        """accelerate's wrappers, seen on the call stack (`joader.client.frameworks`): under its
        DataLoaderDispatcher rank 0 reads the whole job and the other ranks nothing (the
        dispatcher slices rank 0's batches for them); under an IterableDatasetShard, refuse.
        Called straight from the dataset's entry points (`skip=2` finds their caller)."""
        found = frameworks.accelerate_wrapper(skip=2)
        if found is None or self.dispatched:
            return
        kind, owner = found
        if kind == frameworks.SHARD:
            raise InvalidArgumentError(frameworks.SHARD_MESSAGE.format(
                n=getattr(owner, "num_processes", "num_processes")))
        if get_worker_info() is not None:
            return  # the training process saw it first (set_epoch), or does next
        self.dispatch(frameworks.process_index(owner, self.rank or 0))

    def dispatch(self, index: int) -> None:
        """accelerate's DataLoaderDispatcher drives this dataset: rank 0 (`index`) reads the
        whole job, and the other ranks nothing (the dispatcher slices rank 0's batches)."""
        self.dispatched = True
        if self.placement is not None and self.placement.world_size == 1:
            return  # one process: it reads the whole job already
        self.detach()
        if index == 0:
            whole = placement.Placement(0, 1, placement.GIVEN)
            name = f"{self.job_name}-dispatched"
            logger.info("joader: accelerate dispatches this loader's batches from rank 0, which "
                        "reads the whole job %r", name)
            self.attach(whole, name)
        else:
            self.rank = index
            self.connection = None

    def rank_items(self) -> int:
        """Items per epoch this process reads: the whole job's under the dispatcher; before
        attaching, what every rank gets (ceil, or floor under drop_last, of N / world_size)."""
        if self.dispatched:
            return self.description.num_job_items
        if self.connection is not None:
            return self.num_items
        size, total = self.world_size, self.description.num_job_items
        return total // size if self.drop_last else -(-total // size)

    def epoch_length(self, undecodable: Undecodable) -> int:
        """Items per epoch of this rank now (`JoaderDataset.__len__`), less the files known to
        be undecodable where that count holds: for a job of one process, or under the
        dispatcher (NOTE [ What len(ds) knows of undecodable files ] in
        joader.client.undecodable)."""
        try:
            self.settle()
        except InvalidArgumentError:
            if self.connection is not None or get_worker_info() is not None:
                raise
            # Not attached yet (WORLD_SIZE known, this rank not): every rank has the same length.
        items = self.rank_items()
        if self.dispatched or self.world_size == 1:
            items -= undecodable.count()
        return items

    def checkpoint_of(self, state: Any, seed_given: bool) -> Checkpoint | None:
        """A state to load, checked, as this reader resumes it: its own rank's state
        (`Checkpoint.from_state_dict`), or a list of every rank's states of the job on another
        layout of ranks or hosts (`joader.client.relayout`); None: nothing to resume."""
        if not isinstance(state, (list, tuple)):
            Checkpoint.check_tag(state)
        self.settle()
        owner, share = self.owner(seed_given), self.share()
        if not isinstance(state, (list, tuple)):
            return Checkpoint.from_state_dict(state, owner, share)
        layout = relayout.NewLayout(self.items(), self.world_size, self.drop_last, hosts.source_salt(self.source),
                                    self.hosts)
        return relayout.rest_checkpoint(state, owner, share, layout)

    def owner(self, seed_given: bool) -> Owner:
        """Whose checkpoint this reader's state is (`JoaderDataset.state_dict`)."""
        return Owner(self.source, self.digest, self.seed, seed_given, self.rank, self.world_size,
                     self.hosts.as_dict() if self.hosts is not None else None)

    def share(self) -> Share:
        """What the job gives this reader, to check a loaded state against: its items on this
        host's joaderd, an epoch's count for this rank, and the readers that load its parts."""
        worker = get_worker_info()
        items = self.all_items
        if self.hosts is not None:
            items = hosts.host_part(self.items(), hosts.source_salt(self.source), self.hosts,
                                    drop_last=self.drop_last)
        return Share(items, self.description.num_source_items, self.rank_items(),
                     worker.num_workers if worker is not None else 1, in_worker=worker is not None)

    def __getstate__(self) -> dict[str, Any]:
        # NOTE [ Pickling an attachment ]
        # Only for the spawn start method: the lease stays with the process that created it, and
        # the client board (a forked mapping) does not travel, so a spawned worker cannot resume
        # after a joaderd restart.
        state = dict(self.__dict__)
        state["keeper"] = None
        state["finalizer"] = None
        if self.connection is not None:
            state["connection"] = self.connection.without_board()
        return state
