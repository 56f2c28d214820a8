"""Per-process gRPC channels to joaderd, and the translation of its errors.

A DataLoader forks its workers; a process forked while a gRPC channel is live can crash. So a
channel is created lazily in the process that uses it, remembered with that process's pid, and
never carried across a fork: a child sees the parent's pid on the cached channel and makes its own.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import grpc

from joader.errors import JoaderError, error_from_status
from joader.proto import ERROR_METADATA_KEY, GRPC_OPTIONS, joader_pb2_grpc

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_channels: dict[str, tuple[int, grpc.Channel, joader_pb2_grpc.JoaderStub]] = {}


def get_stub(address: str) -> joader_pb2_grpc.JoaderStub:
    """The stub for `address` in this process, creating its channel on first use."""
    pid = os.getpid()
    with _lock:
        cached = _channels.get(address)
        if cached is not None and cached[0] == pid:
            return cached[2]
        channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        stub = joader_pb2_grpc.JoaderStub(channel)
        _channels[address] = (pid, channel, stub)
        return stub


def reset_channel(address: str) -> None:
    """Forgets this process's channel to `address`; the next call makes a fresh one (after
    joaderd restarted, a fresh channel connects at once instead of backing off).

    NOTE [ Resetting a channel must not close it ]
    The channel is the process's, shared by every dataset (and thread) that talks to `address`:
    Optuna's `n_jobs` trials are threads of one process, each with its own dataset. When joaderd
    restarted, the first reader to adopt the new job closed the channel, and the call another
    trial's reader had just sent on it to the new joaderd failed with "CANCELLED: Channel
    closed!", ending that trial. The old channel is only dropped from the cache: calls in flight
    on it finish (or fail as the dead server's calls do), and it is closed when the last of them
    lets go of it."""
    with _lock:
        _channels.pop(address, None)


def translate(error: grpc.RpcError, address: str) -> Exception:
    """The exception to raise for a failed call: a `JoaderError` subclass or `ConnectionError`."""
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    details: str = error.details() or ""  # type: ignore[attr-defined]
    class_name = None
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == ERROR_METADATA_KEY:
            class_name = value
    if class_name is not None:  # joaderd raised it on purpose: the same class, its message
        return error_from_status(class_name, code.name, details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectionError(
            f"no joaderd is answering at {address} ({details}). Start one with "
            "`joaderd --source NAME=PATH`, or point JOADER_ADDRESS (or address=) at the one running, "
            "or pass root=PATH to JoaderDataset and it starts one itself."
        )
    if code == grpc.StatusCode.CANCELLED:
        # NOTE [ A stopping server cancels its calls ]
        # This client never cancels a call it then waits for; joaderd's gRPC server (grpc.aio)
        # ends the calls in flight CANCELLED when it stops (killed driver, `joader servers
        # --stop`, a shutdown). That is the server going away, as UNAVAILABLE is: raised as a
        # joaderd failure, it ended a job that should have learned why (a restart to wait for,
        # or ServerStoppedError naming the fix).
        return ConnectionError(f"joaderd at {address} went away while a call was in flight ({details})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(f"joaderd at {address} did not answer in time ({details})")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # gRPC's own limits, not joaderd's errors
        return JoaderError(
            f"joaderd at {address} refused the request: {details}. A request larger than "
            "joaderd accepts usually means indices outside the source; pass indices within it"
        )
    if code not in _JOADER_CODES:
        return JoaderError(f"joaderd at {address} failed: {code.name}: {details}")
    return error_from_status(None, code.name, details)


_JOADER_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
}


def call(address: str, method: str, request: Any, timeout_s: float | None = None) -> Any:
    """Calls a unary method by name, raising translated errors."""
    stub = get_stub(address)
    try:
        return getattr(stub, method)(request, timeout=timeout_s)
    except grpc.RpcError as error:
        raise translate(error, address) from None


class PendingCall:
    """A unary call in flight; `result()` waits and raises translated errors."""

    def __init__(self, future: Any, address: str) -> None:
        self._future = future
        self._address = address

    def on_success(self, callback: Callable[[Any], None]) -> None:
        """Calls `callback(reply)` as soon as the reply arrives (on a gRPC thread, or at once if
        it is here): what must happen even if nobody reads the reply for a while."""
        def done(future: Any) -> None:
            if not future.cancelled() and future.exception() is None:
                try:
                    callback(future.result())
                except Exception:  # noqa: BLE001  a gRPC thread must not die of it
                    logger.exception("reply callback failed")
        self._future.add_done_callback(done)

    def result(self) -> Any:
        try:
            return self._future.result()
        except grpc.RpcError as error:
            raise translate(error, self._address) from None


def call_async(address: str, method: str, request: Any, timeout_s: float | None = None) -> PendingCall:
    """Starts a unary call by name without waiting for it."""
    stub = get_stub(address)
    return PendingCall(getattr(stub, method).future(request, timeout=timeout_s), address)
