"""The lease keeper: a small process that registers a job and holds its lease stream.

`JoaderDataset` runs this as a child (`python -m joader.client.keeper`) so that the training
process itself never holds a gRPC channel when a DataLoader forks its workers. Protocol, one JSON
line each way: the parent writes the registration; the keeper answers with the job's description
(or the error), then sends heartbeats on the `Attach` stream until its stdin reaches EOF (the
dataset was closed, or the training process died) or its parent changes. Closing the stream makes
joaderd remove the job and release everything it held.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from joader.address import verify_server
from joader.client.channel import get_stub, translate
from joader.errors import JoaderError
from joader.proto import joader_pb2

DEFAULT_HEARTBEAT_S = 1.0


def _requests(registration: dict[str, Any], stop: threading.Event, interval: list[float]) -> Iterator[joader_pb2.AttachRequest]:
    yield joader_pb2.AttachRequest(
        source=registration["source"],
        indices=base64.b64decode(registration["indices"]),
        name=registration.get("name", ""),
        batch_size=int(registration.get("batch_size", 64)),
    )
    parent = os.getppid()
    while not stop.wait(interval[0]):
        if os.getppid() != parent:  # the training process died; its pipe may still be held open
            return
        yield joader_pb2.AttachRequest(heartbeat=True)


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training script's to handle
    registration = json.loads(sys.stdin.readline())
    address = registration["address"]
    try:
        # Before a byte is sent: the socket must be served by this user's own joaderd, not by
        # whoever squatted its directory.
        server_uid = verify_server(address)
    except (JoaderError, ConnectionError) as error:
        _reply({"ok": False, "kind": type(error).__name__, "message": str(error)})
        return 1
    stop = threading.Event()
    interval = [DEFAULT_HEARTBEAT_S]
    responses = get_stub(address).Attach(_requests(registration, stop, interval))
    try:
        first = next(responses)
    except grpc.RpcError as error:
        translated = translate(error, address)
        kind = type(translated).__name__
        _reply({"ok": False, "kind": kind, "message": str(translated)})
        return 1
    interval[0] = max(0.05, min(DEFAULT_HEARTBEAT_S, first.lease_s / 4))
    _reply({
        "ok": True,
        "job_id": first.job_id,
        "job_secret": base64.b64encode(first.job_secret).decode(),
        "server_uid": server_uid,
        "server_pid": first.server_pid,
        "source": first.source,
        "classes": [os.fsdecode(c) for c in first.classes],
        "num_source_items": first.num_source_items,
        "num_items": first.num_items,
        "image_size": first.image_size,
        "item_nbytes": first.item_nbytes,
        "arena_path": first.arena_path,
        "lease_s": first.lease_s,
    })

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    try:
        for _ in responses:
            pass
    except grpc.RpcError as error:
        if not stop.is_set():
            print(f"joader lease keeper: {translate(error, address)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (JoaderError, KeyError, ValueError) as error:
        _reply({"ok": False, "kind": "JoaderError", "message": f"lease keeper failed: {error}"})
        sys.exit(1)
