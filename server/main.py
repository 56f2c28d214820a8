"""`joaderd`: the entry point. Builds the pieces in the one order that is safe, then serves.

Order matters: the decode pool forks its forker process before any gRPC object exists (a fork
with a live gRPC channel or server can crash the child; every later worker is forked by that
forker, never by this process), so `joader.server.service`, which imports grpc, is imported only
after the pool has started.

Serving runs on an asyncio event loop in the main thread (`grpc.aio`: a job's lease stream costs
a coroutine, not a thread). Three threads do the rest, all *supervised*: the scheduler (DSA rounds,
decode dispatch, leases), the results thread (finished decodes into the cache) and the source
checker (`source_watch.py`: is each source on disk still the one listed?). If one dies
with an exception, joaderd logs the traceback, answers every request with `ServerFailedError`,
and exits with status 70 (EX_SOFTWARE): a server that keeps accepting requests while nothing
feeds its queues would hang every job without a word.

Shutdown (SIGTERM, SIGINT, SIGHUP, a failure, or `--idle-exit-s` seconds with no job: the
supervised `joaderd-idle` thread asks `Registry.exit_if_idle`, server/registry/idle_exit.py) removes the
arena, the socket and the ready file. A restart after a crash removes the arenas a dead joaderd
left behind.

The status `joader status` shows is composed in server/status_view.py; the fault tests' hook
(JOADERD_INJECT_FAULT) is server/fault_hooks.py.

`--cache-size auto` sizes the arena from the sources once they are listed (server/cache_sizing.py);
with `--cache-budget-dir` against what the user's other auto-sized servers hold
(server/cache_budget.py), under that budget's lock until the arena is allocated and recorded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from joader.address import is_loopback, prepare_server_socket, resolve_address, socket_path
from joader.cache.arena import Arena, format_size, remove_stale_arenas
from joader.errors import CacheSpaceError, JoaderError
from joader.launch import read_ready_file, write_ready_file
from joader.process_ref import ProcessRef
from joader.server import cpu_meter, fault_hooks, heap, log_limits
from joader.server.autoscale import AutoscaleConfig, Autoscaler, PeriodMeter
from joader.server.books.item_sizes import bound_is_nominal
from joader.server.books.source_watch import SourceChecker
from joader.server.cache_budget import BudgetClaim, CacheBudget
from joader.server.cache_sizing import (
    CacheSize,
    PreparedSource,
    SharedBudget,
    auto_cache_size,
    host_memory,
    memory_limit,
    prepared_bytes,
    shm_size_bytes,
)
from joader.server.config import ServerConfig, load_config
from joader.server.metrics import serve_metrics
from joader.server.pool.decode_pool import DecodePool, PoolConfig, SourceSpec
from joader.server.registry.idle_exit import check_period_s
from joader.server.registry.registry import Registry, RegistryConfig, Source
from joader.server.status_view import StatusView
from joader.sources.base import open_source
from joader.stages import build_stage

logger = logging.getLogger("joader.server")

EXIT_INTERNAL_ERROR = 70  # EX_SOFTWARE


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except JoaderError as error:
        print(f"joaderd: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # at DEBUG, every line
        log_limits.install(logging.getLogger())  # a client cannot flood the log (server/log_limits.py)
        logging.getLogger("grpc._cython.cygrpc").addFilter(log_limits.PeerGoneFilter())
    heap.one_arena()  # before any thread (NOTE in server/heap.py)
    try:
        return run(config)
    except JoaderError as error:
        logger.error("%s", error)
        return 1


class Supervisor:
    """Runs joaderd's background threads; the first one to die stops the server.

    `failure` holds the dead thread's name and exception once that happened; `on_failure` is
    called once, from the dying thread, to make the rest of the server stop.
    """

    def __init__(self, on_failure: Callable[[str, bool], None]) -> None:
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self.failure: str | None = None
        self.threads: list[threading.Thread] = []

    def spawn(self, name: str, target: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(name, target), name=name, daemon=True)
        self.threads.append(thread)
        thread.start()
        return thread

    def _run(self, name: str, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as error:  # noqa: BLE001  any death of a worker thread is fatal
            logger.critical(
                "internal thread %s died; joaderd stops:\n%s",
                name, "".join(traceback.format_exception(error)),
            )
            self._record(f"thread {name} died: {type(error).__name__}: {error}")

    def stop_failed(self, reason: str) -> None:
        """A part that is not a thread died (a Next front): joaderd exits 70, but its requests
        are not answered `ServerFailedError` meanwhile. The books are sound; the jobs only lost
        their way in, so they wait for a restart as after a kill (NOTE [ Next fronts ])."""
        logger.critical("%s", reason)
        self._record(reason, refuse=False)

    def _record(self, reason: str, refuse: bool = True) -> None:
        """The first failure stops the server; later ones only add to the log."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = reason
        if first:
            self._on_failure(reason, refuse)

    def join(self, timeout_s: float) -> None:
        for thread in self.threads:
            thread.join(timeout=timeout_s)


