"""`--cache-size auto`: the arena sized from the data, so that a user never has to.

The rule (`auto_cache_size`, pure: every input is an argument):

- want the whole prepared dataset: for each source, its items times the bytes of one prepared
  item (`PreparedSource.item_bytes`: exactly what every item takes for a fixed-size stage, and
  for `center-crop`, whose bound is the size of every image at least S; the stage's bound for a
  variable one; `Source.max_item_bytes` in every case), each rounded up to the allocator's
  64-byte units, plus a margin of 1/16 (NOTE [ The margin of an auto cache ]);
- at most half of what the shared-memory filesystem can hold now (`shm_free_bytes`): the arena is
  allocated in full at start (`posix_fallocate`), and DataLoader workers make their batches in
  the same /dev/shm (a full one is `SharedMemoryFullError` in the training process);
- at most a quarter of the host's RAM (`ram_bytes`): tmpfs pages are RAM that the training
  processes, their workers and the page cache of the source files also need;
- at least what the arena takes (`min_bytes`: one item of the largest source): below that
  joaderd cannot serve at all. When the caps are below it, the arena is tried at that size and
  its allocation names the fix if /dev/shm cannot hold it.

The explicit default (`--cache-size 1GiB`) stays what a plain `joaderd` gets; "auto" is opt-in
(a client that starts joaderd for itself passes it). `host_memory`, `shm_size_bytes` and
`memory_limit` are the impure part: what /dev/shm and the host (or this process's cgroup) have now.

With a shared budget (`--cache-budget-dir`, what auto-started servers get: `SharedBudget`, the
ledger in server/cache_budget.py) the rule is the same but for one cap, NOTE [ One budget for
all of a user's auto-started servers ]:

- all of them together: at most half of /dev/shm's whole size and a quarter of the RAM (or of
  this process's cgroup memory limit, whichever is lower): `budget_bytes`;
- one server takes its whole prepared dataset if that fits in what the live others left of the
  budget, and otherwise half of what they left, so the next spec of a sweep still gets a cache;
- still never more than half of what /dev/shm has free now;
- and if what they left is below the floor, it refuses to start (`CacheSpaceError` naming the
  others, the budget and the fix) instead of going over.

NOTE [ One budget for all of a user's auto-started servers ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A budget per server is no budget: each auto-started server (one per spec: image size, stage,
mode) took half of what /dev/shm had free, so N of them took 1 - 2^-N of it (four took 960 of
1,024 MiB, and the training process's DataLoader workers then had no room for a batch). Now the
live ones share one budget. Its shares: half of /dev/shm's size leaves the other half to the
training processes (DataLoader workers make their batches there), and a quarter of the RAM
leaves the rest to the processes, their workers and the page cache of the source files; a
cgroup limit is the RAM a container or a Slurm job really has. Why half of what is left, not all
of it, when the dataset does not fit: the servers cannot know how many specs are still to come,
and an arena cannot shrink once allocated; halving keeps the total below the budget for any
number of servers in any order, and the k-th server still gets 1/2^k of it. A dataset that fits
in what is left is taken whole (a whole-dataset cache is the case that pays most, across epochs).

NOTE [ The margin of an auto cache ]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For a fixed-size stage one copy of each item, each rounded to 64 bytes, is all the arena ever
holds at once when everything fits: decodes in flight are items of the dataset too, padding
copies and later epochs reuse the cached item, and clients copy items out. So the sum is exact,
and the margin is for what it does not count: a file rewritten larger under joaderd (placed
again at its new size), the tails a decode given its bound leaves when it lands smaller
(`center-crop` of a small image), best fit's holes once the cache holds items of several
sources. 1/16 is cheap next to the caps; for a variable stage the bound already overshoots
(`resize` items are given 3 x S x 8S, most take a sixth of that), so "the whole dataset" is then
an upper bound, and the caps usually decide.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from joader.cache.arena import DEFAULT_SHM_DIR, Arena, format_size
from joader.errors import CacheSpaceError

__all__ = [
    "MARGIN_DIVISOR", "RAM_BUDGET_DIVISOR", "SHM_BUDGET_DIVISOR", "CacheSize", "PreparedSource", "SharedBudget",
    "auto_cache_size", "budget_bytes", "cgroup_memory_limit", "host_memory", "memory_limit", "prepared_bytes",
    "shm_size_bytes",
]

MARGIN_DIVISOR = 16  # NOTE [ The margin of an auto cache ]
SHM_SHARE_DIVISOR = 2  # at most half of /dev/shm's free space
RAM_SHARE_DIVISOR = 4  # at most a quarter of the host's RAM
SHM_BUDGET_DIVISOR = 2  # all auto-started servers together: at most half of /dev/shm's size
RAM_BUDGET_DIVISOR = 4  # ... and a quarter of the RAM (or the cgroup's limit)
HOST_RAM = "the host's RAM"
CGROUP_LIMIT = "this cgroup's memory limit"
BUDGET_FIX = ("stop one of them (`joader servers --stop` stops every auto-started joaderd), or give this "
              "one an explicit size (JOADER_CACHE_SIZE=512MiB for auto-started servers, --cache-size for joaderd)")


@dataclass(frozen=True)
class PreparedSource:
    """One source as the sizing sees it: `items` of at most `item_bytes` each once prepared;
    `exact` when (nearly) every item takes exactly that: a fixed-size stage, or a bound that is
    the size of nearly every item (`item_sizes.bound_is_nominal`: `center-crop`)."""

    name: str
    items: int
    item_bytes: int
    exact: bool


@dataclass(frozen=True)
class SharedBudget:
    """The one budget of a user's auto-sized servers as one start sees it (the ledger's reading):
    /dev/shm's whole size, and the live other servers (a description each, and their arena bytes)."""

    shm_size_bytes: int
    others: tuple[tuple[str, int], ...] = ()

    @property
    def others_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.others)


