"""Sweeps as people launch them, with the real packages (Ray Tune, Optuna), a real joaderd and
content checks: every epoch of every trial exactly once (indices, labels and pixels against a
decode made here), each trial's job named so that `joader status` tells the trials apart, and
every trial's job gone once its trial ends, also a trial stopped early, while the sweep goes on.

The sweeps run in their own processes (`tests.support.sweep_trials`, the examples): the pytest
process opens no gRPC channel and starts no Ray driver (it forks decode workers in other tests).
One joaderd serves the whole module, reached through `JOADER_ADDRESS` (Ray's workers get it from
the driver's runtime_env). Each Ray driver starts its own local cluster, `ray.init(num_cpus=2,
include_dashboard=False, log_to_driver=False)`, 3-8 s here: a cluster shared by the module
(`ray start --head --block`) would need Ray's token authentication set up for its drivers
(Ray 2.60 enables it), for two sweeps.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from joader.testing.integrity import check_records, complete_epochs
from tests.integration.conftest import Joaderd
from tests.support.processes import IMAGE_SIZE, NUM_DEMO_ITEMS, ROOT, Clients

pytestmark = pytest.mark.timeout(180)

LEASE_S = 3.0
EPOCHS = 2
TRIALS = "tests.support.sweep_trials"
ALL = set(range(NUM_DEMO_ITEMS))


@pytest.fixture(scope="module")
def server(demo_root: Path) -> Iterator[Joaderd]:
    """One joaderd for the module's sweeps: the demo source, all of it in the cache."""
    joaderd = Joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS, lease_s=LEASE_S)
    try:
        yield joaderd
        code = joaderd.stop()
        assert code == 0, f"joaderd exited with {code}:\n{joaderd.log()}"
    finally:
        joaderd.cleanup()


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(clients: Clients, name: str, args: list[str], server: Joaderd, timeout_s: float) -> None:
    client = clients.popen(name, [sys.executable, "-m", TRIALS, *args], env={"JOADER_ADDRESS": server.address})
    clients.wait(client, timeout_s)


def _trials(out: Path) -> dict[str, list[dict[str, Any]]]:
    return {path.stem.removeprefix("trial-"): _lines(path) for path in sorted(out.glob("trial-*.jsonl"))}


def _driver(out: Path) -> list[dict[str, Any]]:
    return [line for path in sorted(out.glob("driver-*.jsonl")) for line in _lines(path)]


def _check_trials(trials: dict[str, list[dict[str, Any]]], driver: list[dict[str, Any]], expected: Any,
                  server: Joaderd, epochs: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Each trial read its epochs exactly once, with the right labels and pixels; each trial's
    job left joaderd's status within a lease of its trial's end; none was left after the sweep.
    Returns each trial's `attached` record."""
    assert sorted(trials) == sorted(epochs), (sorted(trials), driver)
    attached = {}
    for key, records in trials.items():
        attached[key] = next(r for r in records if r["kind"] == "attached")
        assert complete_epochs(records) == epochs[key], (key, [r for r in records if r["kind"] != "sample"])
        findings = check_records(records, expected, ALL, epochs[key], f"trial {key}")
        assert findings.ok and findings.checked == epochs[key] * NUM_DEMO_ITEMS, findings.summary()
    gone = {r["job_id"]: r for r in driver if r["kind"] == "gone"}
    for key, first in attached.items():
        assert first["job_id"] in gone, (key, driver)
        after = gone[first["job_id"]]["after_s"]
        assert after is not None and after <= LEASE_S, (f"trial {key}'s job {first['job_id']} left joaderd's "
                                                         f"status {after} s after its trial ended", driver)
    # Once a driver's sweep returned, no job of its trials was attached (its process still alive;
    # a process of a shared study sees the other processes' trials still running).
    afters = [r for r in driver if r["kind"] == "after"]
    assert afters, driver
    for after in afters:
        own = {first["job_id"] for first in attached.values() if first["pid"] == after["pid"] or after["all"]}
        assert not own & set(after["jobs"]), (after, attached)
    assert server.status()["jobs"] == []
    return attached


def test_ray_tune_trials_are_named_after_themselves_and_read_each_epoch_exactly_once(
        server: Joaderd, clients: Clients, expected: Any, tmp_path: Path) -> None:
    out = tmp_path / "ray"
    out.mkdir()
    _run(clients, "ray-sweep", ["ray", "--out", str(out), "--epochs", str(EPOCHS)], server, 150)
    trials, driver = _trials(out), _driver(out)
    assert [r["errors"] for r in driver if r["kind"] == "after"] == [[]], driver
    early = [key for key, records in trials.items() if complete_epochs(records) == 1]
    assert len(early) == 1, "the stopper stops exactly one trial after its first epoch"
    attached = _check_trials(trials, driver, expected, server,
                             {key: 1 if key in early else EPOCHS for key in trials})
    names = [first["status_name"] for first in attached.values()]
    # While it ran, each trial's job was shown under the trial's name (no name= given).
    assert all(first["status_name"] == first["trial"] for first in attached.values()), attached
    assert len(set(names)) == 3 and all(re.fullmatch(r"trainable_[0-9a-f]+_0000[0-2]", n) for n in names), names
    assert "already attached" not in server.log()


def test_optuna_trials_in_threads_get_distinct_names_and_end_their_jobs_when_they_end(
        server: Joaderd, clients: Clients, expected: Any, tmp_path: Path) -> None:
    out = tmp_path / "threads"
    out.mkdir()
    _run(clients, "optuna-threads", ["optuna-threads", "--out", str(out), "--epochs", str(EPOCHS)], server, 120)
    trials, driver = _trials(out), _driver(out)
    # trial 0 ends its `with` block; trial 1 is pruned inside one after its first epoch; trial 2
    # lets its dataset go out of scope (sweep_trials.PLAN): each job is gone within a lease.
    attached = _check_trials(trials, driver, expected, server, {"0": EPOCHS, "1": 1, "2": EPOCHS})
    assert {r["trial"]: r["state"] for r in driver if r["kind"] == "gone"} == {
        "0": "COMPLETE", "1": "PRUNED", "2": "COMPLETE"}
    pids = {first["pid"] for first in attached.values()}
    assert len(pids) == 1, "one process, three threads"
    names = sorted(first["status_name"] for first in attached.values())
    base = min(names, key=len)  # the command line; the process's later datasets are "#2", "#3"
    assert base.startswith(next(iter(attached.values()))["script"]), names
    assert names == sorted([base, f"{base} #2", f"{base} #3"]), names
    assert "already attached" not in server.log()


def test_optuna_trials_in_processes_on_one_sqlite_study(
        server: Joaderd, clients: Clients, expected: Any, tmp_path: Path) -> None:
    out = tmp_path / "processes"
    out.mkdir()
    storage = ["--storage", f"sqlite:///{tmp_path / 'study.db'}", "--study", "sweep"]
    _run(clients, "optuna-create", ["optuna-create", *storage], server, 60)
    processes = [clients.popen(f"optuna-{n}", [sys.executable, "-m", TRIALS, "optuna-process", "--out", str(out),
                                               "--epochs", str(EPOCHS), *storage],
                               env={"JOADER_ADDRESS": server.address}) for n in range(3)]
    for process in processes:
        clients.wait(process, 120)
    trials, driver = _trials(out), _driver(out)
    attached = _check_trials(trials, driver, expected, server, {"0": EPOCHS, "1": 1, "2": EPOCHS})
    # Three processes of one command line: the first keeps it as its name, the others are told
    # at attach that a live job has it and take their pid (NOTE [ Default names that tell trials
    # apart ] in client/placement.py), so joaderd logs that notice for them.
    names = [first["status_name"] for first in attached.values()]
    base = min(names, key=len)
    assert base.startswith(f"{next(iter(attached.values()))['script']} optuna-process"), names
    pids = {first["pid"] for first in attached.values()}
    others = [n for n in names if n != base]
    assert len(others) == 2 and set(others) <= {f"{base} (pid {pid})" for pid in pids}, names
    assert len(set(names)) == 3, names


# ------------------------------------------------------------------------------------ the examples

_EXAMPLE_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "RAY_ADDRESS")


