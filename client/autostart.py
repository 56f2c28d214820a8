"""A joaderd that jobs start themselves: found, or started, per user and per source.

`JoaderDataset("photos", root="/data/photos", image_size=64)` needs no server started by hand.
The dataset looks for this user's joaderd serving exactly that (the source's name, its root and
the stage options: the *spec*) at a socket named after the spec, and starts one if none answers:
detached from the job (its own session, so a Ctrl-C or a trial's end does not take it down),
shared by every later job with the same spec, and exiting by itself once no job has been attached
for `idle_exit_s` (the sccache / Gradle-daemon pattern). `serve(...)` is the sweep-scoped form
for a driver: the same server, kept for the `with` block, its address exported in
`JOADER_ADDRESS` to the trials the driver starts, and stopped at the end if the block started it.

NOTE [ One server per spec, and the lock ]
Jobs of one sweep start at the same instant. Each first probes the spec's socket; if nothing
listens, it takes an exclusive `flock` on the spec's lock file, probes again (another job may
have started the server while it waited), and only then starts one and waits for its ready file
before letting go of the lock. So concurrent first jobs start one server, and the others find it.
The kernel drops a `flock` when its holder dies, so a job killed while starting never wedges the
next. The lock and the socket live in the user's private socket directory (`joader.address`).

NOTE [ A server that died ]
A joaderd that was killed is started again by the next client that needs it: the lease keeper of
a running job, whose registration carries the spec, calls `ensure_server` while it reconnects
(`joader.client.keeper`), and the job resumes its epoch as after any restart. Several keepers
racing to restart it meet at the lock, as first jobs do.

The explicit `joaderd` stays the way for shared hosts and systemd: `address=`, `JOADER_ADDRESS`
or the default socket, exactly as before; a spec never uses the default socket.

This module imports neither grpc nor torch: the training process probes with a plain socket,
and must hold no gRPC channel when a DataLoader forks its workers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from joader.address import ENV_ADDRESS, default_socket_path
from joader.cache.arena import pid_alive
from joader.errors import InvalidArgumentError
from joader.launch import JoaderdStartError, read_ready_file

__all__ = ["DEFAULT_IDLE_EXIT_S", "ServerSpec", "Served", "ensure_server", "running_servers", "serve", "stop_server", "stop_servers"]

logger = logging.getLogger(__name__)

DEFAULT_IDLE_EXIT_S = 600.0  # an auto-started joaderd exits after this long without a job
ENV_IDLE_EXIT_S = "JOADER_IDLE_EXIT_S"  # the environment's say on both, for the servers jobs start
ENV_CACHE_SIZE = "JOADER_CACHE_SIZE"
START_TIMEOUT_S = 120.0  # listing a large source takes a while
_POLL_S = 0.05
_LOG_TAIL_CHARS = 3000
MODES = ("RGB", "L")


@dataclass(frozen=True)
class ServerSpec:
    """What an auto-started joaderd serves: one source and its shared stage.

    `cache_size` and `idle_exit_s` size and time the server the first job starts; they are not
    part of its identity (`key`): a later job with another cache size uses the running one."""

    source: str
    root: str
    image_size: int | None = None
    mode: str | None = None
    stage: str | None = None
    decoder: str | None = None
    upscale: bool = False
    cache_size: str = field(default_factory=lambda: os.environ.get(ENV_CACHE_SIZE, "auto"))
    idle_exit_s: float = field(default_factory=lambda: _env_seconds(ENV_IDLE_EXIT_S, DEFAULT_IDLE_EXIT_S))

    @classmethod
    def make(cls, source: str, root: str | os.PathLike[str], **options: Any) -> ServerSpec:
        """A checked spec; `root` is made absolute (jobs started from other directories meet)."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", source or ""):
            raise InvalidArgumentError(
                f"source name {source!r} cannot name an auto-started joaderd: use letters, digits, "
                "'.', '_' or '-'")
        path = Path(root).expanduser().resolve()
        if not path.exists():
            raise InvalidArgumentError(
                f"root {str(root)!r} does not exist: pass the directory of the source's images (an "
                "ImageFolder tree), a .tsv/.csv list or a folder of .tar shards")
        spec = cls(source, str(path), **options)
        if spec.image_size is not None and (isinstance(spec.image_size, bool) or not isinstance(spec.image_size, int)
                                            or spec.image_size < 1):
            raise InvalidArgumentError(f"image_size must be a positive int, got {spec.image_size!r}")
        if spec.mode is not None and spec.mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}, got {spec.mode!r}")
        return spec

    def key(self) -> str:
        """The spec's identity: jobs whose specs have the same key share one joaderd."""
        identity = {k: v for k, v in asdict(self).items() if k not in ("cache_size", "idle_exit_s")}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]

    def socket_path(self) -> Path:
        return default_socket_path().parent / f"auto-{self.source[:32]}-{self.key()}.sock"

    @property
    def address(self) -> str:
        return f"unix:{self.socket_path()}"

    def server_args(self) -> list[str]:
        """joaderd's arguments for this spec (the address and ready file aside)."""
        args = ["--source", f"{self.source}={self.root}", "--cache-size", str(self.cache_size),
                "--idle-exit-s", f"{self.idle_exit_s:g}"]
        if self.image_size is not None:
            args += ["--image-size", str(self.image_size)]
        if self.mode is not None:
            args += ["--mode", self.mode]
        if self.stage is not None:
            args += ["--stage", self.stage]
        if self.decoder is not None:
            args += ["--decoder", self.decoder]
        if self.upscale:
            args += ["--upscale", self.source]
        return args

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ServerSpec:
        return cls(**values)


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError(f"{name}={raw!r} is not a number of seconds: set it to e.g. 600, or unset it") from None
    if value < 0:
        raise InvalidArgumentError(f"{name}={raw!r} is negative: set it to 0 (never exit) or more")
    return value


