"""The gRPC servicer: a thin asyncio adapter between joader.proto and the `Registry`.

Why `grpc.aio`: a synchronous `grpc.server` spends one pool thread per open stream for the
stream's whole life, and every job holds a lease stream, so jobs and in-flight `Next` calls
shared 64 threads and job 65 broke the others. Here a lease stream or a waiting `Next` is a
suspended coroutine; the only limit is `--max-jobs`, refused with an error that names it.

The registry never blocks the event loop for long: its calls take its lock for a few
microseconds, and a `Next` that must wait for a decode awaits an `asyncio.Event` that the
registry sets (through `call_soon_threadsafe`) when the job's items may be ready.

Errors: every `JoaderError` becomes a gRPC status through the one table in `joader.errors`, with
the exception's class name in the `joader-error` trailing metadata so the client can raise the
same type. Anything else is a bug: it is logged with its traceback and reported as INTERNAL.

NOTE [ A malformed message is the client's error, in one line ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With the generated handlers, bytes that are not a valid message (or a string field that is not
UTF-8) made protobuf raise inside gRPC's deserializer: gRPC logged ten lines of traceback at
ERROR for each, and the client got a bare UNKNOWN. Anyone who can reach the socket could fill
joaderd's log that way. The handlers here parse with `tolerant`, which returns a `Malformed`
instead of raising; the method refuses it with InvalidArgumentError (what was wrong, which
message, the fix), and joaderd logs one line per kind of malformed message per minute, then how
many more there were (`server/log_limits.py`; every one with --log-level DEBUG).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from pyroaring import BitMap

from joader.errors import InvalidArgumentError, JoaderError, UnknownJobError, status_code_name
from joader.proto import (
    DTYPE_CODES,
    ERROR_METADATA_KEY,
    MAX_MESSAGE_BYTES,
    joader_pb2,
    joader_pb2_grpc,
)
from joader.server.books.records import RestShare
from joader.server.registry.next_call import Batch, NextArgs, NextCall
from joader.server.registry.registry import Registry, max_indices_bytes
from joader.sources.safe_open import display_path

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


_SERVICE = "joader.Joader"


@dataclass(frozen=True)
class Malformed:
    """What `tolerant` makes of bytes that do not parse as the method's request message."""

    message: str  # the message type's name, e.g. NextRequest
    num_bytes: int
    problem: str  # protobuf's words

    def error(self, method: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"joaderd could not parse the {self.message} ({self.num_bytes} bytes) of a {method} "
            f"call: {self.problem}; send {_SERVICE} messages as joader's client does (a client "
            "and a joaderd of the same joader version)"
        )


def tolerant(message_type: Any) -> Callable[[bytes], Any]:
    """`message_type.FromString`, returning a `Malformed` instead of raising (NOTE [ A malformed
    message is the client's error, in one line ])."""
    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            return Malformed(message_type.DESCRIPTOR.name, len(data), str(error))

    return parse


async def _abort(context: grpc.aio.ServicerContext, error: JoaderError) -> None:
    context.set_trailing_metadata(((ERROR_METADATA_KEY, type(error).__name__),))
    await context.abort(grpc.StatusCode[status_code_name(error)], str(error))


async def _refuse(method: str, malformed: Malformed, context: grpc.aio.ServicerContext) -> None:
    log_refusal(method, malformed, _peer(context) or "an unknown peer")
    await _abort(context, malformed.error(method))


def log_refusal(method: str, malformed: Malformed, peer: str) -> None:
    """One line a minute per kind (method, problem) in joaderd's log: an outsider repeats it at will."""
    logger.warning("refused a malformed %s (%d bytes) on %s from %s: %s", malformed.message,
                   malformed.num_bytes, method, peer, malformed.problem,
                   extra={"repeat_key": ("malformed", method, malformed.problem), "repeat_burst": 1})


def _peer(context: grpc.aio.ServicerContext) -> str:
    try:
        return str(context.peer())
    except Exception:  # a context without a peer (a test's) is no reason to fail the refusal
        return ""


