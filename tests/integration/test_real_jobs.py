"""Real training jobs (issue 8): DDP ranks under torchrun, checkpoint and resume (also through
torchdata's StatefulDataLoader), joaderd restarted under running jobs, fixed seeds, and the
DataLoader conventions (`targets`, `len`).

Every test starts a real joaderd; every job is a real process running
`python -m tests.support.real_clients CMD`, which writes a JSON report of the indices it
consumed per epoch (and, with `--progress`, one fsynced line per batch). The pytest process never
opens a gRPC channel nor imports torch.distributed. Each client process and all its descendants
carry a tag in their environment; after each test none may be left (they are killed and the test
fails if one is).
"""

from __future__ import annotations

import math
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from joader.sources.imagefolder import list_image_folder
from tests.support.processes import Client, Clients, wait_for

pytestmark = pytest.mark.timeout(120)

# The one warning a job may print when joaderd goes away (spec: "joaderd at ... went away;
# reconnecting"); any other line saying so is a second warning about the same event.
RECONNECT_WARNING = re.compile(r"joaderd at \S+ went away")


def _subset(spec: str) -> list[int]:
    return list(range(*map(int, spec.split(":"))))


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]  # state, ..., starttime (field 22)


def _descendants(pid: int) -> dict[int, str | None]:
    """pid -> start time of every live descendant of `pid` (joaderd's forker and workers)."""
    found: dict[int, str | None] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found[child] = _start_time(child)
                    todo.append(child)
    return found



def _check_epoch_orders(report: dict[str, Any]) -> None:
    """`ds.epoch_order(e)` gives, for the epochs this process read, what it yielded; a JoaderError
    for the others."""
    orders = report["epoch_orders"]
    assert orders, "ds.epoch_order is missing"
    read = [orders[k]["order"] for k in sorted(orders, key=int) if "order" in orders[k]]
    assert read == report["epochs"], "epoch_order(e) differs from what the epochs yielded"
    refused = [v for v in orders.values() if "order" not in v]
    assert refused and all(v["joader_error"] for v in refused), orders


# ---------------------------------------------------------------------------------------------
# 1. DDP ranks of one job


def _check_ranks(reports: list[dict[str, Any]], subset: list[int], epochs: int, drop_last: bool) -> None:
    world = len(reports)
    n = len(subset)
    per_rank = n // world if drop_last else math.ceil(n / world)
    for rank, report in enumerate(reports):
        assert (report["rank"], report["world_size"]) == (rank, world), {k: report[k] for k in ("rank", "world_size", "len")}
        assert report["len"] == per_rank, f"rank {rank}: len(ds) == {report['len']}, expected {per_rank}"
        assert len(report["epochs"]) == epochs
    for epoch in range(epochs):
        lists = [report["epochs"][epoch] for report in reports]
        counts = [len(items) for items in lists]
        assert counts == [per_rank] * world, f"epoch {epoch}: items per rank {counts}, expected {per_rank} each"
        seen = Counter(i for items in lists for i in items)
        extra = {i: c - 1 for i, c in seen.items() if c > 1}
        assert set(seen) <= set(subset), f"epoch {epoch}: items outside the subset {sorted(set(seen) - set(subset))}"
        if drop_last:
            assert not extra, f"epoch {epoch}: duplicates with drop_last=True: {extra}"
            assert len(seen) == world * per_rank
        else:
            missing = sorted(set(subset) - set(seen))
            assert not missing, f"epoch {epoch}: items no rank got: {missing}"
            # Padding only: each duplicate is an item of this epoch, at most world_size - 1 of them.
            assert sum(extra.values()) == world * per_rank - n <= world - 1, f"epoch {epoch}: duplicates {extra}"


@pytest.mark.parametrize(("workers", "drop_last"), [(0, False), (2, False), (0, True)],
                         ids=["workers0", "workers2", "drop_last"])
