"""The private runtime directory and its files (`joader.private_dir`), and the choice of that
directory when the usual one would make socket paths too long (`joader.address.runtime_dir`)."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from joader.address import SUN_PATH_MAX, prepare_server_socket, runtime_dir
from joader.errors import InvalidArgumentError, UntrustedServerError
from joader.private_dir import open_private, private_dir, write_private


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="jpd-", dir="/tmp"))
    yield path
    for entry in sorted(path.rglob("*"), reverse=True):
        entry.unlink() if entry.is_symlink() or not entry.is_dir() else entry.rmdir()
    path.rmdir()


def test_a_missing_directory_is_made_0700(base: Path) -> None:
    made = private_dir(base / "a" / "joader", parents=True)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_our_directory_that_others_may_only_read_is_closed(base: Path) -> None:
    (base / "d").mkdir(mode=0o755)
    (base / "d").chmod(0o755)
    private_dir(base / "d")
    assert stat.S_IMODE((base / "d").stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_directory_others_may_write_is_refused_and_left_alone(base: Path, mode: int) -> None:
    (base / "d").mkdir()
    (base / "d").chmod(mode)
    with pytest.raises(UntrustedServerError, match=f"writable by group or others.*mode 0o{mode:o}.*XDG_RUNTIME_DIR"):
        private_dir(base / "d")
    assert stat.S_IMODE((base / "d").stat().st_mode) == mode


def test_a_symlinked_directory_is_refused(base: Path) -> None:
    (base / "real").mkdir(mode=0o700)
    (base / "link").symlink_to(base / "real")
    with pytest.raises(UntrustedServerError, match="is a symbolic link"):
        private_dir(base / "link")


def test_a_planted_symlink_is_never_opened(base: Path) -> None:
    target = base / "precious.txt"
    target.write_text("keep")
    (base / "x.log").symlink_to(target)
    with pytest.raises(UntrustedServerError, match=f"x.log is a symbolic link.*points to {target}"):
        open_private(base / "x.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    assert target.read_text() == "keep"


def test_a_planted_fifo_is_refused_without_blocking(base: Path) -> None:
    os.mkfifo(base / "x.json")
    with pytest.raises(UntrustedServerError, match="is not a regular file"):
        open_private(base / "x.json", os.O_RDONLY)


def test_write_private_replaces_a_symlink_instead_of_writing_through_it(base: Path) -> None:
    target = base / "precious.txt"
    target.write_text("keep")
    (base / "x.json").symlink_to(target)
    write_private(base / "x.json", b"{}")
    assert target.read_text() == "keep"
    assert not (base / "x.json").is_symlink() and (base / "x.json").read_bytes() == b"{}"
    assert stat.S_IMODE((base / "x.json").stat().st_mode) == 0o600
    assert sorted(p.name for p in base.iterdir()) == ["precious.txt", "x.json"]  # no temporary left


def test_a_long_runtime_directory_is_passed_over_for_one_whose_sockets_fit(base: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    long = base / ("x" * 80)
    long.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(long))
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    chosen = runtime_dir()
    assert chosen == Path("/tmp") / f"joader-{os.getuid()}"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    assert runtime_dir() == base / "joader"


def test_a_socket_path_too_long_is_refused_with_the_fix(base: Path) -> None:
    path = base / ("s" * (SUN_PATH_MAX - len(str(base)))) / "j.sock"
    with pytest.raises(InvalidArgumentError, match=r"holds at most 107: pass --listen unix:/a/shorter/path.sock"):
        prepare_server_socket(path, f"unix:{path}")
