"""A client cannot flood joaderd's log (issue 36, item 7): malformed messages and attach/cancel
loops against a real joaderd.

Before: each malformed message wrote a 10-line traceback at ERROR (gRPC's deserializer raised)
and the client got a bare UNKNOWN; each attach/cancel pair wrote its lines however many there
were. Now a malformed message is refused with INVALID_ARGUMENT naming the problem, joaderd logs
one line per kind per minute, and a count of the rest (server/log_limits.py).

The pytest process opens no gRPC channel (it forks decode workers in other tests): the flooding
client runs in its own interpreter.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(180)

NUM_CALLS = 200

_FLOOD = r"""
import json, sys
import grpc
from joader.proto import ERROR_METADATA_KEY, joader_pb2

address, num_calls = sys.argv[1], int(sys.argv[2])
raw = lambda data: data
seen = {}

def note(kind, error):
    trailing = dict(error.trailing_metadata() or ())
    seen.setdefault(kind, {"codes": set(), "details": error.details(), "type": trailing.get(ERROR_METADATA_KEY)})
    seen[kind]["codes"].add(error.code().name)

with grpc.insecure_channel(address) as channel:
    for method in ("Next", "Status"):
        call = channel.unary_unary(f"/joader.Joader/{method}", request_serializer=raw, response_deserializer=raw)
        for _ in range(num_calls):
            try:
                call(b"\xff\xff\xff\xff not a message", timeout=10)
            except grpc.RpcError as error:
                note(method, error)
    attach = channel.stream_stream("/joader.Joader/Attach", request_serializer=raw, response_deserializer=raw)
    bad_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (source, a string), two bytes that are not UTF-8
    for _ in range(num_calls):
        try:
            list(attach(iter([bad_utf8]), timeout=10))
        except grpc.RpcError as error:
            note("Attach", error)
    # A lease stream whose later message is malformed: the job ends, and the client is told why.
    lease = attach(iter([joader_pb2.AttachRequest(source="demo", name="lease").SerializeToString(),
                         b"\xff\xff not a heartbeat"]), timeout=10)
    try:
        list(lease)
    except grpc.RpcError as error:
        note("heartbeat", error)
    good = channel.stream_stream("/joader.Joader/Attach",
                                 request_serializer=joader_pb2.AttachRequest.SerializeToString,
                                 response_deserializer=joader_pb2.AttachResponse.FromString)
    attached = 0
    for i in range(num_calls):  # attach, then cancel at once: a fuzzer's loop
        stream = good(iter([joader_pb2.AttachRequest(source="demo", name=f"fuzz{i}", batch_size=4)]), timeout=10)
        attached += bool(next(stream).job_id)
        stream.cancel()
    status = channel.unary_unary("/joader.Joader/Status", request_serializer=joader_pb2.StatusRequest.SerializeToString,
                                 response_deserializer=joader_pb2.StatusResponse.FromString)
    alive = "jobs" in json.loads(status(joader_pb2.StatusRequest(), timeout=10).json)
print(json.dumps({"seen": {k: {**v, "codes": sorted(v["codes"])} for k, v in seen.items()},
                  "attached": attached, "alive": alive}))
"""


def _flood(address: str) -> dict[str, Any]:
    run = subprocess.run([sys.executable, "-c", _FLOOD, address, str(NUM_CALLS)],
                         capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_malformed_messages_and_attach_loops_cost_the_log_a_few_lines(demo_root: Path, start_joaderd: Any) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    got = _flood(server.address)
    assert got["alive"] and got["attached"] == NUM_CALLS
    for method, message in (("Next", "NextRequest"), ("Status", "StatusRequest"), ("Attach", "AttachRequest")):
        refused = got["seen"][method]
        assert refused["codes"] == ["INVALID_ARGUMENT"] and refused["type"] == "InvalidArgumentError", refused
        assert refused["details"].startswith(f"joaderd could not parse the {message} ")
        assert refused["details"].endswith("(a client and a joaderd of the same joader version)")
    assert "bad UTF-8" in got["seen"]["Attach"]["details"]
    assert got["seen"]["heartbeat"]["codes"] == ["INVALID_ARGUMENT"]
    assert "Wire format was corrupt" in got["seen"]["heartbeat"]["details"]

    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    malformed = [line for line in log.splitlines() if "refused a malformed" in line]
    # one per kind (method, problem): Next, Status, Attach's bad UTF-8, the lease's corrupt heartbeat
    assert len(malformed) == 4, "\n".join(malformed[:20])
    assert re.search(r"job lease-\w+: removed \(its Attach failed: its lease stream sent a malformed", log)
    assert len(re.findall(r"attached to source demo", log)) <= 10
    assert server.stop() == 0
    # At exit, what was counted: every call accounted for, none logged one by one.
    log = server.log()
    for method in ("Next", "Status", "Attach"):
        assert re.search(rf"repeated {NUM_CALLS - 1} more times in the 60 s after: refused a malformed "
                         rf"\w+ \(\d+ bytes\) on {method} ", log), log[-3000:]
    assert re.search(r"repeated \d+ more times in the 60 s after: job [\w-]+: attached", log), log[-3000:]