def _translating(method: F) -> F:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await _refuse(method.__name__, request, context)
            return None
        try:
            return await method(self, request, context)
        except JoaderError as error:
            await _abort(context, error)
        except Exception:
            logger.exception("internal error in %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in joaderd ({method.__name__})")

    return wrapper  # type: ignore[return-value]


_ATTACH_INTERNAL = "internal error in joaderd (Attach): its log has the traceback; the job was not started"


def _threadsafe_setter(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> Callable[[], None]:
    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(event.set)

    return wake


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Waker:
    """Wakes one waiting `Next` from any thread: a bare future per wait, one hand-over to the
    loop per wait however many times the registry wakes it.

    NOTE [ A Next waits on a bare future ]
    A waiting `Next` used an `asyncio.Event` and `asyncio.wait_for`: a task, a timer and a
    cancellation per wait, and a call into the loop (a write to its wake-up pipe) per wake,
    several per wait as items settle (issue 37: the event loop was most of joaderd's main CPU
    per warm delivery). Now a wait is one future and one timer; a wake that finds a hand-over
    already on its way adds nothing. A wake while the call is not waiting (it is polling, on
    the loop's thread) reaches the future made before the poll, so it is never lost."""

    __slots__ = ("_future", "_loop", "_pending")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._future: asyncio.Future[None] | None = None
        self._pending = False

    def arm(self) -> asyncio.Future[None]:
        """A fresh future for the next wait (made before the poll that may decide to wait)."""
        self._future = self._loop.create_future()
        return self._future

    def __call__(self) -> None:
        if self._pending:
            return
        self._pending = True
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        self._pending = False
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)


@dataclass(frozen=True)
class WaitingNext:
    """A Next call that waits for its batch: the registry's call, and how it is woken."""

    call: NextCall
    waker: _Waker
    future: asyncio.Future[None]