def test_torchrun_ranks_split_each_epoch(demo_root: Path, start_joaderd: Any, clients: Clients,
                                         workers: int, drop_last: bool) -> None:
    """Two gloo ranks under torchrun, rank and world size taken from torch.distributed; an
    all_reduce per step, so ranks with different step counts would hang (the gloo timeout and
    ours end that)."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    indices = "20:121"  # 101 items: an odd count, so ranks need padding
    started = time.monotonic()
    run = clients.torchrun("ddp", server, "ddp", "--indices", indices, "--workers", str(workers),
                           "--epochs", "2", "--batch-size", "8", "--dist-timeout-s", "30",
                           *(["--drop-last"] if drop_last else []))
    clients.wait(run, 50)
    print(f"torchrun, 2 ranks, 2 epochs, {workers} workers: {time.monotonic() - started:.1f} s")
    reports = [run.report(rank) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["dist_rank"] == rank and report["dist_world_size"] == 2
        for gathered in report["counts_across_ranks"]:
            assert gathered["min"] == gathered["max"], f"ranks' step counts differ: {report['counts_across_ranks']}"
    _check_ranks(reports, _subset(indices), epochs=2, drop_last=drop_last)


def test_explicit_rank_and_world_size_without_torchrun(demo_root: Path, start_joaderd: Any, clients: Clients) -> None:
    """Two plain processes with rank=/world_size= (no torch.distributed, no torchrun env); they
    meet before closing their datasets, as DDP ranks do. Rank 0 first checks that world_size=2
    without a name (and no torchrun environment) is refused with a message asking for name=."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    indices = "20:121"
    barrier = clients.dir / "barrier"
    barrier.mkdir()
    ranks = [
        clients.start("job", server, f"rank{rank}", "--indices", indices, "--rank", str(rank), "--world-size", "2",
                      "--name", "explicit", "--epochs", "2", "--batch-size", "8", "--finish-barrier", str(barrier),
                      *(["--expect-name-required"] if rank == 0 else []))
        for rank in (0, 1)
    ]
    for proc in ranks:
        clients.wait(proc, 50)
    _check_ranks([proc.report() for proc in ranks], _subset(indices), epochs=2, drop_last=False)


def test_a_rank_that_finishes_first_does_not_end_the_others(demo_root: Path, start_joaderd: Any,
                                                           clients: Clients) -> None:
    """Rank 0 reads its epochs fast and closes its dataset while rank 1 (slower steps) is still
    reading: a clean close of one rank must not remove the job under the others."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    indices = "20:121"
    ranks = [
        clients.start("job", server, f"rank{rank}", "--indices", indices, "--rank", str(rank), "--world-size", "2",
                      "--name", "uneven", "--epochs", "2", "--batch-size", "8",
                      *(["--sleep", "0.15"] if rank == 1 else []))
        for rank in (0, 1)
    ]
    for proc in ranks:
        clients.wait(proc, 50)
    _check_ranks([proc.report() for proc in ranks], _subset(indices), epochs=2, drop_last=False)


def test_a_rank_that_dies_ends_the_job_for_the_others_with_its_rank_named(
        demo_root: Path, start_joaderd: Any, clients: Clients) -> None:
    """Rank 1 is SIGKILLed mid-epoch (it kills itself after its 3rd batch): rank 0's next read
    raises UnknownJobError saying that rank 1's lease ended, instead of waiting forever."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    common = ["--indices", "20:121", "--world-size", "2", "--name", "dies", "--batch-size", "4"]
    survivor = clients.start("job", server, "rank0", *common, "--rank", "0", "--epochs", "3", "--sleep", "0.1")
    victim = clients.start("job", server, "rank1", *common, "--rank", "1", "--epochs", "3",
                           "--save-after", "3", "--state", str(clients.dir / "rank1.state"))
    clients.wait(victim, 40, expect=-signal.SIGKILL)
    code = clients.wait(survivor, 40, expect=None)
    err = survivor.stderr()
    assert code != 0, "rank 0 finished its epochs although rank 1 died"
    assert "UnknownJobError" in err and "rank 1" in err, err[-3000:]
    assert not server.status()["jobs"]


