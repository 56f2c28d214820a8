"""Trust, the host side: decode workers that die or hang, hostile files, the socket, the arena.

Each test starts a real joaderd and kills, stops or abuses real processes (issue 7, items 4, 5,
6, 9, 10, 11, 12, 13 and the server-side smaller items of 14).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from joader.client.tools.demo_data import make_demo_data
from joader.process_ref import ProcessRef
from joader.testing.integrity import check_records, read_records, reference
from tests.support.processes import IMAGE_SIZE, NUM_DEMO_ITEMS, wait_for
from tests.support.trust import client, end, joader_segments, read_line, rss_bytes, run_client

pytestmark = pytest.mark.timeout(240)


def workers(server: Any) -> dict[str, Any]:
    return server.status()["workers"]


def start_failing(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs joaderd expecting it to refuse to start; returns the finished process."""
    return subprocess.run([sys.executable, "-m", "joader.server", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_a_killed_idle_worker_is_replaced_and_jobs_finish(demo_root: Path, start_joaderd: Any) -> None:
    """Item 5: one dead idle worker used to stop all decoding (it died holding the queue's lock)."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS, workers=2)
    before = workers(server)
    assert before["alive"] == before["configured"] == 2
    os.kill(before["pids"][0], signal.SIGKILL)
    wait_for(lambda: (w := workers(server))["replaced"] == 1 and w["alive"] == 2, 30, "a replacement worker")
    result, _ = run_client(server.address, "read")
    print(f"epoch of {NUM_DEMO_ITEMS} items after an idle worker was killed: {result['epoch_s'][0]:.2f} s")
    assert sorted(result["epochs"][0]) == list(range(NUM_DEMO_ITEMS))
    assert server.status()["items_failed"] == 0


def test_all_workers_killed_are_replaced(demo_root: Path, start_joaderd: Any) -> None:
    """Item 5: with every worker dead, jobs used to hang until their 300 s timeout."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS, workers=2)
    for pid in workers(server)["pids"]:
        os.kill(pid, signal.SIGKILL)
    result, _ = run_client(server.address, "read", "--timeout-s", "60")
    assert sorted(result["epochs"][0]) == list(range(NUM_DEMO_ITEMS))
    w = workers(server)
    assert w["alive"] == 2 and w["replaced"] >= 2


# With --no-upscale the demo's center-crop serves images smaller than S at their own size, so
# its items' sizes are read from their headers first (probes, which go to the workers ahead of
# decodes); by default (upscale) every item has S x S and no probe is sent: the workers hold
# decode tasks.
STAGES = {"fixed size (upscale)": [], "header probes first": ["--no-upscale", "demo"]}


@pytest.mark.parametrize("stage", STAGES)
def test_a_worker_killed_mid_decode_is_not_a_file_failure(demo_root: Path, start_joaderd: Any, stage: str) -> None:
    """Item 4: the items the dead worker held are decoded again elsewhere, not marked failed
    (with probes first, what it held may be header probes: their items are decoded anyway)."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS, workers=2, extra=STAGES[stage])
    victim = workers(server)["pids"][0]
    os.kill(victim, signal.SIGSTOP)  # it takes tasks and holds them
    proc = client(server.address, "read")
    read_line(proc)
    wait_for(lambda: server.status()["items_decoded"] > 0, 30, "decoding to start")
    time.sleep(0.5)  # the stopped worker is handed its share of tasks meanwhile
    os.kill(victim, signal.SIGKILL)
    done = read_line(proc, timeout_s=90)
    end(proc)
    assert done["count"] == NUM_DEMO_ITEMS
    status = server.status()
    assert status["items_failed"] == 0, status["failed"]
    if STAGES[stage]:  # it held decode tasks: they were retried
        assert status["workers"]["tasks_retried"] >= 1


@pytest.mark.parametrize("stage", STAGES)
def test_a_stuck_decode_times_out_and_is_retried_elsewhere(demo_root: Path, start_joaderd: Any, stage: str) -> None:
    """Item 6: a worker that hangs (stopped, as on a dead NFS mount) is killed and replaced,
    also when what it hangs on is a header probe (the read then finishes without it)."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS, workers=2,
                           extra=["--decode-timeout-s", "2", *STAGES[stage]])
    stuck = ProcessRef.of(workers(server)["pids"][0])  # NOTE [ Signals to a pid another test may now hold ]
    assert stuck is not None and stuck.send_signal(signal.SIGSTOP)
    try:
        result, _ = run_client(server.address, "read", "--timeout-s", "60")
        wait_for(lambda: workers(server)["tasks_timed_out"] >= 1, 30, "the decode timeout to kill the stuck worker")
    finally:
        stuck.send_signal(signal.SIGKILL)  # the pool killed it already, unless the test failed
    assert sorted(result["epochs"][0]) == list(range(NUM_DEMO_ITEMS))
    w = wait_for(lambda: (lambda w: w if w["replaced"] >= 1 and w["alive"] == 2 else None)(workers(server)),
                 30, "the stuck worker to be replaced")
    assert w["tasks_timed_out"] >= 1 and w["replaced"] >= 1 and w["alive"] == 2
    assert "--decode-timeout-s" in server.log()


def test_thin_images_cost_bounded_work(tmp_path: Path, start_joaderd: Any) -> None:
    """Item 9: a 1x10000 PNG used to cost 8.6 s and 2.7 GB in a worker."""
    root = tmp_path / "images"
    listing = make_demo_data(root, 8, num_classes=2, seed=6, progress=False)
    Image.new("RGB", (1, 10000), (200, 10, 10)).save(root / listing.classes[0] / "thin_tall.png")
    Image.new("RGB", (10000, 1), (10, 200, 10)).save(root / listing.classes[1] / "thin_wide.png")
    server = start_joaderd({"demo": root}, cache_items=16, workers=1)
    result, _ = run_client(server.address, "read", "--batch-size", "4")
    assert sorted(result["epochs"][0]) == list(range(10))
    assert server.status()["items_failed"] == 0
    peak = max(rss_bytes(pid, "VmHWM") for pid in workers(server)["pids"])
    print(f"decode worker peak RSS with 1x10000 images: {peak / 2**20:.0f} MiB")
    assert peak < 512 * 2**20


def test_a_symlink_swapped_in_after_start_is_not_followed_out_of_the_root(
    tmp_path: Path, start_joaderd: Any
) -> None:
    """Item 12: the listing skipped links leaving the root; a link made later must not leak."""
    root = tmp_path / "images"
    listing = make_demo_data(root, 8, num_classes=2, seed=7, progress=False)
    secret = tmp_path / "outside.jpg"
    secret.write_bytes((root / listing.paths[0]).read_bytes())
    server = start_joaderd({"demo": root}, cache_items=16)
    target = root / listing.paths[3]
    target.unlink()
    target.symlink_to(secret)
    result, err = run_client(server.address, "read", "--batch-size", "4")
    assert sorted(result["epochs"][0]) == [i for i in range(8) if i != 3]
    failed = server.status()["failed"]
    assert len(failed) == 1 and "outside" in failed[0]["reason"], failed


def _new_segments_of(before: set[str], pids: set[int]) -> set[str]:
    """Segments made since `before` by the joaderds `pids` (another test's, or another checkout's,
    may come and go meanwhile: `make test` runs several at once)."""
    return {s for s in joader_segments() - before if int(s.split("-")[2]) in pids}


def test_kill_9_and_an_immediate_restart_leave_exactly_one_arena(demo_root: Path, start_joaderd: Any) -> None:
    """Item 13: workers used to inherit the arena's lock, so the restart kept the dead arena."""
    before = joader_segments()
    first = start_joaderd({"demo": demo_root}, cache_items=64)
    first.expected_exit_code = -signal.SIGKILL
    first.proc.kill()
    first.proc.wait()
    second = start_joaderd({"demo": demo_root}, cache_items=64)
    time.sleep(3.0)  # the figure asked for: what is left 3 s after the restart
    left = _new_segments_of(before, {first.proc.pid, second.proc.pid})
    print(f"joader segments 3 s after kill -9 and restart: {sorted(left)}")
    assert left == {Path(second.arena_path).name}


def test_sighup_removes_arena_and_socket(demo_root: Path, start_joaderd: Any) -> None:
    """Item 13: SIGHUP (a closed terminal) used to leave the arena and the socket behind."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    arena = Path(server.arena_path)
    sock = Path(server.address.removeprefix("unix:"))
    server.proc.send_signal(signal.SIGHUP)
    assert server.proc.wait(timeout=30) == 0
    assert not arena.exists() and not sock.exists()


def test_listen_on_a_regular_file_refuses_and_keeps_the_file(demo_root: Path, tmp_path: Path) -> None:
    """Item 13: `--listen unix:/some/regular-file` used to delete that file."""
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    done = start_failing(["--source", f"demo={demo_root}", "--listen", f"unix:{precious}", "--cache-size", "4MiB"])
    assert done.returncode != 0
    assert "not a socket" in done.stderr
    assert precious.read_text() == "keep me"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A TMPDIR short enough that joader keeps its default directory there (under a long one,
    whose socket paths would pass 107 bytes, it moves to /tmp/joader-<uid>)."""
    path = Path(tempfile.mkdtemp(prefix="jt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _default_socket_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "JOADER_ADDRESS")}
    env["TMPDIR"] = str(tmp_path)
    return env


def test_a_squatted_socket_directory_is_refused(demo_root: Path, short_tmp: Path) -> None:
    """Item 10: without XDG_RUNTIME_DIR, /tmp/joader-<uid> may be made first by someone else."""
    tmp_path = short_tmp
    squatted = tmp_path / f"joader-{os.getuid()}"
    squatted.mkdir()
    squatted.chmod(0o777)
    env = _default_socket_env(tmp_path)
    done = start_failing(["--source", f"demo={demo_root}", "--cache-size", "4MiB"], env=env)
    assert done.returncode != 0
    assert str(squatted) in done.stderr and "Traceback" not in done.stderr
    if os.getuid() == 0:
        squatted.chmod(0o700)
        os.chown(squatted, 65534, 65534)  # owned by another user ("nobody")
        done = start_failing(["--source", f"demo={demo_root}", "--cache-size", "4MiB"], env=env)
        assert done.returncode != 0 and str(squatted) in done.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to serve a socket as another user")
def test_the_client_refuses_a_server_run_by_another_user(short_tmp: Path) -> None:
    """Item 10: the client checks who serves the socket (SO_PEERCRED) before sending a byte."""
    tmp_path = short_tmp
    squatted = tmp_path / f"joader-{os.getuid()}"
    squatted.mkdir(mode=0o777)
    squatted.chmod(0o777)
    sock_path = squatted / "joaderd.sock"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the squatter: another user listening where the victim's client will look
        try:
            os.close(ready_r)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(sock_path))  # as root: pytest's temp dir is closed to others
            os.setgid(65534)
            os.setuid(65534)
            listener.listen(8)  # the kernel records the listener's credentials here
            os.write(ready_w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"x", "the squatter could not listen"
        env = _default_socket_env(tmp_path)
        done = subprocess.run(
            [sys.executable, "-c", "from joader.client.dataset import JoaderDataset; JoaderDataset('demo')"],
            capture_output=True, text=True, timeout=60, env=env,
        )
        assert done.returncode != 0
        assert "UntrustedServerError" in done.stderr, done.stderr
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)


def test_non_loopback_listen_needs_allow_remote(demo_root: Path, tmp_path: Path, start_joaderd: Any) -> None:
    """Item 11: 0.0.0.0 was accepted silently; port 0 is reported as the real port."""
    done = start_failing(["--source", f"demo={demo_root}", "--listen", "0.0.0.0:0", "--cache-size", "4MiB"])
    assert done.returncode == 2 and "--allow-remote" in done.stderr
    local = start_joaderd({"demo": demo_root}, cache_items=16, listen="127.0.0.1:0")
    port = local.info["port"]
    assert port and local.address == f"127.0.0.1:{port}"
    assert local.status()["address"] == local.address
    remote = start_joaderd({"demo": demo_root}, cache_items=16, listen="0.0.0.0:0", extra=["--allow-remote"])
    assert remote.info["port"] and "NO authentication" in remote.log()


def test_config_mistakes_are_named_without_tracebacks(demo_root: Path, tmp_path: Path) -> None:
    """Item 14: unknown TOML keys, bad values and --log-level LOUD."""
    config = tmp_path / "joaderd.toml"
    config.write_text('cache-size = "8MiB"\n')
    done = start_failing(["--config", str(config), "--source", f"demo={demo_root}"])
    assert done.returncode == 2 and "cache_size" in done.stderr and "Traceback" not in done.stderr
    config.write_text('workers = "many"\n')
    done = start_failing(["--config", str(config), "--source", f"demo={demo_root}"])
    assert done.returncode == 2 and "workers" in done.stderr and "Traceback" not in done.stderr
    done = start_failing(["--source", f"demo={demo_root}", "--log-level", "LOUD"])
    assert done.returncode == 2 and "WARNING" in done.stderr and "Traceback" not in done.stderr


def test_default_workers_follow_cpu_affinity(demo_root: Path, tmp_path: Path) -> None:
    """Item 14: a joaderd pinned to one CPU starts one decode worker, not one per host CPU."""
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "joader.server", "--source", f"demo={demo_root}", "--cache-size", "4MiB",
         "--listen", f"unix:{tmp_path / 'j.sock'}", "--ready-file", str(ready)],
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 60, "joaderd to start")
        assert proc.poll() is None
        assert json.loads(ready.read_text())["num_workers"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_client_that_cannot_read_the_arena_holds_no_job_slot(demo_root: Path, start_joaderd: Any,
                                                             tmp_path: Path) -> None:
    """Issue 27, finding 5d: over TCP (no peer credentials), a client of another user attached
    jobs whose arena it could not read, and kept them (a notebook goes on after an error): each
    held a --max-jobs slot and a share of the cache from the host's owner, for as long as its
    process lived. Now its dataset fails at once, naming the fix, and its job is removed; a raw
    client that keeps a lease but never sends a request loses the job within its lease. The
    owner's job then attaches and reads every sample right."""
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS, listen="127.0.0.1:0",
                           extra=["--max-jobs", "2"])
    other = client(server.address, "other-user", "--jobs", "2", stdin=True)
    raw = None
    try:
        results = read_line(other)["results"]
        assert [r["ok"] for r in results] == [False, False], results
        assert all(r["class"] == "UntrustedServerError" and "run the job as that user" in r["message"]
                   for r in results), results
        # Started once the other user's jobs failed (the raw client imports no torch, and would
        # otherwise take a --max-jobs slot first): it attaches only if they left theirs.
        raw = client(server.address, "attach-only", stdin=True)
        read_line(raw)  # attached, heartbeating, never asking
        ended = read_line(raw, timeout_s=30)["ended"]  # lease_s is 3 s
        assert "sent no request within 3 s of attaching" in ended, ended
        assert not server.status()["jobs"]
        records = tmp_path / "owner.jsonl"
        owner = subprocess.run(
            [sys.executable, "-m", "joader.testing.integrity_job", "--address", server.address,
             "--records", str(records), "--epochs", "1"],
            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
        assert owner.returncode == 0, owner.stderr[-3000:]
        findings = check_records(read_records(records), reference(demo_root, IMAGE_SIZE),
                                 set(range(NUM_DEMO_ITEMS)), 1, "owner")
        assert findings.ok, findings.summary()
    finally:
        for proc in (other, raw):
            if proc is not None:
                end(proc)
