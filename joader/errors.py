"""The exception types of joader, and the one table that maps them to gRPC status codes.

Every error a user can cause derives from `JoaderError` and carries a message that names the
problem and the fix. The table is kept here, as status-code *names*, so that the core does not
import grpc; the server and the client translate with `grpc.StatusCode[name]`.
"""

from __future__ import annotations


class JoaderError(Exception):
    """Base class of every error joader raises on purpose."""

    status_code: str = "INTERNAL"


class InvalidArgumentError(JoaderError, ValueError):
    """A request or an argument is malformed: bad sizes, indices out of range, empty dataset."""

    status_code = "INVALID_ARGUMENT"


class UnknownSourceError(JoaderError, KeyError):
    """A source name the server does not serve."""

    status_code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownJobError(JoaderError, KeyError):
    """A job id that is not registered (never was, was removed, or its lease expired)."""

    status_code = "NOT_FOUND"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateJobError(JoaderError, ValueError):
    """A job id that is already registered."""

    status_code = "ALREADY_EXISTS"


class DecodeError(JoaderError):
    """A file of a source could not be read or decoded (truncated, corrupt, not an image)."""

    status_code = "DATA_LOSS"


class CacheSpaceError(JoaderError, OSError):
    """The shared-memory arena cannot be allocated (too little /dev/shm)."""

    status_code = "RESOURCE_EXHAUSTED"


class PassSupersededError(JoaderError, RuntimeError):
    """A newer pass (iterator) over the same job took over its epoch; this one cannot continue."""

    status_code = "FAILED_PRECONDITION"


def superseded_message(job_id: str, epoch: int | None = None) -> str:
    """The one text of `PassSupersededError`, raised by joaderd and by the client alike."""
    what = f"epoch {epoch}" if epoch is not None else "epoch"
    return (
        f"job {job_id}: this iterator's {what} was taken over by a newer iterator over the same "
        "JoaderDataset (a job reads one epoch at a time, and the newest iter() wins). Finish or "
        "delete the old iterator before starting another, or use a second JoaderDataset for a "
        "second concurrent reader."
    )


class TooManyJobsError(JoaderError, OSError):
    """joaderd already serves as many jobs as `--max-jobs` allows."""

    status_code = "RESOURCE_EXHAUSTED"


class ServerFailedError(JoaderError, RuntimeError):
    """joaderd hit an internal error and is shutting down (its log has the traceback)."""

    status_code = "UNAVAILABLE"


class ServerExitingError(JoaderError, ConnectionError):
    """joaderd is exiting because it had no job for `--idle-exit-s`: the attach came in the
    moment between its decision and its socket going away. To a client the same as finding no
    joaderd (a `ConnectionError`): start one again (NOTE [ Deciding to exit refuses the next
    attach ] in server/registry/idle_exit.py)."""

    status_code = "UNAVAILABLE"


class ServerStoppedError(JoaderError, ConnectionError):
    """The auto-started joaderd of a job was stopped on purpose (`joader servers --stop`): the
    job's lease keeper does not start it again (NOTE [ Stop means stop ] in
    `joader.client.autostart`). Run the job again to start a new one."""

    status_code = "UNAVAILABLE"


class UntrustedServerError(JoaderError, PermissionError):
    """A socket, its directory or a cache arena is not private to this user.

    Raised when someone else could have put it there: the socket is served by another uid, its
    directory is writable by others, or the arena file is not this user's. joader refuses to
    send a byte to, or read a byte from, anything another local user may control.
    """

    status_code = "PERMISSION_DENIED"


class SourceChangedError(JoaderError, RuntimeError):
    """joaderd came back after a restart serving another source under the job's source name
    (another item count, other files or labels, another stage): resuming the epoch there would
    deliver other items under the same indices."""

    status_code = "FAILED_PRECONDITION"


class IntegrityError(JoaderError, RuntimeError):
    """Bytes a reader copied out of the arena are not the bytes joaderd's decode wrote there
    (their checksum differs): never train on them. Only checked with verification on."""

    status_code = "DATA_LOSS"


class InvariantError(JoaderError, AssertionError):
    """joaderd's own books disagree (a refcount below zero, a pin released twice): a bug in
    joaderd, never the user's doing. Raised inside joaderd; the job whose bookkeeping broke is
    ended (`JobEndedError`) and every other job goes on."""

    status_code = "INTERNAL"


class JobEndedError(JoaderError, RuntimeError):
    """joaderd ended this job after an internal error in its bookkeeping (a bug, logged with
    its traceback); the server and every other job go on."""

    status_code = "ABORTED"


class ParentDiedError(JoaderError, RuntimeError):
    """A DataLoader worker's training process died: the worker stops reading (what it held is
    released with the job's lease, which ended with the training process)."""

    status_code = "CANCELLED"


class SharedMemoryFullError(JoaderError, OSError):
    """A client could not allocate a batch in shared memory: /dev/shm (a tmpfs) is full."""

    status_code = "RESOURCE_EXHAUSTED"


class BatchShapeError(JoaderError, RuntimeError):
    """The items of one batch differ in shape, so no batch tensor can hold them (raised in the
    client, `joader.client.batch_shapes`). A RuntimeError, as torch's collate error it replaces."""

    status_code = "FAILED_PRECONDITION"


# One table, both directions. The client picks the class from the `joader-error` trailing
# metadata the server attaches, and falls back to the status code alone.
ERROR_CLASSES: dict[str, type[JoaderError]] = {
    cls.__name__: cls
    for cls in (
        JoaderError,
        InvalidArgumentError,
        UnknownSourceError,
        UnknownJobError,
        DuplicateJobError,
        DecodeError,
        CacheSpaceError,
        PassSupersededError,
        TooManyJobsError,
        ServerFailedError,
        ServerExitingError,
        ServerStoppedError,
        UntrustedServerError,
        SourceChangedError,
        IntegrityError,
        InvariantError,
        JobEndedError,
        ParentDiedError,
        SharedMemoryFullError,
        BatchShapeError,
    )
}


def status_code_name(error: JoaderError) -> str:
    """The gRPC status-code name for `error`."""
    return type(error).status_code


def error_from_status(class_name: str | None, code_name: str, message: str) -> JoaderError:
    """Rebuild the error a server raised from its class name (if known) or its status code."""
    if class_name in ERROR_CLASSES:
        return ERROR_CLASSES[class_name](message)
    for cls in ERROR_CLASSES.values():
        if cls is not JoaderError and cls.status_code == code_name:
            return cls(message)
    return JoaderError(message)
