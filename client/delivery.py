"""Reading one pass: the reply loop, and the three ways its items reach the training loop.

A reader is one pass as one process reads it (the training process, or one DataLoader worker):
the class `Reader`, which owns its `Pass`, records what the loop took in the dataset's
`Progress`, and reads its options (`ReadOptions`), not the dataset. (An arena's `ArenaReader`
is called a mapping here.) Its reply loop (`replies`) asks joaderd for the pass's
items, a batch per request, each request carrying the previous batch's acknowledgements so that
it travels while that batch is consumed; it survives a joaderd restart (the connection adopts the
new identity, and the pass resumes its epoch without what this rank already received). The
delivery modes only say how a reply's items are placed:

- `items`: one tensor per item (a DataLoader collates them);
- `batches`: whole batches copied straight into one tensor (`batched=True`);
- `handed_off`: in a DataLoader worker without a transform, batches as arena offsets that the
  training process copies (`joader.client.handoff`).

None of them keeps a piece of the job's identity: every reply is read through the arena it
names, via the connection.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import get_worker_info

from joader.client import frameworks
from joader.client.batch_shapes import ItemNames, guard_shapes, shape_error
from joader.client.batchpool import ProcessBatchPool
from joader.client.connection import BATCHES_PER_REQUEST, Call, Connection, Reply
from joader.client.handoff import ArenaBatch, Layout, Receipts
from joader.client.passes import Pass, Progress, continued_epoch
from joader.client.prefetch import prefetched
from joader.client.shm_batches import guard_collate, shared_batch_tensor
from joader.client.undecodable import Undecodable
from joader.errors import (
    DecodeError,
    InvalidArgumentError,
    PassSupersededError,
    superseded_message,
)
from joader.proto import DTYPES, joader_pb2
from joader.sources.safe_open import display_path

logger = logging.getLogger(__name__)

_NOTICE_BATCH_SIZE = 1  # board notice: "the dataset's batch size is not the loader's"
# Another rank that never asked for items after this long is not coming: a script that reads on
# one rank only (waiting out `timeout_s`, 300 s, the error would blame the cache).
RANK_NEVER_READ_LIMIT_S = 60.0


@dataclass(frozen=True)
class ReadOptions:
    """What a reader needs of its dataset's arguments and of joaderd's description."""

    source: str
    batch_size: int  # items per request, and per batch under `batched`
    batch_size_given: bool = False  # else requests follow the DataLoader's batch size
    batched: bool = False
    transform: Callable[[torch.Tensor], Any] | None = None
    return_index: bool = False
    on_error: str = "skip"
    timeout_s: float = 300.0
    prefetch: int = 1
    item_shape: tuple[int, ...] | None = None
    item_dtype: str = ""
    rank: int | None = 0
    world_size: int = 1
    names: ItemNames = field(default_factory=ItemNames)  # how an error names an item

    @classmethod
    def of_dataset(cls, ds: Any, names: ItemNames) -> ReadOptions:
        """A `JoaderDataset`'s, as it is now (its rank, and joaderd's description)."""
        return cls(
            source=ds.source, batch_size=ds.batch_size, batch_size_given=ds._batch_size_given,
            batched=ds.batched, transform=ds.transform, return_index=ds.return_index,
            on_error=ds.on_error, timeout_s=ds.timeout_s, prefetch=ds.prefetch,
            item_shape=ds.item_shape, item_dtype=ds.item_dtype, rank=ds.rank, world_size=ds.world_size,
            names=names)


def check_read_arguments(on_error: str, prefetch: int, batch_size: int | None) -> None:
    """`JoaderDataset`'s arguments of reading, checked before anything is attached."""
    if on_error not in ("skip", "raise"):
        raise InvalidArgumentError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise InvalidArgumentError(f"prefetch must be an int >= 0 (replies read ahead; 0: none), got {prefetch!r}")
    if batch_size is not None and batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")


_SERVED_KEPT = 8192  # odd-shaped items remembered for a batch's error (the newest)