# ---------------------------------------------------------------------------------------------
# 2. Checkpoint, crash, resume


def _crash_after_checkpoint(clients: Clients, server: Any, name: str, *args: str) -> tuple[Client, list[int]]:
    """Runs a job that checkpoints after batch K of its first epoch and SIGKILLs itself; returns
    it and the items it consumed before (its fsynced progress)."""
    first = clients.start("job", server, name, *args)
    clients.wait(first, 40, expect=-signal.SIGKILL)
    assert first.state_path.exists(), first.stderr()
    before = [i for event in first.batches() if event["epoch"] == 0 for i in event["indices"]]
    saved = [e for e in first.events() if e["event"] == "saved"]
    assert len(saved) == 1, first.events()
    parts = saved[0]["parts"]
    assert parts and all(p["version"] == 1 for p in parts), parts
    consumed = [i for p in parts for i in p["consumed"]]
    assert len(consumed) == len(set(consumed)), f"workers' consumed sets overlap: {parts}"
    assert sorted(consumed) == sorted(before), (
        f"the checkpoint's consumed items are not what the loader yielded before it: "
        f"{len(consumed)} in the state, {len(before)} yielded"
    )
    return first, before


def _check_resumed(before: list[int], report: dict[str, Any], subset: list[int]) -> None:
    rest, second = report["epochs"]
    twice = sorted(set(before) & set(rest))
    assert not twice, f"items consumed before the checkpoint and again after it: {twice}"
    assert len(rest) == len(set(rest)), f"the resumed epoch repeats items: {Counter(rest).most_common(3)}"
    missing = sorted(set(subset) - set(before) - set(rest))
    assert not missing, f"the checkpointed epoch never delivered: {missing}"
    assert sorted(before + rest) == subset
    assert sorted(second) == subset, "the pass after the resumed epoch is not a full epoch"


