"""A failed Attach gives the client a clear error: the servicer's Attach driven by a stub registry.

Before: an exception in the registry or while building the reply escaped the stream handler
(gRPC made a bare UNKNOWN of it, and once the `finally` hid it behind an UnboundLocalError on
`closed`), and a reply past gRPC's message limit failed its send with a RESOURCE_EXHAUSTED that
the client took for a full /dev/shm (CacheSpaceError).

The servicer imports grpc, which the pytest process must not (it forks decode workers in other
tests): each case runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

_DRIVER = r"""
import asyncio, json, sys, types
import numpy as np
from pyroaring import BitMap
from joader.proto import joader_pb2
import joader.server.service as service

case = sys.argv[1]


class Abort(Exception):
    pass


class Context:
    def __init__(self):
        self.code = self.details = None
        self.trailing = ()

    def set_trailing_metadata(self, metadata):
        self.trailing = metadata

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Abort()


classes = tuple(str(k) for k in (3, 7, 10_000_000))
labels = np.array([3, 10_000_000, 3, 7], dtype=np.int32)
if case == "reply-bug":
    labels = labels[:2]  # the job's ids 2 and 3 index past it: an IndexError building the reply
listing = types.SimpleNamespace(classes=classes, class_to_idx={c: int(c) for c in classes}, labels=labels)
stage = types.SimpleNamespace(size=64, name="center-crop", spec=types.SimpleNamespace(shape=(64, 64, 3), dtype="uint8"))
source = types.SimpleNamespace(name="s", listing=listing, num_items=4, stage=stage, max_item_bytes=12288,
                               fingerprint="f")
job = types.SimpleNamespace(job_id="j1", secret=b"s" * 16, num_items=4, world_size=1, per_rank=4, seed=1,
                            dataset=BitMap(range(4)), ranks=[types.SimpleNamespace(notice="")])
if case == "notice":
    job.ranks[0].notice = "a job named 'job' is already attached (job id j0); ..."


class Registry:
    config = types.SimpleNamespace(lease_s=3.0)

    def __init__(self):
        self.removed = []

    def source(self, name):
        return source

    def attach(self, *args, **kwargs):
        if case == "attach-bug":
            raise RuntimeError("a bug in the registry")
        return job

    def on_removed(self, job_id, callback):
        self.callback = callback

    def remove_job(self, job_id, reason):
        self.removed.append(reason)
        self.callback(reason)

    def close_rank(self, job_id, rank):
        self.removed.append("closed")

    def touch(self, job_id, rank):
        pass


if case == "too-large":
    service.MAX_MESSAGE_BYTES = 100


async def main():
    registry = Registry()
    servicer = service.JoaderServicer(registry, "/dev/shm/joader-arena-x", lambda: {})
    context = Context()

    async def requests():
        yield joader_pb2.AttachRequest(source="s", name="job")

    replies = []
    try:
        async for reply in servicer.Attach(requests(), context):
            replies.append({"classes": [c.decode() for c in reply.classes], "class_labels": list(reply.class_labels),
                            "targets": np.frombuffer(reply.targets, dtype="<i4").tolist(), "notice": reply.notice})
    except Abort:
        pass
    except Exception as error:
        return {"raised": f"{type(error).__name__}: {error}"}
    return {"code": context.code.name if context.code else None, "details": context.details,
            "trailing": [list(m) for m in context.trailing], "replies": replies, "removed": registry.removed}


print(json.dumps(asyncio.run(main())))
"""


def _attach(case: str) -> dict[str, Any]:
    run = subprocess.run([sys.executable, "-c", _DRIVER, case], capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_good_attach_says_classes_their_labels_and_the_targets() -> None:
    got = _attach("ok")
    assert got["code"] is None
    # Integer labels: the classes that occur, in numeric order, each standing for itself; the
    # targets are the labels as written, in index order.
    assert got["replies"] == [{"classes": ["3", "7", "10000000"], "class_labels": [3, 7, 10_000_000],
                               "targets": [3, 10_000_000, 3, 7], "notice": ""}]
    assert len(got["removed"]) == 1 and "lease stream closed" in got["removed"][0]


def test_the_attach_reply_carries_the_ranks_notice() -> None:
    got = _attach("notice")  # a name another live job has (JobTable._name_notice)
    assert got["code"] is None
    assert got["replies"][0]["notice"].startswith("a job named 'job' is already attached (job id j0)")


def test_a_bug_in_the_registry_is_an_internal_error_that_says_so() -> None:
    got = _attach("attach-bug")
    assert "raised" not in got, got
    assert got["code"] == "INTERNAL"
    assert got["details"].startswith("internal error in joaderd (Attach): its log has the traceback")
    assert got["replies"] == [] and got["removed"] == []  # no job was made


def test_a_failure_building_the_reply_is_an_error_and_removes_the_job_saying_why() -> None:
    got = _attach("reply-bug")
    assert "raised" not in got, got
    assert got["code"] == "INTERNAL" and "internal error in joaderd (Attach)" in got["details"]
    assert got["replies"] == []
    assert len(got["removed"]) == 1 and got["removed"][0].startswith("its Attach failed: joaderd failed to build")


def test_a_reply_past_grpcs_limit_is_refused_naming_the_counts_and_the_fix() -> None:
    got = _attach("too-large")
    assert "raised" not in got, got
    assert got["code"] == "INVALID_ARGUMENT"
    assert ["joader-error", "InvalidArgumentError"] in got["trailing"]
    assert "over gRPC's limit of 100" in got["details"] and "(3 classes, 4 labels of the job's items)" in got["details"]
    assert got["details"].endswith("give the source fewer distinct labels (classes, not one label per image), "
                                   "or the job fewer items (indices=...)")
    assert got["replies"] == [] and got["removed"][0].startswith("its Attach failed: joaderd cannot describe")
