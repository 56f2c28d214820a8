"""The socket's trust checks: the server's directory preparation, the client's check of who serves.

Threat (issue 7, item 10): without XDG_RUNTIME_DIR the default socket is in /tmp/joader-<uid>,
which another local user can create first. Tests that need a second uid run only as root.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from joader import address as address_module
from joader.address import default_socket_path, is_loopback, prepare_server_socket, verify_server
from joader.errors import InvalidArgumentError, JoaderError, UntrustedServerError

pytestmark = pytest.mark.timeout(60)
OTHER_UID = 65534  # "nobody"
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A private directory with a short path (sun_path holds 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ja-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def default_location(sockdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Makes the default socket `<sockdir>/t/joader-<uid>/joaderd.sock`, as without XDG (a short
    path: a temporary directory whose socket names would not fit is passed over for /tmp)."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(sockdir / "t"))
    return default_socket_path()


def listen_at(path: Path) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    return listener


def dead_socket_at(path: Path) -> None:
    listen_at(path).close()  # the file stays, nothing listens


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("unix:/tmp/x.sock", True), ("/tmp/x.sock", True), ("127.0.0.1:7070", True),
        ("127.8.9.10:1", True), ("[::1]:7070", True), ("localhost:7070", True),
        ("LOCALHOST:0", True), ("[::ffff:127.0.0.1]:7070", True), ("0.0.0.0:7070", False),
        ("[::]:7070", False), ("192.168.1.5:7070", False), ("10.1.2.3:0", False),
        ("example.com:7070", False), ("localhost.evil.com:1", False), ("[::ffff:10.0.0.1]:1", False),
    ],
)
def test_is_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


# --- the server side --------------------------------------------------------------------------


def test_prepare_creates_a_private_directory(sockdir: Path) -> None:
    path = sockdir / "run" / "j.sock"
    prepare_server_socket(path, f"unix:{path}")
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and not path.exists()
    prepare_server_socket(path, f"unix:{path}")  # again: fine


def test_prepare_creates_parents_only_for_the_default_location(sockdir: Path, default_location: Path) -> None:
    prepare_server_socket(default_location, f"unix:{default_location}")
    assert default_location.parent.is_dir()
    assert stat.S_IMODE(default_location.parent.stat().st_mode) == 0o700
    explicit = sockdir / "a" / "b" / "j.sock"
    with pytest.raises(InvalidArgumentError, match=f"{sockdir / 'a'} does not exist.*--listen"):
        prepare_server_socket(explicit, f"unix:{explicit}")


def test_a_squatted_default_directory_is_refused(default_location: Path) -> None:
    squatted = default_location.parent
    squatted.mkdir(parents=True)
    squatted.chmod(0o777)
    with pytest.raises(UntrustedServerError) as info:
        prepare_server_socket(default_location, f"unix:{default_location}")
    message = str(info.value)
    assert str(squatted) in message and f"uid {os.getuid()}" in message and "mode 0o777" in message
    assert "writable by group or others" in message
    assert message.endswith("set XDG_RUNTIME_DIR to a directory of yours that only you can enter (mode 0700), "
                            "and run the job again")
    squatted.chmod(0o1777)  # sticky is no excuse for the default location: it must be ours alone
    with pytest.raises(UntrustedServerError, match="writable by group or others"):
        prepare_server_socket(default_location, f"unix:{default_location}")


def test_a_group_writable_directory_is_refused(sockdir: Path) -> None:
    sockdir.chmod(0o770)
    with pytest.raises(UntrustedServerError, match="writable by group or others.*mode 0o770"):
        prepare_server_socket(sockdir / "j.sock", f"unix:{sockdir}/j.sock")


def test_a_symlinked_directory_is_refused(sockdir: Path) -> None:
    (sockdir / "real").mkdir(mode=0o700)
    (sockdir / "link").symlink_to(sockdir / "real")
    path = sockdir / "link" / "j.sock"
    with pytest.raises(UntrustedServerError, match="is a symbolic link"):
        prepare_server_socket(path, f"unix:{path}")


@needs_root
def test_a_directory_of_another_user_is_refused(sockdir: Path) -> None:
    os.chown(sockdir, OTHER_UID, OTHER_UID)
    with pytest.raises(UntrustedServerError, match=f"owned by uid {OTHER_UID}, not by you"):
        prepare_server_socket(sockdir / "j.sock", f"unix:{sockdir}/j.sock")


def test_an_explicit_socket_in_a_sticky_directory_is_allowed(sockdir: Path) -> None:
    sockdir.chmod(0o1777)  # ours and sticky; /tmp itself is root's and sticky
    prepare_server_socket(sockdir / "j.sock", f"unix:{sockdir}/j.sock")
    tmp = Path("/tmp")
    if tmp.stat().st_uid == 0 and tmp.stat().st_mode & stat.S_ISVTX:
        path = tmp / f"joader-test-{secrets.token_hex(4)}.sock"
        prepare_server_socket(path, f"unix:{path}")
        assert not path.exists()


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_what_is_not_a_socket_is_refused_and_kept(sockdir: Path, kind: str) -> None:
    path = sockdir / "j.sock"
    if kind == "file":
        path.write_text("keep me")
    elif kind == "directory":
        path.mkdir()
    else:
        listener = listen_at(sockdir / "real.sock")
        path.symlink_to(sockdir / "real.sock")
    with pytest.raises(InvalidArgumentError, match="is not a socket .*does not delete it"):
        prepare_server_socket(path, f"unix:{path}")
    assert os.path.lexists(path)
    if kind == "file":
        assert path.read_text() == "keep me"
    if kind == "symlink":
        listener.close()


def test_a_dead_socket_is_removed(sockdir: Path) -> None:
    path = sockdir / "j.sock"
    dead_socket_at(path)
    assert path.is_socket()
    prepare_server_socket(path, f"unix:{path}")
    assert not os.path.lexists(path)


def test_a_live_socket_is_another_joaderd(sockdir: Path) -> None:
    path = sockdir / "j.sock"
    with listen_at(path):
        with pytest.raises(JoaderError, match="another joaderd is already listening at unix:"):
            prepare_server_socket(path, f"unix:{path}")
        assert path.is_socket()


# --- the client side --------------------------------------------------------------------------


def test_verify_accepts_our_own_listener(sockdir: Path) -> None:
    path = sockdir / "j.sock"
    with listen_at(path):
        assert verify_server(f"unix:{path}") == os.getuid()
        assert verify_server(f"unix://{path}") == os.getuid()
        assert verify_server(str(path)) == os.getuid()


def test_verify_cannot_check_tcp() -> None:
    assert verify_server("127.0.0.1:1") is None


@pytest.mark.parametrize("setup", ["no socket", "no directory", "dead socket", "regular file"])
def test_verify_says_how_to_start_joaderd_when_nothing_listens(sockdir: Path, setup: str) -> None:
    path = sockdir / "j.sock"
    if setup == "no directory":
        path = sockdir / "missing" / "j.sock"
    elif setup == "dead socket":
        dead_socket_at(path)
    elif setup == "regular file":
        path.write_text("x")
    with pytest.raises(ConnectionError, match="no joaderd is answering.*joaderd --source NAME=PATH.*JOADER_ADDRESS"):
        verify_server(f"unix:{path}")


def test_verify_refuses_a_squatted_directory(sockdir: Path) -> None:
    path = sockdir / "j.sock"
    with listen_at(path):
        sockdir.chmod(0o777)
        with pytest.raises(UntrustedServerError, match=f"{sockdir} is writable by group or others.*JOADER_ADDRESS"):
            verify_server(f"unix:{path}")
        sockdir.chmod(0o1777)  # sticky and ours (or root's): others cannot replace our socket
        assert verify_server(f"unix:{path}") == os.getuid()


def test_verify_refuses_a_symlinked_directory(sockdir: Path) -> None:
    (sockdir / "real").mkdir(mode=0o700)
    (sockdir / "link").symlink_to(sockdir / "real")
    with listen_at(sockdir / "real" / "j.sock"):
        with pytest.raises(UntrustedServerError, match="symbolic link"):
            verify_server(f"unix:{sockdir}/link/j.sock")


def test_verify_refuses_a_listener_of_another_uid(sockdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = sockdir / "j.sock"
    with listen_at(path):
        monkeypatch.setattr(address_module, "_peer_credentials", lambda *_: (4321, os.getuid() + 1))
        with pytest.raises(UntrustedServerError, match=f"served by uid {os.getuid() + 1} \\(pid 4321\\)"):
            verify_server(f"unix:{path}")


@needs_root
def test_verify_refuses_a_socket_file_of_another_uid(sockdir: Path) -> None:
    path = sockdir / "j.sock"
    with listen_at(path):
        os.chown(path, OTHER_UID, OTHER_UID)
        with pytest.raises(UntrustedServerError, match=f"belongs to uid {OTHER_UID}"):
            verify_server(f"unix:{path}")


SQUATTER = """
import os, socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
os.setgid(65534)
os.setuid(65534)
listener.listen(4)  # SO_PEERCRED reports the credentials at listen()
print("ready", flush=True)
sys.stdin.read()
"""


@needs_root
def test_verify_reads_the_listeners_uid_from_the_kernel(sockdir: Path) -> None:
    path = sockdir / "j.sock"
    squatter = subprocess.Popen([sys.executable, "-c", SQUATTER, str(path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "ready\n"
        assert path.stat().st_uid == 0  # the file is ours: only the kernel can tell
        with pytest.raises(UntrustedServerError, match=f"served by uid {OTHER_UID} \\(pid {squatter.pid}\\)"):
            verify_server(f"unix:{path}")
    finally:
        squatter.communicate(input="", timeout=30)