@pytest.mark.parametrize("loader", ["dataset", "stateful"])
def test_resume_after_a_crash_reads_the_rest_of_the_epoch(demo_root: Path, start_joaderd: Any, clients: Clients,
                                                          loader: str) -> None:
    """ds.state_dict() (0 workers), or StatefulDataLoader.state_dict() (2 workers), saved after
    batch 5, then SIGKILL; a new process loads it: the epoch is completed exactly once."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    indices = "10:150"
    opts = (["--loader", "stateful", "--workers", "2"] if loader == "stateful" else ["--workers", "0"])
    started = time.monotonic()
    first, before = _crash_after_checkpoint(clients, server, "first", "--indices", indices, "--batch-size", "8",
                                            "--save-after", "5", "--state", str(clients.dir / "first.state"), *opts)
    assert len(before) == 40
    resumed = clients.start("job", server, "resumed", "--indices", indices, "--batch-size", "8",
                            "--load-state", str(first.state_path), "--epochs", "2", *opts)
    clients.wait(resumed, 40)
    print(f"crash and resume ({loader}): {time.monotonic() - started:.1f} s")
    _check_resumed(before, resumed.report(), _subset(indices))


def test_a_resumed_job_shares_with_a_running_one(demo_root: Path, start_joaderd: Any, clients: Clients) -> None:
    """Job B runs (slow steps) on the same items when the crashed job A resumes: both exactly
    once, and the two share decodes (items decoded < items delivered over their common run)."""
    server = start_joaderd({"demo": demo_root}, cache_items=48)
    indices = "0:160"
    subset = _subset(indices)
    common = ["--indices", indices, "--batch-size", "4"]
    first, before = _crash_after_checkpoint(clients, server, "a1", *common, "--save-after", "10",
                                            "--state", str(clients.dir / "a1.state"))
    assert len(before) == 40
    status_before = server.status()
    b = clients.start("job", server, "b", *common, "--epochs", "3", "--sleep", "0.02")
    wait_for(lambda: b.batches(), 30, "job B's first batch")
    a = clients.start("job", server, "a2", *common, "--load-state", str(first.state_path), "--epochs", "2",
                      "--sleep", "0.02")
    clients.wait(a, 50)
    clients.wait(b, 50)
    status = server.status()
    decoded = status["items_decoded"] - status_before["items_decoded"]
    delivered = status["items_delivered"] - status_before["items_delivered"]
    print(f"resumed A beside B: {delivered} items delivered, {decoded} decoded "
          f"(sharing factor {delivered / max(decoded, 1):.2f})")
    _check_resumed(before, a.report(), subset)
    assert [sorted(e) for e in b.report()["epochs"]] == [subset] * 3
    assert delivered == 3 * len(subset) + 2 * len(subset) - len(before)
    assert decoded < delivered, f"no sharing: {decoded} decoded for {delivered} delivered"


# ---------------------------------------------------------------------------------------------
# 3. joaderd killed and restarted under running jobs


def test_jobs_survive_a_joaderd_restart_on_the_same_address(demo_root: Path, start_joaderd: Any,
                                                             clients: Clients) -> None:
    """kill -9 of joaderd with three jobs mid-epoch, a new joaderd on the same socket 2 s later:
    every job finishes every epoch exactly once, warning once that it reconnected."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    subsets = {"j1": ("0:100", "0"), "j2": ("60:160", "2"), "j3": ("0:160:2", "0")}  # indices, workers
    jobs = {
        name: clients.start("job", server, name, "--indices", indices, "--workers", workers, "--batch-size", "4",
                            "--epochs", "2", "--sleep", "0.25", "--timeout-s", "60")
        for name, (indices, workers) in subsets.items()
    }
    # A step of 0.25 s: j1's 2 epochs take 12.5 s at least, longer than the other jobs' start
    # (torch's import) takes on a loaded machine; at 0.1 s, j1 once finished before j3 read its
    # second batch, and the test could not show anything.
    wait_for(lambda: all(len(job.batches()) >= 2 for job in jobs.values()), 40, "every job's second batch")
    old_children = _descendants(server.proc.pid)
    assert old_children, "joaderd has no forker or decode worker?"
    server.expected_exit_code = -signal.SIGKILL
    print(f"joaderd killed at {time.time():.3f}")
    server.proc.kill()
    server.proc.wait()
    at_kill = {name: job.batches() for name, job in jobs.items()}
    for name in at_kill:
        done = [e for e in jobs[name].events() if e["event"] == "epoch_end"]
        assert len(done) < 2, f"{name} had finished before joaderd was killed: the test is too slow to show anything"
    time.sleep(2.0)
    restarted = start_joaderd.restart(server)
    print(f"joaderd restarted, serving at {time.time():.3f}")
    assert restarted.address == server.address
    assert not Path(server.arena_path).exists(), "the restarted joaderd left the dead server's arena"
    assert Path(restarted.arena_path).exists()
    wait_for(lambda: all(_start_time(pid) != started for pid, started in old_children.items()), 15,
             f"the killed joaderd's children {sorted(old_children)} to exit")
    codes = {name: clients.wait(job, 60, expect=None) for name, job in jobs.items()}
    problems = []
    for name, job in jobs.items():
        err = job.stderr()
        if codes[name] != 0:
            problems.append(f"{name} ({subsets[name][1]} workers) exited with {codes[name]}:\n{err[-5000:]}")
            continue
        subset = _subset(subsets[name][0])
        report = job.report()
        for epoch, items in enumerate(report["epochs"]):
            twice = sorted(i for i, c in Counter(items).items() if c > 1)
            missing = sorted(set(subset) - set(items))
            if twice or missing:
                problems.append(f"{name} epoch {epoch}: twice {twice}, missing {missing}")
        warnings = RECONNECT_WARNING.findall(err)
        if len(warnings) != 1 or "Traceback" in err:
            problems.append(f"{name}: {len(warnings)} warnings that joaderd went away, expected one:\n{err[-4000:]}")
        print(f"{name}: {len(at_kill[name])} batches before the kill; epochs of {[len(e) for e in report['epochs']]}")
    assert not problems, "\n\n".join(problems)
    assert restarted.status()["items_delivered"] > 0
    assert restarted.stop() == 0
    assert not Path(restarted.arena_path).exists()


