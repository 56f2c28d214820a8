"""The lease keeper process: registers a job and holds its lease stream (`python -m
joader.client.keeper_process`, spawned by `joader.client.keeper.Keeper`).

`JoaderDataset` runs this as a child so that the training process itself never holds a gRPC
channel when a DataLoader forks its workers. Protocol, one JSON line each way: the parent writes
the registration; the keeper answers with the job's description (or the error), then sends
heartbeats on the `Attach` stream until its stdin reaches EOF (the dataset was closed, or the
training process died) or its parent changes. Closing the stream makes joaderd remove the job and
release everything it held.

When joaderd goes away (the stream fails with UNAVAILABLE: a crash, an upgrade), the keeper says
so once on stderr and attaches the job again as soon as a joaderd answers on the same address,
for up to the dataset's `timeout_s`; it publishes the new job's identity on the client board
(`joader.client.board`), where the readers find it and resume their epoch.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from joader.address import verify_server
from joader.client.autostart import stopped_notice
from joader.client.board import Board
from joader.client.channel import get_stub, reset_channel, translate
from joader.errors import JoaderError, ServerStoppedError
from joader.proto import joader_pb2

DEFAULT_HEARTBEAT_S = 1.0

# Set when the dataset said "close" before its stdin ended: the lease ends on purpose, not by a
# death, and the job's other ranks (if any) go on.
closing = threading.Event()


def _requests(registration: dict[str, Any], stop: threading.Event, interval: list[float]) -> Iterator[joader_pb2.AttachRequest]:
    seed = registration.get("seed")
    yield joader_pb2.AttachRequest(
        source=registration["source"],
        indices=base64.b64decode(registration["indices"]),
        name=registration.get("name", ""),
        batch_size=int(registration.get("batch_size", 64)),
        rank=int(registration.get("rank", 0)),
        world_size=int(registration.get("world_size", 1)),
        drop_last=bool(registration.get("drop_last", False)),
        seed=int(seed) if seed is not None else 0,
        has_seed=seed is not None,
        describe=bool(registration.get("describe")),
        resume_epoch=int(registration.get("resume_epoch", 0)),
        resume_consumed=registration.get("resume_consumed", b""),
        resume_rest=bool(registration.get("resume_rest", False)),
        resume_share=int(registration.get("resume_share", 0)),
        resume_base=int(registration.get("resume_base", 0)),
        order=registration.get("order", "shared"),
    )
    if registration.get("describe"):
        return  # one reply, no lease
    parent = os.getppid()
    while not stop.wait(interval[0]):
        if os.getppid() != parent:  # the training process died; its pipe may still be held open
            return
        _release_old_arenas()
        yield joader_pb2.AttachRequest(heartbeat=True)
    if closing.is_set():
        yield joader_pb2.AttachRequest(closing=True)


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# Descriptors of the arenas of the job's recent servers, newest last. A reply a dead joaderd
# sent before it died may still be read after a restart removed its arena's name; its items are
# intact in that memory, and readers reach it through /proc/<keeper>/fd/<fd> (ArenaReader).
# A dead server's arena is released OLD_ARENA_GRACE_S after the job attached again: a reply
# read later than that is refused with an error, and /dev/shm does not keep a dead arena's
# pages (they count against its size) any longer than the replies in flight need.
_held_arenas: collections.deque[int] = collections.deque()
_held_since = [0.0]
OLD_ARENA_GRACE_S = 60.0
_ARENAS_HELD = 4  # restarts in quick succession: a prefetched batch may be three arenas old


def _hold_arena(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    _held_arenas.append(fd)
    _held_since[0] = time.monotonic()
    while len(_held_arenas) > _ARENAS_HELD:
        os.close(_held_arenas.popleft())
    return fd


def _release_old_arenas() -> None:
    if len(_held_arenas) > 1 and time.monotonic() - _held_since[0] > OLD_ARENA_GRACE_S:
        while len(_held_arenas) > 1:
            os.close(_held_arenas.popleft())


def _identity(first: joader_pb2.AttachResponse, server_uid: int | None) -> dict[str, Any]:
    return {
        "job_id": first.job_id,
        "job_secret": base64.b64encode(first.job_secret).decode(),
        "server_uid": server_uid,
        "server_pid": first.server_pid,
        "arena_path": first.arena_path,
        "fingerprint": first.fingerprint,
        "keeper_pid": os.getpid(),
        "arena_fd": _hold_arena(first.arena_path),
        "rank": first.rank,  # in the job on this joaderd (a host's ranks count from 0)
        "next_address": _checked_front(first.next_address),
    }


def _checked_front(address: str) -> str:
    """The Next front joaderd named (NOTE [ Next fronts ] in server/fronts/__init__.py), if its
    socket passes the checks joaderd's own did (our directory, served by our uid); else "": the
    readers then send Next to joaderd's own socket, which serves it too."""
    if not address:
        return ""
    try:
        verify_server(address, timeout_s=2.0)
    except (OSError, JoaderError) as error:
        print(f"joader: the Next front joaderd named ({address}) is not used: {error}", file=sys.stderr)
        return ""
    return address


