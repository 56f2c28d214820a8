"""`joader top`: a live view of one joaderd, refreshed every second; `q` quits.

Each frame is built from two status snapshots (`joader status --json`, docs/status.md) an
interval apart: rates (samples/s, images decoded/s, decode workers' busy share, hit rate,
evictions/s) are differences over that interval, not averages since joaderd started. The host's
CPU comes from psutil. `rich` draws it; it works over ssh in any terminal that shows colour or
not. `--once` prints one frame (two snapshots `--interval` apart) and exits, for scripts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from typing import Any

import psutil
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from joader.client.tools.cli import (
    add_server_options,
    fetch_status,
    find_address,
    format_bytes,
    format_percent,
    printable,
)


def _rate(now: dict[str, Any], before: dict[str, Any] | None, dt: float, *path: str) -> float | None:
    if before is None or dt <= 0:
        return None
    a: Any = now
    b: Any = before
    for key in path:
        a, b = a[key], b[key]
    return (a - b) / dt


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _bar(done: int, total: int, width: int) -> Text:
    """A text progress bar: readable in any terminal and in a captured `--once` frame."""
    filled = round(width * min(1.0, done / total)) if total > 0 else 0
    return Text.assemble(("█" * filled, "green"), ("░" * (width - filled), "dim"))


# NOTE [ What SHARED means ]
# SHARED used to be the share of a job's deliveries that another job had received first (a
# decode it did not pay for). Of four jobs whose every decode served all four, the one that
# paid for most decodes read "SHARED 17%", which reads as "hardly sharing" (issue 38). So SHARED
# now counts both ways: of the images the job received (its first delivery of each copy; a
# later epoch's re-read of a cached copy is neither), the share that another job received too,
# whichever came first (`items_with_others`, server/books/item_cache.py). FROM OTHERS keeps the old
# figure, over the same images: the share served from a decode another job paid for. A server
# that does not report `items_with_others` gets no SHARED column, rather than a wrong one.


def sharing(job: dict[str, Any]) -> tuple[float | None, float | None]:
    """A job's (SHARED, FROM OTHERS) as fractions of the images it received (NOTE [ What
    SHARED means ]); None where it received none, or the server does not count it."""
    received = job["items_delivered"] - job.get("items_reused", 0)
    if received <= 0:
        return None, None
    with_others = job.get("items_with_others")
    shared = None if with_others is None else min(1.0, with_others / received)
    return shared, min(1.0, job.get("items_shared", 0) / received)


def _jobs_table(now: dict[str, Any], before: dict[str, Any] | None, dt: float) -> Table:
    both_ways = any("items_with_others" in job for job in now["jobs"])
    columns = [("JOB", "left"), ("RANKS", "right"), ("EPOCH", "right"), ("PROGRESS", "left"),
               ("SAMPLES/S", "right"), ("STALL", "right"), *([("SHARED", "right")] if both_ways else []),
               ("FROM\nOTHERS", "right"), ("DELIVERED", "right")]
    jobs = Table(title="jobs", title_justify="left", expand=True, pad_edge=False)
    for name, justify in columns:  # headers whole: a long job name is what wraps
        jobs.add_column(name, justify=justify, no_wrap=name != "JOB",  # type: ignore[arg-type]
                        min_width=None if name == "JOB" else max(map(len, name.split("\n"))))
    previous = {j["job_id"]: j for j in (before or {}).get("jobs", [])}
    for job in now["jobs"]:
        old = previous.get(job["job_id"])
        rate = (job["items_delivered"] - old["items_delivered"]) / dt if old is not None and dt > 0 else \
            job.get("samples_per_s")
        bar = _bar(job["epoch_delivered"], job["epoch_items"], 8)
        bar.append(f" {job['epoch_delivered']:,}/{job['epoch_items']:,}", style="dim")
        stall = (job.get("stall") or {}).get("fraction")
        shared, from_others = sharing(job)
        jobs.add_row(  # a job's name is the user's text, never markup ("exp[/data/x]") nor escapes
            Text(printable(job["name"])), f"{job['ranks_attached']}/{job['world_size']}",
            str(job["epoch"]) if job["epoch"] else "-", bar, _number(rate), format_percent(stall),
            *([format_percent(shared)] if both_ways else []), format_percent(from_others),
            f"{job['items_delivered']:,}",
        )
    if not now["jobs"]:
        jobs.add_row("no jobs attached", *[""] * (len(columns) - 1))
    return jobs


def render(now: dict[str, Any], before: dict[str, Any] | None, dt: float, cpu: list[float],
           live: bool = False) -> Group:
    """One frame from two snapshots `dt` seconds apart (`before` None: the first frame)."""
    workers = now.get("workers", {})
    alive = workers.get("alive", 0)
    header = Text.assemble(
        ("joaderd ", "bold"), f"{printable(now.get('address', '?'))} (pid {now.get('pid', '?')}), up "
        f"{now['uptime_s']:.0f} s   host CPU ",
        (f"{sum(cpu) / max(1, len(cpu)):.0f}%", "bold"),
        f" ({' '.join(f'{c:.0f}' for c in cpu)} per core)" + ("   q quits" if live else ""),
    )

    jobs = _jobs_table(now, before, dt)

    decoded_rate = _rate(now, before, dt, "items_decoded")
    busy_rate = _rate(now, before, dt, "decodes", "decode_s")
    pool = Table(title="decode workers", title_justify="left", expand=True, pad_edge=False)
    for name in ("ALIVE", "BUSY", "IMAGES/S", "IN FLIGHT", "FAILED", "REPLACED"):
        pool.add_column(name, justify="right", no_wrap=True)
    pool.add_row(
        f"{alive}/{workers.get('configured', '?')}"
        + (f" (auto, 1..{workers.get('max', '?')})" if workers.get("mode") == "auto" else ""),
        format_percent(busy_rate / alive if busy_rate is not None and alive else None),
        _number(decoded_rate), str(now["decodes"]["in_flight"]), str(now["decodes"]["failures"]),
        str(workers.get("replaced", 0)),
    )

    cache = now["cache"]
    hit_rate = cache["hit_rate"]
    if before is not None:
        found = [cache["lookups"][k] - before["cache"]["lookups"][k] for k in ("hits", "joined_decode", "misses", "failed")]
        if sum(found):
            hit_rate = (found[0] + found[1]) / sum(found)
    table = Table(title="cache", title_justify="left", expand=True, pad_edge=False)
    for name in ("USED", "", "ITEMS", "PINNED", "HIT RATE", "EVICTIONS/S", "EVICTIONS"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_row(
        f"{format_bytes(cache['used_bytes'])} of {format_bytes(cache['capacity_bytes'])}",
        _bar(cache["used_bytes"], cache["capacity_bytes"], 12),
        f"{cache['items']:,}", f"{cache['pinned_items']:,}", format_percent(hit_rate),
        _number(_rate(now, before, dt, "cache", "evictions")), f"{cache['evictions']:,}",
    )
    sharing = now["sharing"]
    footer = Text(
        f"sharing within epochs {_number(sharing['within_epoch'], 2)} jobs per decode, cross-epoch reuse "
        f"{_number(sharing['cross_epoch_reuse'], 2)} per decode; {now['items_decoded']:,} decoded, "
        f"{now['items_delivered']:,} delivered", style="dim")
    parts: list[Any] = [header, jobs, pool, table, footer]
    if workers.get("crash_loop"):
        parts.append(Text(f"decode workers keep dying (a crash loop, see joaderd's log): replacements slowed "
                          f"down, next in {workers.get('restart_in_s', 0):g} s; decodes wait", style="bold red"))
    events = now.get("workers", {}).get("resizes") or []
    if events:
        log = Text("decode pool changes (--workers auto):\n", style="bold")
        for event in events[-5:]:
            log.append(f"  {printable(event)}\n")
        parts.append(log)
    return Group(*parts)


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """stdin in cbreak mode (single keys, no echo) while the view runs, if it is a terminal."""
    if not sys.stdin.isatty():
        yield None
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(fd: int | None, timeout_s: float) -> bool:
    """Waits up to `timeout_s` for a key; True if it was q (or Q, or Ctrl-D)."""
    if fd is None:
        time.sleep(timeout_s)
        return False
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            key = os.read(fd, 1)
            if key in (b"q", b"Q", b"\x04", b""):
                return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="joader top", description=__doc__.split("\n")[0])
    add_server_options(parser)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default 1)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be > 0")
    address = find_address(args.address, args.source, command="top")
    psutil.cpu_percent(percpu=True)  # starts the host CPU measurement
    before = fetch_status(address)
    taken = time.monotonic()
    if args.once:
        time.sleep(args.interval)
        now = fetch_status(address)
        frame = render(now, before, time.monotonic() - taken, psutil.cpu_percent(percpu=True))
        Console(width=max(100, Console().width)).print(frame)
        return 0
    console = Console()
    with _keys() as fd, Live(render(before, None, 0.0, psutil.cpu_percent(percpu=True), live=True), console=console,
                             screen=console.is_terminal, auto_refresh=False) as live:
        while not _quit_pressed(fd, args.interval):
            now = fetch_status(address)
            at = time.monotonic()
            live.update(render(now, before, at - taken, psutil.cpu_percent(percpu=True), live=True), refresh=True)
            before, taken = now, at
    return 0


if __name__ == "__main__":
    sys.exit(main())
