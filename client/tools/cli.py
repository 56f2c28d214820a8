"""The `joader` command: `status`, `top`, `analyze`, `make-demo-data` and `verify`.

    joader status [--json] [--source NAME | --address ADDRESS]
    joader top [--once] [--interval S] [--source NAME | --address ADDRESS]   (see `joader top --help`)
    joader analyze [--json] [--interval S] [--source NAME | --address ADDRESS]
    joader servers [--json] [--stop]

With neither --source nor --address, status, top and analyze show $JOADER_ADDRESS's joaderd, else
the one joaderd of yours that runs (at the default socket, or started by a job with root=), and
list them when there are several (`joader.client.tools.which_server`).
    joader make-demo-data DIR --items N [--classes K] [--seed S]
    joader verify --job a=0:600 --job b=300:1300 ...   (see `joader verify --help`)

NOTE [ Three checks once called "verify" ]
`joader verify` (`joader.verify`) is a simulation: it runs a job mix through the sampler and tests
its guarantees (exactly once, uniformity, sharing); it reads no data. `JoaderDataset(verify=True)`
(or JOADER_VERIFY=1) is a crc32 check of each item copied out of the arena, called `crc_check`
inside the client (`Connection.check_crcs`, `handoff.Layout.crc_check`). `verify_server` in
`joader.address` is the peer check that a socket is served by this user's own joaderd. The
user-facing names stay; code inside names the check it does.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from joader.address import resolve_address
from joader.errors import JoaderError

SERVER_HELP = ("joaderd's address (default: $JOADER_ADDRESS, else the one joaderd of yours running: at the "
               "default socket, or started by a job with root=)")


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """`--source` and `--address`: which joaderd a tool shows (`joader.client.tools.which_server`)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--source", metavar="NAME", help="show the joaderd serving source NAME (when several of yours run)")
    which.add_argument("--address", help=SERVER_HELP)


def find_address(address: str | None, source: str | None, *, command: str) -> str:
    """The address a tool shows (`joader.client.tools.which_server.find_address`)."""
    from joader.client.tools.which_server import find_address as find

    return find(address, source, command=command)