@dataclass(frozen=True)
class CacheSize:
    """The chosen arena size and why (the log line and status's `cache_sizing`)."""

    size_bytes: int
    dataset_bytes: int  # every source prepared, in the allocator's units (no margin)
    reason: str  # the whole prepared dataset, or the cap or floor that decided

    def describe(self) -> str:
        """The log line: "cache 375.0 MiB = the whole prepared dataset (...)"."""
        if self.reason.startswith("the whole"):
            return f"cache {format_size(self.size_bytes)} = {self.reason}"
        return f"cache {format_size(self.size_bytes)}, {self.reason}"


def prepared_bytes(sources: Sequence[PreparedSource]) -> int:
    """Every source's items prepared, each rounded up to the allocator's 64-byte units."""
    return sum(s.items * _round_up(max(1, s.item_bytes), Arena.ALIGN) for s in sources)


def budget_bytes(shm_size_bytes: int, ram_bytes: int, ram_what: str = HOST_RAM) -> tuple[int, str]:
    """What a user's auto-sized servers may hold together, and its description (the shares in
    NOTE [ One budget for all of a user's auto-started servers ]). Pure."""
    by_shm = _round_down(shm_size_bytes // SHM_BUDGET_DIVISOR, Arena.ALIGN)
    by_ram = _round_down(ram_bytes // RAM_BUDGET_DIVISOR, Arena.ALIGN)
    if by_shm <= by_ram:
        return by_shm, f"half of the {format_size(shm_size_bytes)} shared-memory filesystem"
    return by_ram, f"a quarter of {ram_what} ({format_size(ram_bytes)})"


def auto_cache_size(sources: Sequence[PreparedSource], *, shm_free_bytes: int, ram_bytes: int,
                    min_bytes: int, shm_dir: str = DEFAULT_SHM_DIR, ram_what: str = HOST_RAM,
                    budget: SharedBudget | None = None) -> CacheSize:
    """The arena's size for `--cache-size auto` (the module docstring's rule). Pure.

    `budget`: the live other auto-sized servers of this user; raises `CacheSpaceError` when they
    left less than the floor of the budget."""
    dataset = prepared_bytes(sources)
    wanted = _round_up(dataset + -(-dataset // MARGIN_DIVISOR), Arena.ALIGN)
    estimate = "" if all(s.exact for s in sources) else ", at the stage's bound per item"
    whole = (f"the whole prepared dataset ({format_size(dataset)} for {_count(sources)}"
             f"{estimate}, plus 1/{MARGIN_DIVISOR})")
    floor = _round_up(max(min_bytes, Arena.ALIGN), Arena.ALIGN)
    shm_cap = (_round_down(shm_free_bytes // SHM_SHARE_DIVISOR, Arena.ALIGN),
               f"capped at half of {shm_dir} free ({format_size(shm_free_bytes)} free); the prepared dataset "
               f"is {format_size(dataset)}")
    if budget is None:
        caps = [shm_cap, (_round_down(ram_bytes // RAM_SHARE_DIVISOR, Arena.ALIGN),
                          f"capped at a quarter of {ram_what} ({format_size(ram_bytes)}); the prepared "
                          f"dataset is {format_size(dataset)}")]
    else:
        caps = [_budget_cap(budget, wanted, dataset, floor, ram_bytes, ram_what), shm_cap]
        whole += f", within {_budget_text(budget, ram_bytes, ram_what)}"
    size, reason = wanted, whole
    for cap, why in caps:
        if cap < size:
            size, reason = cap, why
    if size < floor:
        size, reason = floor, (
            f"raised to the least the arena takes (one item of {format_size(min_bytes)}) over its caps "
            f"({_caps_text(caps)}); "
            f"free space in {shm_dir} (in Docker raise --shm-size)")
    return CacheSize(size, dataset, reason)


def _budget_cap(budget: SharedBudget, wanted: int, dataset: int, floor: int, ram_bytes: int,
                ram_what: str) -> tuple[int, str]:
    """What the shared budget lets this server take: the whole dataset if it fits in what the
    others left, else half of that; refused below the floor."""
    total, _ = budget_bytes(budget.shm_size_bytes, ram_bytes, ram_what)
    left = max(0, total - budget.others_bytes)
    if left < floor:
        raise CacheSpaceError(
            f"--cache-size auto: the auto-started joaderds of this user already hold "
            f"{format_size(budget.others_bytes)} of {_budget_text(budget, ram_bytes, ram_what)}, "
            f"leaving {format_size(left)}, less than this server's least cache (one item of "
            f"{format_size(floor)}); they are: {'; '.join(f'{what} ({format_size(n)})' for what, n in budget.others)}; "
            f"{BUDGET_FIX}")
    if wanted <= left:
        return left, ""  # the whole dataset fits: this cap never decides
    return _round_down(left // 2, Arena.ALIGN), (
        f"half of what the {_servers(budget)} left of {_budget_text(budget, ram_bytes, ram_what)} "
        f"({format_size(left)} left); the prepared dataset is {format_size(dataset)}")


def _budget_text(budget: SharedBudget, ram_bytes: int, ram_what: str) -> str:
    """ "the 512.0 MiB budget of all auto-started servers (half of ...)" """
    total, why = budget_bytes(budget.shm_size_bytes, ram_bytes, ram_what)
    return f"the {format_size(total)} budget of all auto-started servers ({why})"


def _caps_text(caps: list[tuple[int, str]]) -> str:
    """ "half of /dev/shm free: 1.0 MiB; a quarter of the RAM: 4.0 GiB" from the caps' reasons """
    return "; ".join(f"{why.partition(' (')[0].removeprefix('capped at ')}: {format_size(cap)}"
                     for cap, why in caps if why)


def _servers(budget: SharedBudget) -> str:
    count = len(budget.others)
    if count == 0:
        return "other auto-started servers (none)"
    return f"{count} other auto-started server{'s' if count > 1 else ''} ({format_size(budget.others_bytes)})"


def host_memory(shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> tuple[int, int]:
    """What `auto_cache_size` is capped by, now: (bytes free in `shm_dir`, the memory this process
    may use: the host's RAM or its cgroup's limit, whichever is lower)."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize, memory_limit()[0]


def shm_size_bytes(shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> int:
    """The whole size of the shared-memory filesystem (what the budget is a share of)."""
    st = os.statvfs(shm_dir)
    return st.f_blocks * st.f_frsize


def memory_limit(read: Callable[[str], str | None] | None = None) -> tuple[int, str]:
    """The memory this process may use and what set it: the host's RAM, or the memory limit of
    its cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`, the lowest on the way to the root)
    when that is lower. `read` (tests): a path's text, or None if unreadable."""
    ram = int(psutil.virtual_memory().total)
    limit = cgroup_memory_limit(read or _read_text)
    if limit is not None and limit < ram:
        return limit, CGROUP_LIMIT
    return ram, HOST_RAM


UNLIMITED = 1 << 60  # v1 writes "no limit" as a huge page-aligned number


def cgroup_memory_limit(read: Callable[[str], str | None]) -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors (v2 and v1 hierarchies
    both), or None if none is set or none can be read. Pure but for `read`."""
    memberships = _memberships(read("/proc/self/cgroup") or "")
    limits: list[int] = []
    for line in (read("/proc/self/mountinfo") or "").splitlines():
        mount = _cgroup_mount(line)
        if mount is None:
            continue
        root, mount_point, version = mount
        path = memberships.get(version)
        if path is None:
            continue
        relative = _relative(path, root)
        limits += _limits_up(read, Path(mount_point), relative, "memory.max" if version == "v2"
                             else "memory.limit_in_bytes")
    real = [limit for limit in limits if 0 < limit < UNLIMITED]
    return min(real) if real else None


def _memberships(text: str) -> dict[str, str]:
    """/proc/self/cgroup: {"v2": path} for the unified line, {"v1": path} for the memory one."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            found["v2"] = path
        elif "memory" in controllers.split(","):
            found["v1"] = path
    return found


def _cgroup_mount(line: str) -> tuple[str, str, str] | None:
    """(root, mount point, "v1"|"v2") of a cgroup2 mount or a v1 memory mount in mountinfo."""
    before, _, after = line.partition(" - ")
    fields, tail = before.split(), after.split()
    if len(fields) < 5 or len(tail) < 3:
        return None
    if tail[0] == "cgroup2":
        return fields[3], _unescape(fields[4]), "v2"
    if tail[0] == "cgroup" and "memory" in tail[2].split(","):
        return fields[3], _unescape(fields[4]), "v1"
    return None


def _relative(path: str, root: str) -> str:
    """The cgroup's path below a mount of the hierarchy at `root`; "/" (the mount point itself) if
    the mount does not show it (a cgroup namespace: the mount is the process's own cgroup)."""
    if root == "/":
        return path
    if path == root or path.startswith(root.rstrip("/") + "/"):
        return path[len(root):] or "/"
    return "/"


def _limits_up(read: Callable[[str], str | None], mount_point: Path, relative: str, name: str) -> list[int]:
    """The limits in `name` from the cgroup's directory up to the mount's root."""
    parts = [p for p in relative.split("/") if p and p != ".."]
    limits = []
    for depth in range(len(parts), -1, -1):
        text = read(str(mount_point.joinpath(*parts[:depth], name)))
        if text is not None and text.strip().isdigit():
            limits.append(int(text.strip()))
    return limits


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            return file.read()
    except OSError:
        return None


def _count(sources: Sequence[PreparedSource]) -> str:
    total = sum(s.items for s in sources)
    return f"{total:,} items" + (f" in {len(sources)} sources" if len(sources) > 1 else "")


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _round_down(value: int, unit: int) -> int:
    return value - value % unit