class JoaderServicer(joader_pb2_grpc.JoaderServicer):
    """Serves `Attach`, `Next` and `Status` from a `Registry`."""

    def __init__(self, registry: Registry, arena_path: str, extra_status: Callable[[], dict[str, Any]]) -> None:
        self._registry = registry
        self._arena_path = arena_path
        self._arena_name = os.path.basename(arena_path)  # what every Next reply names
        self._extra_status = extra_status
        # Where an attaching rank is told to send its Next calls (NOTE [ Next fronts ]); "": here.
        self.next_address: Callable[[], str] = lambda: ""

    async def Attach(
        self, request_iterator: AsyncIterator[joader_pb2.AttachRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[joader_pb2.AttachResponse]:
        try:
            first = await anext(request_iterator)
        except StopAsyncIteration:
            return
        if isinstance(first, Malformed):
            await _refuse("Attach", first, context)
            return
        try:
            source = self._registry.source(first.source)
            indices = _parse_indices(first.indices, source.num_items) if first.indices else None
            if first.describe:  # nothing registered: the description, and the stream ends
                yield self._checked_size(self._source_reply(source, indices), source)
                return
            rank = first.rank
            report = None
            if first.resume_epoch:
                report = (first.resume_epoch, _parse_indices(first.resume_consumed, source.num_items),
                          _rest_share(first))
            job = self._registry.attach(
                first.source, indices, first.name, first.batch_size or 64, rank=rank,
                world_size=first.world_size or 1, drop_last=first.drop_last,
                seed=first.seed if first.has_seed else None, restart_report=report,
                order=first.order or "shared",
            )
        except JoaderError as error:
            await _abort(context, error)
            return
        except Exception:
            # A bug, not the client's mistake: say so, instead of the bare UNKNOWN that gRPC
            # makes of an exception escaping a stream handler.
            logger.exception("internal error in Attach (source %r, job %r)", first.source, first.name)
            await context.abort(grpc.StatusCode.INTERNAL, _ATTACH_INTERNAL)
            return
        removed = asyncio.Event()
        reason: list[str] = []
        set_removed = _threadsafe_setter(asyncio.get_running_loop(), removed)

        def on_removed(why: str) -> None:
            reason.append(why)
            set_removed()

        job_id = job.job_id
        self._registry.on_removed(job_id, on_removed)
        # Both set before anything can fail: the `finally` below must know whether the lease
        # closed on purpose, and why a job that never got its reply was removed (an unset name
        # there would raise UnboundLocalError and hide the real failure from the client).
        closed: list[bool] = []
        failure: list[str] = []
        try:
            try:
                reply = self._attach_reply(job, source, rank)
            except JoaderError as error:
                failure.append(str(error))
                await _abort(context, error)
                return
            except Exception:
                failure.append("joaderd failed to build its Attach reply (an internal error; its log has the traceback)")
                logger.exception("internal error building the Attach reply of job %s (source %r)", job_id, first.source)
                await context.abort(grpc.StatusCode.INTERNAL, _ATTACH_INTERNAL)
                return
            yield reply
            malformed: list[Malformed] = []
            heartbeats = asyncio.ensure_future(
                self._heartbeats(job_id, rank, request_iterator, closed, malformed))
            gone = asyncio.ensure_future(removed.wait())
            try:
                await asyncio.wait({heartbeats, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (heartbeats, gone):
                    task.cancel()
            if malformed:
                failure.append(f"its lease stream sent a malformed message ({malformed[0].problem})")
                await _refuse("Attach", malformed[0], context)
                return
            if removed.is_set():
                # The lease ended on the server's side (expired): end the stream, freeing it.
                context.set_trailing_metadata(((ERROR_METADATA_KEY, "UnknownJobError"),))
                await context.abort(grpc.StatusCode.NOT_FOUND, f"job {job_id} was removed: {reason[0]}")
        finally:
            # The stream ended: the client closed it on purpose (`closing`), or its process died
            # or lost its connection, or the call was cancelled.
            if closed:
                self._registry.close_rank(job_id, rank)
            elif failure:
                self._registry.remove_job(job_id, f"its Attach failed: {failure[0]}")
            else:
                who = f"rank {rank}'s" if job.world_size > 1 else "its"
                self._registry.remove_job(job_id, f"{who} lease stream closed: the lease keeper "
                                          "process of the training job exited or lost its connection")

    def _attach_reply(self, job: Any, source: Any, rank: int) -> joader_pb2.AttachResponse:
        """The first reply of a job's lease stream: its identity, the source, and its labels."""
        reply = self._source_reply(source, job.dataset)
        reply.MergeFrom(joader_pb2.AttachResponse(
            job_id=job.job_id,
            job_secret=job.secret,
            num_items=job.num_items,
            arena_path=self._arena_path,
            lease_s=self._registry.config.lease_s,
            server_pid=os.getpid(),
            world_size=job.world_size,
            rank=rank,
            num_rank_items=job.per_rank,
            seed=job.seed,
            notice=job.ranks[rank].notice,
            next_address=self.next_address(),
        ))
        return self._checked_size(reply, source)

    def _source_reply(self, source: Any, dataset: BitMap | None) -> joader_pb2.AttachResponse:
        """What a job trains on: the source, its classes, the dataset's labels and size."""
        listing = source.listing
        ids = dataset.to_array() if dataset is not None else slice(None)
        return joader_pb2.AttachResponse(
            source=source.name,
            classes=[os.fsencode(c) for c in listing.classes],
            class_labels=[listing.class_to_idx[c] for c in listing.classes],
            num_source_items=source.num_items,
            num_items=len(dataset) if dataset is not None else source.num_items,
            image_size=getattr(source.stage, "size", 0) or 0,
            item_nbytes=source.max_item_bytes,
            stage=source.stage.name,
            # A fixed-size stage's shape; or the shape a stage's items have but for rare
            # exceptions (center-crop without upscale: images smaller than S), which a
            # batched client then refuses one by one, naming the item and the fix.
            item_shape=list(source.stage.spec.shape or getattr(source.stage, "nominal_shape", None) or ()),
            item_dtype=source.stage.spec.dtype or "",
            fingerprint=source.fingerprint,
            targets=listing.labels[ids].astype("<i4").tobytes(),
        )

    @staticmethod
    def _checked_size(reply: joader_pb2.AttachResponse, source: Any) -> joader_pb2.AttachResponse:
        """`reply`, or InvalidArgumentError if it cannot be sent: past gRPC's message limit the
        send failed with a RESOURCE_EXHAUSTED that the client took for a full /dev/shm. A
        source with millions of distinct labels (a label per image is not a class) or a job of
        over 60 million items gets there."""
        size = reply.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            raise InvalidArgumentError(
                f"joaderd cannot describe source {source.name!r} to this job: its Attach reply "
                f"would take {size:,} bytes, over gRPC's limit of {MAX_MESSAGE_BYTES:,} "
                f"({len(source.listing.classes):,} classes, {len(reply.targets) // 4:,} labels of the "
                "job's items); give the source fewer distinct labels (classes, not one label per "
                "image), or the job fewer items (indices=...)"
            )
        return reply

    async def _heartbeats(self, job_id: str, rank: int,
                          request_iterator: AsyncIterator[joader_pb2.AttachRequest],
                          closed: list[bool], malformed: list[Malformed]) -> None:
        try:
            async for request in request_iterator:
                if isinstance(request, Malformed):
                    malformed.append(request)
                    return
                if request.closing:
                    closed.append(True)
                    return
                self._registry.touch(job_id, rank)
        except UnknownJobError:
            return  # removed meanwhile: the removal ends the stream
        except grpc.RpcError:
            return  # the client went away: the stream's end removes the job

    @_translating
    async def Next(self, request: joader_pb2.NextRequest, context: grpc.aio.ServicerContext) -> joader_pb2.NextResponse:
        started = self.start_next(request)
        if isinstance(started, joader_pb2.NextResponse):
            return started
        return await self.finish_next(started)

    def start_next(self, request: joader_pb2.NextRequest) -> joader_pb2.NextResponse | WaitingNext:
        """A Next call's start, on the event loop's thread: its reply if the rank's batch is
        ready, else the call to wait for (`finish_next`). Raises `JoaderError`s as the call's."""
        registry = self._registry
        consumed = None
        if request.resume_epoch:
            job_source = registry.job_source(request.job_id)
            consumed = _parse_indices(request.resume_consumed, job_source.num_items) if job_source else BitMap()
        args = NextArgs(
            request.job_id, request.job_secret, request.token, request.max_items,
            tuple(request.acks), request.worker_id, request.pid, request.rank,
            request.resume_epoch, consumed, request.resume_parts or 1, request.max_batches or 1,
            (request.stall_epoch, request.stall_wait_s, request.stall_step_s, request.stall_items)
            if request.stall_epoch else None, request.num_workers, request.continue_epoch,
            _rest_share(request) if request.resume_epoch else None,
        )  # fmt: skip
        waker = _Waker(asyncio.get_running_loop())
        future = waker.arm()
        call = registry.begin_next(args, waker)
        if isinstance(call, Batch):
            return _response(call, self._arena_name)
        return WaitingNext(call, waker, future)

    async def finish_next(self, waiting: WaitingNext) -> joader_pb2.NextResponse:
        """Waits for a started call's batch (woken as its items settle); its reply."""
        registry, waker, future, call = self._registry, waiting.waker, waiting.future, waiting.call
        loop = asyncio.get_running_loop()
        try:
            while True:
                result = registry.poll_next(call)
                if isinstance(result, Batch):
                    return _response(result, self._arena_name)
                if not future.done():  # else woken during the poll: poll again at once
                    timer = loop.call_later(result, _set_done, future)
                    try:
                        await future
                    finally:
                        timer.cancel()
                future = waker.arm()
        finally:
            registry.end_next(call)

    @_translating
    async def Status(self, request: joader_pb2.StatusRequest, context: grpc.aio.ServicerContext) -> joader_pb2.StatusResponse:
        status = self._registry.status(self._extra_status())
        return joader_pb2.StatusResponse(json=json.dumps(status))


def _response(batch: Batch, arena: str) -> joader_pb2.NextResponse:
    forms = batch.forms
    # A batch's items mostly share one form (size, shape and dtype: the same object, the cache
    # shares them): then the repeated fields are one list repeated, not a loop per item.
    if forms and forms.count(forms[0]) == len(forms):
        nbytes, shape, dtype = forms[0]
        lengths = [nbytes] * len(forms)
        dims = list(shape) * len(forms)
        ndims = [len(shape)] * len(forms)
        codes = [DTYPE_CODES[dtype]] * len(forms)
    else:
        lengths = [form[0] for form in forms]
        dims = [dim for form in forms for dim in form[1]]
        ndims = [len(form[1]) for form in forms]
        codes = [DTYPE_CODES[form[2]] for form in forms]
    return joader_pb2.NextResponse(
        epoch=batch.epoch,
        end_of_epoch=batch.end_of_epoch,
        item_ids=batch.item_ids,
        labels=batch.labels,
        offsets=batch.offsets,
        failed=[
            joader_pb2.FailedItem(item_id=i, path=os.fsencode(p), reason=display_path(r))
            for i, p, r in batch.failed
        ],
        lengths=lengths,
        ndims=ndims,
        dims=dims,
        dtypes=codes,
        arena=arena,
        checksums=batch.checksums,
        copy_now=batch.copy_now,
        waiting=batch.waiting,
        rank_never_read=batch.rank_never_read,
        waiting_s=batch.waiting_s,
    )


def _rest_share(request: joader_pb2.NextRequest | joader_pb2.AttachRequest) -> RestShare | None:
    """A resume's share of an elastic resume's rest (NOTE [ An elastic resume ]), if it says one."""
    return RestShare(request.resume_share, request.resume_base) if request.resume_rest else None


def _parse_indices(data: bytes, num_items: int) -> BitMap:
    limit = max_indices_bytes(num_items)
    if len(data) > limit:
        raise InvalidArgumentError(
            f"the job's indices take {len(data)} bytes serialized, more than any subset of this "
            f"source ({num_items} items) can ({limit} bytes); pass indices within 0..{num_items - 1}"
        )
    try:
        return BitMap.deserialize(data)
    except Exception as error:  # pyroaring raises ValueError or its own errors on bad bytes
        raise InvalidArgumentError(
            f"the job's indices are not a serialized pyroaring BitMap ({error}); "
            "pass indices as a range, ints, a numpy array or a BitMap"
        ) from error


def receive_limit_bytes(source_sizes: list[int]) -> int:
    """The largest request joaderd accepts: the largest indices any source admits, plus room.

    gRPC refuses a larger message before it is parsed, so a hostile 242 MB request costs
    joaderd nothing.
    """
    largest = max((max_indices_bytes(n) for n in source_sizes), default=0)
    return min(MAX_MESSAGE_BYTES, max(1 << 20, 2 * largest + (64 << 10)))


async def start_server(
    servicer: JoaderServicer, address: str, receive_limit: int
) -> tuple[grpc.aio.Server, int]:
    """Starts a `grpc.aio` server for `servicer` on `address`; returns it and its TCP port
    (0 on a Unix socket). Must run inside the event loop that will serve it."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", receive_limit),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    add_servicer(servicer, server)
    port = server.add_insecure_port(address)
    if port == 0 and not address.startswith("unix:"):
        raise OSError(f"joaderd cannot listen on {address}: the port is taken or the host is not local")
    await server.start()
    return server, port


def add_servicer(servicer: JoaderServicer, server: grpc.aio.Server) -> None:
    """`joader_pb2_grpc.add_JoaderServicer_to_server`, but every request parsed by `tolerant`
    (NOTE [ A malformed message is the client's error, in one line ]); the methods are read from
    the service's descriptor, so a method added to joader.proto is served the same way."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in joader_pb2.DESCRIPTOR.services_by_name[_SERVICE.split(".")[-1]].methods:
        make = kinds[(method.client_streaming, method.server_streaming)]
        reply_type = getattr(joader_pb2, method.output_type.name)
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=tolerant(getattr(joader_pb2, method.input_type.name)),
            response_serializer=reply_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)