def _attach(address: str, registration: dict[str, Any], stop: threading.Event,
            interval: list[float]) -> tuple[Any, joader_pb2.AttachResponse, int | None]:
    """Verifies the server, opens the lease stream and reads the job's description."""
    # Before a byte is sent: the socket must be served by this user's own joaderd, not by
    # whoever squatted its directory.
    server_uid = verify_server(address)
    responses = get_stub(address).Attach(_requests(registration, stop, interval))
    first = next(responses)
    interval[0] = max(0.05, min(DEFAULT_HEARTBEAT_S, first.lease_s / 4))
    if not registration.get("describe"):
        try:
            _confirm(address, first)
        except BaseException:
            responses.cancel()  # the lease ends now: joaderd removes the job, freeing its slot
            raise
    return responses, first, server_uid


def _confirm(address: str, first: joader_pb2.AttachResponse) -> None:
    """Tells joaderd at once that the job's client is here: a request on the new job.

    NOTE [ A job's first request ]
    joaderd removes a job whose client sends no request within its lease of attaching
    (`JobTable.expire`): a client of another user, over TCP, can attach jobs it can never read
    (the arena is private to joaderd's user), each holding a --max-jobs slot and a share of the
    cache for as long as its process lives. This request keeps the lease of a job whose
    training loop starts minutes later; the dataset then checks that it can read the arena,
    and ends the lease if not (`Attachment.attach`)."""
    request = joader_pb2.NextRequest(job_id=first.job_id, job_secret=first.job_secret, max_items=0,
                                     rank=first.rank, pid=os.getpid())
    try:
        get_stub(address).Next(request, timeout=30)
    except grpc.RpcError as error:
        raise translate(error, address) from None


STARTING_GRACE_S = 15.0


def _restart_if_auto(registration: dict[str, Any]) -> str | None:
    """A job whose dataset auto-started its joaderd (`root=`) starts it again when it is gone
    (NOTE [ A server that died ] in `joader.client.autostart`); a failed start is said once and
    retried at the next try. Returns why the server must not be started again (stopped on
    purpose, or its `serve` driver ended: NOTE [ Stop means stop ]), else None."""
    spec = registration.get("autostart")
    if not spec:
        return None
    from joader.client.autostart import ServerSpec, ensure_server, listening

    server_spec = ServerSpec.from_dict(spec)
    if listening(server_spec.socket_path()):
        return None
    try:
        _address, started = ensure_server(server_spec, restart=True)
    except ServerStoppedError as stopped:
        return str(stopped)
    except JoaderError as error:
        if not registration.get("_start_failed"):
            print(f"joader lease keeper: could not start joaderd again: {error}", file=sys.stderr, flush=True)
        registration["_start_failed"] = True
        return None
    if started is not None:
        print(f"joader: started joaderd again for {server_spec.source} (pid {started.pid})", file=sys.stderr,
              flush=True)
    return None


def _first_attach(address: str, registration: dict[str, Any], stop: threading.Event,
                  interval: list[float]) -> tuple[Any, joader_pb2.AttachResponse, int | None]:
    """`_attach`, retried for a few seconds while a socket file is there but refuses: a joaderd
    restarting (a killed one leaves its socket) comes back within seconds. No socket file means
    no joaderd: the error is immediate, unless the dataset auto-starts its server (one that
    exited for idleness just after the dataset found it is started again)."""
    path = address[len("unix:"):] if address.startswith("unix:") else None
    deadline = time.monotonic() + STARTING_GRACE_S
    auto = bool(registration.get("autostart"))
    while True:
        try:
            return _attach(address, registration, stop, interval)
        except ConnectionError:
            if path is None or not (auto or os.path.exists(path)) or time.monotonic() > deadline:
                raise
        except grpc.RpcError as error:
            translated = translate(error, address)
            if not isinstance(translated, ConnectionError) or path is None or not (auto or os.path.exists(path)) \
                    or time.monotonic() > deadline:
                raise
        time.sleep(0.25)
        reset_channel(address)
        if (notice := _restart_if_auto(registration)) is not None:
            raise ServerStoppedError(notice)


def _with_report(registration: dict[str, Any], board: Board) -> dict[str, Any]:
    """The registration, with what this rank's readers received of their current epoch (the
    board's): the restarted joaderd resumes the epoch once every rank's keeper reported, so a
    reader that waits in a DDP collective for another rank (which waits for the resumed epoch)
    need not report first. Taken at each try: the board is final once joaderd died."""
    epoch, _token = board.current_pass()
    if not epoch:
        return registration
    report = dict(registration, resume_epoch=epoch, resume_consumed=board.received(epoch).serialize())
    rest = board.rest(epoch)
    if rest is not None:  # NOTE [ An elastic resume ] in server/registry/resumes.py
        report.update(resume_rest=True, resume_share=rest[0], resume_base=rest[1])
    return report