def run(config: ServerConfig) -> int:
    """Serves until SIGTERM, SIGINT or SIGHUP (or an internal failure); returns the exit code."""
    address = resolve_address(config.listen)
    sock = socket_path(address)
    bound_socket: list[tuple[int, int]] = []  # (st_dev, st_ino) of the socket this joaderd bound
    if sock is not None:
        prepare_server_socket(sock, address, remove_dead=False)  # removed right before the bind
    elif not is_loopback(address):
        logger.warning(
            "joaderd listens on %s, reachable from other hosts (--allow-remote): there is NO "
            "authentication, and anyone who can reach the port can read the served data", address,
        )
    for name in remove_stale_arenas():
        logger.warning("removed %s, left behind by a joaderd that did not exit cleanly", name)

    sources: list[Source] = []
    specs: list[SourceSpec] = []
    key_base = 0
    for i, source_config in enumerate(config.sources):
        listing = open_source(source_config.path)
        stage = build_stage(
            source_config.stage, size=source_config.image_size, mode=source_config.mode,
            upscale=source_config.upscale, decoder=source_config.decoder, options=source_config.options,
            exif_transpose=source_config.exif_transpose,
        )
        sources.append(Source(source_config.name, listing, stage, key_base, config.seed + i,
                              epoch_align=config.epoch_align))
        specs.append(SourceSpec(listing, stage))
        key_base += len(listing.paths)
        logger.info(
            "source %s: %d items in %d classes (%s at %s), stage %s",
            source_config.name, len(listing.paths), len(listing.classes), listing.kind, listing.root, stage.name,
        )
    checker = SourceChecker(sources, seed=config.seed)  # each source's stamp, right after listing
    min_bytes = max(s.max_item_bytes for s in sources)
    budget = CacheBudget(config.cache_budget_dir) if config.cache_budget_dir is not None else None
    cache_size, arena = _sized_arena(config, sources, min_bytes, budget)
    pool: DecodePool | None = None
    try:
        pool = DecodePool(
            PoolConfig(num_workers=config.num_workers, decode_timeout_s=config.decode_timeout_s),
            str(arena.path), specs,
        )
        registry = Registry(
            sources, arena.size_bytes, pool,
            RegistryConfig(
                lookahead_batches=config.lookahead_batches, lease_s=config.lease_s,
                retry_failed_s=config.retry_failed_s, max_jobs=config.max_jobs,
                rank_attach_timeout_s=config.rank_attach_timeout_s,
                deadline_pacing=config.pacing == "deadline", plan_horizon=config.plan_horizon,
                max_hold_s=config.max_hold_s, idle_exit_s=config.idle_exit_s,
            ),
        )
        return asyncio.run(_serve(config, address, arena, pool, registry, [len(s.listing.paths) for s in sources],
                                  checker, cache_size, bound_socket))
    finally:
        if pool is not None:
            pool.close()
        arena.close()
        arena.unlink()
        if budget is not None:
            budget.release()
        if sock is not None:
            _remove_own_socket(sock, bound_socket)
        logger.info("joaderd stopped; removed %s", arena.path)


