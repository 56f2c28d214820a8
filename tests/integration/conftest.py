"""A real joaderd subprocess, real demo JPEGs, and emulated training jobs in their own processes.

The pytest process itself never opens a gRPC channel: the unit tests fork decode workers, and a
fork with a live channel can crash. Status is read through `joader status --json` in a
subprocess, and jobs run through `python -m joader.testing.simjob`, as a training script would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from joader.address import resolve_address
from joader.client.tools.demo_data import make_demo_data
from joader.launch import JoaderdProcess, JoaderdStartError
from joader.proto import GRPC_OPTIONS, joader_pb2, joader_pb2_grpc
from joader.testing.integrity import reference
from tests.support.processes import IMAGE_SIZE, ITEM_NBYTES, NUM_DEMO_ITEMS, ROOT, Clients

SIMJOB = ("-m", "joader.testing.simjob")  # the emulated training job, shared with the benches



class Joaderd:
    """One joaderd subprocess, on a private Unix socket unless `listen` names another address.

    Started by `joader.launch.JoaderdProcess`, which waits for joaderd's ready file; `address`
    is the one joaderd reports there (with the real port for `127.0.0.1:0`), and `info` is the
    whole ready file (`arena_path`, `pid`, `num_workers`, `port`).
    """

    def __init__(self, sources: dict[str, Path], cache_items: int, *, lease_s: float = 3.0,
                 workers: int | str = 2, listen: str | None = None, extra: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        # What `start_joaderd.restart(server)` needs to start the same server again.
        self.options: dict[str, Any] = {"sources": dict(sources), "cache_items": cache_items,
                                        "lease_s": lease_s, "workers": workers, "listen": listen,
                                        "extra": tuple(extra), "env": env}
        self.dir = Path(tempfile.mkdtemp(prefix="jd-", dir="/tmp"))  # short: sun_path is 108 bytes
        self.log_path = self.dir / "joaderd.log"
        self.expected_exit_code = 0  # a test that kills the server on purpose changes it
        args = ["--listen", listen or f"unix:{self.dir / 'joaderd.sock'}",
                "--cache-size", str(cache_items * ITEM_NBYTES), "--image-size", str(IMAGE_SIZE),
                "--workers", str(workers), "--lease-s", str(lease_s), *extra]
        for name, path in sources.items():
            args += ["--source", f"{name}={path}"]
        try:
            self.process = JoaderdProcess.start(args, stdout=self.log_path, ready_timeout_s=60,
                                                env={**os.environ, **(env or {})})
        except JoaderdStartError as error:
            shutil.rmtree(self.dir, ignore_errors=True)
            pytest.fail(str(error))
        self.proc = self.process.proc
        self.info = self.process.info
        self.address = self.process.address
        self.arena_path = self.process.arena_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        """joaderd's status snapshot (what `joader status --json` prints), asked from this
        process on a channel of its own, closed at once (NOTE [ No gRPC channel outlives these
        tests ] in tests/unit/client/conftest.py: this process forks). Each call was a CLI
        process, 0.14 CPU-s, and tests poll it while they wait; the CLI itself is tested in
        tests/unit/client/tools and test_tools_find_servers."""
        with grpc.insecure_channel(resolve_address(self.address), options=GRPC_OPTIONS) as channel:
            response = joader_pb2_grpc.JoaderStub(channel).Status(joader_pb2.StatusRequest(), timeout=60)
        return json.loads(response.json)

    def job(self, *args: str, name: str = "job") -> subprocess.Popen[bytes]:
        """Starts an emulated training job; its JSON report goes to `report_path(name)`."""
        command = [sys.executable, *SIMJOB, "--address", self.address,
                   "--image-size", str(IMAGE_SIZE), "--name", name, "--record",
                   "--out", str(self.report_path(name)), *args]
        # The repository on the path: this checkout's joader.testing, from any working directory.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        return subprocess.Popen(command, stderr=open(self.dir / f"{name}.err", "wb"), start_new_session=True, env=env)

    def report_path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def report(self, name: str) -> dict[str, Any]:
        return json.loads(self.report_path(name).read_text())

    def job_stderr(self, name: str) -> str:
        return (self.dir / f"{name}.err").read_text(errors="replace")

    def stop(self) -> int:
        code = self.process.stop(timeout_s=20)
        if self.process.killed_after_timeout:
            pytest.fail(f"joaderd did not stop within 20 s of SIGTERM:\n{self.log()}")
        return code

    def cleanup(self) -> None:
        self.process.kill()  # reaps and releases the launcher's files; nothing if already stopped
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo") / "images"
    make_demo_data(root, NUM_DEMO_ITEMS, num_classes=4, seed=1, progress=False)
    return root


@pytest.fixture(scope="session")
def expected(demo_root: Path) -> dict[int, Any]:
    """Every demo item's pixels (crc32) and label, decoded here, outside joaderd: what the
    content checks (`integrity.check_records`) compare each delivered sample with."""
    return reference(demo_root, IMAGE_SIZE)


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[Clients]:
    """Client programs started by the test; none is left running after it (`Clients.close`)."""
    runner = Clients(tmp_path)
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture
def start_joaderd() -> Iterator[Any]:
    """`start_joaderd(sources, cache_items, ...)` -> Joaderd; stopped and checked afterwards.

    `start_joaderd.restart(server)` starts a new joaderd like `server` (same sources, cache size
    and options) on the same address, as a restart after a crash does; `server` must have exited.
    Servers are stopped newest first: a restarted one serves on a socket in its predecessor's
    directory, which goes with the predecessor's cleanup.
    """
    servers: list[Joaderd] = []

    def start(sources: dict[str, Path], cache_items: int, **kwargs: Any) -> Joaderd:
        server = Joaderd(sources, cache_items, **kwargs)
        servers.append(server)
        return server

    def restart(server: Joaderd, **overrides: Any) -> Joaderd:
        assert server.proc.poll() is not None, "restart(server) needs the old joaderd gone"
        options = {**server.options, "listen": server.address, **overrides}
        return start(options.pop("sources"), options.pop("cache_items"), **options)

    start.restart = restart  # type: ignore[attr-defined]
    yield start
    problems = []
    for server in reversed(servers):
        try:
            code = server.stop()
            if code != server.expected_exit_code:
                problems.append(f"joaderd exited with {code}:\n{server.log()}")
        finally:
            server.cleanup()
    assert not problems, "\n".join(problems)
