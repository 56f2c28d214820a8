"""The forker: the one process that forks decode workers, so that joaderd never forks again.

It is forked once, when the pool is created, before joaderd imports grpc. joaderd must never
fork once gRPC runs (a child of a process with live gRPC state can crash), yet dead and stuck
workers must be replaced: the forker is single-threaded and has no gRPC, so it forks every
worker on request and hands joaderd the worker's socket over SCM_RIGHTS. Create the pool from
the main thread of a process that has not imported grpc.

The forker closes every descriptor it inherited and unmaps its inherited mapping of the arena
(so its children never get either). That matters for the arena's `flock`: a lock belongs to the
open file description, and both a descriptor and a memory mapping keep the description open, so
a child that kept either would keep the arena "alive" after joaderd died, and a restart would
not remove it. Workers map the arena themselves, through a description of their own. Both set
`PR_SET_PDEATHSIG` (SIGKILL) so that they die with their parent: the forker with joaderd (it is
forked from the thread that runs joaderd to its end; the death signal fires when the *thread*
that forked exits), the workers with the forker. It reports each worker's exit to joaderd.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import select
import signal
import socket
from collections.abc import Iterable

from joader.server.pool.worker import WorkerContext, close_inherited, die_with_parent, worker_main

__all__ = ["forker_main", "log_exit"]

logger = logging.getLogger("joader.server.pool.decode_pool")  # its notices belong to the pool's log


def forker_main(control: socket.socket, ctx: WorkerContext, parent: int, keep: set[int]) -> None:
    close_inherited(keep)
    unmap(os.path.realpath(ctx.arena_path))
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    children: set[int] = set()
    try:
        while True:
            ready, _, _ = select.select([control], [], [], 0.5)
            for pid, how in reaped(children):
                try:
                    control.send(pickle.dumps(("exit", pid, how)))
                except OSError:
                    return
            if not ready:
                continue
            try:
                message = control.recv(64)
            except OSError:
                return
            if not message:  # the pool closed, or joaderd died
                return
            # a stream: NOTE [ One read per batch of results ] in wire.py
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            pid = os.fork()
            if pid == 0:
                try:
                    keep_fd = theirs.fileno()
                    worker_main(theirs, ctx, keep={keep_fd})
                finally:
                    os._exit(0)
            theirs.close()
            children.add(pid)
            try:
                socket.send_fds(control, [pickle.dumps(("spawned", pid, ""))], [ours.fileno()])
            except OSError:
                return
            finally:
                ours.close()
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in children:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def reaped(children: set[int]) -> Iterable[tuple[int, str]]:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        if os.WIFSIGNALED(status):
            yield pid, f"killed by signal {os.WTERMSIG(status)}"
        else:
            yield pid, f"exit code {os.waitstatus_to_exitcode(status)}"


def unmap(path: str) -> None:
    """Unmaps every inherited mapping of `path`.

    A mapping holds a reference to the open file description it was made from, and so does the
    `flock` on it: joaderd's own mapping of the arena, inherited by fork, would keep the lock
    held after joaderd died as surely as an inherited descriptor. The forker never touches the
    memory; the Python object that owned it in joaderd is never used here.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    with open("/proc/self/maps") as maps:
        lines = maps.readlines()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].rstrip("\n").removesuffix(" (deleted)") == path:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            libc.munmap(start, end - start)


def log_exit(message: bytes) -> None:
    """The forker's notice of how a worker exited (usually after its EOF was handled)."""
    kind, pid, how = pickle.loads(message)
    if kind == "exit":
        logger.info("decode pool: worker pid %d exited (%s)", pid, how)