def _example(script: str, args: list[str], demo_root: Path, tmp_path: Path, env: dict[str, str],
             timeout_s: float, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs an example as its README shows it: no joaderd started by hand (its trials start one
    for `--root`, in a private XDG_RUNTIME_DIR); afterwards no joaderd of it may be left."""
    from joader.client.autostart import running_servers, stop_servers

    runtime = Path(tempfile.mkdtemp(prefix="jex-", dir="/tmp"))  # short: sun_path is 108 bytes
    runtime.chmod(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    clean = {key: value for key, value in os.environ.items() if key not in _EXAMPLE_ENV + ("JOADER_ADDRESS",)}
    try:
        try:
            done = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--root", str(demo_root),
                                   "--image-size", str(IMAGE_SIZE), *args], capture_output=True, text=True,
                                  timeout=timeout_s, cwd=tmp_path,
                                  env={**clean, "JOADER_IDLE_EXIT_S": str(IDLE_EXIT_S), **env})
        except subprocess.TimeoutExpired as error:
            pytest.fail(f"examples/{script} did not finish within {timeout_s:g} s:\n{error.stdout}\n{error.stderr}")
        assert done.returncode == 0, f"examples/{script} failed:\n{done.stdout}\n{done.stderr[-6000:]}"
        logs = "".join(p.read_text() for p in (runtime / "joader").glob("*.log"))
        assert logs.count(" started by pid ") == 1, logs  # one joaderd for the whole sweep
        deadline = time.monotonic() + IDLE_EXIT_S + 20
        while running_servers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running_servers(), f"examples/{script} left its joaderd running"
    finally:
        stop_servers()
        shutil.rmtree(runtime, ignore_errors=True)
    return done.stdout


IDLE_EXIT_S = 3  # the auto-started joaderd of the Optuna example exits this long after its last trial


def test_the_ray_tune_example_runs_its_sweep(demo_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's `joader.serve` block starts the sweep's joaderd and stops it at its end."""
    out = _example("ray_tune_sweep.py", ["--epochs", "2", "--cpus-per-trial", "0.5", "--storage",
                                         str(tmp_path / "results")],
                   demo_root, tmp_path, {"RAY_USAGE_STATS_ENABLED": "0"}, 150, monkeypatch)
    lines = out.splitlines()
    assert len([line for line in lines if line.startswith("lr ")]) == 3 and lines[-1].startswith("best: lr "), out


def test_the_optuna_example_runs_its_study_in_threads(demo_root: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The first trial starts joaderd; it exits by itself once the study is over."""
    out = _example("optuna_sweep.py", ["--epochs", "2"], demo_root, tmp_path, {}, 120, monkeypatch)
    lines = out.splitlines()
    assert len([line for line in lines if line.startswith("trial ")]) == 3 and lines[-1].startswith("best: trial "), out