# ---------------------------------------------------------------------------------------------
# 4. Seed


def test_a_seeded_solo_job_gets_the_same_order_in_every_run(demo_root: Path, start_joaderd: Any,
                                                            clients: Clients) -> None:
    """seed=7 alone on two joaderd runs: the same order in epochs 1 and 2; seed=8 another.

    The second joaderd has another server seed (`--seed`) and serves two other jobs first, so
    neither the server's seed nor its RNG's history may leak into the seeded job's order."""
    indices = "0:100"
    common = ["--indices", indices, "--batch-size", "10", "--epochs", "2"]
    first_server = start_joaderd({"demo": demo_root}, cache_items=64)
    first = clients.start("job", first_server, "seed7-run1", *common, "--seed", "7")
    clients.wait(first, 40)
    assert first_server.stop() == 0
    second_server = start_joaderd({"demo": demo_root}, cache_items=64, extra=["--seed", "5"])
    runs = {}
    for name, seed in [("unseeded", []), ("seed8", ["--seed", "8"]), ("seed7-run2", ["--seed", "7"])]:
        proc = clients.start("job", second_server, name, *common, *seed)
        clients.wait(proc, 40)
        runs[name] = proc.report()
    one, two = first.report(), runs["seed7-run2"]
    for report in (one, two, runs["seed8"], runs["unseeded"]):
        assert [sorted(e) for e in report["epochs"]] == [_subset(indices)] * 2
        _check_epoch_orders(report)
    assert one["seed"] == two["seed"] == 7 and runs["seed8"]["seed"] == 8
    assert isinstance(runs["unseeded"]["seed"], int), "ds.seed is the seed joaderd chose when none was given"
    assert one["epochs"][0] == two["epochs"][0], "seed=7: epoch 1 differs between two joaderd runs"
    assert one["epochs"][1] == two["epochs"][1], "seed=7: epoch 2 differs between two joaderd runs"
    assert one["epochs"][0] != one["epochs"][1], "seed=7: epoch 2 repeats epoch 1's order"
    assert runs["seed8"]["epochs"][0] != one["epochs"][0] and runs["seed8"]["epochs"][1] != one["epochs"][1]


# ---------------------------------------------------------------------------------------------
# 5. DataLoader conventions


def test_targets_and_len_follow_the_dataloader_conventions(demo_root: Path, start_joaderd: Any,
                                                           clients: Clients) -> None:
    """ds.targets are the labels in index order; len(DataLoader) (2 workers) is the number of
    batches each epoch really yields: the workers get whole batches."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    indices = "1:160:3"  # 53 items, 7 batches of 8: workers splitting items, not batches, would make 8
    subset = _subset(indices)
    batch_size = 8
    proc = clients.start("conventions", server, "conv", "--indices", indices, "--batch-size", str(batch_size),
                         "--workers", "2", "--epochs", "2")
    clients.wait(proc, 40)
    report = proc.report()
    listing = list_image_folder(demo_root)
    received = {int(k): v for k, v in report["labels"].items()}
    assert received == {i: int(listing.labels[i]) for i in subset}, "labels differ from the ImageFolder's"
    assert report["len"] == len(subset)
    assert report["targets"] == [received[i] for i in sorted(subset)]
    expected_batches = math.ceil(len(subset) / batch_size)
    assert report["len_loader"] == expected_batches
    for epoch, (items, sizes) in enumerate(zip(report["epochs"], report["batch_sizes"], strict=True)):
        assert sorted(items) == subset, f"epoch {epoch}"
        assert len(sizes) == expected_batches, f"epoch {epoch}: {len(sizes)} batches of {sizes}, len(loader) {expected_batches}"
        assert sum(1 for s in sizes if s != batch_size) <= 1, f"epoch {epoch}: batch sizes {sizes}"
