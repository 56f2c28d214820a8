"""A joaderd that jobs start themselves (`JoaderDataset(..., root=...)`, `joader.serve`), with
real processes: concurrent first jobs start one server, a server killed -9 under running jobs is
started again by them, a job that expects another stage than the server's is refused by name.
Every sample is checked against a decode made here (`tests.support.integrity`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from joader.client.autostart import ServerSpec, stop_server
from joader.launch import read_ready_file
from tests.support.integrity import Findings, check_records, read_records
from tests.support.processes import IMAGE_SIZE, NUM_DEMO_ITEMS, ROOT, finish, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR: this test's auto-started servers, their sockets and locks are
    its own. Every server started under it is stopped afterwards, and must have been only one
    per spec."""
    path = Path(tempfile.mkdtemp(prefix="ja-", dir="/tmp"))  # short: sun_path is 108 bytes
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        for ready in (path / "joader").glob("*.ready"):
            info = read_ready_file(ready)
            if info is not None:
                stop_server(int(info["pid"]), timeout_s=20)
        shutil.rmtree(path, ignore_errors=True)


def _env(runtime_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JOADER_ADDRESS"}
    env.update(XDG_RUNTIME_DIR=str(runtime_dir), **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _job(tmp: Path, name: str, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tests.support.integrity_job", "--records", str(tmp / f"{name}.jsonl"),
               "--name", name, *args]
    return subprocess.Popen(command, stderr=open(tmp / f"{name}.err", "wb"), env=env, start_new_session=True)


def _spec(root: Path, runtime_dir: Path) -> tuple[ServerSpec, Path]:
    """The spec the jobs below declare, and its socket under `runtime_dir`."""
    spec = ServerSpec.make("demo", root, image_size=IMAGE_SIZE)
    return spec, runtime_dir / "joader" / spec.socket_path().name


def _starts(socket: Path) -> int:
    """How many joaderds were started for this spec: one log line each."""
    log = socket.with_suffix(".log")
    return log.read_text().count(" started by pid ") if log.exists() else 0


def _check(tmp: Path, names: list[str], expected: dict[int, Any], epochs: int) -> None:
    findings = Findings()
    for name in names:
        check_records(read_records(tmp / f"{name}.jsonl"), expected, set(range(NUM_DEMO_ITEMS)), epochs, name,
                      findings)
    assert findings.ok, findings.summary()
    assert findings.checked == len(names) * epochs * NUM_DEMO_ITEMS


def test_jobs_starting_at_one_instant_start_one_server(demo_root: Path, expected: dict[int, Any], tmp_path: Path,
                                                       runtime_dir: Path) -> None:
    spec, socket = _spec(demo_root, runtime_dir)
    go = tmp_path / "go"
    env = _env(runtime_dir)
    names = ["first", "second", "third"]
    jobs = [_job(tmp_path, n, env, "--root", str(demo_root), "--image-size", str(IMAGE_SIZE), "--epochs", "2",
                 "--go-file", str(go)) for n in names]
    time.sleep(3.0)  # every job imported torch and waits at the go file
    go.touch()
    for name, job in zip(names, jobs, strict=True):
        assert finish(job) == 0, (tmp_path / f"{name}.err").read_text()
    assert _starts(socket) == 1, socket.with_suffix(".log").read_text()
    _check(tmp_path, names, expected, 2)
    info = read_ready_file(socket.with_suffix(".ready"))
    assert info is not None and info["address"] == f"unix:{socket}"


def test_server_killed_under_running_jobs_is_started_again(demo_root: Path, expected: dict[int, Any],
                                                           tmp_path: Path, runtime_dir: Path) -> None:
    spec, socket = _spec(demo_root, runtime_dir)
    env = _env(runtime_dir)
    names = ["plain", "workers"]
    jobs = [_job(tmp_path, "plain", env, "--root", str(demo_root), "--image-size", str(IMAGE_SIZE),
                 "--epochs", "3", "--sleep", "0.05"),
            _job(tmp_path, "workers", env, "--root", str(demo_root), "--image-size", str(IMAGE_SIZE),
                 "--epochs", "3", "--sleep", "0.05", "--workers", "2", "--transform")]

    def samples() -> int:
        return sum(1 for n in names for r in read_records(tmp_path / f"{n}.jsonl") if r.get("kind") == "sample")

    wait_for(lambda: samples() >= NUM_DEMO_ITEMS, 120, "the jobs to read most of an epoch")
    first = read_ready_file(socket.with_suffix(".ready"))
    assert first is not None
    os.kill(int(first["pid"]), signal.SIGKILL)
    for name, job in zip(names, jobs, strict=True):
        assert finish(job, timeout_s=180) == 0, (tmp_path / f"{name}.err").read_text()
    assert _starts(socket) == 2, socket.with_suffix(".log").read_text()
    second = read_ready_file(socket.with_suffix(".ready"))
    assert second is not None and second["pid"] != first["pid"]
    assert "started joaderd again" in "".join((tmp_path / f"{n}.err").read_text() for n in names)
    _check(tmp_path, names, expected, 3)


def test_a_job_expecting_another_image_size_is_refused_by_name(demo_root: Path, start_joaderd: Any,
                                                               tmp_path: Path) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=40)
    code = ("from joader import JoaderDataset\n"
            f"JoaderDataset('demo', address={server.address!r}, image_size=32, mode='L')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "InvalidArgumentError" in out.stderr, out.stderr
    assert f"serves source 'demo' with stage 'center-crop:{IMAGE_SIZE}'" in out.stderr
    assert "--image-size demo=32" in out.stderr and "--mode demo=L" in out.stderr
    assert not server.status()["jobs"], "the refused job must not stay attached"


def test_serve_exports_its_address_and_stops_the_server_it_started(demo_root: Path, expected: dict[int, Any],
                                                                   tmp_path: Path, runtime_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import joader

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.delenv("JOADER_ADDRESS", raising=False)
    with joader.serve("demo", demo_root, image_size=IMAGE_SIZE) as served:
        assert os.environ["JOADER_ADDRESS"] == served.address and served.started_pid is not None
        env = _env(runtime_dir, JOADER_ADDRESS=served.address)
        job = _job(tmp_path, "trial", env, "--address", served.address, "--epochs", "1")
        assert finish(job) == 0, (tmp_path / "trial.err").read_text()
        again = _job(tmp_path, "by-root", env, "--root", str(demo_root), "--image-size", str(IMAGE_SIZE),
                     "--epochs", "1")
        assert finish(again) == 0, (tmp_path / "by-root.err").read_text()
        pid = served.started_pid
    assert "JOADER_ADDRESS" not in os.environ
    wait_for(lambda: not _alive(pid), 20, "the served joaderd to stop")
    assert not served.spec.socket_path().exists()
    _check(tmp_path, ["trial", "by-root"], expected, 1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
