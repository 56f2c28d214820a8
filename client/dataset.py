"""`JoaderDataset`: what a training script uses in place of its ImageFolder.

The dataset holds no sampling logic: like a FUSE mount, the data simply looks local. Each
`iter()` is one epoch of this job, in the order joaderd's dependent sampler chose, with every
index exactly once, also when a DataLoader spreads the epoch over worker processes (the workers
of one pass share a token, so they read one epoch between them).

Pixels are copied out of joaderd's shared-memory arena, mapped read-only; the copy is
acknowledged in the next request, which lets the server reuse the slot. The job itself is
registered, and its lease held, by a small child process (`joader.client.keeper_process`), so this process
creates gRPC channels only where it reads, lazily, after any fork.

Real jobs (docs in the README, "Running real jobs"):
- ranks: the processes of one DDP job attach as ranks of ONE job, and joaderd splits each epoch
  between them (`len(ds)` items each);
- resume: `state_dict()` records the items this process (or DataLoader worker) yielded in its
  epoch; `load_state_dict()` makes the next pass deliver exactly the rest (every rank's states
  on another layout of ranks or hosts: `joader.client.relayout`);
- restart: every reader marks what it received on the client board (`joader.client.board`); when
  joaderd restarts, the keeper attaches again and the readers resume their epoch without it;
- audit: `epoch_order(epoch)` is the order this process yielded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from joader.address import resolve_address
from joader.client.attachment import Attached, Attachment, Expected, to_bitmap
from joader.client.autostart import server_for_dataset
from joader.client.batch_shapes import ItemNames
from joader.client.batchpool import ProcessBatchPool
from joader.client.checkpoint import Checkpoint, ResumePoint
from joader.client.connection import BATCHES_PER_REQUEST, Connection, crc_check_wanted
from joader.client.delivery import Reader, ReadOptions, check_read_arguments
from joader.client.keeper import Keeper
from joader.client.passes import Pass, Progress, note_copy_only_workers
from joader.client.threads import set_threads
from joader.client.undecodable import Undecodable
from joader.errors import InvalidArgumentError
from joader.sampling import check_order

__all__ = ["BATCHES_PER_REQUEST", "JoaderDataset", "to_bitmap"]

DEFAULT_BATCH_SIZE = 64  # items per request when no DataLoader says otherwise


class JoaderDataset(IterableDataset):
    """Samples of a joaderd source, prepared once and shared with every job that needs them.

    Args:
        source: the source's name on the server (`joaderd --source NAME=PATH`), or, with
            `root`, the name the auto-started server gives it.
        root: the source's files (an ImageFolder tree, a .tsv/.csv list, a folder of .tar
            shards). With it the dataset finds this user's joaderd serving `root` with these
            stage options, or starts one: detached, shared by every later job with the same
            root and options, exiting after 10 idle minutes, its cache sized from the data, and
            started again by a job that finds it died (`joader.client.autostart`). Without it,
            the job uses the joaderd at `address`.
        image_size, mode, stage: what this job expects the shared stage to serve: S (the side of
            `--image-size`), "RGB" or "L", and the stage's kind ("center-crop", "resize",
            "max-side"). With `root`, the auto-started server serves exactly that; without, a
            joaderd that serves something else is refused with an error naming its option.
        decoder, upscale, exif_transpose: with `root`, how the auto-started server decodes (as
            joaderd's `--decoder`, `--no-upscale NAME`, `--exif-transpose NAME`). `decoder`:
            "pil" (exactly torchvision's decode, Resize and CenterCrop), "pil-draft" (Pillow with
            libjpeg's DCT downscaling: faster, not bit-exact) or "turbo" (simplejpeg + OpenCV);
            None: joaderd's default. `upscale` (default True): images smaller than S are upscaled
            to S, as torchvision's Resize would, so every item has one shape; False serves them
            at their own size, and a batch that mixes sizes then raises `BatchShapeError` naming
            the file. `exif_transpose` (default False, as torchvision's ImageFolder): rotate each
            photo by its EXIF orientation first (`PIL.ImageOps.exif_transpose`). Jobs that differ
            in any of them use different servers. Without `root`, they say what the job expects,
            as `image_size` does: a joaderd that decodes otherwise is refused, naming its flag.
        indices: the items of the source this job trains on (range, ints, numpy array or
            pyroaring BitMap); None for all of them.
        transform: applied in this process to each uint8 CHW tensor (the per-job stage).
        return_index: yield `(index, image, label)` instead of `(image, label)`.
        address: joaderd's address; default `$JOADER_ADDRESS`, else the per-user socket.
        name: a name for this job in `joader status`. Default for one process: inside a Ray
            Tune trial the trial's name, else the command line (`train.py --lr 0.1`: paths cut
            to their last part, at most 64 characters; a bash loop's trials differ), with the
            pid added if another live job has that name (`train.py --lr 0.1 (pid 14910)`); the
            process's second and later datasets add ` #2`, ` #3`, ... (an Optuna study's trials
            in threads differ). For ranks, one name per run that every rank agrees on (through
            the process group's store when torch.distributed is initialized, else torchrun's run
            id). A given name another live job on the same joaderd has (not a rank of this job)
            is accepted, with a warning in this process's log: pass each trial its own name.
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
            every run; beside other jobs the order also depends on when each job reads
            (unless order="independent").
        order: "shared" (default) or "independent". Every job's epoch is an exactly-once,
            uniformly shuffled order either way. "shared": joaderd correlates this job's order
            with the other jobs' on the same source, so that one decode serves several jobs
            at once (two identical jobs read mostly the same item at the same step); the
            jobs' orders are then NOT independent of each other. "independent": this job's
            order is independent of every other job's (an ensemble member, a variance study,
            a comparison between runs), drawn from its own seed's stream only; it still reads
            items other jobs had decoded when they are cached, but it shares fewer decodes.
            Every rank of a DDP job must give the same order. Two independent jobs with the
            same `seed` get the same order: give them different seeds (or none).
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
            plain jobs started together (bench/system/four_jobs.py): 93-94% of the GPU-bound ideal
            against 86-89% with 0, and as few decodes; 2 decoded up to 30% more (a job far ahead
            stopped waiting for the decodes the others then found cached, and the jobs drifted
            apart) for no gain in speed. The transform then draws its random
            numbers in that thread, so augmentations do not follow torch.manual_seed exactly
            (joader's order never did: it depends on the other jobs). DataLoader workers and
            `batched=True` read as before.
    """

    rank = Attached()
    world_size = Attached()
    seed = Attached()
    hosts = Attached()  # this rank's host (`joader.sampling.hosts.HostLayout`), when the job spans hosts
    classes = Attached(described=True)
    class_to_idx = Attached(described=True)
    targets = Attached(described=True)
    image_size = Attached(described=True)
    stage = Attached(described=True)
    item_shape = Attached(described=True)
    item_dtype = Attached(described=True)
    num_job_items = Attached(described=True)

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
        order: str = "shared",
        threads: int | str | None = "auto",
        verify: bool | None = None,
        prefetch: int = 1,
        root: str | os.PathLike[str] | None = None,
        image_size: int | None = None,
        mode: str | None = None,
        stage: str | None = None,
        decoder: str | None = None,
        upscale: bool | None = None,
        exif_transpose: bool | None = None,
    ) -> None:
        super().__init__()
        set_threads(threads)
        check_read_arguments(on_error, prefetch, batch_size)
        self.prefetch = prefetch
        self.source = source
        self.transform = transform
        self.return_index = return_index
        self.on_error = on_error
        # Requests ask for the DataLoader's batch size when it shows (`frameworks`), else this.
        self._batch_size_given = batch_size is not None
        self.batch_size = batch_size if batch_size is not None else DEFAULT_BATCH_SIZE
        self.batched = batched
        self.timeout_s = timeout_s
        self.expected = Expected.make(source, image_size=image_size, mode=mode, stage=stage, decoder=decoder,
                                      upscale=upscale, exif_transpose=exif_transpose)
        address, autostart = server_for_dataset(source, root, address, image_size=image_size, mode=mode, stage=stage,
                                                decoder=decoder, upscale=upscale, exif_transpose=exif_transpose)
        self.root = autostart["root"] if autostart is not None else None
        self.address = resolve_address(address)
        self.drop_last = drop_last
        if seed is not None and not 0 <= seed < 2**64:
            raise InvalidArgumentError(f"seed must be in 0..2**64-1, got {seed}")
        self._seed_given = seed is not None
        self.order = check_order(order)
        self._pool = ProcessBatchPool()  # batched: reused batch buffers
        self._warned: set[int] = set()  # failed items already logged
        self._progress = Progress()  # what this process yielded: state_dict, epoch_order
        self._resume: ResumePoint | None = None  # a loaded checkpoint, for the next pass
        self._item_names: ItemNames | None = None  # for errors that name an item (`_names`)
        self._attachment = Attachment(
            source, to_bitmap(indices), address=self.address, name=name, batch_size=self.batch_size,
            batched=batched, timeout_s=timeout_s, drop_last=drop_last, seed=seed, crc_check=crc_check_wanted(verify),
            rank=rank, world_size=world_size, order=order, expected=self.expected, autostart=autostart)
        # Before any DataLoader worker forks: its readers note failures where len() counts them.
        self._undecodable = Undecodable(self._attachment.description.num_source_items)

    # ----------------------------------------------------------------------------- the job

    @property
    def _conn(self) -> Connection:
        """The connection of the job this process is attached to now (attaching if it can)."""
        return self._attachment.connected()

    @property
    def _connection(self) -> Connection | None:
        return self._attachment.connection

    @property
    def _keeper(self) -> Keeper | None:
        return self._attachment.keeper

    @property
    def job_id(self) -> str:
        """The job's id on the joaderd it is attached to now (a restart gives a new one)."""
        return self._conn.job_id

    def __len__(self) -> int:
        """Items per epoch of this rank; batches under `batched=True` (what the loop receives
        from `DataLoader(ds, batch_size=None)`). Under accelerate's dispatcher, the whole job's.

        Files known to be undecodable are left out (`on_error="skip"` skips them), for a job of
        one process: once an epoch has ended, `len(ds)` is what it yielded. A file is known once
        a reply of this job reported it, so before the first epoch reaches it (and for the ranks
        of a DDP job, whose items move between ranks) `len(ds)` counts it, and the epoch yields
        one item fewer; `joader status` lists the files (NOTE [ What len(ds) knows of
        undecodable files ] in joader.client.undecodable)."""
        self._attachment.check_framework()
        items = self._attachment.epoch_length(self._undecodable)
        return -(-items // self.batch_size) if self.batched else items

    def set_epoch(self, epoch: int) -> None:
        """Accepted, for the frameworks that call it on a dataset (accelerate's loaders, at the
        start of each epoch). joaderd counts a job's epochs itself: each `iter()` is the next."""
        self._attachment.check_framework()

    def close(self) -> None:
        """Ends this job on the server now; `with JoaderDataset(...) as ds:` calls it at the end
        of the block. Otherwise the job ends when the dataset is collected or the process exits.

        NOTE [ A sweep's trial ends its job ]
        joader keeps no reference cycle of its own: a dataset that goes out of scope (an Optuna
        objective that returns, in a thread of the study's `n_jobs`) ends its job at once, its
        lease keeper stopped by the attachment's finalizer (tests/unit/client/test_dataset.py
        runs such trials with the cycle collector off). What holds one longer is the caller's:
        an objective that raises (`optuna.TrialPruned`, a failure) leaves its frame, and the
        dataset in it, in a cycle Optuna keeps (its `func_err` holds the exception, whose
        traceback holds the frame that holds `func_err`) until Python's cycle collector runs;
        a dataset kept in a global lives with the process. A sweep's trial should use `with`,
        or call `close()`, which ends the job whatever holds the dataset.
        """
        self._attachment.close()

    def __enter__(self) -> JoaderDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- real jobs

    def state_dict(self) -> dict[str, Any]:
        """Where this reader is in its epoch: picklable, small, version-tagged (`joader.client.
        checkpoint`). `epoch`: its newest pass's; `consumed`: the ids it yielded of it (a
        serialized pyroaring BitMap), so a checkpoint taken between steps is exact. Under a
        DataLoader with workers each worker has its own (torchdata's StatefulDataLoader collects
        them); `parts` says how many readers reported, so that joaderd resumes with all of them.
        A finished epoch read by one process is saved as the start of the next. `source`,
        `dataset` (a digest of the indices) and `seed` say whose state it is."""
        self._attachment.settle()
        worker = get_worker_info()
        epoch, consumed, rest = self._progress.saved(parts := worker.num_workers if worker is not None else 1)
        return Checkpoint(self._attachment.owner(self._seed_given), epoch, consumed, parts, rest).state_dict()

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Makes the next `iter()` resume `state`'s epoch: exactly the items not consumed in it
        (in a uniform random order), then whole epochs. On another number of ranks or hosts,
        give every rank's states (a list): the epoch's rest is dealt anew (`joader.client.relayout`)."""
        checkpoint = self._attachment.checkpoint_of(state, self._seed_given)
        if checkpoint is not None:
            self._progress.restore(checkpoint.epoch, checkpoint.consumed, checkpoint.rest)
        self._resume = checkpoint.resume_point if checkpoint is not None else None

    def _names(self) -> ItemNames:
        """How an error names this job's items: class, and path when `root` is known."""
        if self._item_names is None:
            self._item_names = ItemNames.of(self.root, self._attachment.description)
        return self._item_names

    @property
    def resuming(self) -> ResumePoint | None:  # what the next `iter()` resumes, if any
        return self._resume

    def epoch_order(self, epoch: int) -> list[int]:
        """The indices this process yielded in `epoch`, in order (for epochs it read)."""
        return self._progress.epoch_order(epoch)

    # ----------------------------------------------------------------------------- reading

    def __iter__(self) -> Iterator[Any]:
        self._attachment.check_framework()
        attachment = self._attachment
        if attachment.dispatched and attachment.connection is None:
            return iter(())  # accelerate: rank 0 reads for this rank
        worker = get_worker_info()
        connection = self._conn
        board = connection.board
        pass_ = Pass.start(worker, attachment.passes, board, os.getpid())
        attachment.passes += 1
        pass_.take(self._resume, board)
        self._resume = None
        self._progress.current = pass_
        note_copy_only_workers(board, worker, self.transform, self.batched)
        # joaderd restarted since this process last read (a DataLoader worker forked from a
        # training process that never reads itself): the job's new identity. Nothing else: a
        # pass that starts now is a new pass (`continued_epoch`), whatever the epochs were.
        connection.refresh()
        options = ReadOptions.of_dataset(self, self._names())
        return Reader(connection, pass_, self._progress, options, warned=self._warned, pool=self._pool,
                      lease=attachment, undecodable=self._undecodable).start()
