"""joaderd's settings: one dataclass, filled from a TOML file and then from the command line.

TOML (`--config FILE`), every key optional, command-line flags win:

    listen = "unix:/run/user/1000/joader/joaderd.sock"   # or "127.0.0.1:7070"
    allow_remote = false       # true: allow a non-loopback TCP listen (no authentication!)
    cache_size = "2GiB"         # or "auto": the whole prepared dataset, within /dev/shm and RAM
    cache_budget_dir = "/run/user/1000/joader"  # auto sizes share one budget with the servers there
    workers = "auto"           # default: adapt between 1 and the CPUs this process may use; or a fixed count
    fronts = "auto"            # processes serving the jobs' Next calls (taking gRPC off joaderd's core); auto: none below 4 CPUs
    lease_s = 10
    lookahead_batches = 4
    image_size = 256           # default S for sources that do not set one
    seed = 0
    log_level = "INFO"         # DEBUG, INFO, WARNING or ERROR
    retry_failed_s = 60        # a file that failed to decode is tried again after this long
    decode_timeout_s = "auto"  # a decode that takes longer kills its worker; auto: fitted to the data, <= 60
    rank_attach_timeout_s = 60 # a job whose ranks do not all attach within this long ends
    max_jobs = 1024            # jobs attached at once; more are refused
    pacing = "deadline"        # decode by when jobs read, evict by speed; "rounds": the old order
    plan_horizon = 0           # a lagging job plans ahead within this share of the cache; 0: off (default)
    max_hold_s = 0             # on a busy host, rounds wait up to this long for a CPU-bound job behind; 0: never (default)
    epoch_align = "first"      # a late job's first epoch takes a running job's rest first; "off"; "always" (see docs/decisions.md, "Epoch alignment")
    ready_file = "/run/joaderd.ready"   # JSON written once joaderd serves (joader.launch)
    metrics_listen = "127.0.0.1:9400"  # Prometheus /metrics (off by default; loopback unless allow_remote)
    idle_exit_s = 0            # exit after this long with no job attached; 0: never (default)

    decoder = "turbo"          # decoder of the built-in stages: turbo (default) | pil (torchvision's, exactly) | pil-draft

    [sources.imagenet]
    path = "/data/imagenet/train"  # an ImageFolder tree, a .tsv/.csv list, or .tar shards
    stage = "resize"           # center-crop (default) | resize | max-side | "package.module:factory"
    image_size = 224           # S of the built-in stages
    mode = "RGB"               # or "L": grayscale stays one channel
    upscale = false            # keep images smaller than S at their size (default true: enlarged to S, as torchvision)
    exif_transpose = true      # turn images upright by their EXIF orientation (default false, as torchvision)
    decoder = "turbo"          # this source's decoder (default: the top-level one)
    options = { n_mels = 64 }  # passed to a user stage's factory (server config only)

Why so strict: a misspelt key (`cache-size`) that is silently ignored leaves joaderd running
with a default the user thinks they changed, and a wrong type used to surface as a traceback
from deep inside the server. So every unknown key is an error that names the closest valid one,
and every value is checked here, once, with a message that names the key, the expected form and
an example (the checks: `joader.server.config_values`). The same checks serve the flags, whose
types argparse has already converted.

A non-loopback `listen` needs `--allow-remote`: joaderd has no authentication, so anyone who
can reach the port can read the served data; that must be a decision, not a typo.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from joader.address import is_loopback, resolve_address
from joader.cache.arena import parse_size
from joader.errors import InvalidArgumentError
from joader.sampling.dependent import ALIGN_MODES
from joader.server import config_values as values
from joader.server.config_values import LOG_LEVELS
from joader.stages import DECODERS, DEFAULT_DECODER

DEFAULT_IMAGE_SIZE = 256
DEFAULT_STAGE = "center-crop"
MODES = ("RGB", "L")
DEFAULT_CACHE_SIZE = "1GiB"
PACINGS = ("deadline", "rounds")  # joader.server.books.pacing


def default_num_workers() -> int:
    """The CPUs this process may run on (its affinity mask), not the host's count.

    A joaderd pinned by `taskset`, a cgroup cpuset or a container to a few CPUs would otherwise
    start a decode worker per host CPU and have them fight over the few it has.
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class SourceConfig:
    name: str
    path: Path
    image_size: int = DEFAULT_IMAGE_SIZE
    stage: str = DEFAULT_STAGE
    mode: str = "RGB"
    upscale: bool = True  # images smaller than S enlarged to S (torchvision's Resize); False: kept small
    decoder: str = DEFAULT_DECODER
    options: dict[str, Any] = field(default_factory=dict)
    exif_transpose: bool = False  # turn images upright by their EXIF orientation first


