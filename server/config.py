"""joaderd's settings: one dataclass, filled from a TOML file and then from the command line.

TOML (`--config FILE`), every key optional, command-line flags win:

    listen = "unix:/run/user/1000/joader/joaderd.sock"   # or "127.0.0.1:7070"
    cache_size = "2GiB"
    workers = 2
    lease_s = 10
    lookahead_batches = 4
    image_size = 256           # default S for sources that do not set one
    seed = 0

    [sources.imagenet]
    path = "/data/imagenet/train"
    image_size = 224
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from joader.cache.arena import parse_size
from joader.errors import InvalidArgumentError

DEFAULT_IMAGE_SIZE = 256
DEFAULT_CACHE_SIZE = "1GiB"


@dataclass(frozen=True)
class SourceConfig:
    name: str
    path: Path
    image_size: int = DEFAULT_IMAGE_SIZE


@dataclass(frozen=True)
class ServerConfig:
    sources: tuple[SourceConfig, ...]
    listen: str | None = None  # None: $JOADER_ADDRESS or the per-user socket
    cache_size_bytes: int = parse_size(DEFAULT_CACHE_SIZE)
    num_workers: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))
    lease_s: float = 10.0
    lookahead_batches: int = 4
    seed: int = 0
    log_level: str = "INFO"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="joaderd",
        description="Serve prepared samples of image folders to concurrent training jobs, "
        "decoding each sample once for every job that needs it.",
    )
    parser.add_argument("--config", type=Path, help="a TOML file with the settings below")
    parser.add_argument(
        "--source", action="append", default=[], metavar="NAME=PATH",
        help="serve the ImageFolder tree at PATH as NAME (repeatable)",
    )
    parser.add_argument(
        "--image-size", action="append", default=[], metavar="[NAME=]S",
        help="side S of the prepared square images, for all sources or for NAME (default 256)",
    )
    parser.add_argument(
        "--listen", metavar="ADDRESS",
        help="unix:/path.sock or 127.0.0.1:PORT (default: $JOADER_ADDRESS, else a per-user socket)",
    )
    parser.add_argument("--cache-size", metavar="BYTES", help=f"shared-memory cache (default {DEFAULT_CACHE_SIZE})")
    parser.add_argument("--workers", type=int, help="decode worker processes (default: number of CPUs)")
    parser.add_argument("--lease-s", type=float, help="drop a job after this long without a request (default 10)")
    parser.add_argument("--lookahead-batches", type=int, help="batches prepared ahead per job (default 4)")
    parser.add_argument("--seed", type=int, help="seed of the samplers (default 0)")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    return parser


def load_config(argv: list[str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(argv)
    settings: dict[str, Any] = {}
    sources: dict[str, dict[str, Any]] = {}
    if args.config:
        try:
            data = tomllib.loads(args.config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise InvalidArgumentError(f"cannot read config {args.config}: {error}") from error
        sources = {name: dict(spec) for name, spec in data.pop("sources", {}).items()}
        settings.update(data)
    for spec in args.source:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise InvalidArgumentError(f"--source {spec!r}: expected NAME=PATH, e.g. imagenet=/data/train")
        sources.setdefault(name, {})["path"] = path
    default_size = int(settings.pop("image_size", DEFAULT_IMAGE_SIZE))
    for spec in args.image_size:
        name, sep, size = spec.rpartition("=")
        if not sep:
            default_size = _positive_int(size, "--image-size")
        elif name not in sources:
            raise InvalidArgumentError(f"--image-size {spec!r}: no source named {name!r}")
        else:
            sources[name]["image_size"] = _positive_int(size, "--image-size")
    if not sources:
        raise InvalidArgumentError(
            "joaderd has nothing to serve: give --source NAME=PATH (an ImageFolder tree), "
            "e.g. joaderd --source demo=./demo-data"
        )
    for flag, key in (("listen", "listen"), ("cache_size", "cache_size"), ("workers", "workers"),
                      ("lease_s", "lease_s"), ("lookahead_batches", "lookahead_batches"),
                      ("seed", "seed"), ("log_level", "log_level")):
        value = getattr(args, flag)
        if value is not None:
            settings[key] = value
    source_configs = []
    for name, spec in sources.items():
        if "path" not in spec:
            raise InvalidArgumentError(f"source {name!r} has no path")
        size = _positive_int(spec.get("image_size", default_size), f"image_size of {name!r}")
        source_configs.append(SourceConfig(name, Path(spec["path"]).expanduser(), size))
    config = ServerConfig(
        sources=tuple(source_configs),
        listen=settings.get("listen"),
        cache_size_bytes=parse_size(str(settings.get("cache_size", DEFAULT_CACHE_SIZE))),
        num_workers=_positive_int(settings.get("workers", max(1, os.cpu_count() or 1)), "--workers"),
        lease_s=float(settings.get("lease_s", 10.0)),
        lookahead_batches=_positive_int(settings.get("lookahead_batches", 4), "--lookahead-batches"),
        seed=int(settings.get("seed", 0)),
        log_level=str(settings.get("log_level", "INFO")).upper(),
    )
    if config.lease_s <= 0:
        raise InvalidArgumentError(f"--lease-s must be positive, got {config.lease_s}")
    return config


def _positive_int(value: Any, what: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise InvalidArgumentError(f"{what}: expected a positive integer, got {value!r}")
    return number
