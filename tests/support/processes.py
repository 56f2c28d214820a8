"""Running client processes for integration tests: each one tagged in its environment, so that
the test kills it and all its descendants afterwards (torchrun's ranks run in sessions of their
own, so a process group is not enough), and fails if one is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from joader.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TAG_VAR = "JOADER_TEST_TAG"
NUM_DEMO_ITEMS = 160  # the integration tests' demo source (conftest's `demo_root`)
IMAGE_SIZE = 64  # small prepared images keep the tests fast; the demo and benches use 256
ITEM_NBYTES = 3 * IMAGE_SIZE * IMAGE_SIZE
# What a torchrun or a caller's environment could leak into a client that must not see it.
_SCRUBBED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "JOADER_ADDRESS")

def tagged_pids(tag: str) -> dict[int, str]:
    """Processes (pid -> command line) whose environment carries `tag`."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


class Client:
    """One client process (or a torchrun and its ranks), with its report and its stderr."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str, directory: Path) -> None:
        self.proc = proc
        self.name = name
        self.out = directory / f"{name}.json"
        self.err_path = directory / f"{name}.err"
        self.progress_path = directory / f"{name}.progress"
        self.state_path = directory / f"{name}.state"

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace") if self.err_path.exists() else ""

    def report(self, rank: int | None = None) -> dict[str, Any]:
        path = self.out if rank is None else self.out.with_name(f"{self.name}-{rank}.json")
        return json.loads(path.read_text())

    def events(self) -> list[dict[str, Any]]:
        """The progress lines so far (a line being written is skipped)."""
        if not self.progress_path.exists():
            return []
        events = []
        for line in self.progress_path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events

    def batches(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == "batch"]


class Clients:
    """Starts client programs in their own sessions; `close()` leaves none of them behind."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.tag = uuid.uuid4().hex
        self.started: list[Client] = []

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
        env[TAG_VAR] = self.tag
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return env

    def popen(self, name: str, command: list[str], *, cwd: Path = ROOT,
              env: dict[str, str] | None = None) -> Client:
        """Starts `command` (tagged, in a session of its own), its output in NAME.err."""
        with open(self.dir / f"{name}.err", "wb") as err:
            proc = subprocess.Popen(command, cwd=cwd, env={**self._env(), **(env or {})},
                                    stdin=subprocess.DEVNULL,
                                    stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
        client = Client(proc, name, self.dir)
        self.started.append(client)
        return client

    def start(self, command: str, server: Any, name: str, *args: str) -> Client:
        """`python -m tests.support.real_clients COMMAND` against `server`."""
        client_args = self._args(command, server, name, args)
        return self.popen(name, [sys.executable, "-m", "tests.support.real_clients", *client_args])

    def torchrun(self, command: str, server: Any, name: str, *args: str, nproc: int = 2) -> Client:
        """The same under `torch.distributed.run` with `nproc` ranks; reports `NAME-RANK.json`."""
        client_args = self._args(command, server, name, args)
        client_args[client_args.index("--out") + 1] = str(self.dir / f"{name}-{{rank}}.json")
        return self.popen(name, [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            "-m", "tests.support.real_clients", *client_args,
        ])

    def _args(self, command: str, server: Any, name: str, args: tuple[str, ...]) -> list[str]:
        return [command, "--address", server.address, "--out", str(self.dir / f"{name}.json"),
                "--progress", str(self.dir / f"{name}.progress"), *args]

    def wait(self, client: Client, timeout_s: float, expect: int | None = 0) -> int:
        """Waits for `client`'s exit; fails with its stderr if it takes longer or exits otherwise."""
        try:
            code = client.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._kill(client)
            pytest.fail(f"client {client.name} did not finish within {timeout_s:g} s; its output:\n"
                        f"{client.stderr()[-6000:]}")
        if expect is not None and code != expect:
            pytest.fail(f"client {client.name} exited with {code}, expected {expect}; its output:\n"
                        f"{client.stderr()[-6000:]}")
        return code

    def _kill(self, client: Client) -> None:
        if client.proc.poll() is None:
            try:
                os.killpg(client.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        client.proc.wait()
        for pid in tagged_pids(self.tag):  # torchrun's ranks run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Kills what is still running; then no tagged process may be left after a grace time."""
        for client in self.started:
            if client.proc.poll() is None:
                self._kill(client)
        deadline = time.monotonic() + 15
        left = tagged_pids(self.tag)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = tagged_pids(self.tag)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert not left, f"client processes left behind 15 s after their test: {left}"

def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    """Polls `predicate` until it returns something truthy; fails the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def finish(proc: subprocess.Popen[bytes], timeout_s: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"job {proc.args} did not finish within {timeout_s:g} s")


@contextlib.contextmanager
def private_runtime_dir(prefix: str) -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR for a test's auto-started servers, their sockets, locks and
    ready files (short, under /tmp: sun_path is 108 bytes); every server started under it is
    stopped afterwards, and the folder removed."""
    from joader.client.autostart import stop_server
    from joader.launch import read_ready_file

    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        for ready in (path / "joader").glob("*.ready"):
            info = read_ready_file(ready)
            if info is not None:
                stop_server(int(info["pid"]), timeout_s=20)
        shutil.rmtree(path, ignore_errors=True)