@dataclass(frozen=True)
class ServerConfig:
    sources: tuple[SourceConfig, ...]
    listen: str | None = None  # None: $JOADER_ADDRESS or the per-user socket
    # None: --cache-size auto, sized from the sources at start (server/cache_sizing.py)
    cache_size_bytes: int | None = parse_size(DEFAULT_CACHE_SIZE)
    # the ledger of one user's auto-sized servers (server/cache_budget.py); None: this one alone
    cache_budget_dir: Path | None = None
    num_workers: int = field(default_factory=lambda: initial_auto_workers())  # at start (fixed unless autoscale)
    autoscale: bool = True  # --workers auto: the pool adapts (joader.server.autoscale)
    max_workers: int = field(default_factory=default_num_workers)  # autoscale's upper bound
    # Next fronts: gRPC servers in processes of their own (server/fronts/); --fronts auto by default
    num_fronts: int = field(default_factory=lambda: auto_fronts(default_num_workers()))
    lease_s: float = 10.0
    lookahead_batches: int = 4
    seed: int = 0
    log_level: str = "INFO"
    allow_remote: bool = False
    ready_file: Path | None = None
    retry_failed_s: float = 60.0
    decode_timeout_s: float | None = None  # None: auto (joader.server.pool.timeout)
    rank_attach_timeout_s: float = 60.0
    max_jobs: int = 1024
    pacing: str = "deadline"
    epoch_align: str = "first"
    plan_horizon: float = 0.0  # NOTE [ Planning a lagging job ahead ] in in_step.py
    max_hold_s: float = 0.0  # NOTE [ A leader waits only where it costs the sweep nothing ] in in_step.py
    metrics_listen: str | None = None  # HOST:PORT of Prometheus /metrics; None: off
    idle_exit_s: float = 0.0  # exit after this long with no job attached (server/registry/idle_exit.py); 0: never
    exit_with: str | None = None  # PID:START_TICKS of a process joaderd exits with (a `joader.serve` driver)


