"""The gRPC servicer: a thin adapter between joader.proto and the `Registry`.

Errors: every `JoaderError` becomes a gRPC status through the one table in `joader.errors`, with
the exception's class name in the `joader-error` trailing metadata so the client can raise the
same type. Anything else is a bug: it is logged with its traceback and reported as INTERNAL.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc
from pyroaring import BitMap

from joader.errors import InvalidArgumentError, JoaderError, UnknownJobError, status_code_name
from joader.proto import ERROR_METADATA_KEY, GRPC_OPTIONS, joader_pb2, joader_pb2_grpc
from joader.server.registry import Registry

logger = logging.getLogger(__name__)


F = TypeVar("F", bound=Callable[..., Any])


def _abort(context: grpc.ServicerContext, error: JoaderError) -> None:
    context.set_trailing_metadata(((ERROR_METADATA_KEY, type(error).__name__),))
    context.abort(grpc.StatusCode[status_code_name(error)], str(error))


def _translating(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except JoaderError as error:
            _abort(context, error)
        except Exception:
            logger.exception("internal error in %s", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in joaderd ({method.__name__})")

    return wrapper  # type: ignore[return-value]


class JoaderServicer(joader_pb2_grpc.JoaderServicer):
    """Serves `Attach`, `Next` and `Status` from a `Registry`."""

    def __init__(self, registry: Registry, arena_path: str, extra_status: dict[str, Any]) -> None:
        self._registry = registry
        self._arena_path = arena_path
        self._extra_status = extra_status

    def Attach(
        self, request_iterator: Iterator[joader_pb2.AttachRequest], context: grpc.ServicerContext
    ) -> Iterator[joader_pb2.AttachResponse]:
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        try:
            indices = _parse_indices(first.indices) if first.indices else None
            job = self._registry.attach(first.source, indices, first.name, first.batch_size or 64)
        except JoaderError as error:
            _abort(context, error)
            return
        job_id = job.job_id
        context.add_callback(lambda: self._registry.remove_job(job_id, "its lease stream closed"))
        source = job.source
        yield joader_pb2.AttachResponse(
            job_id=job_id,
            source=source.name,
            classes=list(source.listing.classes),
            num_source_items=source.num_items,
            num_items=job.num_items,
            image_size=source.image_size,
            item_nbytes=source.item_nbytes,
            arena_path=self._arena_path,
            lease_s=self._registry.config.lease_s,
        )
        try:
            for _ in request_iterator:
                self._registry.touch(job_id)
        except UnknownJobError as error:
            _abort(context, error)
        self._registry.remove_job(job_id, "its client closed the lease")

    @_translating
    def Next(self, request: joader_pb2.NextRequest, context: grpc.ServicerContext) -> joader_pb2.NextResponse:
        batch = self._registry.next_items(
            request.job_id, request.token, request.max_items, request.acks
        )
        return joader_pb2.NextResponse(
            epoch=batch.epoch,
            end_of_epoch=batch.end_of_epoch,
            item_ids=batch.item_ids,
            labels=batch.labels,
            offsets=batch.offsets,
            failed=[
                joader_pb2.FailedItem(item_id=i, path=p, reason=r) for i, p, r in batch.failed
            ],
        )

    @_translating
    def Status(self, request: joader_pb2.StatusRequest, context: grpc.ServicerContext) -> joader_pb2.StatusResponse:
        status = self._registry.status()
        status.update(self._extra_status)
        return joader_pb2.StatusResponse(json=json.dumps(status))


def _parse_indices(data: bytes) -> BitMap:
    try:
        return BitMap.deserialize(data)
    except Exception as error:  # pyroaring raises ValueError or its own errors on bad bytes
        raise InvalidArgumentError(
            f"the job's indices are not a serialized pyroaring BitMap ({error}); "
            "pass indices as a range, ints, a numpy array or a BitMap"
        ) from error


def create_server(
    servicer: JoaderServicer, address: str, max_workers: int = 64
) -> tuple[grpc.Server, int]:
    """Starts a gRPC server for `servicer` on `address`; returns it and its TCP port (0 on a socket).

    One thread serves each job's lease stream for the job's lifetime, so `max_workers` bounds the
    number of jobs plus concurrent `Next` calls.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="joaderd-rpc"),
        options=GRPC_OPTIONS,
        maximum_concurrent_rpcs=max_workers,
    )
    joader_pb2_grpc.add_JoaderServicer_to_server(servicer, server)
    port = server.add_insecure_port(address)
    if port == 0 and not address.startswith("unix:"):
        raise OSError(f"joaderd cannot listen on {address}: the port is taken or the host is not local")
    server.start()
    return server, port
