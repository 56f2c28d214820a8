"""A joaderd that jobs start themselves (`JoaderDataset(..., root=...)`, `joader.serve`), with
real processes: concurrent first jobs start one server, a server killed -9 under running jobs is
started again by them, a job that expects another stage than the server's is refused by name.
Every sample is checked against a decode made here (`joader.testing.integrity`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from joader.client.autostart import ServerSpec, listening
from joader.launch import read_ready_file
from joader.testing.integrity import Findings, check_records, read_records
from tests.support.processes import (
    IMAGE_SIZE,
    NUM_DEMO_ITEMS,
    ROOT,
    finish,
    private_runtime_dir,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR: this test's auto-started servers, their sockets and locks are
    its own. Every server started under it is stopped afterwards, and must have been only one
    per spec."""
    with private_runtime_dir("ja-") as path:
        yield path


def _env(runtime_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JOADER_ADDRESS"}
    env.update(XDG_RUNTIME_DIR=str(runtime_dir), **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _job(tmp: Path, name: str, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "joader.testing.integrity_job", "--records", str(tmp / f"{name}.jsonl"),
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


# --- stop means stop, and a driver's server ends with the driver --------------------------------


def _joaderds_for(socket: Path) -> list[int]:
    """pids of every joaderd process serving `socket` (whatever any file says)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"joader.server" in cmdline and f"unix:{socket}".encode() in cmdline:
                found.append(int(entry.name))
    return found


def test_servers_stop_is_not_undone_by_running_jobs(demo_root: Path, tmp_path: Path, runtime_dir: Path) -> None:
    """`joader servers --stop` under two running jobs (one with DataLoader workers): the jobs'
    keepers used to start the server again within seconds. Now no joaderd runs 10 s later, and
    each job ends with an error that says it was stopped and how to start again."""
    _spec_, socket = _spec(demo_root, runtime_dir)
    env = _env(runtime_dir)
    names = ["plain", "workers"]
    jobs = [_job(tmp_path, "plain", env, "--root", str(demo_root), "--image-size", str(IMAGE_SIZE),
                 "--epochs", "50", "--sleep", "0.05"),
            _job(tmp_path, "workers", env, "--root", str(demo_root), "--image-size", str(IMAGE_SIZE),
                 "--epochs", "50", "--sleep", "0.05", "--workers", "2")]
    wait_for(lambda: all(any(r.get("kind") == "sample" for r in read_records(tmp_path / f"{n}.jsonl"))
                         for n in names), 120, "both jobs to read")
    stopped = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", "servers", "--stop"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped demo" in stopped.stdout and "no job starts them again" in stopped.stdout
    stopped_at = time.monotonic()
    for name, job in zip(names, jobs, strict=True):
        assert finish(job, timeout_s=60) != 0, f"{name} went on without its server"
        err = (tmp_path / f"{name}.err").read_text()
        print(f"{name}: {err.strip().splitlines()[-1]}")
        assert "ServerStoppedError" in err and "was stopped by `joader servers --stop`" in err, err
        assert "Run the job again to start a new server" in err
        assert "started joaderd again" not in err
    time.sleep(max(0.0, stopped_at + 10 - time.monotonic()))
    assert _joaderds_for(socket) == [] and not listening(socket)
    assert _starts(socket) == 1, socket.with_suffix(".log").read_text()


_DRIVER = """
import os, sys, time
import joader
with joader.serve("demo", sys.argv[1], image_size=int(sys.argv[2])) as served:
    print(served.started_pid, flush=True)
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.05)
print("block ended", flush=True)
"""


def _driver(demo_root: Path, tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    # -X faulthandler: a driver that hangs is made to print every thread's stack (`_exited`)
    return subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", _DRIVER, str(demo_root), str(IMAGE_SIZE),
                             str(tmp_path / "end")],
                            env=env, stdout=subprocess.PIPE, stderr=open(tmp_path / "driver.err", "wb"), text=True)


def _exited(driver: subprocess.Popen[str], tmp_path: Path, timeout_s: float) -> int:
    """The driver's exit code; if it is still running after `timeout_s`, the test fails with
    where it hangs: its signal masks and every thread's Python stack (SIGABRT to faulthandler)."""
    try:
        return driver.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        status = Path(f"/proc/{driver.pid}/status").read_text()
        masks = [line for line in status.splitlines() if line.startswith(("State", "Sig"))]
        driver.send_signal(signal.SIGABRT)
        driver.wait(timeout=30)
        pytest.fail(f"the driver did not exit within {timeout_s:g} s ({masks}); its stderr:\n"
                    + (tmp_path / "driver.err").read_text())


def _owner_of(server_pid: int) -> str:
    """The `--exit-with` of joaderd `server_pid`: what a trial inside the block inherits."""
    words = Path(f"/proc/{server_pid}/cmdline").read_bytes().decode().split("\0")
    return words[words.index("--exit-with") + 1]


def _nothing_left(socket: Path, arenas: list[str]) -> None:
    wait_for(lambda: not _joaderds_for(socket), 20, "every joaderd of the spec to exit")
    assert not listening(socket)
    assert [a for a in arenas if os.path.exists(a)] == []


def test_serve_driver_killed_by_sigterm_leaves_nothing(demo_root: Path, tmp_path: Path, runtime_dir: Path) -> None:
    _spec_, socket = _spec(demo_root, runtime_dir)
    driver = _driver(demo_root, tmp_path, _env(runtime_dir))
    assert driver.stdout is not None and int(driver.stdout.readline())
    info = read_ready_file(socket.with_suffix(".ready"))
    assert info is not None
    trial_env = dict(_env(runtime_dir), JOADER_SERVE_OWNER=_owner_of(int(info["pid"])),
                     JOADER_ADDRESS=f"unix:{socket}")  # as inside the block
    trial = _job(tmp_path, "trial", trial_env, "--root", str(demo_root), "--image-size", str(IMAGE_SIZE),
                 "--epochs", "40", "--sleep", "0.05")
    wait_for(lambda: any(r.get("kind") == "sample" for r in read_records(tmp_path / "trial.jsonl")), 120,
             "the trial to read")
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=30) == -signal.SIGTERM
    _nothing_left(socket, [info["arena_path"]])
    assert finish(trial, timeout_s=60) != 0  # its keeper did not start the driver's server again
    err = (tmp_path / "trial.err").read_text()
    assert "ServerStoppedError" in err and "which has ended, so it is not started again" in err, err
    assert _starts(socket) == 1, socket.with_suffix(".log").read_text()


def test_serve_interrupted_while_its_server_starts_leaves_nothing(demo_root: Path, tmp_path: Path,
                                                                  runtime_dir: Path) -> None:
    _spec_, socket = _spec(demo_root, runtime_dir)
    driver = _driver(demo_root, tmp_path, _env(runtime_dir))
    wait_for(lambda: _starts(socket) == 1, 60, "the driver to start joaderd")
    driver.send_signal(signal.SIGINT)  # Ctrl-C before the server is ready
    assert _exited(driver, tmp_path, 60) != 0
    assert "KeyboardInterrupt" in (tmp_path / "driver.err").read_text()
    _nothing_left(socket, [])


def test_serve_stops_the_server_a_keeper_started_again(demo_root: Path, tmp_path: Path, runtime_dir: Path) -> None:
    """The block's server is killed -9 under a trial, whose keeper starts it again: the block's
    end stops that one too (it used to stop only the dead pid it had recorded)."""
    _spec_, socket = _spec(demo_root, runtime_dir)
    env = _env(runtime_dir)
    driver = _driver(demo_root, tmp_path, env)
    assert driver.stdout is not None
    first_pid = int(driver.stdout.readline())
    first = read_ready_file(socket.with_suffix(".ready"))
    assert first is not None
    trial_env = dict(env, JOADER_SERVE_OWNER=_owner_of(first_pid), JOADER_ADDRESS=f"unix:{socket}")  # as inside the block
    trial = _job(tmp_path, "trial", trial_env, "--root", str(demo_root), "--image-size", str(IMAGE_SIZE),
                 "--epochs", "40", "--sleep", "0.05")
    wait_for(lambda: any(r.get("kind") == "sample" for r in read_records(tmp_path / "trial.jsonl")), 120,
             "the trial to read")
    os.kill(first_pid, signal.SIGKILL)
    wait_for(lambda: (info := read_ready_file(socket.with_suffix(".ready"))) and info["pid"] != first_pid
             and listening(socket), 60, "the trial's keeper to start joaderd again")
    second = read_ready_file(socket.with_suffix(".ready"))
    assert second is not None
    (tmp_path / "end").touch()
    assert driver.wait(timeout=60) == 0, (tmp_path / "driver.err").read_text()
    _nothing_left(socket, [second["arena_path"]])
    assert finish(trial, timeout_s=60) != 0  # its server is gone for good, and it says why
    err = (tmp_path / "trial.err").read_text()
    assert "ServerStoppedError" in err and "the end of the joader.serve block that started it" in err, err
    assert _starts(socket) == 2, socket.with_suffix(".log").read_text()  # the block's, and the keeper's one