def _sized_arena(config: ServerConfig, sources: list[Source], min_bytes: int,
                 budget: CacheBudget | None) -> tuple[CacheSize, Arena]:
    """The arena, sized (`_cache_size`) and allocated; with a budget, both under its lock, and
    recorded in its ledger before the lock is let go (server/cache_budget.py)."""
    if budget is None:
        cache_size = _cache_size(config, sources, min_bytes)
        return cache_size, Arena.create(cache_size.size_bytes, min_bytes)
    with budget.claim() as claim:
        cache_size = _cache_size(config, sources, min_bytes, claim)
        arena = Arena.create(cache_size.size_bytes, min_bytes)
        what = ", ".join(f"{s.name} ({s.stage.name})" for s in sources)
        claim.record(arena.size_bytes, str(arena.path), f"{what} at {resolve_address(config.listen)}")
    return cache_size, arena


def _cache_size(config: ServerConfig, sources: list[Source], min_bytes: int,
                claim: BudgetClaim | None = None) -> CacheSize:
    """The arena's size: `--cache-size` as given, or chosen from the sources (`auto`, logged);
    `claim`: the live other servers of the budget (`--cache-budget-dir`)."""
    prepared = [PreparedSource(s.name, s.num_items, s.max_item_bytes,
                               s.stage.spec.shape is not None or bound_is_nominal(s)) for s in sources]
    if config.cache_size_bytes is not None:
        return CacheSize(config.cache_size_bytes, prepared_bytes(prepared), "set by --cache-size")
    try:
        shm_free, ram = host_memory()
        shared = None if claim is None else SharedBudget(
            shm_size_bytes(), tuple((h.describe(), h.arena_bytes) for h in claim.others))
    except OSError as error:
        raise CacheSpaceError(
            f"--cache-size auto: cannot read the free space of /dev/shm ({error}); joader needs a "
            "tmpfs such as /dev/shm (Linux); or give --cache-size a size") from None
    choice = auto_cache_size(prepared, shm_free_bytes=shm_free, ram_bytes=ram, min_bytes=min_bytes,
                             ram_what=memory_limit()[1], budget=shared)
    logger.info("--cache-size auto: %s", choice.describe())
    return choice


