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
(`joader.client.keeper_process`), and the job resumes its epoch as after any restart. Several keepers
racing to restart it meet at the lock, as first jobs do.

The explicit `joaderd` stays the way for shared hosts and systemd: `address=`, `JOADER_ADDRESS`
or the default socket, exactly as before; a spec never uses the default socket.

This module imports neither grpc nor torch: the training process probes with a plain socket,
and must hold no gRPC channel when a DataLoader forks its workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from joader.address import ENV_ADDRESS, SUN_PATH_MAX, runtime_dir
from joader.errors import InvalidArgumentError, ServerStoppedError, UntrustedServerError
from joader.launch import JoaderdStartError, read_ready_file
from joader.private_dir import (
    flocked,
    lock_holder,
    open_private,
    owner_name,
    private_dir,
    write_private,
)
from joader.process_ref import ProcessRef

__all__ = ["DEFAULT_IDLE_EXIT_S", "ServerSpec", "Served", "ensure_server", "running_servers", "serve",
           "stop_server", "stop_servers", "stopped_notice"]

logger = logging.getLogger(__name__)

DEFAULT_IDLE_EXIT_S = 600.0  # an auto-started joaderd exits after this long without a job
ENV_IDLE_EXIT_S = "JOADER_IDLE_EXIT_S"  # the environment's say on both, for the servers jobs start
ENV_CACHE_SIZE = "JOADER_CACHE_SIZE"
ENV_OWNER = "JOADER_SERVE_OWNER"  # set by `serve` for its block: servers started inside exit with the driver
START_TIMEOUT_S = 120.0  # listing a large source takes a while
_POLL_S = 0.05
_LOG_TAIL_CHARS = 3000
_SOURCE_IN_NAME = 32  # characters of the source's name in its files' names
MODES = ("RGB", "L")


@dataclass(frozen=True)
class ServerSpec:
    """What an auto-started joaderd serves: one source and its shared stage.

    `cache_size` and `idle_exit_s` size and time the server the first job starts, and `owner`
    (a `ProcessRef` as text: a `serve` block's driver) is the process it exits with; none of
    them is part of its identity (`key`): a later job with another cache size uses the running
    one."""

    source: str
    root: str
    image_size: int | None = None
    mode: str | None = None
    stage: str | None = None
    decoder: str | None = None  # None: joaderd's default
    upscale: bool = True  # images smaller than S upscaled to S (False: served at their own size)
    exif_transpose: bool = False  # rotate by the EXIF orientation before the stage
    cache_size: str = field(default_factory=lambda: os.environ.get(ENV_CACHE_SIZE, "auto"))
    idle_exit_s: float = field(default_factory=lambda: _env_seconds(ENV_IDLE_EXIT_S, DEFAULT_IDLE_EXIT_S))
    owner: str | None = field(default_factory=lambda: os.environ.get(ENV_OWNER) or None)

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
        if spec.decoder is not None:  # joader.stages imports Pillow: only when a decoder is named
            from joader.stages.image import DECODERS

            if spec.decoder not in DECODERS:
                raise InvalidArgumentError(f"decoder must be one of {', '.join(DECODERS)}, got {spec.decoder!r}")
        for flag in ("upscale", "exif_transpose"):
            if not isinstance(getattr(spec, flag), bool):
                raise InvalidArgumentError(f"{flag} must be True or False, got {getattr(spec, flag)!r}")
        return spec

    def key(self) -> str:
        """The spec's identity: jobs whose specs have the same key share one joaderd."""
        identity = {k: v for k, v in asdict(self).items() if k not in ("cache_size", "idle_exit_s", "owner")}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]

    def socket_path(self) -> Path:
        """`<runtime dir>/auto-<source>-<key>.sock`; the source's part goes if the path would not
        fit a Unix socket's 107 bytes (`joader.address.runtime_dir` keeps the rest short)."""
        directory = runtime_dir()
        path = directory / f"auto-{self.source[:_SOURCE_IN_NAME]}-{self.key()}.sock"
        return path if len(os.fsencode(path)) <= SUN_PATH_MAX else directory / f"auto-{self.key()}.sock"

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
        # Said either way: joaderd's default is not this client's to assume.
        args += ["--upscale" if self.upscale else "--no-upscale", self.source]
        if self.exif_transpose:
            args += ["--exif-transpose", self.source]
        if self.owner is not None:
            args += ["--exit-with", self.owner]
        # One budget for every server this user auto-starts, counted also when sized explicitly
        # (server/cache_budget.py): their socket directory holds the ledger.
        return args + ["--cache-budget-dir", str(self.socket_path().parent)]

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
        except (TimeoutError, BlockingIOError):
            return True  # a full backlog: a busy server, not a dead one (as joader.address sees it)
        except OSError:  # no file, refused (a dead server's socket)
            return False
    return True