def listening(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket `path` (a dead server's socket
    file refuses). Who that process is, the keeper checks before it sends a byte
    (`joader.address.verify_server`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:  # no file, refused (a dead server's socket), timed out
            return False
    return True


def ensure_server(spec: ServerSpec, *, timeout_s: float = START_TIMEOUT_S) -> tuple[str, int | None]:
    """The address of the joaderd serving `spec`, started first if none answers; and the pid of
    the server this call started (None if it found one running)."""
    path = spec.socket_path()
    if listening(path):
        return spec.address, None
    _private_dir(path.parent)
    with _locked(path.with_suffix(".lock"), timeout_s, spec):
        if listening(path):
            return spec.address, None
        return spec.address, _start(spec, path, timeout_s)


def _private_dir(directory: Path) -> None:
    """The user's socket directory, made 0700 if missing; joaderd checks it again (a directory
    another user created or can write is refused, `joader.address.prepare_server_socket`)."""
    try:
        directory.mkdir(mode=0o700, parents=False, exist_ok=True)
    except FileNotFoundError:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float, spec: ServerSpec) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise JoaderdStartError(
                        f"another process has been starting joaderd for {spec.source!r} for over "
                        f"{timeout_s:g} s (lock {path}); see its log {path.with_suffix('.log')}, or "
                        "start joaderd by hand and pass address=") from None
                time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def _start(spec: ServerSpec, path: Path, timeout_s: float) -> int:
    """Starts joaderd for `spec` detached from this process; returns its pid once it serves."""
    ready = path.with_suffix(".ready")
    log_path = path.with_suffix(".log")
    ready.unlink(missing_ok=True)
    path.with_suffix(".json").write_text(json.dumps(spec.to_dict()))  # what `joader servers` lists
    command = [sys.executable, "-m", "joader.server", *spec.server_args(),
               "--listen", spec.address, "--ready-file", str(ready)]
    logger.info("joader: starting joaderd for %s (%s); log %s", spec.source, spec.root, log_path)
    with open(log_path, "ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} started by pid {os.getpid()}: "
                  f"{' '.join(command)}\n".encode())
        log.flush()
        # NOTE [ The server is nobody's child ]
        # Started through a short-lived launcher that exits at once, joaderd is reparented to
        # init (or the session's subreaper), which reaps it: a server started by a trial is not
        # that trial's child, so it never lingers as a zombie that looks alive (its arena would
        # count as a live server's). In a session of its own, the job's Ctrl-C and its process
        # group's SIGKILL (Ray's, a scheduler's) leave it to the other jobs that share it.
        launcher = subprocess.run([sys.executable, "-c", _LAUNCHER, *command], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=log, close_fds=True, timeout=60, check=False)
    try:
        server_pid = int(launcher.stdout.split()[0])
    except (IndexError, ValueError):
        raise JoaderdStartError(f"could not start joaderd for {spec.source!r}: {_tail(log_path)}") from None
    deadline = time.monotonic() + timeout_s
    while True:
        info = read_ready_file(ready)
        if info is not None:
            return int(info.get("pid") or server_pid)
        exited = not pid_alive(server_pid)
        if exited or time.monotonic() > deadline:
            if not exited:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server_pid, signal.SIGKILL)
            tail = _tail(log_path)
            what = "exited" if exited else f"was not ready within {timeout_s:g} s"
            raise JoaderdStartError(
                f"joaderd for source {spec.source!r} ({spec.root}) {what}. Its log ({log_path}) "
                f"ends with:\n{tail}\nFix what it says, or start joaderd by hand and pass address=")
        time.sleep(_POLL_S)