async def _serve(
    config: ServerConfig,
    address: str,
    arena: Arena,
    pool: DecodePool,
    registry: Registry,
    source_sizes: list[int],
    checker: SourceChecker,
    cache_size: CacheSize,
    bound_socket: list[tuple[int, int]],
) -> int:
    from joader.server.fronts.fronts import Fronts  # grpc only after the fork
    from joader.server.service import (  # grpc only after the fork
        JoaderServicer,
        receive_limit_bytes,
        start_server,
    )

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stopping = threading.Event()  # the same, for the threads

    def fail(reason: str, refuse: bool) -> None:
        if refuse:  # every request answers ServerFailedError until the exit
            registry.fail(reason)
        stopping.set()
        loop.call_soon_threadsafe(stop.set)

    supervisor = Supervisor(fail)
    fault_hooks.arm(os.environ)  # tests only: server/fault_hooks.py
    supervisor.spawn("joaderd-scheduler",
                     lambda: registry.run_scheduler(after_work=lambda: fault_hooks.reached(fault_hooks.SCHEDULER)))
    supervisor.spawn("joaderd-results", lambda: _forward_results(pool, registry, stopping))
    supervisor.spawn("joaderd-sources", lambda: checker.run(registry.source_checked, stopping))
    if config.max_hold_s > 0:
        supervisor.spawn("joaderd-cpu", lambda: cpu_meter.run(registry.job_pids, registry.set_cpu, stopping,
                                                              time.monotonic))
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(signum, stop.set)

    status = StatusView(registry, pool, config, address, str(arena.path), cache_size)
    if config.autoscale:
        supervisor.spawn("joaderd-autoscale", lambda: _autoscale(pool, status.full, config, stopping))
    supervisor.spawn("joaderd-stale", lambda: _remove_stale_later(stopping))
    servicer = JoaderServicer(registry, str(arena.path), status.extra)
    bind_address = address
    if (unix_path := socket_path(address)) is not None:
        prepare_server_socket(unix_path, address)  # checked again; a dead socket goes now
        bind_address = f"unix:{_bind_path(unix_path)}"
    receive_limit = receive_limit_bytes(source_sizes)
    server, port = await start_server(servicer, bind_address, receive_limit)
    registry.serving()  # --idle-exit-s counts from here
    metrics_server = None
    fronts = Fronts(config.num_fronts, socket_path(address), receive_limit, servicer, supervisor.stop_failed)
    status.fronts = fronts
    try:
        await fronts.start()
        servicer.next_address = fronts.next_address
        if config.idle_exit_s > 0:
            supervisor.spawn("joaderd-idle", lambda: _exit_when_idle(registry, config.idle_exit_s, stopping,
                                                                     lambda: loop.call_soon_threadsafe(stop.set)))
        if config.exit_with is not None:
            owner = ProcessRef.parse(config.exit_with)
            supervisor.spawn("joaderd-owner", lambda: _exit_with(owner, stopping,
                                                                 lambda: loop.call_soon_threadsafe(stop.set)))
        sock = socket_path(address)
        if sock is not None:
            bound = _bind_path(sock)
            os.chmod(bound, 0o600)
            st = os.lstat(bound)
            bound_socket.append((st.st_dev, st.st_ino))
            os.replace(bound, sock)  # NOTE [ An exiting joaderd removes only its own files ]
        elif address.rpartition(":")[2] == "0":
            address = f"{address.rpartition(':')[0]}:{port}"  # the port the kernel chose
            status.address = address
        metrics_port = None
        if config.metrics_listen is not None:
            metrics_server, metrics_port = serve_metrics(config.metrics_listen, status.full)
        ready = {
            "address": address,
            "port": port if sock is None else None,
            "arena_path": str(arena.path),
            "pid": os.getpid(),
            "start_ticks": ProcessRef.current().start_ticks,  # with the pid: this very process
            "num_workers": pool.num_workers,
            "metrics_port": metrics_port,
            "version": 1,
        }
        if config.ready_file is not None:
            write_ready_file(config.ready_file, ready)
        logger.info(
            "joaderd ready at %s: cache %s in %s, %d decode workers",
            address, format_size(arena.size_bytes), arena.path, pool.num_workers,
        )
        await stop.wait()
        logger.info("joaderd stopping")
    finally:
        stopping.set()
        checker.poke()  # its wait ends now
        if metrics_server is not None:
            metrics_server.shutdown()
        registry.stop()
        await fronts.stop()
        await server.stop(grace=0.5)
        supervisor.join(timeout_s=5)
        if config.ready_file is not None:
            _remove_own_ready_file(config.ready_file)
    if supervisor.failure is not None:
        logger.error("joaderd stopped after an internal error: %s", supervisor.failure)
        return EXIT_INTERNAL_ERROR
    return 0


# cheap decodes: results gathered up to this long into one filing (NOTE [ Results in batches ])
RESULTS_GATHER_S = 0.005


def _forward_results(pool: DecodePool, registry: Registry, stop: threading.Event) -> None:
    """The results thread: files the pool's finished decodes, whatever is queued at once
    (NOTE [ Filing a batch under one lock ], server/registry/filing.py)."""
    while not stop.is_set():
        results = pool.get_results(timeout_s=0.2, gather_s=RESULTS_GATHER_S)
        if results:
            fault_hooks.reached(fault_hooks.RESULTS)  # tests only: server/fault_hooks.py
            registry.file_results(results)


STALE_SWEEPS_S = (2.0, 10.0, 30.0)  # after start: when the dead server's arena is looked at again