def server_for_dataset(source: str, root: str | os.PathLike[str] | None, address: str | None, *,
                       image_size: int | None, mode: str | None, stage: str | None, decoder: str | None,
                       upscale: bool | None, exif_transpose: bool | None) -> tuple[str | None, dict[str, Any] | None]:
    """`JoaderDataset`'s server: with `root`, the auto-started joaderd serving it (started now if
    none answers) and its spec as a dict (the keeper's, to start it again); else `address` as
    given and None."""
    if root is None:
        return address, None
    if address is not None:
        raise InvalidArgumentError(
            f"JoaderDataset({source!r}) got both address= (a joaderd you started) and root= "
            "(a joaderd joader starts for you): pass one of them")
    spec = ServerSpec.make(source, root, image_size=image_size, mode=mode, stage=stage, decoder=decoder,
                           upscale=True if upscale is None else upscale,
                           exif_transpose=False if exif_transpose is None else exif_transpose)
    found, _started = ensure_server(spec)
    return found, spec.to_dict()


def ensure_server(spec: ServerSpec, *, timeout_s: float = START_TIMEOUT_S,
                  restart: bool = False) -> tuple[str, ProcessRef | None]:
    """The address of the joaderd serving `spec`, started first if none answers; and the server
    this call started (None if it found one running).

    `restart` is a lease keeper's call for a server that went away: it raises
    `ServerStoppedError` instead of starting one that `joader servers --stop` stopped (NOTE
    [ Stop means stop ]). A job's own first call starts it again, and the stop is forgotten."""
    path = spec.socket_path()
    private_dir(path.parent, parents=True)  # before anything is opened there
    if listening(path):
        return spec.address, None
    spec = _without_dead_owner(spec, restart)
    _refuse_if_stopped(path, restart)
    with _locked(path.with_suffix(".lock"), timeout_s, spec):
        if listening(path):
            return spec.address, None
        _refuse_if_stopped(path, restart)
        path.with_suffix(".stopped").unlink(missing_ok=True)
        return spec.address, _start(spec, path, timeout_s)


# NOTE [ Stop means stop ]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A running job's lease keeper starts its auto-started joaderd again when it dies (NOTE [ A server
# that died ]), which is right after a crash and wrong after `joader servers --stop`: the server
# was back within seconds, then idled for ten minutes after its jobs ended. So a stop first leaves
# a *stop file* beside the socket (who stopped it, when), then stops the server. A keeper that
# finds the server gone and the stop file there neither starts it nor waits for it: it tells its
# job's readers, whose next call raises `ServerStoppedError` with the text below. A job started
# afterwards (a new `JoaderDataset(root=...)`) removes the stop file and starts a server: starting
# a job is asking for one.


def stopped_notice(address: str) -> str | None:
    """The error text for the jobs of the auto-started joaderd at `address` if it was stopped by
    `joader servers --stop` (its stop file), else None."""
    if not address.startswith("unix:"):
        return None
    path = Path(address[len("unix:"):])
    if not path.name.startswith("auto-"):
        return None
    try:
        fd = open_private(path.with_suffix(".stopped"), os.O_RDONLY)
    except (FileNotFoundError, UntrustedServerError):
        return None
    with os.fdopen(fd, "rb") as file:
        try:
            info = json.loads(file.read() or b"{}")
        except ValueError:
            info = {}
    when = time.strftime("%H:%M:%S", time.localtime(float(info.get("at", 0) or 0)))
    by = info.get("by", "`joader servers --stop`")
    return (f"the joaderd at {address} was stopped by {by} (pid {info.get('by_pid', '?')}, at {when}), so "
            "this job cannot go on reading. Run the job again to start a new server (from a checkpoint, if "
            "you saved one), or pass address= of a joaderd you run yourself")


