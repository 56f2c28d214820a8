"""The ledger of a user's auto-sized joaderds (server/cache_budget.py): entries of live servers
only (pid AND start time), written whole, the lock exclusive, the directory and its files the
user's own (no symlinks)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from joader.errors import CacheSpaceError, UntrustedServerError
from joader.server import main as main_module
from joader.server.cache_budget import LEDGER_NAME, LOCK_NAME, CacheBudget, Holder, live_holders
from joader.server.config import ServerConfig, SourceConfig, load_config
from joader.stages import build_stage


def _me(arena_bytes: int = 64) -> Holder:
    pid = os.getpid()
    return Holder(pid, psutil.Process(pid).create_time(), arena_bytes, "/dev/shm/joader-x", "demo (resize:64)")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _ledger(directory: Path) -> list[dict[str, object]]:
    return json.loads((directory / LEDGER_NAME).read_text())["servers"]


def _write_ledger(directory: Path, holders: list[Holder]) -> None:
    directory.mkdir(mode=0o700, exist_ok=True)
    (directory / LEDGER_NAME).write_text(json.dumps({"version": 1, "servers": [h.__dict__ for h in holders]}))


def test_a_first_server_sees_no_others_and_is_recorded_then_removed_at_exit(tmp_path: Path) -> None:
    budget = CacheBudget(tmp_path / "joader")
    with budget.claim() as claim:
        assert claim.others == []
        claim.record(256 << 20, "/dev/shm/joader-0-1-ab", "photos (resize:512) at unix:/s.sock")
    entry, = _ledger(tmp_path / "joader")
    assert (entry["pid"], entry["arena_bytes"], entry["what"]) == (os.getpid(), 256 << 20,
                                                                   "photos (resize:512) at unix:/s.sock")
    assert (tmp_path / "joader").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "joader" / LEDGER_NAME).stat().st_mode & 0o777 == 0o600
    budget.release()
    assert _ledger(tmp_path / "joader") == []


def test_the_entries_of_dead_servers_count_no_more(tmp_path: Path) -> None:
    me = _me(100)
    dead = Holder(_dead_pid(), me.started, 200, "/dev/shm/joader-y", "gone")
    reused = Holder(os.getpid(), me.started - 3600.0, 300, "/dev/shm/joader-z", "an hour older: the pid wrapped")
    _write_ledger(tmp_path, [me, dead, reused])
    with CacheBudget(tmp_path).claim() as claim:
        assert claim.others == [me]
    assert [e["arena_bytes"] for e in _ledger(tmp_path)] == [100]  # the dead are dropped on the way


def test_live_holders_asks_pid_and_start_time() -> None:
    entries = [Holder(7, 1000.0, 1, "a", "same"), Holder(8, 1000.0, 1, "b", "reused"), Holder(9, 5.0, 1, "c", "gone")]
    starts = {7: 1000.001, 8: 2000.0}
    assert [h.what for h in live_holders(entries, starts.get)] == ["same"]


def test_nothing_is_written_when_sizing_or_allocating_fails(tmp_path: Path) -> None:
    _write_ledger(tmp_path, [_me(100)])
    before = (tmp_path / LEDGER_NAME).read_text()
    with pytest.raises(CacheSpaceError), CacheBudget(tmp_path).claim() as claim:
        claim.record(5, "x", "y")
        raise CacheSpaceError("no room")
    assert (tmp_path / LEDGER_NAME).read_text() == before


def test_the_lock_is_exclusive_and_a_wait_past_the_timeout_names_it(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another server, sizing its arena
        with pytest.raises(CacheSpaceError, match=f"held the cache budget's lock {tmp_path / LOCK_NAME}"):
            with CacheBudget(tmp_path, lock_timeout_s=0.1).claim():
                pass
    finally:
        os.close(fd)
    with CacheBudget(tmp_path, lock_timeout_s=0.1).claim() as claim:  # free once it let go
        assert claim.others == []


def test_an_unreadable_ledger_starts_afresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tmp_path.chmod(0o700)
    (tmp_path / LEDGER_NAME).write_text("{not json")
    with CacheBudget(tmp_path).claim() as claim:
        assert claim.others == []
    assert "unreadable" in caplog.text


def test_a_symlinked_ledger_is_refused_not_followed(tmp_path: Path) -> None:
    directory = tmp_path / "joader"
    directory.mkdir(mode=0o700)
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"version": 1, "servers": []}))
    (directory / LEDGER_NAME).symlink_to(target)
    with pytest.raises(UntrustedServerError, match=r"budget.json is a symbolic link; joader does not follow"):
        with CacheBudget(directory).claim():
            pass


@pytest.mark.parametrize("problem", ["symlink", "group-writable"])
def test_a_directory_that_is_not_the_users_alone_is_refused(tmp_path: Path, problem: str) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    directory = real
    if problem == "symlink":
        directory = tmp_path / "link"
        directory.symlink_to(real)
    else:
        real.chmod(0o770)
    with pytest.raises(UntrustedServerError, match="another local user could turn the files"):
        with CacheBudget(directory).claim():
            pass
    assert not (real / LEDGER_NAME).exists()


def test_release_without_a_record_touches_nothing(tmp_path: Path) -> None:
    CacheBudget(tmp_path / "never").release()
    assert not (tmp_path / "never").exists()


def test_the_flag_names_the_budget_directory(tmp_path: Path) -> None:
    config = load_config(["--source", f"a={tmp_path}", "--cache-size", "auto", "--cache-budget-dir", str(tmp_path)])
    assert (config.cache_size_bytes, config.cache_budget_dir) == (None, tmp_path)
    assert load_config(["--source", f"a={tmp_path}"]).cache_budget_dir is None


def test_joaderd_sizes_allocates_and_records_its_arena_under_the_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Two servers of one budget, in this process: the second sees the first's arena."""
    monkeypatch.setattr(main_module, "host_memory", lambda: (1 << 40, 1 << 40))
    monkeypatch.setattr(main_module, "shm_size_bytes", lambda: 64 << 20)  # a 32 MiB budget
    stage = build_stage("center-crop", size=64)
    sources = [SimpleNamespace(name="demo", num_items=10_000, max_item_bytes=stage.spec.max_nbytes, stage=stage)]
    config = ServerConfig(sources=(SourceConfig("demo", tmp_path),), cache_size_bytes=None,
                          cache_budget_dir=tmp_path / "budget", listen="unix:/tmp/x.sock")
    budget = CacheBudget(tmp_path / "budget")
    arenas = []
    try:
        with caplog.at_level(logging.INFO, logger="joader.server"):
            for _ in range(2):
                arenas.append(main_module._sized_arena(config, sources, 12288, budget)[1])  # type: ignore[arg-type]
        assert [a.size_bytes for a in arenas] == [16 << 20, 8 << 20]
        assert [e["arena_bytes"] for e in _ledger(tmp_path / "budget")] == [16 << 20, 8 << 20]
        assert _ledger(tmp_path / "budget")[0]["what"] == "demo (center-crop:64) at unix:/tmp/x.sock"
        assert ("cache 8.0 MiB, half of what the 1 other auto-started server (16.0 MiB) left of the 32.0 MiB "
                "budget of all auto-started servers") in caplog.text
    finally:
        for arena in arenas:
            arena.close()
            arena.unlink()
        budget.release()
    assert _ledger(tmp_path / "budget") == []
