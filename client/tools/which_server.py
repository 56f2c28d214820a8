"""Which joaderd `joader status`, `top` and `analyze` show when no `--address` is given.

A user whose jobs pass `root=` never started a server: their jobs did, each at a socket named
after its source (`joader.client.autostart`), not at the default socket. So the tools look where
the user's jobs are, in this order:

1. `--address`, else `$JOADER_ADDRESS` (a `joader.serve` block exports it to its trials): used
   as given, nothing is looked up.
2. Otherwise the candidates are the joaderd answering at the default socket (one started by
   hand, or by systemd) and every auto-started joaderd of this user (`joader servers`). One
   candidate is used, and so is the only one with jobs attached (a sweep's server stays up,
   idle, for 10 minutes after its last job: it should not make the user choose each time);
   otherwise they are listed (sources, roots, sockets, jobs) and the user picks one with
   `--source NAME` (the server serving that source) or `--address`. None gives a text that
   says where the tools looked and why a `root=` server may be gone (it exits after its last
   job).

`--source` picks among all of them, `$JOADER_ADDRESS`'s server included.

`choose` is the decision, pure (candidates in, a candidate or an error out); `find_address`
gathers the candidates (a socket probe and a status call each) and asks it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from joader.address import ENV_ADDRESS, default_socket_path, resolve_address, runtime_dir
from joader.errors import InvalidArgumentError, JoaderError

__all__ = ["Candidate", "Looked", "choose", "find_address"]

logger = logging.getLogger(__name__)

DEFAULT = "default socket"
AUTO = "started by a job with root="
ENV = "$JOADER_ADDRESS"
_PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Candidate:
    """A joaderd the tools could show: its address, how it was found (`DEFAULT`, `AUTO`,
    `ENV`), the sources it serves as (name, root), and its jobs attached (None: unknown)."""

    address: str
    origin: str
    sources: tuple[tuple[str, str], ...] = ()
    jobs: int | None = None
    pid: int | None = None

    def line(self) -> str:
        names = ", ".join(name for name, _ in self.sources) or "?"
        roots = ", ".join(root for _, root in self.sources) or "?"
        jobs = "" if self.jobs is None else f", {self.jobs} job{'' if self.jobs == 1 else 's'} attached"
        return f"  {names:<16} {roots}  ({self.origin}{jobs})\n  {'':<16} {self.address}"


@dataclass(frozen=True)
class Looked:
    """Where the tools looked, for the text when nothing answers."""

    default_socket: str
    runtime_dir: str
    command: str = "status"
    idle_exit_s: float = 600.0


def choose(candidates: Sequence[Candidate], *, source: str | None, looked: Looked) -> Candidate:
    """The server to show: the one serving `source` if given, else the only candidate, else
    the only one with jobs attached.

    Raises `ConnectionError` when there is none, and `InvalidArgumentError` (the candidates
    listed, and how to pick) when `source` matches none or several, or when there are several
    and no `source`."""
    if not candidates:
        raise ConnectionError(_none_text(looked))
    if source is not None:
        matches = [c for c in candidates if source in {name for name, _ in c.sources}]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise InvalidArgumentError(
                f"no joaderd of yours serves a source named {source!r}. Running:\n{_listing(candidates)}\n"
                f"pass one of these names to --source, or --address ADDRESS")
        raise InvalidArgumentError(
            f"{len(matches)} joaderds of yours serve a source named {source!r} (with other image sizes, "
            f"modes or stages):\n{_listing(matches)}\npick one with --address ADDRESS, e.g. "
            f"`joader {looked.command} --address {matches[0].address}`")
    if len(candidates) == 1:
        return candidates[0]
    busy = [c for c in candidates if c.jobs]
    if len(busy) == 1:
        return busy[0]
    example = next((name for c in candidates for name, _ in c.sources), "NAME")
    raise InvalidArgumentError(
        f"{len(candidates)} joaderds of yours are running:\n{_listing(candidates)}\n"
        f"say which with --source NAME (e.g. `joader {looked.command} --source {example}`), or --address ADDRESS")


def _listing(candidates: Sequence[Candidate]) -> str:
    return "\n".join(c.line() for c in candidates)


def _none_text(looked: Looked) -> str:
    minutes = looked.idle_exit_s / 60
    after = f"{minutes:g} minutes" if looked.idle_exit_s >= 60 else f"{looked.idle_exit_s:g} s"
    return (
        f"no joaderd of yours is running: nothing answers at the default socket {looked.default_socket}, "
        f"and no server started by a job with root= is there (their sockets are "
        f"{looked.runtime_dir}/auto-*.sock; `joader servers` lists them). A server that "
        f"JoaderDataset(root=...) starts exits {after} after its last job ends "
        f"(JOADER_IDLE_EXIT_S), and one a joader.serve block starts ends with the block. Run "
        f"`joader {looked.command}` while your jobs read; or start a server by hand with "
        "`joaderd --source NAME=PATH`, or pass --address ADDRESS")


# --- gathering --------------------------------------------------------------------------------


def find_address(address: str | None, source: str | None, *, command: str = "status") -> str:
    """The resolved address the tool `command` shows (see the module's docstring)."""
    if address:
        return resolve_address(address)
    env = os.environ.get(ENV_ADDRESS)
    if env and source is None:
        return resolve_address(env)
    from joader.client.autostart import DEFAULT_IDLE_EXIT_S, ENV_IDLE_EXIT_S

    candidates = _gather(resolve_address(env) if env else None)
    try:
        idle = float(os.environ.get(ENV_IDLE_EXIT_S) or DEFAULT_IDLE_EXIT_S)
    except ValueError:
        idle = DEFAULT_IDLE_EXIT_S
    looked = Looked(str(default_socket_path()), str(runtime_dir()), command, idle)
    chosen = choose(candidates, source=source, looked=looked)
    others = [] if source is not None else [c for c in candidates if c is not chosen]
    if (note := chosen_note(chosen, others)) is not None:
        print(f"joader: {note}", file=sys.stderr)
    return chosen.address


def chosen_note(chosen: Candidate, others: Sequence[Candidate]) -> str | None:
    """What the tool says (on stderr) about a server it found: which one, and the `others` it
    passed over (idle ones: `choose`)."""
    if chosen.origin != AUTO and not others:
        return None  # the default socket, as before
    names = ", ".join(f"{name} ({root})" for name, root in chosen.sources) or chosen.address
    what = "a job started for" if chosen.origin == AUTO else f"at the {chosen.origin}, serving"
    note = f"showing the joaderd {what} {names}"
    if others:
        idle = ", ".join(name for c in others for name, _ in c.sources) or "?"
        note += f"; also running, with no job attached: {idle} (--source NAME shows one)"
    return note


def _gather(env: str | None) -> list[Candidate]:
    """The joaderds of this user that answer: `env`'s, the default socket's, the auto-started."""
    from joader.client.autostart import listening, running_servers

    found: list[Candidate] = []
    if env is not None:
        found.append(_described(env, ENV))
    default = f"unix:{default_socket_path()}"
    if default != env and listening(Path(default[len("unix:"):])):
        found.append(_described(default, DEFAULT))
    for server in running_servers():
        if server["address"] in (env, default):
            continue
        candidate = _described(server["address"], AUTO)
        if not candidate.sources:
            candidate = Candidate(server["address"], AUTO, ((server.get("source", "?"), server.get("root", "?")),),
                                  None, server.get("pid"))
        found.append(candidate)
    return found


def _described(address: str, origin: str) -> Candidate:
    """`address` with its sources and jobs from its status (left unknown if it does not answer)."""
    from joader.client.tools.cli import fetch_status

    try:
        status = fetch_status(address, timeout_s=_PROBE_TIMEOUT_S)
    except (JoaderError, ConnectionError, TimeoutError, OSError) as error:
        logger.debug("joaderd at %s did not describe itself: %s", address, error)
        return Candidate(address, origin)
    sources = tuple((str(s.get("name", "?")), str(s.get("root", "?"))) for s in status.get("sources", []))
    return Candidate(address, origin, sources, len(status.get("jobs", [])), status.get("pid"))
