"""Containment: a bug in one job's bookkeeping ends that job, never the server.

Every job on the host depends on one joaderd (see NOTE [ One job's books, one job's loss ]).
The entry points of the `Registry` are wrapped by `contained`: an error that is not one joader raises on purpose (a `JoaderError` other than `InvariantError`)
ends the jobs the call was working for, loudly (joaderd's log has the traceback, status counts
it, the job's next request gets `JobEndedError` with the reason), and the cache's pins and
refcounts are rebuilt from the jobs left (`ItemCache.resync`). Only an error that containment
itself cannot undo (the books of the jobs left disagree too) still stops joaderd.

NOTE [ One job's books, one job's loss ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A broken invariant (a refcount below zero, a pin released twice, a missing key) that escapes a
supervised thread makes the supervisor stop joaderd, and one job's bad books then cost every
job on the host its server: a 4-trial sweep lost its joaderd in 3 of 6 runs that way (issue
27). Such an error is a bug in the books of the jobs the call worked for, so it ends those jobs
and the cache is recounted from the others.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from joader.errors import InvariantError, JoaderError, JobEndedError

F = TypeVar("F", bound=Callable[..., Any])


def is_bookkeeping_error(error: BaseException) -> bool:
    """Whether `error` is a bug in joaderd's books rather than an error raised on purpose (a
    bad request, an unknown job, a superseded pass): those go to the caller unchanged."""
    return isinstance(error, Exception) and (
        not isinstance(error, JoaderError) or isinstance(error, InvariantError))


def contained(where: str, job_ids: Callable[..., Iterable[str]], *, reraise: bool = True) -> Callable[[F], F]:
    """Wraps a `Registry` method: a bookkeeping error in it ends the jobs `job_ids(registry,
    *args, **kwargs)` names (`Registry.contain`) and, with `reraise`, the caller gets
    `JobEndedError`; without it (a background thread's call) the method returns None."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(registry: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(registry, *args, **kwargs)
            except Exception as error:
                if not is_bookkeeping_error(error):
                    raise
                try:
                    ids = list(job_ids(registry, *args, **kwargs))
                except Exception:  # noqa: BLE001  the ids are a best effort; nobody is ended
                    ids = []
                reason = registry.contain(error, ids, where)
                if reraise:
                    raise JobEndedError(reason) from error
                return None

        return wrapper  # type: ignore[return-value]

    return decorate