def _reattach(address: str, registration: dict[str, Any], stop: threading.Event,
              interval: list[float], board: Board) -> Any | None:
    """joaderd went away: attach again once one answers, within the dataset's timeout."""
    timeout_s = float(registration.get("timeout_s", 300.0))
    board.reconnecting = True
    print(f"joader: joaderd at {address} went away; reconnecting (for up to {timeout_s:g} s)",
          file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        stop.wait(0.25)
        reset_channel(address)
        notice = stopped_notice(address) or _restart_if_auto(registration)
        if notice is not None:  # NOTE [ Stop means stop ]
            print(f"joader lease keeper: {notice}", file=sys.stderr, flush=True)
            board.publish({"refused": notice, "error": ServerStoppedError.__name__})
            board.reconnecting = False
            return None
        try:
            responses, first, server_uid = _attach(address, _with_report(registration, board), stop, interval)
        except ConnectionError:
            continue
        except grpc.RpcError as error:
            translated = translate(error, address)
            if isinstance(translated, ConnectionError):
                continue
            print(f"joader lease keeper: joaderd is back but refused the job: {translated}",
                  file=sys.stderr, flush=True)
            board.reconnecting = False  # the readers' errors stand
            return None
        expected = registration.get("fingerprint")
        if expected and first.fingerprint and first.fingerprint != expected:
            message = (
                f"joaderd at {address} restarted and now serves another source under the name "
                f"{registration['source']!r} (fingerprint {first.fingerprint}, was {expected}: the "
                "item count, files, labels or stage differ); resuming the epoch there would "
                "deliver other items under the same indices. Restart joaderd with the same "
                "--source and stage options, or start the job again from scratch.")
            print(f"joader lease keeper: {message}", file=sys.stderr, flush=True)
            board.refuse(message)
            board.reconnecting = False
            return None
        board.publish(_identity(first, server_uid))
        board.reconnecting = False
        print(f"joader: reconnected to joaderd at {address} (job {first.job_id})", file=sys.stderr, flush=True)
        return responses
    if not stop.is_set():
        print(f"joader lease keeper: no joaderd at {address} within {timeout_s:g} s; giving up",
              file=sys.stderr, flush=True)
    board.reconnecting = False
    return None


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training script's to handle
    registration = json.loads(sys.stdin.readline())
    address = registration["address"]
    board_fd = registration.get("board_fd")
    stop = threading.Event()
    interval = [DEFAULT_HEARTBEAT_S]
    try:
        responses, first, server_uid = _first_attach(address, registration, stop, interval)
    except (JoaderError, ConnectionError) as error:
        _reply({"ok": False, "kind": type(error).__name__, "message": str(error)})
        return 1
    except grpc.RpcError as error:
        translated = translate(error, address)
        _reply({"ok": False, "kind": type(translated).__name__, "message": str(translated)})
        return 1
    registration["fingerprint"] = first.fingerprint  # what a restarted joaderd must serve
    if registration.get("describe"):
        _reply({"ok": True, **_description(first)})
        return 0
    # `notice`: what joaderd said of the registration (a name another live job has); the dataset
    # logs it. Not part of the identity: a re-attach after a restart says nothing new to the user.
    _reply({"ok": True, **_identity(first, server_uid), **_description(first), "notice": first.notice})

    def wait_for_eof() -> None:
        if "close" in sys.stdin.read():
            closing.set()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while True:
        try:
            for _ in responses:
                pass
            return 0
        except grpc.RpcError as error:
            if stop.is_set():
                return 0
            if error.code() != grpc.StatusCode.UNAVAILABLE or board_fd is None:  # type: ignore[attr-defined]
                print(f"joader lease keeper: {translate(error, address)}", file=sys.stderr)
                return 1
        responses = _reattach(address, registration, stop, interval, Board.open(int(board_fd)))
        if responses is None:
            return 0 if stop.is_set() else 1


def _description(first: joader_pb2.AttachResponse) -> dict[str, Any]:
    """What the job trains on, as the dataset reads it (a job's reply, or a description's)."""
    return {
        "source": first.source,
        "classes": [os.fsdecode(c) for c in first.classes],
        "class_labels": list(first.class_labels),
        "num_source_items": first.num_source_items,
        "num_items": first.num_items,
        "num_rank_items": first.num_rank_items,
        "world_size": first.world_size or 1,
        "rank": first.rank,
        "seed": first.seed,
        "targets": base64.b64encode(first.targets).decode(),
        "image_size": first.image_size,
        "item_nbytes": first.item_nbytes,
        "stage": first.stage,
        "item_shape": list(first.item_shape),
        "item_dtype": first.item_dtype,
        "lease_s": first.lease_s,
    }


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (JoaderError, KeyError, ValueError) as error:
        _reply({"ok": False, "kind": "JoaderError", "message": f"lease keeper failed: {error}"})
        sys.exit(1)