def _leave_stop_file(sock: Path, by: str, server: ProcessRef) -> None:
    """NOTE [ Stop means stop ]: written before the server is signalled, so that a keeper that
    sees it gone finds the file."""
    write_private(sock.with_suffix(".stopped"),
                  json.dumps({"by": by, "by_pid": os.getpid(), "at": time.time(), "server_pid": server.pid}).encode())


def _without_dead_owner(spec: ServerSpec, restart: bool) -> ServerSpec:
    """`spec`, or `spec` with no owner if its `serve` driver has ended: a keeper does not start
    the server of a driver that ended (NOTE [ A driver's server ends with the driver ]), and a
    job's own start (a trial that outlived its driver) starts one that does not exit with it."""
    try:
        owner = ProcessRef.parse(spec.owner) if spec.owner else None
    except ValueError:
        owner = None
    if owner is None:  # none, or not PID:START_TICKS
        return spec if spec.owner is None else dataclasses.replace(spec, owner=None)
    if owner.is_running():
        return spec
    if restart:
        raise ServerStoppedError(
            f"the joaderd at {spec.address} was started for the joader.serve block of pid {owner.pid}, "
            "which has ended, so it is not started again. Run the job again (inside a new serve block, "
            "or with root= alone) to start a new server")
    return dataclasses.replace(spec, owner=None)


def _refuse_if_stopped(path: Path, restart: bool) -> None:
    if restart and (notice := stopped_notice(f"unix:{path}")) is not None:
        raise ServerStoppedError(notice)


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float, spec: ServerSpec) -> Iterator[None]:
    """An exclusive `flock` on the spec's lock file (NOTE [ One server per spec, and the lock ]).
    A holder of another account is refused at once; one of ours is waited for, and named if it
    keeps the lock past `timeout_s`."""

    def busy(fd: int) -> None:
        holder = lock_holder(fd)
        if holder is not None and holder[1] != os.getuid():
            raise UntrustedServerError(
                f"the lock {path} is held by pid {holder[0]} of {owner_name(holder[1])}, not by "
                f"you: another account is using your private directory {path.parent}. Ask "
                f"{owner_name(holder[1]).split(' (')[0]} to stop it, or set XDG_RUNTIME_DIR to a "
                "directory of yours (mode 0700)")

    def timed_out(fd: int) -> BaseException:
        holder = lock_holder(fd)
        who = f"pid {holder[0]} ({_command(holder[0])})" if holder else "another process"
        return JoaderdStartError(
            f"{who} has been starting joaderd for {spec.source!r} for over {timeout_s:g} s "
            f"(lock {path}); see its log {path.with_suffix('.log')}, stop that process, or "
            "start joaderd by hand and pass address=")

    with flocked(path, timeout_s, timed_out, busy):
        yield


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200] or "?"
    except OSError:
        return "?"