def fetch_status(address: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """joaderd's status snapshot as a dict (the schema of `joader status --json`)."""
    from joader.client.channel import call
    from joader.proto import joader_pb2

    resolved = resolve_address(address)
    response = call(resolved, "Status", joader_pb2.StatusRequest(), timeout_s=timeout_s)
    return json.loads(response.json)


# C0 controls, DEL and C1 controls: what a terminal may act on (ESC starts a sequence that can
# recolour, retitle or clear it) or that breaks a line of the table (a newline, a tab).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def printable(text: object) -> str:
    """User text (job, source and class names, paths, stages, error reasons) made safe to
    print: control characters become `\\xNN`, so a name cannot act on the terminal, forge a
    line or shift the columns. `joader top` shows it as rich `Text`, never as markup."""
    return str(text).translate(_CONTROLS)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def format_percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def format_status(status: dict[str, Any]) -> str:
    """A human-readable table of a status snapshot."""
    workers = status.get("workers", {})
    lines = [f"joaderd at {printable(status.get('address', '?'))} (pid {status.get('pid', '?')}), "
             f"up {status['uptime_s']:.0f} s, decode workers {workers.get('alive', '?')}/"
             f"{workers.get('configured', '?')} alive"
             + (f" (auto, 1..{workers.get('max', '?')})" if workers.get("mode") == "auto" else "")
             + f", {workers.get('busy', '?')} busy "
             f"(replaced {workers.get('replaced', 0)}, tasks retried {workers.get('tasks_retried', 0)}, "
             f"timed out {workers.get('tasks_timed_out', 0)})"
             + (f"; exits after {status['idle_exit_s']:g} s with no job (--idle-exit-s)"
                if status.get("idle_exit_s") else "")]
    if workers.get("crash_loop"):
        lines.append(f"decode pool: workers keep dying (a crash loop, see joaderd's log); replacements slowed "
                     f"down, next in {workers.get('restart_in_s', 0):g} s; decodes wait meanwhile")
    lines.append("")
    lines.append(f"{'SOURCE':<16} {'ITEMS':>9} {'CLASSES':>8} {'KIND':<11} {'STAGE':<22} {'JOBS':>5}  ROOT")
    for s in status["sources"]:
        lines.append(f"{printable(s['name']):<16} {s['num_items']:>9} {s['num_classes']:>8} "
                     f"{printable(s.get('kind', '?')):<11} {printable(s.get('stage', '?'))[:22]:<22} "
                     f"{s['num_jobs']:>5}  {printable(s['root'])}")
        if s.get("small_items"):
            lines.append(f"  {s['small_items']} images smaller than the stage's size, served at their own size")
    lines.append("")
    if status["jobs"]:
        # as wide as the longest name (default names are command lines: `train.py --lr 0.01`)
        width = min(64, max(24, *(len(printable(j["name"])) for j in status["jobs"])))
        lines.append(f"{'JOB':<{width}} {'SOURCE':<12} {'ITEMS':>8} {'RANKS':>5} {'ORDER':<11} {'EPOCH':>6} {'PROGRESS':>13} "
                     f"{'SAMPLES/S':>9} {'STALL':>6} {'DELIVERED':>10}")
        for j in status["jobs"]:
            ranks = f"{j.get('ranks_attached', 1)}/{j.get('world_size', 1)}"
            progress = f"{j['epoch_delivered']}/{j['epoch_items']}" if j["epoch"] else "not started"
            lines.append(f"{printable(j['name'])[:width]:<{width}} {printable(j['source'])[:12]:<12} {j['num_items']:>8} {ranks:>5} "
                         f"{printable(j.get('order', 'shared'))[:11]:<11} {j['epoch']:>6} {progress:>13} {_number(j.get('samples_per_s')):>9} "
                         f"{format_percent((j.get('stall') or {}).get('fraction')):>6} {j['items_delivered']:>10}")
        lines.append("  ORDER: shared (correlated with the other jobs' orders, to share decodes) or "
                     "independent (its own order); EPOCH: the epoch the job reads now; STALL: the share of its training loop's time spent "
                     "waiting for data in that epoch (reported by a reader in the training process; - with "
                     "DataLoader workers)")
    elif status.get("idle_s") is not None:
        lines.append(f"no jobs for {status['idle_s']:.0f} s")
    else:
        lines.append("no jobs")
    pairs = [p for p in status.get("sharing_pairs", []) if p.get("rounds") and p.get("live", True)]
    if pairs:
        lines.append("")
        shown = [f"{printable(p['name_a'])[:64]} + {printable(p['name_b'])[:64]}" for p in pairs[:10]]
        width = max(46, *(len(pair) for pair in shown))  # whole names, as in the JOB column
        lines.append(f"{'SHARING (pairs of jobs)':<{width}} {'ROUNDS':>8} {'SHARED':>8} {'BOUND':>6}")
        for pair, p in zip(shown, pairs, strict=False):
            lines.append(f"{pair:<{width}} {p['rounds']:>8} {p['rate']:>8.0%} {p['bound']:>6.0%}")
    c = status["cache"]
    lookups, ahead = c["lookups"], c["lookahead"]
    lines.append("")
    lines.append(
        f"cache: {format_bytes(c['used_bytes'])} of {format_bytes(c['capacity_bytes'])} used, {c['items']} items "
        f"({c['pinned_items']} pinned), evictions {c['evictions']}; hit rate {format_percent(c['hit_rate'])} "
        f"(hits {lookups['hits']}, joined a decode {lookups['joined_decode']}, misses {lookups['misses']}; "
        f"lookahead for next epochs: hits {ahead['hits']}, misses {ahead['misses']})"
    )
    if "largest_free_bytes" in c:
        lines.append(
            f"       items hold {format_bytes(c['items_bytes'])}; free {format_bytes(c['free_bytes'])}, largest "
            f"free block {format_bytes(c['largest_free_bytes'])} (fragmentation {c['fragmentation']:.0%})"
        )
    sizing = status.get("cache_sizing") or {}
    if sizing.get("mode") == "auto":
        lines.append(f"       sized by --cache-size auto: {printable(str(sizing.get('reason', '?')))}")
    d = status["decodes"]
    lines.append(
        f"decodes: {status['items_decoded']} done, {d['in_flight']} in flight, {d['failures']} failed "
        f"({status['items_failed']} items failing now, {d['retried']} retried), {d['cancelled']} cancelled"
    )
    sharing = status["sharing"]
    lines.append(
        f"delivered {status['items_delivered']}: sharing within epochs {_number(sharing['within_epoch'])} jobs "
        f"per decode, cross-epoch reuse {_number(sharing['cross_epoch_reuse'])} per decode"
    )
    for f in status.get("failed", [])[:10]:
        lines.append(f"  failed: {printable(f['source'])}/{printable(f['path'])}: {printable(f['reason'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="joader", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_status = sub.add_parser("status", help="show joaderd's sources, jobs and cache")
    p_status.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    add_server_options(p_status)
    p_servers = sub.add_parser("servers", help="list the joaderds jobs started themselves (root=), or stop them")
    p_servers.add_argument("--json", action="store_true")
    p_servers.add_argument("--stop", action="store_true", help="stop every one of them")
    p_demo = sub.add_parser("make-demo-data", help="write an ImageNet-like folder of JPEGs")
    p_demo.add_argument("dir")
    p_demo.add_argument("--items", type=int, required=True)
    p_demo.add_argument("--classes", type=int, default=10)
    p_demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("verify", help="simulate a job mix and test the sampler's guarantees", add_help=False)
    sub.add_parser("top", help="a live view of joaderd's jobs, decode workers and cache", add_help=False)
    sub.add_parser("analyze", help="each job's data stall, and what more decode workers or cache would buy",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "verify":
            # the sampling simulation (NOTE [ Three checks once called "verify" ])
            from joader.verify import main as simulate_sampling

            return simulate_sampling(rest)
        if args.command == "top":
            from joader.client.tools.top import main as top_main

            return top_main(rest)
        if args.command == "analyze":
            from joader.client.tools.analyze import main as analyze_main

            return analyze_main(rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "status":
            status = fetch_status(find_address(args.address, args.source, command="status"))
            print(json.dumps(status, indent=2) if args.json else format_status(status))
            return 0
        if args.command == "servers":
            return _servers(args.json, args.stop)
        from joader.client.tools.demo_data import make_demo_data

        make_demo_data(args.dir, args.items, num_classes=args.classes, seed=args.seed, progress=True)
        return 0
    except (JoaderError, ConnectionError, TimeoutError) as error:
        print(f"joader: {error}", file=sys.stderr)
        return 1


def _servers(as_json: bool, stop: bool) -> int:
    from joader.client.autostart import running_servers, stop_servers

    servers = stop_servers() if stop else running_servers()
    if as_json:
        print(json.dumps(servers, indent=2))
        return 0
    if not servers:
        print("no auto-started joaderd is running (jobs with root= start one)")
        return 0
    for server in servers:
        stage = ", ".join(f"{k}={server[k]}" for k in ("image_size", "mode", "stage") if server.get(k))
        print(f"{'stopped' if stop else 'serving'} {server.get('source', '?')} ({server.get('root', '?')}"
              f"{', ' + stage if stage else ''}): pid {server.get('pid')}, {server['address']}, log {server['log']}")
    if stop:
        print("their jobs end with an error that says so, and no job starts them again; a job started "
              "from now on starts a new one")
    else:
        print("joader status --source NAME shows one; joader servers --stop stops them all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