class Reader:
    """One pass in this process: its requests, its reply loop, and how its items reach the
    training loop. It records what the loop took in `progress` (the dataset's, for
    `state_dict` and `epoch_order`); `warned` is the dataset's set of failed items already
    logged; `pool` its batch buffers (`batched=True` in the training process)."""

    def __init__(self, conn: Connection, pass_: Pass, progress: Progress, options: ReadOptions, *,
                 warned: set[int] | None = None, pool: ProcessBatchPool | None = None, lease: Any = None,
                 undecodable: Undecodable | None = None) -> None:
        self.conn = conn
        self.pass_ = pass_
        self.progress = progress
        self.options = options
        self.size = options.batch_size  # items per request: whole batches of the loop's size
        self.warned = warned if warned is not None else set()
        self.pool = pool if pool is not None else ProcessBatchPool()
        self.served: dict[int, tuple[int, ...]] = {}  # items served in another shape than the stage's
        self.undecodable = undecodable  # the job's items known to fail, for len(ds)
        # NOTE [ A pass keeps its job's lease ]
        # `for x in JoaderDataset(...)` holds only the iterator: the job's lease (the dataset's
        # attachment, whose collection stops the lease keeper) must live as long as the pass.
        self._lease = lease
        if get_worker_info() is not None:
            self.conn.watch_parent()

    def start(self) -> Iterator[Any]:
        """The iterator `iter(dataset)` returns: the delivery mode of this pass, chosen once.

        - items (`batched=False`): one `(image, label)` (or `(index, image, label)`) per item;
        - batches (`batched=True`): whole batches copied straight into one tensor;
        - handed off (`batched=True` in a forked DataLoader worker without a transform): batches
          as arena offsets that the training process copies (`joader.client.handoff`)."""
        options, board = self.options, self.conn.board
        worker = get_worker_info()
        if options.batched and worker is not None and options.transform is None \
                and Receipts.possible(board, worker.id):
            assert board is not None
            return self.handed_off(Receipts(board, worker.id, self.pass_.token))
        return self._deliver(options.batched, timed=worker is None)

    # ----------------------------------------------------------------------------- requests

    def _fields(self, max_items: int) -> dict[str, Any]:
        pass_ = self.pass_
        fields: dict[str, Any] = {
            "token": pass_.token, "max_items": max_items, "worker_id": pass_.worker_id,
            "rank": self.conn.identity.rank, "max_batches": BATCHES_PER_REQUEST if max_items else 0,
            "num_workers": pass_.num_workers, "continue_epoch": continued_epoch(self.conn.board, pass_),
        }
        if pass_.measured and pass_.epoch:
            fields.update(stall_epoch=pass_.epoch, stall_wait_s=pass_.wait_s,
                          stall_step_s=pass_.step_s, stall_items=pass_.items)
        if max_items and pass_.resume is not None:  # until the pass's first reply
            resume = pass_.resume
            fields.update(resume_epoch=resume.epoch, resume_consumed=resume.consumed.serialize(),
                          resume_parts=resume.parts)
            if resume.rest is not None:
                fields.update(resume_rest=True, resume_share=resume.rest.share, resume_base=resume.rest.base)
        return fields

    def ask(self, acks: Reply | list[int] | None = None) -> Call:
        """Asks for the next batch, acknowledging `acks`. The reply's items are marked on the
        client board the moment it arrives, read or not: a restart's resume report is built
        from the board, and an item that arrived but was not yet marked would be dealt again."""
        return self.conn.request(self._fields(self.size), acks, on_reply=self._mark)

    def report(self) -> None:
        """A request that asks for nothing: carries the stall figures."""
        self.conn.request(self._fields(0)).pending.result()

    def acknowledge(self, reply: Reply, ids: list[int]) -> None:
        self.conn.acknowledge(reply, ids, self._fields(0))

    def _mark(self, response: Any) -> None:
        board = self.conn.board
        ids = list(response.item_ids) + [f.item_id for f in response.failed]
        if board is not None and ids:
            if self.pass_.resume is not None:  # on arrival: a restart's report may come before the loop
                self._note_checkpoint(response.epoch)
            board.note_pass(response.epoch, self.pass_.token)
            board.mark(ids, response.epoch)

    def _note_checkpoint(self, epoch: int) -> None:
        """joaderd took this pass's checkpoint: what the run that saved it consumed of `epoch`
        goes on the board as received in it.

        NOTE [ A checkpoint's items are received items ]
        The lease keeper's report after a joaderd restart is the board's; without these marks, a
        restart later in the resumed epoch would deal the checkpoint's items again."""
        board, resume = self.conn.board, self.pass_.resume
        if board is None or resume is None or resume.epoch != epoch or not epoch:
            return
        board.note_pass(epoch, self.pass_.token)
        if resume.rest is not None:
            board.note_rest(epoch, resume.rest.share, resume.rest.base)
        if resume.consumed:
            board.mark(list(resume.consumed), epoch)

    # ----------------------------------------------------------------------------- the loop

    def replies(self, place: Callable[[Reply], None],
                copied: Callable[[], list[int]] | None = None, finish: bool = True) -> Iterator[None]:
        """One epoch of replies. `place(reply)` copies the reply's items out of the arena;
        each batch is then acknowledged in the request that fetches the next one. Yields after
        each placing. `copied()`, if given, says what to acknowledge instead of the placed ids:
        items another process copies out (`joader.client.handoff`), of the current server.
        `finish`: mark the pass's epoch finished at the end (a caller that reads ahead marks
        it once the loop has taken the last item)."""
        conn, pass_, progress = self.conn, self.pass_, self.progress
        call: Call | None = self.ask()
        unreachable: list[float | None] = [None]
        idle_s = 0.0
        try:
            while call is not None:
                reply = conn.reply(call, unreachable)
                if reply is None:  # joaderd restarted (the job is attached again) or was unreachable
                    # The next request says which epoch this pass continues, if any reader of
                    # it received items (`continued_epoch`); a checkpoint no joaderd took yet
                    # still travels. What the rank received, the lease keeper reported.
                    call = self.ask()
                    continue
                call = None
                conn.check_parent()
                response = reply.response
                if pass_.resume is not None:
                    self._note_checkpoint(response.epoch)
                if not pass_.epoch:
                    progress.start_epoch(pass_, response.epoch)
                # joaderd has taken the checkpoint's resume: it must not travel again, least of
                # all to a restarted joaderd, which would then deal again what this pass
                # received in between.
                pass_.resume = None
                # The mode's copy out of the arena, here and not after this loop step: it must
                # happen between the reply's arrival and the next request, which acknowledges
                # the copied items (so joaderd may reuse their slots) and travels while the loop
                # consumes them.
                place(reply)
                ids = list(response.item_ids)
                self._mark(response)  # again: the callback may not have run yet
                if self.undecodable is not None:
                    self.undecodable.note((f.item_id for f in response.failed), response.item_ids)
                if response.failed and self.options.on_error == "raise":
                    self.acknowledge(reply, ids)  # nothing of this batch stays pinned
                    self._raise_failure(response.failed[0])
                for failed in response.failed:
                    self._warn_failure(failed)
                acks: Reply | list[int] = reply if copied is None else copied()
                if response.end_of_epoch:
                    if isinstance(acks, Reply):
                        self.acknowledge(reply, ids)
                    elif acks:
                        conn.acknowledge(Reply(response, conn.identity), acks, self._fields(0))
                else:
                    call = self.ask(acks)
                if ids:
                    idle_s = 0.0
                elif not response.end_of_epoch:
                    idle_s += 1.0  # the server waited about a second for a ready item
                    if idle_s > self.options.timeout_s or (response.rank_never_read
                                                           and response.waiting_s > RANK_NEVER_READ_LIMIT_S):
                        self._timed_out(response.waiting, idle_s)
                yield
            if finish and progress.current is pass_:
                progress.finished = True
        finally:
            if call is not None:  # the loop broke out early with a batch on its way
                self._acknowledge_leftover(call)

    def _timed_out(self, waiting: str, idle_s: float) -> None:
        options = self.options
        if waiting:
            raise TimeoutError(
                f"job {self.conn.job_id} (rank {options.rank} of {options.world_size}): no item from joaderd for "
                f"{idle_s:.0f} s: {waiting}. Under accelerate, keep prepare()'s default dispatch or "
                "leave the DataLoader out of prepare(); with a DDP launcher, check that every rank "
                "builds the dataset with the same source, indices, world_size and drop_last")
        raise TimeoutError(
            f"job {self.conn.job_id}: no item from joaderd for {options.timeout_s:g} s; see `joader "
            "status`: the decode pool's state (a crash loop, a stuck worker), or its job's "
            "`waiting` (resume reports still missing).")

    def _acknowledge_leftover(self, call: Call) -> None:
        """Best effort: give back a prefetched batch nobody will read (the lease's end would
        release it anyway). At interpreter exit, grpc may already be torn down: skip it."""
        if sys.is_finalizing():
            return
        try:
            response = call.pending.result()
            if response.item_ids:
                self.acknowledge(Reply(response, call.identity), list(response.item_ids))
        except Exception as error:  # noqa: BLE001  a failed courtesy call must not mask anything
            logger.debug("job %s: leftover batch not acknowledged: %s", self.conn.job_id, error)

    def _yielded(self, indices: list[int]) -> None:
        """`indices` are given to the loop now. A newer iter() in this process took the epoch:
        items this pass still holds (prefetched before) must not be yielded as if its epoch went
        on. joaderd tells the same to readers in other processes (DataLoader workers) at their
        next request."""
        if self.progress.current is not self.pass_:
            raise PassSupersededError(superseded_message(self.conn.job_id))
        self.progress.yielded(self.pass_, indices)

    def _raise_failure(self, failed: joader_pb2.FailedItem) -> None:
        raise DecodeError(
            f"job {self.conn.job_id}: item {failed.item_id} ({display_path(failed.path)}) of source "
            f"{self.options.source!r} could not be decoded: {failed.reason}. Fix or remove the file "
            "(joaderd retries it after --retry-failed-s), or pass on_error='skip' to train "
            "without it."
        )

    def _warn_failure(self, failed: joader_pb2.FailedItem) -> None:
        if failed.item_id not in self.warned:
            self.warned.add(failed.item_id)
            logger.warning("job %s: skipping item %d (%s): %s", self.conn.job_id, failed.item_id,
                           display_path(failed.path), failed.reason)

    def _check_shapes(self, response: Any) -> None:
        """`batched=True`: every item goes into one batch tensor of the stage's shape."""
        options = self.options
        for index, label, item_shape in zip(response.item_ids, response.labels, shapes(response), strict=True):
            if item_shape != options.item_shape:
                raise shape_error(options.source, options.names.name(index, label), item_shape, options.item_shape)

    def _note_served(self, response: Any, item_shapes: list[tuple[int, ...]]) -> None:
        """Remembers the items served in another shape than the stage's, for the error of a
        batch that cannot be formed (`joader.client.batch_shapes`). A reply whose every item
        has the stage's shape costs one comparison of its `dims`."""
        expected, served = self.options.item_shape, self.served
        if expected is not None and list(response.dims) == list(expected) * len(item_shapes):
            return
        for index, item_shape in zip(response.item_ids, item_shapes, strict=True):
            if item_shape != expected:
                served[index] = item_shape
                if len(served) > _SERVED_KEPT:
                    del served[next(iter(served))]

    def _recent(self, count: int) -> list[int]:
        """The last `count` items this pass yielded (NOTE [ Which items a failed batch holds ])."""
        return self.progress.orders.get(self.pass_.epoch, [])[-count:]

    # ----------------------------------------------------------------------------- modes

    def _deliver(self, batched: bool, timed: bool) -> Iterator[Any]:
        """What the training loop's `next()` runs: the items (or batches) of the mode's chunks,
        each recorded as yielded when the loop takes it.

        `timed` (the training process): the loop's seconds inside `next()` (the data stall)
        and between calls (the step) go to the pass; each request reports them, and the last
        one, once the loop asks past the end (after its last step), goes alone.

        NOTE [ One generator on the loop's path ]
        Timing, the check that the pass is still current, and the record of what was yielded
        are done inline here, not by wrapping generators: each wrapper would be one more frame
        per item on the loop's `next()`."""
        pass_, progress = self.pass_, self.progress
        clock = time.perf_counter
        if timed:
            pass_.measured = True
        started = clock()
        # On the first next(): a DataLoader fetch, if any, is on the call stack now (not at iter()).
        chunks = self._batch_chunks() if batched else self._item_chunks_started()
        try:
            for chunk in chunks:
                for ids, value in chunk:
                    if progress.current is not pass_:
                        raise PassSupersededError(superseded_message(self.conn.job_id))
                    if batched:  # the chunks' two shapes: a batch's indices, or an item's index
                        progress.yielded(pass_, cast(list[int], ids))
                        value = self._emit(*value)
                    else:
                        progress.yielded(pass_, [cast(int, ids)])
                    if timed:
                        yielded = clock()
                        pass_.wait_s += yielded - started
                        yield value
                        started = clock()
                        pass_.step_s += started - yielded
                    else:
                        yield value
        finally:
            chunks.close()  # type: ignore[union-attr]  # a generator: its cleanup runs now
        if not batched and progress.current is pass_:
            progress.finished = True  # items: once the loop took the last one (batches: `replies`)
        if timed:
            pass_.wait_s += clock() - started
            if pass_.epoch and progress.current is pass_:
                try:
                    self.report()
                except Exception as error:  # noqa: BLE001  a lost figure must not fail the epoch
                    logger.debug("job %s: stall report not delivered: %s", self.conn.job_id, error)

    def _item_chunks_started(self) -> Iterator[list[tuple[int, Any]]]:
        """The items' chunks, once the request size follows the DataLoader's. In the training
        process (no DataLoader worker) replies are read, copied out and transformed
        `prefetch` replies ahead by a thread (`joader.client.prefetch`)."""
        self._follow_loader(skip=3)
        worker = get_worker_info()
        fetcher = frameworks.loader_fetcher(skip=3)
        if worker is not None:
            guard_collate(fetcher)
        guard_shapes(fetcher, self._recent, self.served, self.options.names, self.options.source,
                     self.options.item_shape)
        chunks = self._item_chunks()
        if self.options.prefetch > 0 and worker is None:
            chunks = prefetched(chunks, self.options.prefetch, f"joader-prefetch-{self.conn.job_id}")
        return chunks

    def _item_chunks(self) -> Iterator[list[tuple[int, Any]]]:
        """Per reply, its items as `(index, what the loop is given)`, transformed."""
        conn = self.conn
        placed: list[tuple[int, torch.Tensor, int]] = []

        def place(reply: Reply) -> None:
            response = reply.response
            # One tensor per item, not views of one batch tensor: torch.stack (in the
            # DataLoader's collate) is ~30x slower on views that share a storage.
            item_shapes = shapes(response)
            arrays = [np.empty(shape, dtype=dtype) for shape, dtype in zip(item_shapes, dtypes(response), strict=True)]
            conn.mapping(response.arena or reply.identity.arena).copy_many(response.offsets, response.lengths, arrays)
            conn.check_crcs(response, arrays)
            self._note_served(response, item_shapes)
            placed.extend(zip(response.item_ids, map(torch.from_numpy, arrays), response.labels, strict=True))

        transform, return_index = self.options.transform, self.options.return_index
        # `place` runs inside the reply loop, before it sends the next request (see `replies`).
        for _ in self.replies(place, finish=False):
            ready, placed[:] = list(placed), []
            chunk = []
            for index, image, label in ready:
                if transform is not None:
                    image = transform(image)
                chunk.append((index, (index, image, label) if return_index else (image, label)))
            yield chunk

    def _follow_loader(self, skip: int) -> None:
        """Asks in the batch size of the DataLoader that collates these items, when its fetch
        is on the stack (`joader.client.frameworks`; `skip`: frames up to the generator the
        fetch resumes): joaderd replies in whole batches of the size asked, so each worker then
        collates whole batches and the epoch has len(loader)."""
        options = self.options
        size = frameworks.loader_batch_size(skip=skip)
        if size is None or size == self.size:
            return
        if not options.batch_size_given:
            self.size = size
        elif self.conn.board is not None and self.conn.board.first_notice(_NOTICE_BATCH_SIZE):
            logger.warning(
                "JoaderDataset(batch_size=%d) under a DataLoader of batch_size=%d: joaderd replies "
                "in batches of %d, so each DataLoader worker's last batch of an epoch comes short "
                "and the epoch has more batches than len(loader). Leave batch_size out of "
                "JoaderDataset (it follows the loader's), or give both the same.", options.batch_size, size,
                options.batch_size)

    def _batch_chunks(self) -> Iterator[list[tuple[list[int], tuple[torch.Tensor, list[int], list[int]]]]]:
        """Whole batches, each copied straight into one tensor (`batched=True`), one per chunk
        as `(indices, (images, indices, labels))`; `_emit` makes what the loop is given."""
        conn, options = self.conn, self.options
        assert options.item_shape is not None
        shape, dtype, size = options.item_shape, np.dtype(options.item_dtype), options.batch_size
        # In a DataLoader worker, each batch is made in shared memory, as the DataLoader's own
        # collate does there: handing it to the main process then passes a file descriptor
        # instead of copying the batch once more. Elsewhere batches fill pooled buffers
        # (joader.client.batchpool), which fresh allocations' page faults made twice as slow.
        pool = None if get_worker_info() is not None else self.pool.get(size * int(np.prod(shape)) * dtype.itemsize)
        done: list[tuple[torch.Tensor, list[int], list[int]]] = []

        def fresh() -> list[Any]:
            if pool is None:
                return [shared_batch_tensor((size, *shape), dtype), [], []]
            return [torch.from_numpy(pool.take().view(dtype).reshape(size, *shape)), [], []]

        current: list[Any] = fresh()

        def place(reply: Reply) -> None:
            response = reply.response
            self._check_shapes(response)
            mapping = conn.mapping(response.arena or reply.identity.arena)
            at, count = 0, len(response.item_ids)
            while at < count:
                images, indices, labels = current
                take = min(size - len(indices), count - at)
                rows = images.numpy()[len(indices):len(indices) + take]
                mapping.copy_many(response.offsets[at:at + take], response.lengths[at:at + take], rows)
                conn.check_crcs(response, list(rows), at)
                indices.extend(response.item_ids[at:at + take])
                labels.extend(response.labels[at:at + take])
                at += take
                if len(indices) == size:
                    done.append((images, indices, labels))
                    current[:] = fresh()

        # `place` runs inside the reply loop, before it sends the next request (see `replies`).
        for _ in self.replies(place):
            while done:
                batch = done.pop(0)
                yield [(batch[1], batch)]
        images, indices, labels = current
        if indices:
            yield [(indices, (images[: len(indices)], indices, labels))]

    def _emit(self, images: torch.Tensor, indices: list[int], labels: list[int]) -> Any:
        options = self.options
        if options.transform is not None:
            images = torch.stack([options.transform(image) for image in images])
        label_tensor = torch.tensor(labels, dtype=torch.int64)
        if options.return_index:
            return torch.tensor(indices, dtype=torch.int64), images, label_tensor
        return images, label_tensor

    def handed_off(self, receipts: Receipts) -> Iterator[ArenaBatch]:
        """`batched=True` in a forked DataLoader worker without a transform: batches as arena
        offsets, which the training process copies out (`joader.client.handoff`). Their items
        are acknowledged once its receipts cover them. When joaderd says the job holds more
        than its share of the cache (`copy_now`), this worker copies the reply's items itself
        and acknowledges them at once: the hand-off pipeline (the DataLoader's prefetch) must
        not hold a small cache's every slot."""
        conn, options = self.conn, self.options
        assert options.item_shape is not None
        layout = Layout(options.item_shape, options.item_dtype, options.batch_size, options.return_index, conn.crc_check)
        done: list[ArenaBatch] = []
        current = [ArenaBatch(layout)]
        copied_now: list[int] = []

        def place(reply: Reply) -> None:
            response = reply.response
            self._check_shapes(response)
            identity = reply.identity
            where = conn.arena(response.arena or identity.arena)
            mapping = conn.mapping(where.name) if response.copy_now else None
            for i, (offset, length, index, label) in enumerate(zip(
                    response.offsets, response.lengths, response.item_ids, response.labels, strict=True)):
                checksum = response.checksums[i] if i < len(response.checksums) else 0
                if mapping is not None:
                    data = bytearray(length)
                    mapping.copy_many([offset], [length], [data])
                    conn.check_crcs(response, [data], i)
                    current[0].add_bytes(bytes(data), index, label)
                    copied_now.append(index)
                else:
                    current[0].add(where, offset, length, index, label, checksum)
                if len(current[0]) == options.batch_size:
                    done.append(current[0])
                    current[0] = ArenaBatch(layout)

        def copied() -> list[int]:
            ids = receipts.copied(conn.identity.arena)
            ids.extend(copied_now)
            copied_now.clear()
            return ids

        # `place` runs inside the reply loop, before it sends the next request (see `replies`);
        # `copied` says what that request acknowledges: what the training process copied.
        for _ in self.replies(place, copied=copied):
            while done:
                batch = done.pop(0)
                self._yielded(batch.item_ids)
                yield receipts.hand(batch)
        if len(current[0]):
            self._yielded(current[0].item_ids)
            yield receipts.hand(current[0])
        # Asked for more after the last batch: acknowledge the rest once the training process
        # copied it (it reads this worker's batches in order, before this worker's end).
        deadline = time.monotonic() + options.timeout_s
        while receipts.outstanding and time.monotonic() < deadline:
            conn.check_parent()  # the training process that would copy them may be dead
            ids = receipts.copied(conn.identity.arena)
            if ids:
                conn.acknowledge(Reply(None, conn.identity), ids, self._fields(0))
            else:
                time.sleep(0.002)


def shapes(response: Any) -> list[tuple[int, ...]]:
    """Each item's shape, from the response's flat `dims` and per-item `ndims`."""
    dims, found, at = response.dims, [], 0
    for ndim in response.ndims:
        found.append(tuple(dims[at:at + ndim]))
        at += ndim
    return found


def dtypes(response: Any) -> list[np.dtype]:
    return [_NUMPY_DTYPES[code] for code in response.dtypes]


_NUMPY_DTYPES = [np.dtype(name) for name in DTYPES]
