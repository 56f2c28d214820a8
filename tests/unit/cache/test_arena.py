"""The shared-memory arena: allocation, the ENOSPC path, reading, stale removal, sizes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from joader.cache import arena as arena_module
from joader.cache.arena import (
    Arena,
    ArenaReader,
    format_size,
    parse_size,
    remove_stale_arenas,
)
from joader.errors import (
    CacheSpaceError,
    InvalidArgumentError,
    JoaderError,
    UntrustedServerError,
)

pytestmark = pytest.mark.timeout(60)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_create_and_unlink_in_dev_shm_leaves_nothing() -> None:
    with Arena.create(10_000, 1_000) as arena:
        assert arena.path.parent == Path("/dev/shm")
        assert arena.name.startswith(f"joader-{os.getuid()}-{os.getpid()}-")
        assert arena.path.stat().st_mode & 0o777 == 0o600
        assert arena.path.stat().st_size == 9_984 and arena.size_bytes == 9_984  # 64-byte units
    assert not arena.path.exists()
    arena.close()  # idempotent
    arena.unlink()


def test_size_rounds_down_to_whole_allocation_units(tmp_path: Path) -> None:
    with Arena.create(10_500, 1_000, shm_dir=tmp_path) as arena:
        assert arena.size_bytes == 10_496
        assert arena.path.stat().st_size == 10_496
        with pytest.raises(InvalidArgumentError, match="outside the arena"):
            arena.array(10_400, (100,))


def test_capacity_below_one_item_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="--cache-size"):
        Arena.create(100, 1_000, shm_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_enospc_is_a_clear_error_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(arena_module.os, "posix_fallocate", no_space)
    with pytest.raises(CacheSpaceError) as info:
        Arena.create(2 << 30, 1 << 20, shm_dir=tmp_path)
    message = str(info.value)
    assert "2.0 GiB" in message and "free of" in message
    assert "--cache-size" in message and "--shm-size" in message
    assert list(tmp_path.iterdir()) == []


def test_reader_sees_writer_bytes_read_only(tmp_path: Path) -> None:
    with Arena.create(4 * 48, 48, shm_dir=tmp_path) as arena:
        view = arena.array(96, (3, 4, 4))
        view[...] = np.arange(48, dtype=np.uint8).reshape(3, 4, 4)
        del view
        with ArenaReader(arena.name, shm_dir=tmp_path) as reader:
            out = np.empty((3, 4, 4), np.uint8)
            reader.copy_into(96, out)
            assert (out.ravel() == np.arange(48)).all()
            assert bytes(reader.view(96, 4)) == bytes([0, 1, 2, 3])
            arr = reader.array(96, (3, 4, 4))
            assert not arr.flags.writeable
            with pytest.raises((TypeError, ValueError)):
                arr[0, 0, 0] = 1
            del arr
            with pytest.raises(InvalidArgumentError, match="outside the arena"):
                reader.view(4 * 48 - 2, 4)


def test_a_removed_arena_is_read_through_the_descriptor_its_keeper_holds(tmp_path: Path) -> None:
    """After a restart the new joaderd removes the dead one's arena; a reply the dead one sent
    is still read, from the same memory, through the lease keeper's descriptor. Never another
    file: a descriptor that is not this arena (reused for something else) is refused."""
    with Arena.create(4 * 48, 48, shm_dir=tmp_path) as arena:
        arena.array(48, (48,))[:] = np.arange(48, dtype=np.uint8)
        held = os.open(arena.path, os.O_RDONLY)
        other = os.open(tmp_path, os.O_RDONLY)
        try:
            arena.unlink()
            with pytest.raises(JoaderError, match="restarted"):
                ArenaReader(arena.name, shm_dir=tmp_path)
            with ArenaReader(arena.name, shm_dir=tmp_path, held_by=(os.getpid(), held)) as reader:
                out = np.empty(48, np.uint8)
                reader.copy_into(48, out)
                assert (out == np.arange(48)).all()
            with pytest.raises(JoaderError, match="no process holds it"):
                ArenaReader(arena.name, shm_dir=tmp_path, held_by=(os.getpid(), other))
        finally:
            os.close(held)
            os.close(other)


def test_reader_of_missing_arena_says_server_is_gone(tmp_path: Path) -> None:
    with pytest.raises(JoaderError, match="restarted"):
        ArenaReader(f"joader-{os.getuid()}-1-dead", shm_dir=tmp_path)


def test_reader_accepts_an_absolute_path_and_an_explicit_own_uid(tmp_path: Path) -> None:
    with Arena.create(4 * 48, 48, shm_dir=tmp_path) as arena:
        with ArenaReader(str(arena.path), expected_uid=os.getuid()) as reader:
            assert reader.size_bytes == 4 * 48


def test_reader_refuses_an_arena_others_may_write(tmp_path: Path) -> None:
    with Arena.create(4 * 48, 48, shm_dir=tmp_path) as arena:
        arena.path.chmod(0o666)
        with pytest.raises(UntrustedServerError, match="mode 0o666") as info:
            ArenaReader(arena.name, shm_dir=tmp_path)
        assert str(arena.path) in str(info.value) and f"uid {os.getuid()}" in str(info.value)
        arena.path.chmod(0o620)  # group-writable is as bad
        with pytest.raises(UntrustedServerError, match="mode 0o620"):
            ArenaReader(arena.name, shm_dir=tmp_path)
        arena.path.chmod(0o644)  # readable by others is the server's choice, not a risk to us
        ArenaReader(arena.name, shm_dir=tmp_path).close()


def test_reader_refuses_a_symlink_even_to_a_good_arena(tmp_path: Path) -> None:
    with Arena.create(4 * 48, 48, shm_dir=tmp_path) as arena:
        link = tmp_path / f"joader-{os.getuid()}-{os.getpid()}-feed"
        link.symlink_to(arena.path)
        with pytest.raises(UntrustedServerError, match="symbolic link"):
            ArenaReader(link.name, shm_dir=tmp_path)


def test_reader_refuses_a_name_that_is_not_an_arena_of_the_expected_uid(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"private")
    with pytest.raises(UntrustedServerError, match="not the name of a cache arena"):
        ArenaReader(str(secret))
    with Arena.create(4 * 48, 48, shm_dir=tmp_path) as arena:
        with pytest.raises(UntrustedServerError, match=f"uid {os.getuid() + 1}"):
            ArenaReader(arena.name, shm_dir=tmp_path, expected_uid=os.getuid() + 1)


def test_reader_refuses_an_arena_owned_by_another_uid(tmp_path: Path) -> None:
    # The name says uid+1 (as a server of that uid would send), the file is ours: refused on owner.
    path = tmp_path / f"joader-{os.getuid() + 1}-{os.getpid()}-abcd"
    path.write_bytes(b"x" * 64)
    path.chmod(0o600)
    with pytest.raises(UntrustedServerError, match=f"owned by uid {os.getuid()}"):
        ArenaReader(path.name, shm_dir=tmp_path, expected_uid=os.getuid() + 1)


def test_reader_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / f"joader-{os.getuid()}-{os.getpid()}-f1f0"
    os.mkfifo(fifo, 0o600)  # would block a plain open
    with pytest.raises(UntrustedServerError, match="not a regular file"):
        ArenaReader(fifo.name, shm_dir=tmp_path)
    directory = tmp_path / f"joader-{os.getuid()}-{os.getpid()}-d1"
    directory.mkdir(mode=0o700)
    with pytest.raises(UntrustedServerError, match="not a regular file"):
        ArenaReader(directory.name, shm_dir=tmp_path)


def test_remove_stale_arenas_only_removes_dead_owners(tmp_path: Path) -> None:
    uid = os.getuid()
    dead = tmp_path / f"joader-{uid}-{_dead_pid()}-abcd"
    alive_pid = tmp_path / f"joader-{uid}-{os.getppid()}-abcd"  # a live pid, not locked
    other_user = tmp_path / f"joader-{uid + 1}-{_dead_pid()}-abcd"
    unrelated = tmp_path / "something-else"
    for path in (dead, alive_pid, other_user, unrelated):
        path.write_bytes(b"x")
    with Arena.create(1_000, 100, shm_dir=tmp_path) as live:
        removed = remove_stale_arenas(tmp_path)
        assert removed == [dead.name]
        assert live.path.exists() and alive_pid.exists() and other_user.exists()
    assert not dead.exists()


def test_remove_stale_arenas_removes_a_zombie_servers_segment(tmp_path: Path) -> None:
    """A server killed -9 whose parent has not reaped it yet is a zombie: its pid answers
    kill(0), but it holds nothing (NOTE [ The server is nobody's child ], client/autostart.py)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while open(f"/proc/{child.pid}/stat", "rb").read().rpartition(b")")[2].split()[0] != b"Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    path = tmp_path / f"joader-{os.getuid()}-{child.pid}-f00d"
    path.write_bytes(b"x")
    try:
        assert remove_stale_arenas(tmp_path) == [path.name]
    finally:
        child.wait()


def test_remove_stale_arenas_keeps_a_locked_segment_with_a_dead_pid(tmp_path: Path) -> None:
    # A live server in another pid namespace: its pid means nothing here, its lock does.
    import fcntl

    path = tmp_path / f"joader-{os.getuid()}-{_dead_pid()}-beef"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert remove_stale_arenas(tmp_path) == []
    finally:
        os.close(fd)
    assert remove_stale_arenas(tmp_path) == [path.name]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1000", 1000),
        ("2GiB", 2 << 30),
        ("2gib", 2 << 30),
        ("512MB", 512_000_000),
        ("100M", 100 << 20),
        ("1.5 GiB", 3 << 29),
        ("64k", 65536),
        ("10kB", 10_000),
        ("7B", 7),
        (123, 123),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 apples", "-5", "1i", "1.2.3G"])
def test_parse_size_errors_show_examples(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="2GiB"):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(3 << 29) == "1.5 GiB"
