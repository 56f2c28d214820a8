"""The client's one owner of a job's identity (joader.client.connection), without a server:
replies are read only through the arena they name, acknowledgements go only to the server that
handed the items out, and a copy that does not match its decode's checksum is refused."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from joader.client.connection import Call, Connection, Identity, Reply, crc_check_wanted
from joader.errors import IntegrityError
from joader.proto import joader_pb2

OLD = Identity("job-a", b"s" * 16, "/dev/shm/joader-0-1-aaaa", None, "fp", generation=0)
NEW = Identity("job-b", b"t" * 16, "/dev/shm/joader-0-2-bbbb", None, "fp", generation=1)


class _Done:
    def __init__(self, response: Any) -> None:
        self.response = response

    def result(self) -> Any:
        return self.response


def _connection(identity: Identity = OLD, crc_check: bool = False) -> Connection:
    return Connection("unix:/nowhere", identity, None, timeout_s=5, crc_check=crc_check)


def test_a_reply_naming_another_arena_than_its_server_uses_is_refused() -> None:
    conn = _connection()
    response = joader_pb2.NextResponse(epoch=1, item_ids=[3], arena="joader-0-2-bbbb")
    with pytest.raises(IntegrityError, match="nothing was read|was not read"):
        conn.reply(Call(_Done(response), OLD), [None])  # type: ignore[arg-type]
    ok = conn.reply(Call(_Done(joader_pb2.NextResponse(epoch=1, arena="joader-0-1-aaaa")), OLD), [None])  # type: ignore[arg-type]
    assert ok is not None and ok.identity is OLD


def test_an_arena_no_identity_of_the_job_named_is_never_mapped() -> None:
    with pytest.raises(IntegrityError, match="no joaderd this job attached to uses"):
        _connection().mapping("joader-0-9-ffff")


def test_acknowledgements_of_a_dead_servers_reply_are_not_sent_to_the_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = _connection(NEW)
    sent: list[Any] = []
    monkeypatch.setattr(conn, "request", lambda *args, **kwargs: sent.append(args))
    conn.acknowledge(Reply(joader_pb2.NextResponse(item_ids=[1, 2]), OLD), [1, 2], {})
    assert sent == []


def test_a_copy_that_differs_from_its_decode_is_refused_with_verification_on() -> None:
    good, bad = np.arange(12, dtype=np.uint8), np.zeros(12, np.uint8)
    response = joader_pb2.NextResponse(item_ids=[7, 8], arena="joader-0-1-aaaa",
                                       checksums=[zlib.crc32(good.tobytes()), zlib.crc32(good.tobytes())])
    _connection(crc_check=False).check_crcs(response, [good, bad])  # off: not checked
    _connection(crc_check=True).check_crcs(response, [good])
    with pytest.raises(IntegrityError, match="item 8 .* does not match the checksum"):
        _connection(crc_check=True).check_crcs(response, [good, bad])


@pytest.mark.parametrize(("env", "given", "wanted"), [
    (None, None, False), ("", None, False), ("0", None, False), ("1", None, True), ("yes", None, True),
    ("1", False, False), (None, True, True),
])
def test_the_crc_check_follows_verify_else_joader_verify(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                                         given: bool | None, wanted: bool) -> None:
    if env is None:
        monkeypatch.delenv("JOADER_VERIFY", raising=False)
    else:
        monkeypatch.setenv("JOADER_VERIFY", env)
    assert crc_check_wanted(given) is wanted