def _start(spec: ServerSpec, path: Path, timeout_s: float) -> ProcessRef:
    """Starts joaderd for `spec` detached from this process; returns it once it serves. An
    interruption (Ctrl-C) or a failure after the launch stops the server it launched."""
    ready = path.with_suffix(".ready")
    log_path = path.with_suffix(".log")
    ready.unlink(missing_ok=True)
    write_private(path.with_suffix(".json"), json.dumps(spec.to_dict()).encode())  # for `joader servers`
    command = [sys.executable, "-m", "joader.server", *spec.server_args(),
               "--listen", spec.address, "--ready-file", str(ready)]
    logger.info("joader: starting joaderd for %s (%s); log %s", spec.source, spec.root, log_path)
    with os.fdopen(open_private(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as log:
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
    launched = _launched(launcher.stdout)
    if launched is None:
        raise JoaderdStartError(f"could not start joaderd for {spec.source!r}: {_tail(log_path)}")
    try:
        return _wait_ready(spec, launched, ready, log_path, timeout_s)
    except BaseException:
        launched.stop(timeout_s=10)  # Ctrl-C while it starts: nothing is left behind
        raise


def _launched(stdout: bytes) -> ProcessRef | None:
    """The server the launcher started: its pid and start time, as the launcher printed them."""
    try:
        return ProcessRef.parse(stdout.split()[0].decode())
    except (IndexError, ValueError):
        return None


def _wait_ready(spec: ServerSpec, launched: ProcessRef, ready: Path, log_path: Path, timeout_s: float) -> ProcessRef:
    deadline = time.monotonic() + timeout_s
    while True:
        if read_ready_file(ready) is not None:
            return launched
        exited = not launched.is_running()
        if exited or time.monotonic() > deadline:
            what = "exited" if exited else f"was not ready within {timeout_s:g} s"
            raise JoaderdStartError(
                f"joaderd for source {spec.source!r} ({spec.root}) {what}. Its log ({log_path}) "
                f"ends with:\n{_tail(log_path)}\nFix what it says, or start joaderd by hand and pass address=")
        time.sleep(_POLL_S)


# The launcher prints the server's pid and start time (`ProcessRef`), read while the server is
# surely its child, so that nothing later signals a pid that was reused.
_LAUNCHER = (
    "import subprocess, sys\n"
    "from joader.process_ref import ProcessRef\n"
    "p = subprocess.Popen(sys.argv[1:], start_new_session=True, stdin=subprocess.DEVNULL, stdout=2, stderr=2)\n"
    "print(ProcessRef.of(p.pid) or p.pid)\n"
)


def _tail(path: Path) -> str:
    try:
        fd = open_private(path, os.O_RDONLY)
    except OSError:
        return "(no log)"
    with os.fdopen(fd, "rb") as log:
        return log.read().decode(errors="replace")[-_LOG_TAIL_CHARS:].strip()


def running_servers() -> list[dict[str, Any]]:
    """This user's auto-started joaderds that serve now: each one's spec, address, pid, start
    ticks and log."""
    directory = runtime_dir()
    if not directory.is_dir():
        return []
    private_dir(directory)
    found = []
    for ready in sorted(directory.glob("auto-*.ready")):
        socket_file = ready.with_suffix(".sock")
        info = read_ready_file(ready)
        server = _server_of(info)
        if info is None or server is None or not listening(socket_file):
            continue
        try:
            with os.fdopen(open_private(ready.with_suffix(".json"), os.O_RDONLY), "rb") as file:
                spec = json.loads(file.read())
        except (OSError, ValueError):
            spec = {}
        found.append({**spec, "address": info["address"], "pid": server.pid, "start_ticks": server.start_ticks,
                      "log": str(ready.with_suffix(".log"))})
    return found


def _server_of(info: dict[str, Any] | None) -> ProcessRef | None:
    """The joaderd a ready file describes, if that very process still runs (its pid alone could
    be another process's by now: the start time must match too)."""
    if info is None or not info.get("pid") or info.get("start_ticks") is None:
        return None
    server = ProcessRef(int(info["pid"]), int(info["start_ticks"]))
    return server if server.is_running() else None


def stop_servers(timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Stops every auto-started joaderd of this user, for good: their jobs' lease keepers do not
    start them again, and the jobs fail with `ServerStoppedError` (NOTE [ Stop means stop ]).
    Returns what was stopped."""
    servers = running_servers()
    for server in servers:
        ref = ProcessRef(server["pid"], server["start_ticks"])
        _leave_stop_file(Path(server["address"][len("unix:"):]), "`joader servers --stop`", ref)
        ref.stop(timeout_s)
    return servers


@dataclass
class Served:
    """The joaderd a `serve` block uses: its address, and the server if the block started it."""

    address: str
    spec: ServerSpec
    started: ProcessRef | None

    @property
    def started_pid(self) -> int | None:
        return self.started.pid if self.started is not None else None


@contextlib.contextmanager
def serve(source: str, root: str | os.PathLike[str], *, image_size: int | None = None, mode: str | None = None,
          stage: str | None = None, decoder: str | None = None, upscale: bool = True, exif_transpose: bool = False,
          cache_size: str | None = None, idle_exit_s: float | None = None,
          stop_timeout_s: float = 30.0) -> Iterator[Served]:
    """A sweep's joaderd, for the driver that launches the trials.

    `image_size`, `mode`, `stage`, `decoder`, `upscale` and `exif_transpose` are the shared
    stage's, as `JoaderDataset(root=...)` takes them (its docstring says what each does); a
    trial must pass the same ones to find this server.

    `cache_size` ("auto": from the data; or bytes such as "2GiB") defaults to
    `$JOADER_CACHE_SIZE`, else "auto"; `idle_exit_s` to 600 s.

    Finds or starts the joaderd of this spec (as a job with `root=` would), exports its address
    in `JOADER_ADDRESS` for the block (trials started inside inherit it, so they may pass just
    the source's name), and stops the server at the end if this block started it. Trials that
    pass the same `root=` and stage options find the same server either way.

    NOTE [ A driver's server ends with the driver ]
    A server the block starts is told to exit with the driver (`--exit-with`, this process's
    pid and start time): a driver killed by SIGTERM or SIGKILL, or interrupted while the server
    starts, leaves nothing behind. The block also exports `JOADER_SERVE_OWNER`, so a server
    that a trial's lease keeper starts again after a crash exits with the driver too, and the
    block's end stops whichever server then serves the spec, not the pid it first recorded.
    """
    # The block ends the server it started; its idle exit is only a last resort, so a short
    # $JOADER_IDLE_EXIT_S (meant for the servers trials start) is not used: the trials of a Ray
    # sweep may take longer than that to start and attach.
    sizing: dict[str, Any] = {"idle_exit_s": DEFAULT_IDLE_EXIT_S if idle_exit_s is None else idle_exit_s}
    if cache_size is not None:
        sizing["cache_size"] = cache_size
    spec = ServerSpec.make(source, root, image_size=image_size, mode=mode, stage=stage, decoder=decoder,
                           upscale=upscale, exif_transpose=exif_transpose, owner=str(ProcessRef.current()), **sizing)
    address, started = ensure_server(spec)
    saved = {name: os.environ.get(name) for name in (ENV_ADDRESS, ENV_OWNER)}
    os.environ[ENV_ADDRESS] = address
    if started is not None:
        os.environ[ENV_OWNER] = spec.owner or ""
    try:
        yield Served(address, spec, started)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if started is not None:
            _stop_owned(spec, started, stop_timeout_s)


def _stop_owned(spec: ServerSpec, started: ProcessRef, timeout_s: float) -> None:
    """Stops the server the block started, and the one serving its spec now if a keeper started
    another (only one that exits with this driver: the block's own). The trials' keepers do not
    start it again (a stop file, NOTE [ Stop means stop ])."""
    by = "the end of the joader.serve block that started it"
    current = _server_of(read_ready_file(spec.socket_path().with_suffix(".ready")))
    for server in (started, current):
        if server is None or not server.is_running() or (server != started and _owner_of(server) != spec.owner):
            continue
        _leave_stop_file(spec.socket_path(), by, server)
        server.stop(timeout_s)


def _owner_of(server: ProcessRef) -> str | None:
    """The `--exit-with` of a running joaderd, from its command line."""
    try:
        words = psutil.Process(server.pid).cmdline()
    except psutil.Error:
        return None
    return words[words.index("--exit-with") + 1] if "--exit-with" in words[:-1] else None


def stop_server(server: ProcessRef | int, timeout_s: float = 30.0) -> None:
    """SIGTERM to joaderd `server`; waits until it exited (SIGKILL after `timeout_s`). A bare
    pid is taken as the process that has it now."""
    ref = ProcessRef.of(server) if isinstance(server, int) else server
    if ref is not None and not ref.stop(timeout_s):
        logger.warning("joader: joaderd %d did not stop after SIGKILL", ref.pid)