def _remove_stale_later(stopping: threading.Event) -> None:
    """Removes, a few times after start, the arenas of dead servers that were still locked at
    start-up.

    NOTE [ A predecessor's arena outlives its start-up sweep ]
    A joaderd killed -9 leaves its arena, locked until its decode workers notice and exit. A
    replacement started at once (a job's keeper restarts an auto-started server within a
    quarter second) swept /dev/shm at start-up while that lock was still held, and nothing
    looked again: the dead server's whole cache stayed in /dev/shm until the next start."""
    started = time.monotonic()
    for at in STALE_SWEEPS_S:
        if stopping.wait(max(0.0, started + at - time.monotonic())):
            return
        for name in remove_stale_arenas():
            logger.warning("removed %s, left behind by a joaderd that did not exit cleanly", name)


def _exit_when_idle(registry: Registry, idle_exit_s: float, stopping: threading.Event,
                    stop_serving: Callable[[], object]) -> None:
    """`--idle-exit-s`: asks the registry about once a second (server/registry/idle_exit.py) and stops
    joaderd, as SIGTERM does, once it had no job for that long."""
    while not stopping.wait(check_period_s(idle_exit_s)):
        idle_s = registry.exit_if_idle()
        if idle_s is not None:
            logger.info("joaderd: no job for %.1f s (--idle-exit-s); exiting", idle_s)
            stop_serving()
            return


# NOTE [ An exiting joaderd removes only its own files ]
# An auto-started joaderd that exits closes its listener first and then takes up to seconds to
# shut down. A job starting meanwhile finds the socket refusing and starts a successor, which
# removes the dead socket, binds the same path and writes the same ready file. Removed by path,
# the successor's socket and ready file went with the old server's cleanup: the new server served
# on an unlinked socket nobody could reach, and its starter waited its whole start timeout. So the
# socket goes only if it is still the inode this joaderd bound, and the ready file only if it
# still names this process (tests/integration/test_autostart_races.py). gRPC itself removes the
# path it bound when it stops, so joaderd binds a name of its own (`_bind_path`) and renames the
# socket into place once it is 0600: gRPC's removal then finds nothing, and no client ever sees
# the socket before its mode is set.


def _bind_path(sock: Path) -> Path:
    """Where joaderd binds before renaming the socket to `sock`: short (a socket path holds 107
    bytes) and this process's own."""
    return sock.parent / f".joaderd-{os.getpid()}.sock"


def _remove_own_socket(sock: Path, bound: list[tuple[int, int]]) -> None:
    try:
        st = os.lstat(sock)
    except FileNotFoundError:
        return
    if bound and (st.st_dev, st.st_ino) == bound[0]:
        sock.unlink(missing_ok=True)


def _remove_own_ready_file(ready_file: Path) -> None:
    info = read_ready_file(ready_file)
    if info is not None and info.get("pid") == os.getpid():
        ready_file.unlink(missing_ok=True)


OWNER_CHECK_S = 0.5  # how often --exit-with looks at its process


def _exit_with(owner: ProcessRef, stopping: threading.Event, stop_serving: Callable[[], object]) -> None:
    """`--exit-with`: stops joaderd, as SIGTERM does, once the process it was started for (a
    `joader.serve` driver) has ended, however it ended (NOTE [ A driver's server ends with the
    driver ] in `joader.client.autostart`)."""
    while owner.is_running():
        if stopping.wait(OWNER_CHECK_S):
            return
    logger.info("joaderd: the process it serves for (pid %d, --exit-with) has ended; exiting", owner.pid)
    stop_serving()


def _autoscale(pool: DecodePool, status: Callable[[], dict[str, Any]], config: ServerConfig,
               stop: threading.Event) -> None:
    """`--workers auto`: every period, measure (joader.server.autoscale) and resize the pool."""
    scaler = Autoscaler(AutoscaleConfig(min_workers=1, max_workers=config.max_workers), workers=pool.num_workers)
    meter = PeriodMeter()
    while not stop.wait(scaler.config.period_s):
        now = time.monotonic()
        period = meter.measure(now, psutil.cpu_times().idle, status())
        decision = scaler.decide(now, period) if period is not None else None
        logger.debug("autoscale: %s -> %s", period, decision)
        if decision is not None:
            pool.resize(decision[0], reason=decision[1])


if __name__ == "__main__":
    sys.exit(main())
