"""The auto-start's pure parts and its lock: a spec's identity, its joaderd arguments, and
concurrent first callers starting one server (`joader.client.autostart`)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from joader.client import autostart
from joader.client.autostart import ServerSpec, ensure_server, listening
from joader.errors import InvalidArgumentError


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    short = Path(os.path.realpath("/tmp")) / f"jau-{os.getpid()}-{threading.get_ident() % 10000}"
    short.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short))
    monkeypatch.delenv("JOADER_IDLE_EXIT_S", raising=False)
    monkeypatch.delenv("JOADER_CACHE_SIZE", raising=False)
    yield short
    for path in sorted(short.rglob("*"), reverse=True):
        path.unlink() if not path.is_dir() else path.rmdir()
    short.rmdir()


def test_the_key_is_what_is_served_not_how_the_server_is_sized(tmp_path: Path) -> None:
    base = ServerSpec.make("photos", tmp_path, image_size=64)
    assert ServerSpec.make("photos", tmp_path, image_size=64, cache_size="2GiB", idle_exit_s=5).key() == base.key()
    assert ServerSpec.make("photos", tmp_path / ".", image_size=64).key() == base.key()  # the root resolved
    for other in (ServerSpec.make("photos", tmp_path, image_size=32), ServerSpec.make("photos", tmp_path),
                  ServerSpec.make("photos", tmp_path, image_size=64, mode="L"),
                  ServerSpec.make("other", tmp_path, image_size=64)):
        assert other.key() != base.key()


def test_server_args_serve_exactly_the_spec(tmp_path: Path) -> None:
    spec = ServerSpec.make("digits", tmp_path, image_size=32, mode="L", stage="resize", upscale=True,
                           cache_size="auto", idle_exit_s=30)
    assert spec.server_args() == [
        "--source", f"digits={tmp_path.resolve()}", "--cache-size", "auto", "--idle-exit-s", "30",
        "--image-size", "32", "--mode", "L", "--stage", "resize", "--upscale", "digits",
        "--cache-budget-dir", str(spec.socket_path().parent)]
    assert ServerSpec.from_dict(spec.to_dict()) == spec  # through the keeper's registration


def test_decoder_upscale_and_exif_become_joaderds_flags(tmp_path: Path) -> None:
    """Every image is served at S unless the job says otherwise (as torchvision's Resize +
    CenterCrop would), and the decoder and EXIF choices reach the server the job starts."""
    def flags(spec: ServerSpec) -> list[str]:
        args = spec.server_args()
        return [a for i, a in enumerate(args) if a in ("--decoder", "--upscale", "--no-upscale", "--exif-transpose")
                or i and args[i - 1] in ("--decoder", "--upscale", "--no-upscale", "--exif-transpose")]

    assert flags(ServerSpec.make("photos", tmp_path)) == ["--upscale", "photos"]
    assert flags(ServerSpec.make("photos", tmp_path, upscale=False)) == ["--no-upscale", "photos"]
    assert flags(ServerSpec.make("photos", tmp_path, decoder="pil", exif_transpose=True)) == [
        "--decoder", "pil", "--upscale", "photos", "--exif-transpose", "photos"]
    keys = {ServerSpec.make("photos", tmp_path, **options).key() for options in (
        {}, {"upscale": False}, {"decoder": "pil"}, {"exif_transpose": True})}
    assert len(keys) == 4  # another choice is another server, as for image_size
    with pytest.raises(InvalidArgumentError, match=r"decoder must be one of .*pil.*turbo.*got 'jpeg'"):
        ServerSpec.make("photos", tmp_path, decoder="jpeg")
    with pytest.raises(InvalidArgumentError, match="upscale must be True or False, got 'no'"):
        ServerSpec.make("photos", tmp_path, upscale="no")


def test_the_environment_sizes_and_times_the_servers_jobs_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOADER_IDLE_EXIT_S", "7")
    monkeypatch.setenv("JOADER_CACHE_SIZE", "256MiB")
    spec = ServerSpec.make("photos", tmp_path)
    assert (spec.idle_exit_s, spec.cache_size) == (7.0, "256MiB")
    monkeypatch.setenv("JOADER_IDLE_EXIT_S", "soon")
    with pytest.raises(InvalidArgumentError, match="JOADER_IDLE_EXIT_S='soon' is not a number"):
        ServerSpec.make("photos", tmp_path)


@pytest.mark.parametrize(("args", "message"), [
    (("bad name", "."), "cannot name an auto-started joaderd"),
    (("photos", "/no/such/dir"), "does not exist"),
])
def test_bad_specs_name_the_fix(args: tuple[str, str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        ServerSpec.make(*args)


def test_listening_tells_a_live_socket_from_a_dead_one(tmp_path: Path) -> None:
    path = Path("/tmp") / f"jau-l-{os.getpid()}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen(1)
        assert listening(path)
        listener.close()
        assert path.exists() and not listening(path)  # a killed server's socket file refuses
    finally:
        listener.close()
        path.unlink(missing_ok=True)
    assert not listening(path)


def test_concurrent_first_callers_start_one_server(runtime: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight callers at one instant: the first to take the lock starts the (stand-in) server,
    which takes a while to listen; the others wait at the lock and then find it."""
    starts: list[int] = []
    listeners: list[socket.socket] = []

    def fake_start(spec: ServerSpec, path: Path, timeout_s: float) -> int:
        starts.append(threading.get_ident())
        time.sleep(0.3)  # listing the source
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        server.listen(16)
        listeners.append(server)
        return 4242

    monkeypatch.setattr(autostart, "_start", fake_start)
    spec = ServerSpec.make("photos", tmp_path, image_size=64)
    barrier = threading.Barrier(8)
    results: list[tuple[str, int | None]] = []

    def caller() -> None:
        barrier.wait()
        results.append(ensure_server(spec, timeout_s=10))

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert len(starts) == 1
        assert sorted(pid or 0 for _, pid in results) == [0] * 7 + [4242]
        assert {address for address, _ in results} == {spec.address}
        assert spec.socket_path().parent == runtime / "joader"
        assert (spec.socket_path().parent.stat().st_mode & 0o777) == 0o700
    finally:
        for server in listeners:
            server.close()