_LAUNCHER = (
    "import subprocess, sys\n"
    "p = subprocess.Popen(sys.argv[1:], start_new_session=True, stdin=subprocess.DEVNULL, stdout=2, stderr=2)\n"
    "print(p.pid)\n"
)


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-_LOG_TAIL_CHARS:].strip()
    except OSError:
        return "(no log)"


def running_servers() -> list[dict[str, Any]]:
    """This user's auto-started joaderds that serve now: each one's spec, address, pid and log."""
    directory = default_socket_path().parent
    found = []
    for ready in sorted(directory.glob("auto-*.ready")) if directory.is_dir() else []:
        socket_file = ready.with_suffix(".sock")
        info = read_ready_file(ready)
        if info is None or not listening(socket_file):
            continue
        try:
            spec = json.loads(ready.with_suffix(".json").read_text())
        except (OSError, ValueError):
            spec = {}
        found.append({**spec, "address": info["address"], "pid": info.get("pid"),
                      "log": str(ready.with_suffix(".log"))})
    return found


def stop_servers(timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Stops every auto-started joaderd of this user (their jobs wait for a new one, or give up
    after their timeout_s); returns what was stopped."""
    servers = running_servers()
    for server in servers:
        if server.get("pid"):
            stop_server(int(server["pid"]), timeout_s)
    return servers


@dataclass
class Served:
    """The joaderd a `serve` block uses: its address, and its pid if the block started it."""

    address: str
    spec: ServerSpec
    started_pid: int | None


@contextlib.contextmanager
def serve(source: str, root: str | os.PathLike[str], *, image_size: int | None = None, mode: str | None = None,
          stage: str | None = None, decoder: str | None = None, upscale: bool = False, cache_size: str | None = None,
          idle_exit_s: float | None = None, stop_timeout_s: float = 30.0) -> Iterator[Served]:
    """A sweep's joaderd, for the driver that launches the trials.

    `cache_size` ("auto": from the data; or bytes such as "2GiB") defaults to
    `$JOADER_CACHE_SIZE`, else "auto"; `idle_exit_s` to 600 s (a server the block started exits
    at the block's end; this is for a driver killed before).

    Finds or starts the joaderd of this spec (as a job with `root=` would), exports its address
    in `JOADER_ADDRESS` for the block (trials started inside inherit it, so they may pass just
    the source's name), and stops the server at the end if this block started it. Trials that
    pass the same `root=` and stage options find the same server either way.
    """
    # The block ends the server it started; its idle exit is only for a driver killed before
    # that, so a short $JOADER_IDLE_EXIT_S (meant for the servers trials start) is not used: the
    # trials of a Ray sweep may take longer than that to start and attach.
    sizing: dict[str, Any] = {"idle_exit_s": DEFAULT_IDLE_EXIT_S if idle_exit_s is None else idle_exit_s}
    if cache_size is not None:
        sizing["cache_size"] = cache_size
    spec = ServerSpec.make(source, root, image_size=image_size, mode=mode, stage=stage, decoder=decoder,
                           upscale=upscale, **sizing)
    address, pid = ensure_server(spec)
    before = os.environ.get(ENV_ADDRESS)
    os.environ[ENV_ADDRESS] = address
    try:
        yield Served(address, spec, pid)
    finally:
        if before is None:
            os.environ.pop(ENV_ADDRESS, None)
        else:
            os.environ[ENV_ADDRESS] = before
        if pid is not None:
            stop_server(pid, stop_timeout_s)


def stop_server(pid: int, timeout_s: float = 30.0) -> None:
    """SIGTERM to joaderd `pid`; waits until it exited (SIGKILL after `timeout_s`)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(_POLL_S)
    logger.warning("joader: joaderd %d did not stop within %g s of SIGTERM; killing it", pid, timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


