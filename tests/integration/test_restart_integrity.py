"""joaderd killed -9 and restarted under running jobs, in every client mode: every sample each
job received is checked against a decode made here (pixels and label), and every epoch is
exactly once (`integrity.py`). Counts alone passed while the content was wrong."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from joader.testing.integrity import Findings, check_records, read_records
from tests.support.processes import IMAGE_SIZE, NUM_DEMO_ITEMS, finish, wait_for

pytestmark = pytest.mark.timeout(240)

# name -> (indices, options): every delivery path, on overlapping subsets.
MODES: dict[str, tuple[str, list[str]]] = {
    "plain": ("0:120", []),
    "batched": ("40:160", ["--batched"]),
    "workers": ("0:160:2", ["--workers", "2"]),
    "workers-transform": ("20:140", ["--workers", "2", "--transform"]),
    "handoff": ("0:96", ["--workers", "2", "--batched"]),
    "reseeded": ("30:130", ["--workers", "2", "--transform", "--reseed"]),
}


def _subset(spec: str) -> set[int]:
    return set(range(*map(int, spec.split(":"))))



def _start(server: Any, name: str, indices: str, options: list[str], epochs: int, sleep: float) -> subprocess.Popen[bytes]:
    """Starts a job; its records and stderr go to the first server's directory (a restarted
    joaderd has a directory of its own)."""
    records = server.dir / f"{name}.jsonl"
    command = [sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address,
               "--records", str(records), "--name", name, "--indices", indices, "--epochs", str(epochs),
               "--sleep", str(sleep), *options]
    return subprocess.Popen(command, stderr=open(server.dir / f"{name}.err", "wb"), start_new_session=True)


def _samples(home: Path, name: str, epoch: int | None = None) -> int:
    path = home / f"{name}.jsonl"
    if not path.exists():
        return 0
    return sum(1 for r in read_records(path) if r.get("kind") == "sample" and (epoch is None or r["epoch"] == epoch))


def _kill(server: Any) -> None:
    server.expected_exit_code = -signal.SIGKILL
    server.proc.kill()
    server.proc.wait()


def _check(home: Path, jobs: dict[str, subprocess.Popen[bytes]], subsets: dict[str, set[int]],
           epochs: dict[str, int], expected: dict[int, Any]) -> Findings:
    findings = Findings()
    failed = []
    for name, job in jobs.items():
        code = finish(job, 150)
        if code != 0:
            failed.append(f"{name} exited with {code}:\n{(home / f'{name}.err').read_text()[-3000:]}")
        check_records(read_records(home / f"{name}.jsonl"), expected, subsets[name], epochs[name], name, findings)
    assert not failed and findings.ok, "\n".join(failed) + "\n" + findings.summary()
    return findings


def test_every_mode_gets_the_right_pixels_across_two_restarts(demo_root: Path, start_joaderd: Any,
                                                              expected: dict[int, Any]) -> None:
    """Six jobs, one per delivery mode, a cache of a few batches; joaderd killed -9 twice
    mid-epoch. Before the fix: other items' pixels under the right labels (num_workers=0),
    empty epochs (re-seeded workers), duplicates (workers)."""
    server = start_joaderd({"demo": demo_root}, cache_items=48)
    home = server.dir
    jobs = {name: _start(server, name, indices, options, 3, 0.05) for name, (indices, options) in MODES.items()}
    for restart in range(2):
        wanted = 24 * (restart + 1)
        wait_for(lambda wanted=wanted: all(_samples(home, name) >= wanted for name in jobs), 90,
                 "every job's next batches")
        _kill(server)
        time.sleep(0.5)
        server = start_joaderd.restart(server)
    findings = _check(home, jobs, {n: _subset(i) for n, (i, _) in MODES.items()}, dict.fromkeys(jobs, 3), expected)
    print(findings.summary())


def test_a_restart_at_an_epochs_end_is_survived(demo_root: Path, start_joaderd: Any,
                                                expected: dict[int, Any]) -> None:
    """joaderd killed while a job reads the last batch of its epoch (the acknowledge-only
    call comes next): before the fix, a ConnectionError instead of reconnecting."""
    server = start_joaderd({"demo": demo_root}, cache_items=48)
    home = server.dir
    subsets = {"last-plain": "0:64", "last-workers": "0:64"}
    jobs = {"last-plain": _start(server, "last-plain", "0:64", [], 2, 0.3),
            "last-workers": _start(server, "last-workers", "0:64", ["--workers", "2", "--batched"], 2, 0.3)}
    wait_for(lambda: _samples(home, "last-plain", 1) >= 64 - 8, 90, "the last batch of epoch 1")
    _kill(server)
    time.sleep(0.5)
    server = start_joaderd.restart(server)
    _check(home, jobs, {n: _subset(s) for n, s in subsets.items()}, dict.fromkeys(jobs, 2), expected)


@pytest.mark.parametrize("options", [[], ["--batched"]], ids=["plain", "batched"])
def test_a_restart_after_a_checkpoint_resume_deals_nothing_twice(demo_root: Path, start_joaderd: Any,
                                                                 expected: dict[int, Any], options: list[str]) -> None:
    """Found by the widened chaos soak: a job killed -9 and started again from its checkpoint
    (`load_state_dict`), then joaderd killed -9 mid-epoch. The restarted joaderd resumed the
    epoch from the board, which held only what the new process had received: the checkpoint's
    items were dealt again (80 of an epoch's 120 twice)."""
    server = start_joaderd({"demo": demo_root}, cache_items=48)
    home = server.dir
    state = home / "ckpt.state"
    command = [sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address,
               "--records", str(home / "ckpt.jsonl"), "--name", "ckpt", "--epochs", "2", "--sleep", "0.15",
               "--state", str(state), "--timeout-s", "60", *options]
    job = subprocess.Popen(command, stderr=open(home / "ckpt.err", "wb"), start_new_session=True)
    wait_for(lambda: _samples(home, "ckpt", 1) >= 64 and state.exists(), 90, "the job's checkpoints")
    job.kill()
    job.wait()
    job = subprocess.Popen(command, stderr=open(home / "ckpt.err", "ab"), start_new_session=True)
    resumed_at = _samples(home, "ckpt", 1)  # the records, cut back to the checkpoint
    wait_for(lambda: _samples(home, "ckpt", 1) >= resumed_at + 24, 90, "the resumed job's next batches")
    _kill(server)
    time.sleep(0.5)
    server = start_joaderd.restart(server)
    _check(home, {"ckpt": job}, {"ckpt": set(range(NUM_DEMO_ITEMS))}, {"ckpt": 2}, expected)


def test_a_joaderd_serving_another_source_under_the_name_is_refused(demo_root: Path, start_joaderd: Any,
                                                                     expected: dict[int, Any]) -> None:
    """Restarted with another image size: the job stops with SourceChangedError naming the
    fix; nothing it received has another shape or other pixels."""
    server = start_joaderd({"demo": demo_root}, cache_items=48)
    home = server.dir
    job = _start(server, "changed", f"0:{NUM_DEMO_ITEMS}", [], 2, 0.05)
    wait_for(lambda: _samples(home, "changed") >= 16, 60, "the job's first batches")
    _kill(server)
    server = start_joaderd.restart(server, extra=("--image-size", str(IMAGE_SIZE // 2)))
    code = finish(job, 120)
    err = (home / "changed.err").read_text()
    assert code != 0 and "SourceChangedError" in err and "same --source and stage options" in err, err[-3000:]
    findings = Findings()
    records = read_records(home / "changed.jsonl")
    check_records(records, expected, set(), 0, "changed", findings)
    assert findings.wrong_pixels == 0 and findings.wrong_labels == 0, findings.summary()


@pytest.mark.parametrize("options", [[], ["--workers", "2"]], ids=["plain", "workers"])
def test_a_job_whose_joaderd_died_for_good_says_it_stopped(demo_root: Path, start_joaderd: Any,
                                                           options: list[str]) -> None:
    """Issue 27: trials whose joaderd died waited, then failed with "no joaderd is answering ...
    Start one with joaderd --source", which sends the user to the wrong fix: one ran, and
    stopped. The job must say that joaderd at its address stopped, and where to look."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    home = server.dir
    job = subprocess.Popen(
        [sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address,
         "--records", str(home / "orphan.jsonl"), "--name", "orphan", "--epochs", "3",
         "--sleep", "0.05", "--timeout-s", "5", *options],
        stderr=open(home / "orphan.err", "wb"), start_new_session=True)
    wait_for(lambda: _samples(home, "orphan") >= 16, 90, "the job to read two batches")
    _kill(server)
    assert finish(job, 90) != 0
    err = (home / "orphan.err").read_text()
    assert f"joaderd at {server.address} stopped while job" in err, err[-3000:]
    assert "See joaderd's log" in err and "Start one with" not in err, err[-3000:]
    # Nobody started joaderd again, which would have removed the killed one's arena: as its admin would.
    Path(server.info["arena_path"]).unlink(missing_ok=True)
