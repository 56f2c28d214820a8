"""`--idle-exit-s`: since when joaderd has had no attached job, and whether it should exit now.

A joaderd that a client starts for itself (detached, per user) must not outlive the sweep it was
started for: with `--idle-exit-s S` it exits, cleanly and as SIGTERM would (exit code 0, arena,
socket and ready file removed), once no job has been attached for S seconds, counted from its
start (the moment it serves) if no job ever attached, and from the moment the last job left
otherwise. A job that attaches again after a joaderd restart (its lease keeper reattaching)
counts from the moment it attached, like any other.

What counts is *attached jobs*, not requests: a job whose training loop evaluates, checkpoints or
sleeps between epochs holds its lease (its keeper's heartbeats) and keeps joaderd up, however
long it reads nothing. A job ends when its last rank closes or its lease expires
(`server/registry/jobs.py`), and that is the moment idleness starts. A `describe` (a dataset learning its
classes and sizes before it attaches, as under Lightning's launcher) registers nothing and is no
job: a setting shorter than the time from a script's start to its first attach is too short.

`IdleExit` is the rule, pure: the clock is an argument of every call. The registry tells it the
number of jobs whenever a job comes or goes (under its lock, so no job is missed between two
checks), and a supervised thread in `server/main.py` asks it about once a second whether to exit
(`Registry.exit_if_idle`, which also refuses every attach from that moment: NOTE [ Deciding to
exit refuses the next attach ]).

NOTE [ Deciding to exit refuses the next attach ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Between the decision to exit and the socket going away there is up to a second of shutdown
(gRPC's grace, the threads' joins). A job attaching in that window would be registered, then
lose its server at once, and its lease keeper would wait for a restart that a detached,
per-user joaderd never gets unless a client starts one. So the decision is taken under the
registry's lock and from then on every attach is refused with `ServerExitingError` (a
`ConnectionError`, UNAVAILABLE): to a client it is the same as finding no joaderd, which is what
it will find a moment later; a keeper reattaching after a restart keeps waiting for the next one.
"""

from __future__ import annotations

__all__ = ["IdleExit", "check_period_s", "exiting_message"]

CHECK_PERIOD_S = 1.0  # how often the idle thread asks, at most


def check_period_s(idle_exit_s: float) -> float:
    """How often to ask whether to exit: about once a second, more often for a short setting
    (a tenth of it, at least 50 ms), so that joaderd exits within a tenth of `idle_exit_s` late."""
    return max(0.05, min(CHECK_PERIOD_S, idle_exit_s / 10))


class IdleExit:
    """Since when no job has been attached, and whether that is `idle_exit_s` or longer.

    `idle_exit_s` 0 never exits. `now` (the constructor's) is joaderd's start: idleness is
    counted from there until a job attaches. Pure: every call takes the clock's reading.
    """

    def __init__(self, idle_exit_s: float, now: float) -> None:
        if idle_exit_s < 0:
            raise ValueError(f"idle_exit_s must be >= 0, got {idle_exit_s}")
        self.idle_exit_s = idle_exit_s
        self._idle_since_s: float | None = now  # None while a job is attached

    def serving(self, now: float) -> None:
        """joaderd accepts calls from `now`: idleness before (listing sources, starting the
        workers, importing grpc: seconds on a busy host) does not count, or a short setting would
        exit before a client could attach."""
        if self._idle_since_s is not None:
            self._idle_since_s = max(self._idle_since_s, now)

    def jobs_now(self, now: float, attached: int) -> None:
        """`attached` jobs are registered now (a job came or went at `now`)."""
        if attached > 0:
            self._idle_since_s = None
        elif self._idle_since_s is None:  # the last job left now; a later call keeps the start
            self._idle_since_s = now

    def idle_s(self, now: float) -> float | None:
        """Seconds with no job attached, or None while a job is attached."""
        if self._idle_since_s is None:
            return None
        return max(0.0, now - self._idle_since_s)

    def due(self, now: float) -> bool:
        """Whether joaderd should exit now: `idle_exit_s` is set and it has been idle that long."""
        idle = self.idle_s(now)
        return self.idle_exit_s > 0 and idle is not None and idle >= self.idle_exit_s


def exiting_message(idle_exit_s: float) -> str:
    """What an attach refused after the decision to exit says (`ServerExitingError`)."""
    return (f"joaderd is exiting: it had no job for {idle_exit_s:g} s (--idle-exit-s {idle_exit_s:g}); "
            "start joaderd again (or let the client start it), then the job")
