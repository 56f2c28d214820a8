"""Start joaderd as a subprocess and know, without guessing, when and where it serves.

joaderd writes a *ready file* (`--ready-file PATH`) once its socket accepts calls: one JSON
object with the address it really serves (with the port the kernel chose for `:0`), its arena,
its pid and its worker count. `JoaderdProcess` starts joaderd with such a file in a private
temporary directory and polls for it, so that the integration tests, the benchmarks and the demo
share one launcher instead of three copies that grepped the log for "joaderd ready" (which broke
whenever a log line changed, and could not learn a port chosen by the kernel).

This module imports neither grpc nor torch, nor the server or the client: the pytest process
and the bench driver use it, and they must never hold a gRPC channel when they fork
(docs/architecture.md, "Processes and threads").
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from joader.errors import JoaderError

__all__ = ["READY_FILE_VERSION", "JoaderdProcess", "JoaderdStartError", "read_ready_file", "write_ready_file"]

logger = logging.getLogger(__name__)

READY_FILE_VERSION = 1
_POLL_S = 0.05
_LOG_TAIL_CHARS = 4000
_READY_FILE_NAME = "ready.json"


class JoaderdStartError(JoaderError, RuntimeError):
    """joaderd exited, or did not become ready in time, while being started by the launcher.

    Local to the launcher (it never crosses the wire), so it is not in `ERROR_CLASSES`.
    """


def write_ready_file(path: Path, info: Mapping[str, Any]) -> None:
    """Writes `info` as JSON to `path` atomically, mode 0600.

    A temporary file in the same directory is written, fsynced and renamed over `path`, so a
    reader polling `path` sees nothing or the whole object, never a partial one.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:  # mkstemp made it 0600
            json.dump(dict(info), out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_ready_file(path: Path) -> dict[str, Any] | None:
    """The ready file's object, or None while it does not exist (or is not a whole object yet)."""
    try:
        info = json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) and "address" in info else None


class JoaderdProcess:
    """A joaderd subprocess started by `start`, ready to serve once that returns.

    `info` is the ready file's object; `address`, `arena_path` and `pid` come from it, and
    `ready_file` is where joaderd wrote it (it removes it when it exits cleanly). The log
    (stdout and stderr) goes to `log_path` if one was given, else to this process's own streams.
    Use as a context manager, or call `stop()` (or `kill()`): both also remove the launcher's
    temporary directory.
    """

    def __init__(self, proc: subprocess.Popen[bytes], info: dict[str, Any], log_path: Path | None,
                 workdir: Path, log_file: IO[bytes] | None) -> None:
        # Use `JoaderdProcess.start`; this only wraps a process that is already ready.
        self.proc = proc
        self.info = info
        self.log_path = log_path
        self.pid: int = proc.pid
        self.address: str = str(info["address"])
        self.arena_path: str | None = info.get("arena_path")
        self.killed_after_timeout = False  # stop() had to SIGKILL
        self.ready_file = workdir / _READY_FILE_NAME
        self._workdir = workdir
        self._log_file = log_file

    @classmethod
    def start(
        cls,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: str | os.PathLike[str] | None = None,
        ready_timeout_s: float = 60.0,
        python: str = sys.executable,
    ) -> JoaderdProcess:
        """Runs `python -m joader.server *args --ready-file ...` and waits until it serves.

        Raises `JoaderdStartError` with the exit code and the log's tail if joaderd exits first,
        or if it is not ready within `ready_timeout_s` (it is killed then).
        """
        workdir = Path(tempfile.mkdtemp(prefix="joaderd-launch-"))
        ready_file = workdir / _READY_FILE_NAME
        log_path = Path(stdout) if stdout is not None else None
        log_file = open(log_path, "wb") if log_path is not None else None
        command = [python, "-m", "joader.server", *args, "--ready-file", str(ready_file)]
        try:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=subprocess.STDOUT if log_file is not None else None,
                env=dict(env) if env is not None else None,
            )
        except BaseException:
            _close_quietly(log_file)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        try:
            info = _wait_ready(proc, ready_file, ready_timeout_s, log_path)
        except BaseException:
            _reap(proc, signal.SIGKILL, 10.0)
            _close_quietly(log_file)
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return cls(proc, info, log_path, workdir, log_file)

    @property
    def returncode(self) -> int | None:
        """The exit status once joaderd has exited (negative: killed by that signal), else None."""
        return self.proc.poll()

    def log(self) -> str:
        """The log so far ("" when it goes to this process's own streams)."""
        return _read_log(self.log_path)

    def signal(self, sig: int) -> None:
        """Sends `sig` to joaderd (nothing if it has exited)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL (`killed_after_timeout`); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.killed_after_timeout = True
                logger.warning("joaderd (pid %d) did not stop within %g s of SIGTERM; killed",
                               self.pid, timeout_s)
                _reap(self.proc, signal.SIGKILL, None)
        self._release()
        return self.proc.returncode

    def kill(self) -> int:
        """SIGKILL, as a crash would; waits for the exit and returns the exit code."""
        _reap(self.proc, signal.SIGKILL, None)
        self._release()
        return self.proc.returncode

    def _release(self) -> None:
        _close_quietly(self._log_file)
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"JoaderdProcess(pid={self.pid}, address={self.address!r}, returncode={self.returncode})"


def _wait_ready(proc: subprocess.Popen[bytes], ready_file: Path, timeout_s: float,
                log_path: Path | None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        info = read_ready_file(ready_file)
        if info is not None:
            return info
        code = proc.poll()
        if code is not None:
            raise JoaderdStartError(f"joaderd exited with code {code} before it was ready{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise JoaderdStartError(
                f"joaderd did not become ready within {timeout_s:g} s (no ready file); it was "
                f"killed. Raise ready_timeout_s for a large source{_tail(log_path)}"
            )
        time.sleep(_POLL_S)


def _tail(log_path: Path | None) -> str:
    if log_path is None:
        return " (its output went to this process's stderr, above)"
    text = _read_log(log_path)
    return f"; the end of its log {log_path}:\n{text[-_LOG_TAIL_CHARS:]}" if text else f" (log {log_path} is empty)"


def _read_log(log_path: Path | None) -> str:
    if log_path is None:
        return ""
    try:
        return log_path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _reap(proc: subprocess.Popen[bytes], sig: int, timeout_s: float | None) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        logger.error("process %d did not exit after signal %d", proc.pid, sig)


def _close_quietly(stream: IO[bytes] | None) -> None:
    if stream is not None and not stream.closed:
        stream.close()
