"""The joaderd launcher: the atomic ready file, and polling for it against a fake joaderd.

The fake is a small script passed as `python=`: it is run as `FAKE -m joader.server MODE ...
--ready-file PATH`, so the launcher's command line and polling are exercised without a server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from joader.launch import JoaderdProcess, JoaderdStartError, read_ready_file, write_ready_file

pytestmark = pytest.mark.timeout(60)

FAKE = f"""#!{sys.executable}
import os, signal, sys, time
from pathlib import Path
from joader.launch import write_ready_file

args = sys.argv[1:]
assert args[:2] == ["-m", "joader.server"], args
mode = args[2]
ready = Path(args[args.index("--ready-file") + 1])
print("fake joaderd", mode, flush=True)
if mode == "exit":
    print("fake joaderd: cannot serve", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
if mode != "hang":
    time.sleep(0.2)  # the launcher polls a while first
    write_ready_file(ready, {{"address": "127.0.0.1:4242", "port": 4242, "arena_path": "/dev/shm/x",
                             "pid": os.getpid(), "num_workers": 2, "version": 1, "env": os.environ.get("FAKE_ENV")}})
while True:
    time.sleep(1)
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    path = tmp_path / "fake-python"
    path.write_text(FAKE)
    path.chmod(0o755)
    return str(path)


def test_write_ready_file_is_atomic_private_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "ready.json"
    info = {"address": "unix:/tmp/x.sock", "port": None, "arena_path": "/dev/shm/a", "pid": 7,
            "num_workers": 2, "version": 1}
    write_ready_file(path, info)
    assert json.loads(path.read_text()) == info and read_ready_file(path) == info
    assert path.stat().st_mode & 0o777 == 0o600
    write_ready_file(path, {**info, "pid": 8})  # replaced whole
    assert read_ready_file(path) == {**info, "pid": 8}
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]


def test_write_ready_file_failure_leaves_no_temporary(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_ready_file(tmp_path / "ready.json", {"address": object()})
    assert list(tmp_path.iterdir()) == []


def test_read_ready_file_ignores_missing_partial_and_foreign_content(tmp_path: Path) -> None:
    path = tmp_path / "ready.json"
    assert read_ready_file(path) is None
    path.write_text('{"address": "unix:/x"')
    assert read_ready_file(path) is None
    path.write_text('["address"]')
    assert read_ready_file(path) is None


def test_start_waits_for_the_ready_file_and_stop_terminates(fake_python: str, tmp_path: Path) -> None:
    log = tmp_path / "joaderd.log"
    server = JoaderdProcess.start(["ready", "--source", "x=/d"], stdout=log, python=fake_python,
                                  env={**os.environ, "FAKE_ENV": "passed"})
    assert server.address == "127.0.0.1:4242" and server.arena_path == "/dev/shm/x"
    assert server.pid == server.proc.pid == server.info["pid"] and server.info["env"] == "passed"
    assert server.returncode is None and "fake joaderd ready" in server.log()
    ready_dir = Path(server.proc.args[-1]).parent
    assert ready_dir.is_dir()
    assert server.stop() == 0 and not server.killed_after_timeout
    assert server.returncode == 0 and not ready_dir.exists()
    assert server.stop() == 0  # idempotent


def test_a_child_that_exits_first_raises_with_code_and_log_tail(fake_python: str, tmp_path: Path) -> None:
    log = tmp_path / "joaderd.log"
    with pytest.raises(JoaderdStartError, match="exited with code 3") as info:
        JoaderdProcess.start(["exit"], stdout=log, python=fake_python)
    assert "cannot serve" in str(info.value) and str(log) in str(info.value)


def test_a_child_that_never_gets_ready_is_killed_after_the_timeout(
        fake_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the launcher's work folders go to a folder of this test's own: others start joaderds meanwhile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(JoaderdStartError, match="within 0.5 s"):
        JoaderdProcess.start(["hang"], stdout=tmp_path / "log", ready_timeout_s=0.5, python=fake_python)
    assert list((tmp_path / "tmp").glob("joaderd-launch-*")) == []


def test_stop_kills_a_child_that_ignores_sigterm(fake_python: str) -> None:
    with JoaderdProcess.start(["ignore-term"], python=fake_python) as server:
        assert server.log() == "" and server.log_path is None
        assert server.stop(timeout_s=0.3) == -signal.SIGKILL
        assert server.killed_after_timeout


def test_kill_and_signal(fake_python: str, tmp_path: Path) -> None:
    server = JoaderdProcess.start(["ready"], stdout=tmp_path / "log", python=fake_python)
    server.signal(signal.SIGCONT)  # harmless; the process lives on
    assert server.returncode is None
    assert server.kill() == -signal.SIGKILL
    server.signal(signal.SIGTERM)  # after exit: nothing


def test_launch_imports_neither_grpc_nor_torch() -> None:
    code = ("import sys, joader.launch; bad = [m for m in sys.modules if m.startswith("
            "('grpc', 'torch', 'joader.server', 'joader.client'))]; print(bad); sys.exit(bool(bad))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
