"""Test fault injection, for the fault tests only: a supervised thread raises at a named point.

`JOADERD_INJECT_FAULT=scheduler` makes the scheduler thread raise after its first turn that did
work (under the registry's lock, as a bookkeeping bug would); `=results` makes the results thread
raise at its first batch of finished decodes, before filing it. Nothing else reads the variable:
joaderd reads it once at start-up (`arm`), and the threads call `reached` at their point, which
does nothing unless that point is armed (tests/integration/test_trust_jobs.py uses it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# NOTE [ A named hook, not a patched registry ]
# The fault tests once replaced `Registry._schedule` and `Registry.file_results` on the live
# object, so the registry's code and the code that ran differed, invisibly to a reader of
# either. The points are named here, and the threads call them where the fault goes in.

FAULT_ENV = "JOADERD_INJECT_FAULT"
SCHEDULER = "scheduler"  # the scheduler thread, after a turn that did work
RESULTS = "results"  # the results thread, at a batch of finished decodes
POINTS = (SCHEDULER, RESULTS)

_armed = ""  # the point that raises; "" (the default): none


def arm(environ: Mapping[str, str]) -> str:
    """Arms the point `environ[FAULT_ENV]` names (an unknown one is logged and ignored); returns
    the point armed, "" for none."""
    global _armed
    where = environ.get(FAULT_ENV, "")
    if where and where not in POINTS:
        logger.warning("%s=%r is not a known fault; ignored", FAULT_ENV, where)
        where = ""
    _armed = where
    return where


def reached(point: str) -> None:
    """Called by a supervised thread at `point`: raises, as a bug would, if the point is armed."""
    if _armed == point:
        raise RuntimeError(f"fault injected by {FAULT_ENV}={point}")