def auto_fronts(cpus: int) -> int:
    """`--fronts auto` (NOTE [ Next fronts ]): none below 4 CPUs (a front would take a core from
    the decoders and the jobs), then one per 16 CPUs, at most 4."""
    return 0 if cpus < 4 else min(4, 1 + cpus // 16)


def initial_auto_workers() -> int:
    """`--workers auto` starts with half the CPUs it may use (at least one) and adapts."""
    return max(1, (default_num_workers() + 1) // 2)


@dataclass(frozen=True)
class _Key:
    """One setting: its flag, its check, and an example value as TOML writes it."""

    flag: str
    check: values.Check
    example: str

    def cli_example(self) -> str:
        if self.example == "true":
            return self.flag
        return self.flag + " " + self.example.strip('"')


_KEYS: dict[str, _Key] = {
    "listen": _Key("--listen", values.string, '"127.0.0.1:7070"'),
    "allow_remote": _Key("--allow-remote", values.boolean, "true"),
    "cache_size": _Key("--cache-size", values.cache_size, '"2GiB"'),
    "cache_budget_dir": _Key("--cache-budget-dir", values.path, '"/run/user/1000/joader"'),
    "workers": _Key("--workers", values.workers, '"auto"'),
    "fronts": _Key("--fronts", values.fronts, '"auto"'),
    "lease_s": _Key("--lease-s", values.positive_seconds, "10"),
    "lookahead_batches": _Key("--lookahead-batches", values.positive_int, "4"),
    "image_size": _Key("--image-size", values.positive_int, "256"),
    "seed": _Key("--seed", values.non_negative_int, "0"),
    "log_level": _Key("--log-level", values.log_level, '"INFO"'),
    "retry_failed_s": _Key("--retry-failed-s", values.non_negative_seconds, "60"),
    "decode_timeout_s": _Key("--decode-timeout-s", values.timeout_seconds, '"auto"'),
    "rank_attach_timeout_s": _Key("--rank-attach-timeout-s", values.positive_seconds, "60"),
    "max_jobs": _Key("--max-jobs", values.positive_int, "1024"),
    "pacing": _Key("--pacing", lambda v, w, e: values.choice(v, w, e, PACINGS), '"deadline"'),
    "epoch_align": _Key("--epoch-align", lambda v, w, e: values.choice(v, w, e, ALIGN_MODES), '"first"'),
    "plan_horizon": _Key("--plan-horizon", values.fraction, "0.5"),
    "max_hold_s": _Key("--max-hold-s", values.non_negative_seconds, "1"),
    "ready_file": _Key("--ready-file", values.path, '"/run/user/1000/joaderd.ready"'),
    "metrics_listen": _Key("--metrics-listen", values.string, '"127.0.0.1:9400"'),
    "idle_exit_s": _Key("--idle-exit-s", values.non_negative_seconds, "600"),
    "exit_with": _Key("--exit-with", values.process_ref, '"4242:183456"'),
}
_KEYS["decoder"] = _Key("--decoder", lambda v, w, e: values.choice(v, w, e, DECODERS), '"turbo"')
_TOML_KEYS = (*_KEYS, "sources")
_SOURCE_KEYS = {
    "path": _Key("--source", values.string, '"/data/train"'),
    "image_size": _KEYS["image_size"],
    "stage": _Key("--stage", values.string, '"resize"'),
    "mode": _Key("--mode", lambda v, w, e: values.choice(v, w, e, MODES), '"L"'),
    "upscale": _Key("--no-upscale", values.boolean, "false"),
    "exif_transpose": _Key("--exif-transpose", values.boolean, "true"),
    "decoder": _KEYS["decoder"],
    "options": _Key("options", values.table, "{ n_mels = 64 }"),
}



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="joaderd",
        description="Serve prepared samples (image folders, lists, tar shards) to concurrent "
        "training jobs, preparing each sample once for every job that needs it.",
    )
    add = parser.add_argument
    add("--config", type=Path, help="a TOML file with the settings below")
    add("--source", action="append", default=[], metavar="NAME=PATH",
        help="serve PATH as NAME (repeatable): an ImageFolder tree, a .tsv/.csv list of "
        "path<TAB>label lines, or a folder (or glob) of .tar shards")
    add("--image-size", action="append", default=[], metavar="[NAME=]S",
        help="S of the built-in stages, for all sources or for NAME (default 256)")
    add("--stage", action="append", default=[], metavar="[NAME=]STAGE[:S]",
        help="the shared stage, for all sources or NAME: center-crop (default), resize, max-side, "
        "or package.module:factory; e.g. --stage imagenet=resize:256")
    add("--mode", action="append", default=[], metavar="[NAME=]MODE",
        help="RGB (default) or L (grayscale stays one channel), for all sources or NAME")
    add("--no-upscale", action="append", default=[], metavar="NAME",
        help="serve NAME's images smaller than S at their own size (default: enlarged to S, as "
        "torchvision's Resize; center-crop items are then all S x S); max-side never enlarges")
    add("--upscale", action="append", default=[], metavar="NAME",
        help="enlarge NAME's images smaller than S to S: the default, accepted for older scripts")
    add("--exif-transpose", action="append", default=[], metavar="NAME",
        help="turn NAME's images upright by their EXIF orientation before resizing (default: "
        "not applied, as torchvision's ImageFolder)")
    add("--decoder", choices=DECODERS,
        help="the built-in stages' decoder: pil (torchvision's ImageFolder + Resize + CenterCrop, bit "
        "for bit), pil-draft (Pillow with JPEG DCT scaling: faster, up to tens of grey levels off) or "
        f"turbo (simplejpeg + OpenCV: fastest, about a grey level off on average) (default {DEFAULT_DECODER})")
    add("--listen", metavar="ADDRESS",
        help="unix:/path.sock or 127.0.0.1:PORT (default: $JOADER_ADDRESS, else a per-user socket)")
    add("--allow-remote", action="store_true", default=None,
        help="allow --listen on a non-loopback address; joaderd has NO authentication")
    add("--cache-size", metavar="BYTES|auto",
        help=f"shared-memory cache (default {DEFAULT_CACHE_SIZE}); auto: the whole prepared dataset, "
             "at most half of /dev/shm's free space and a quarter of the RAM (or the cgroup's limit)")
    add("--cache-budget-dir", metavar="DIR",
        help="with --cache-size auto: share one budget with the other servers that name DIR (a "
             "directory of yours, 0700; jobs' auto-started servers use their socket directory): all of "
             "them together hold at most half of /dev/shm's size and a quarter of the RAM; each takes "
             "its whole prepared dataset if it fits in what the others left, else half of that")
    add("--workers", metavar="N|auto",
        help="decode worker processes: auto (default) starts with half the CPUs this process may "
             "use and adapts between 1 and all of them, by the jobs' stalls and the host's idle CPU; "
             "N fixes the count")
    add("--fronts", metavar="N|auto",
        help="processes that serve the jobs' Next calls beside joaderd, taking gRPC's work off its "
             "one core: auto (default) none below 4 CPUs, then one per 16 CPUs, at most 4; 0: "
             "joaderd serves every call itself")
    add("--lease-s", type=float, help="drop a job after this long without a request (default 10)")
    add("--lookahead-batches", type=int, help="batches prepared ahead per job (default 4)")
    add("--seed", type=int, help="seed of the jobs that do not give their own (default 0)")
    add("--log-level", help=f"{', '.join(LOG_LEVELS)} (default INFO)")
    add("--retry-failed-s", type=float, metavar="S",
        help="retry a file that failed to decode at its next use after S seconds (default 60)")
    add("--decode-timeout-s", type=values.seconds_or_auto, metavar="S|auto",
        help="kill and replace a decode worker stuck on one file for S seconds; a file that does it "
             "twice is quarantined until it changes on disk (default auto: max(2 s, 20 x the p99 "
             "of the measured decode times), at most 60 s)")
    add("--rank-attach-timeout-s", type=float, metavar="S",
        help="end a job whose ranks do not all attach within S seconds of its first (default 60)")
    add("--max-jobs", type=int, help="jobs attached at once; more are refused (default 1024)")
    add("--pacing", choices=PACINGS,
        help="deadline (default): decode what jobs read soonest first and evict what they read "
             "last (RefCnt weighted by speed); rounds: decode in round order, plain RefCnt")
    add("--epoch-align", choices=ALIGN_MODES,
        help="first (default): a job whose first epoch starts while another job on the same "
             "dataset is mid-epoch takes that job's rest first, and shares it; always: at every "
             "epoch (shares every round, but a late job takes the same half first every epoch); off")
    add("--plan-horizon", type=float, metavar="F",
        help="a job that lags the others on its source keeps taking part in their rounds while "
             "its queue fits in this share of the cache and the cache can keep the items "
             "between its reads and theirs, e.g. 0.5 (default 0: only within two lookaheads; "
             "see the README)")
    add("--max-hold-s", type=float, metavar="S",
        help="on a host whose cores are all busy, a round waits up to S seconds for a CPU-bound "
             "job of about the same speed that fell behind, so the jobs stay in step and share "
             "(default 0: never; see the README)")
    add("--ready-file", metavar="PATH",
        help="once serving, write JSON there: address, port, arena_path, pid, num_workers, metrics_port")
    add("--metrics-listen", metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (off by default; a loopback "
             "address unless --allow-remote)")
    add("--idle-exit-s", type=float, metavar="S",
        help="exit (as on SIGTERM) once no job has been attached for S seconds, counted from the "
             "start or from when the last job left (default 0: never)")
    add("--exit-with", metavar="PID:START_TICKS",
        help="exit (as on SIGTERM) once that process (its pid, and its start in clock ticks after boot) has "
             "ended: `joader.serve` ties the server it starts to its driver")
    return parser


def load_config(argv: list[str] | None = None) -> ServerConfig:
    """The settings from `argv` (and the TOML file it names); InvalidArgumentError if wrong."""
    args = build_parser().parse_args(argv)
    settings: dict[str, Any] = {}
    sources: dict[str, dict[str, Any]] = {}
    if args.config:
        settings, sources = _read_toml(args.config)
    for key, spec in _KEYS.items():
        value = getattr(args, key, None)
        if value is not None and key not in ("image_size", "decoder"):
            settings[key] = spec.check(value, spec.flag, spec.cli_example())
    _add_cli_sources(args.source, sources)
    default_size = _apply_image_sizes(args.image_size, settings.pop("image_size", DEFAULT_IMAGE_SIZE), sources)
    defaults = {"image_size": default_size, "decoder": args.decoder or settings.pop("decoder", DEFAULT_DECODER)}
    settings.pop("decoder", None)
    defaults.update(_apply_per_source(args.stage, "--stage", sources, _stage_value))
    defaults.update(_apply_per_source(args.mode, "--mode", sources, _mode_value))
    _apply_source_switches(args, sources)
    config = ServerConfig(
        sources=_source_configs(sources, defaults),
        listen=settings.get("listen"),
        cache_size_bytes=_cache_bytes(settings.get("cache_size", DEFAULT_CACHE_SIZE)),
        **_worker_settings(settings.get("workers", "auto")),
        **_front_settings(settings.get("fronts", "auto")),
        **{k: settings[k] for k in _PLAIN_FIELDS if k in settings},
    )
    _check_listen(config)
    return config


def _cache_bytes(cache_size: int | str) -> int | None:
    return None if cache_size == "auto" else parse_size(cache_size)


def _front_settings(fronts: int | str) -> dict[str, Any]:
    return {"num_fronts": auto_fronts(default_num_workers()) if fronts == "auto" else fronts}


def _worker_settings(workers: int | str) -> dict[str, Any]:
    if workers == "auto":
        return {"num_workers": initial_auto_workers(), "autoscale": True, "max_workers": default_num_workers()}
    return {"num_workers": workers, "autoscale": False, "max_workers": workers}


# Settings whose ServerConfig field has the same name as the key.
_PLAIN_FIELDS = ("cache_budget_dir", "lease_s", "lookahead_batches", "seed", "log_level", "allow_remote",
                 "ready_file", "retry_failed_s", "decode_timeout_s", "rank_attach_timeout_s", "max_jobs",
                 "pacing", "epoch_align", "plan_horizon", "max_hold_s", "metrics_listen", "idle_exit_s",
                 "exit_with")


def _read_toml(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The checked top-level settings and the `[sources.NAME]` tables of a config file."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise InvalidArgumentError(
            f"cannot read config {path}: {error}; fix the file, or leave out --config"
        ) from error
    _refuse_unknown(data, _TOML_KEYS, f"in {path}")
    settings = {}
    for key, value in data.items():
        if key != "sources":
            spec = _KEYS[key]
            settings[key] = spec.check(value, f"{key} in {path}", f"{key} = {spec.example}")
    return settings, _toml_sources(data.get("sources", {}), path)


def _toml_sources(tables: Any, path: Path) -> dict[str, dict[str, Any]]:
    example = '[sources.imagenet] with path = "/data/imagenet/train"'
    if not isinstance(tables, dict):
        raise values.fail(f"sources in {path}", "tables [sources.NAME]", tables, example)
    sources = {}
    for name, table in tables.items():
        where = f"[sources.{name}] in {path}"
        if not isinstance(table, dict):
            raise values.fail(where, "a table with path (and stage, image_size, mode, ...)", table, example)
        _refuse_unknown(table, tuple(_SOURCE_KEYS), f"in {where}")
        sources[name] = {
            key: _SOURCE_KEYS[key].check(value, f"{key} of {where}", f"{key} = {_SOURCE_KEYS[key].example}")
            for key, value in table.items()
        }
    return sources


def _refuse_unknown(table: dict[str, Any], valid: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(valid)}"
            raise InvalidArgumentError(f"unknown key {key!r} {where}; {hint}")


def _add_cli_sources(specs: list[str], sources: dict[str, dict[str, Any]]) -> None:
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise InvalidArgumentError(f"--source {spec!r}: expected NAME=PATH, e.g. imagenet=/data/train")
        sources.setdefault(name, {})["path"] = path


def _apply_image_sizes(specs: list[str], default_size: int, sources: dict[str, dict[str, Any]]) -> int:
    """Applies `--image-size [NAME=]S` flags; returns the default size for the other sources."""
    for spec in specs:
        name, sep, size = spec.rpartition("=")
        if sep and name not in sources:
            raise InvalidArgumentError(f"--image-size {spec!r}: no source named {name!r}; "
                                       f"known: {', '.join(sources) or 'none'}")
        value = values.positive_int(int(size) if size.strip().isdigit() else size, "--image-size",
                              "--image-size 224 or --image-size NAME=224")
        if sep:
            sources[name]["image_size"] = value
        else:
            default_size = value
    return default_size


def _apply_source_switches(args: argparse.Namespace, sources: dict[str, dict[str, Any]]) -> None:
    """Applies `--upscale NAME`, `--no-upscale NAME` and `--exif-transpose NAME`."""
    switches = (("--upscale", args.upscale, "upscale", True), ("--no-upscale", args.no_upscale, "upscale", False),
                ("--exif-transpose", args.exif_transpose, "exif_transpose", True))
    for flag, names, key, value in switches:
        for name in names:
            if name not in sources:
                raise InvalidArgumentError(f"{flag} {name!r}: no source named {name!r}; known: "
                                           f"{', '.join(sources) or 'none'}; pass a name given to --source")
            sources[name][key] = value
    both = sorted(set(args.upscale) & set(args.no_upscale))
    if both:
        raise InvalidArgumentError(f"--upscale and --no-upscale both name {both[0]!r}; keep one (upscale "
                                   "is the default: --no-upscale alone keeps small images small)")


def _stage_value(text: str) -> dict[str, Any]:
    """`--stage resize:256` -> stage and image_size; `--stage pkg.mod:factory` -> stage."""
    kind, sep, size = text.rpartition(":")
    if sep and size.isdigit() and "." not in kind:
        return {"stage": kind, "image_size": values.positive_int(int(size), "--stage", "--stage resize:256")}
    return {"stage": text}


def _mode_value(text: str) -> dict[str, Any]:
    return {"mode": values.choice(text, "--mode", "--mode L or --mode NAME=L", MODES)}


def _apply_per_source(specs: list[str], flag: str, sources: dict[str, dict[str, Any]],
                      parse: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """Applies `FLAG [NAME=]VALUE` flags; returns the defaults set for all sources."""
    defaults: dict[str, Any] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if sep and name in sources:
            sources[name].update(parse(value))
        elif sep:
            raise InvalidArgumentError(f"{flag} {spec!r}: no source named {name!r}; "
                                       f"known: {', '.join(sources) or 'none'}")
        else:
            defaults.update(parse(spec))
    return defaults


def _source_configs(sources: dict[str, dict[str, Any]], defaults: dict[str, Any]) -> tuple[SourceConfig, ...]:
    if not sources:
        raise InvalidArgumentError(
            "joaderd has nothing to serve: give --source NAME=PATH (an ImageFolder tree, a "
            ".tsv list or a folder of .tar shards), e.g. joaderd --source demo=./demo-data"
        )
    configs = []
    for name, spec in sources.items():
        if "path" not in spec:
            raise InvalidArgumentError(
                f"source {name!r} has no path; add path = \"/data/...\" to [sources.{name}] or "
                f"pass --source {name}=PATH"
            )
        merged = {**defaults, **spec}
        configs.append(SourceConfig(
            name, Path(merged["path"]).expanduser(), merged.get("image_size", DEFAULT_IMAGE_SIZE),
            stage=merged.get("stage", DEFAULT_STAGE), mode=merged.get("mode", "RGB"),
            upscale=merged.get("upscale", True), decoder=merged.get("decoder", DEFAULT_DECODER),
            options=merged.get("options", {}), exif_transpose=merged.get("exif_transpose", False),
        ))
    return tuple(configs)


def _check_listen(config: ServerConfig) -> None:
    """The address must parse, and may reach beyond this host only with allow_remote."""
    where = "the listen address" if config.listen else "$JOADER_ADDRESS"
    try:
        address = resolve_address(config.listen)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{where}: {error}") from None
    if not config.allow_remote and not is_loopback(address):
        raise InvalidArgumentError(
            f"{where} {address} would accept connections from other hosts, and joaderd has no "
            "authentication: anyone who reaches the port could read the served data and attach "
            "jobs. Listen on 127.0.0.1:PORT or a unix: socket, or pass --allow-remote "
            "(allow_remote = true) if that is what you want"
        )
    if config.metrics_listen is not None:
        from joader.server.metrics import split_metrics_listen

        host, _ = split_metrics_listen(config.metrics_listen)
        if not config.allow_remote and not is_loopback(f"{host}:0"):
            raise InvalidArgumentError(
                f"--metrics-listen {config.metrics_listen} would show other hosts joaderd's jobs "
                "and figures. Listen on 127.0.0.1:PORT, or pass --allow-remote "
                "(allow_remote = true) if that is what you want")
