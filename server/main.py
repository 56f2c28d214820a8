"""`joaderd`: the entry point. Builds the pieces in the one order that is safe, then serves.

Order matters: the decode pool forks its workers before any gRPC object exists (a fork with a
live gRPC channel or server can crash the child), so `joader.server.service`, which imports
grpc, is imported only after the pool has started. Shutdown (SIGTERM, SIGINT or an error)
removes the arena and the socket; a restart after a crash removes the arenas a dead joaderd
left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from joader.address import resolve_address, socket_path
from joader.cache.arena import Arena, remove_stale_arenas
from joader.errors import JoaderError
from joader.server.config import ServerConfig, load_config
from joader.server.decode_pool import DecodePool, SourceSpec
from joader.server.registry import Registry, RegistryConfig, Source
from joader.sources.imagefolder import list_image_folder

logger = logging.getLogger("joader.server")


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
    try:
        return run(config)
    except JoaderError as error:
        logger.error("%s", error)
        return 1


def run(config: ServerConfig, ready: threading.Event | None = None) -> int:
    """Serves until SIGTERM or SIGINT; returns the exit code. `ready` is set once it answers."""
    address = resolve_address(config.listen)
    sock = socket_path(address)
    if sock is not None:
        _prepare_socket(sock, address)
    for name in remove_stale_arenas():
        logger.warning("removed %s, left behind by a joaderd that did not exit cleanly", name)

    sources: list[Source] = []
    specs: list[SourceSpec] = []
    key_base = 0
    for i, source_config in enumerate(config.sources):
        listing = list_image_folder(source_config.path)
        sources.append(Source(source_config.name, listing, source_config.image_size, key_base, config.seed + i))
        specs.append(SourceSpec(str(listing.root), listing.paths, source_config.image_size))
        key_base += len(listing.paths)
        logger.info(
            "source %s: %d items in %d classes at %s, prepared at %dx%d",
            source_config.name, len(listing.paths), len(listing.classes), listing.root,
            source_config.image_size, source_config.image_size,
        )
    slot_bytes = max(s.item_nbytes for s in sources)
    arena = Arena.create(config.cache_size_bytes, slot_bytes)
    pool: DecodePool | None = None
    server: Any = None
    registry: Registry | None = None
    threads: list[threading.Thread] = []
    stop = threading.Event()
    try:
        pool = DecodePool(config.num_workers, str(arena.path), slot_bytes, specs)
        from joader.server.service import JoaderServicer, create_server  # grpc only after the fork

        registry = Registry(
            sources, arena.num_slots, slot_bytes, pool,
            RegistryConfig(lookahead_batches=config.lookahead_batches, lease_s=config.lease_s),
        )
        threads = [
            threading.Thread(target=registry.run_scheduler, name="joaderd-scheduler", daemon=True),
            threading.Thread(target=_forward_results, args=(pool, registry, stop), name="joaderd-results", daemon=True),
        ]
        for thread in threads:
            thread.start()
        extra = {"address": address, "arena_path": str(arena.path), "num_workers": pool.num_workers, "pid": os.getpid()}
        server, _port = create_server(JoaderServicer(registry, str(arena.path), extra), address)
        if sock is not None:
            os.chmod(sock, 0o600)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        logger.info(
            "joaderd ready at %s: cache %d slots of %d bytes in %s, %d decode workers",
            address, arena.num_slots, slot_bytes, arena.path, pool.num_workers,
        )
        if ready is not None:
            ready.set()
        # A signal may land on any thread; the main thread only notices it between bytecodes,
        # so it waits in short slices rather than blocking in one uninterruptible acquire.
        while not stop.wait(0.2):
            pass
        logger.info("joaderd stopping")
        return 0
    finally:
        stop.set()
        if server is not None:
            server.stop(grace=0.5).wait()
        if registry is not None:
            registry.stop()
        for thread in threads:
            thread.join(timeout=5)
        if pool is not None:
            pool.close()
        arena.close()
        arena.unlink()
        if sock is not None and sock.exists():
            sock.unlink()
        logger.info("joaderd stopped; removed %s", arena.path)


def _forward_results(pool: DecodePool, registry: Registry, stop: threading.Event) -> None:
    while not stop.is_set():
        result = pool.get_result(timeout_s=0.2)
        if result is not None:
            registry.file_result(result.task_id, result.ok, result.error, result.decode_s)


def _prepare_socket(path: Path, address: str) -> None:
    """Makes the socket's directory private, and refuses to start beside a live joaderd."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a socket file left by a joaderd that died
        else:
            raise JoaderError(
                f"another joaderd is already listening at {address}; stop it, or start this one "
                "with --listen unix:/other/path.sock (and set JOADER_ADDRESS for its clients)"
            )
        finally:
            probe.close()


if __name__ == "__main__":
    sys.exit(main())
