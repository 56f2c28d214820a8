"""Bad input gets a message that names the problem and the fix; the server stays up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from joader import JoaderDataset
from joader.errors import InvalidArgumentError, UnknownSourceError
from tests.conftest import joader_segments
from tests.support.data import corrupt_jpeg
from tests.support.processes import NUM_DEMO_ITEMS, finish, wait_for

pytestmark = pytest.mark.timeout(180)


def test_unknown_source_lists_the_known_ones(demo_root: Path, start_joaderd: Any) -> None:
    server = start_joaderd({"demo": demo_root, "other": demo_root}, cache_items=16)
    with pytest.raises(UnknownSourceError, match=r"'imagenet'.*demo, other"):
        JoaderDataset("imagenet", address=server.address)


def test_indices_outside_the_source_name_the_bad_range(demo_root: Path, start_joaderd: Any) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=16)
    with pytest.raises(InvalidArgumentError, match=rf"{NUM_DEMO_ITEMS}\.\.{NUM_DEMO_ITEMS + 9}.*0\.\.{NUM_DEMO_ITEMS - 1}"):
        JoaderDataset("demo", indices=range(NUM_DEMO_ITEMS - 5, NUM_DEMO_ITEMS + 10), address=server.address)
    # The server is still up and serves a good request.
    with JoaderDataset("demo", indices=range(10), address=server.address) as ds:
        assert len(ds) == 10
        assert ds.classes == sorted(ds.classes) and len(ds.classes) == 4
        assert ds.class_to_idx == {c: i for i, c in enumerate(ds.classes)}


@pytest.mark.parametrize("indices", [[], [-1, 3], [0.5, 2]])
def test_malformed_indices_are_refused_before_any_request(indices: list[Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        JoaderDataset("demo", indices=indices, address="unix:/nonexistent/joaderd.sock")


def test_no_server_says_how_to_start_one(tmp_path: Path) -> None:
    with pytest.raises(ConnectionError, match="joaderd --source"):
        JoaderDataset("demo", address=f"unix:{tmp_path}/none.sock")


def test_corrupt_jpeg_is_skipped_and_reported(demo_root: Path, tmp_path: Path, start_joaderd: Any) -> None:
    root = tmp_path / "images"
    shutil.copytree(demo_root, root)
    victim = sorted(root.rglob("*.jpg"))[7]
    corrupt_jpeg(victim)
    relative = victim.relative_to(root).as_posix()
    server = start_joaderd({"demo": root}, cache_items=32)
    skip = server.job("--epochs", "2", "--batch-size", "8", name="skip")
    assert finish(skip) == 0, server.job_stderr("skip")
    for epoch in server.report("skip")["epochs"]:
        assert sorted(epoch["order"]) == [i for i in range(NUM_DEMO_ITEMS) if i != 7]
    assert relative in server.job_stderr("skip")  # logged once by the client
    status = server.status()
    assert status["items_failed"] == 1
    assert status["failed"][0]["path"] == relative
    raising = server.job("--epochs", "1", "--batch-size", "8", "--on-error", "raise", name="raise")
    assert finish(raising) != 0
    assert "DecodeError" in server.job_stderr("raise") and relative in server.job_stderr("raise")
    assert server.status()["items_failed"] == 1  # known bad, not decoded again


def _run_joaderd(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "joader.server", *args], capture_output=True,
                          text=True, timeout=timeout_s)


def test_a_cache_larger_than_dev_shm_is_a_clear_error_at_start(demo_root: Path, tmp_path: Path) -> None:
    result = _run_joaderd("--source", f"demo={demo_root}", "--listen", f"unix:{tmp_path}/s.sock",
                          "--cache-size", "100TiB", "--workers", "1")
    assert result.returncode == 1
    assert "free" in result.stderr and "--cache-size" in result.stderr and "--shm-size" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--source", "demo"], "NAME=PATH"),
        ([], "nothing to serve"),
        (["--source", "demo=/nonexistent/folder"], "/nonexistent/folder"),
        (["--source", "demo=.", "--cache-size", "lots"], "lots"),
    ],
)
def test_bad_command_lines_name_the_problem(args: list[str], message: str, tmp_path: Path) -> None:
    result = _run_joaderd(*args, "--listen", f"unix:{tmp_path}/s.sock")
    assert result.returncode != 0
    assert message in result.stderr


def test_a_second_server_on_the_same_socket_refuses(demo_root: Path, start_joaderd: Any) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=16)
    result = _run_joaderd("--source", f"demo={demo_root}", "--listen", server.address, "--workers", "1")
    assert result.returncode == 1
    assert "already listening" in result.stderr
    assert server.status()["sources"][0]["name"] == "demo"


@pytest.mark.serial  # any joaderd that starts removes stale arenas: only this one may start meanwhile
def test_restart_after_a_crash_removes_the_dead_servers_arena(demo_root: Path, start_joaderd: Any) -> None:
    crashed = start_joaderd({"demo": demo_root}, cache_items=16)
    arena = Path(crashed.status()["arena_path"])
    crashed.expected_exit_code = -signal.SIGKILL
    os.kill(crashed.proc.pid, signal.SIGKILL)
    crashed.proc.wait()
    assert arena.exists()  # nothing ran to remove it
    wait_for(lambda: not _processes_mapping(arena.name), 15, "orphaned decode workers to exit")
    restarted = start_joaderd({"demo": demo_root}, cache_items=16)
    assert not arena.exists()
    assert arena.name in restarted.log()
    assert arena.name not in joader_segments()


def _processes_mapping(name: str) -> list[int]:
    """The processes that still map or hold open the arena file `name` (the dead server's
    decode workers and forker): not every joaderd process on the machine, which another
    server's would be."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            held = name in (proc / "maps").read_text(errors="replace") or any(
                name in os.readlink(fd) for fd in (proc / "fd").iterdir())
        except OSError:
            continue
        if held:
            found.append(int(proc.name))
    return found


_API_SCRIPT = r"""
import sys, torch
from torch.utils.data import DataLoader
from joader import JoaderDataset
address, n = sys.argv[1], int(sys.argv[2])
scale = lambda image: image.float() / 255
with JoaderDataset("demo", indices=range(10, 10 + n), transform=scale, return_index=True,
                   address=address, batch_size=8) as ds:
    assert len(ds) == n
    seen = []
    for index, image, label in ds:
        assert image.dtype == torch.float32 and image.shape == (3, 64, 64)  # transformed here
        assert isinstance(label, int) and 0 <= label < len(ds.classes)
        seen.append(index)
    assert sorted(seen) == list(range(10, 10 + n)), seen
with JoaderDataset("demo", indices=range(n), batched=True, address=address, batch_size=8) as ds:
    sizes, labels = [], []
    for images, batch_labels in DataLoader(ds, batch_size=None):
        assert images.shape[1:] == (3, 64, 64) and images.dtype == torch.uint8
        assert batch_labels.dtype == torch.int64 and len(batch_labels) == len(images)
        sizes.append(len(images))
    assert sizes == [8] * (n // 8) + ([n % 8] if n % 8 else []), sizes
print("ok")
"""


def test_dataset_api_per_item_and_batched(demo_root: Path, start_joaderd: Any) -> None:
    """`(index, image, label)` with a transform, per item; exact batches with `batched=True`."""
    server = start_joaderd({"demo": demo_root}, cache_items=32)
    result = subprocess.run([sys.executable, "-c", _API_SCRIPT, server.address, "21"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


_HANDOFF_SCRIPT = r"""
import sys, torch
from torch.utils.data import DataLoader
from joader import JoaderDataset
address, n = sys.argv[1], int(sys.argv[2])
seen = {}
with JoaderDataset("demo", indices=range(n), batched=True, return_index=True, address=address,
                   batch_size=8, timeout_s=30) as ds:
    for workers in (0, 2, 2):
        kept = []  # every batch stays referenced: a pooled buffer must not be reused under it
        for indices, images, labels in DataLoader(ds, batch_size=None, num_workers=workers):
            assert isinstance(images, torch.Tensor) and images.shape[1:] == (3, 64, 64), type(images)
            assert len(indices) == len(images) == len(labels)
            kept.append((indices, images, labels))
        assert sorted(len(b[0]) for b in kept) == sorted([8] * (n // 8) + [n % 8]), [len(b[0]) for b in kept]
        got = {int(i): (image, int(label)) for b in kept for i, image, label in zip(*b)}
        assert sorted(got) == list(range(n)), sorted(got)
        for index, (image, label) in got.items():
            if index in seen:  # the same pixels and label, whoever copied them
                assert torch.equal(seen[index][0], image) and seen[index][1] == label, index
            seen[index] = (image, label)
print("ok")
"""


def test_batches_from_workers_are_copied_by_the_training_process(demo_root: Path, start_joaderd: Any) -> None:
    """`batched=True` in DataLoader workers without a transform: the workers hand over offsets,
    the training process copies and acknowledges (joader.client.handoff). Same items, same
    pixels as without workers, every item once per epoch, and no pin left behind: the cache
    holds under half the items, so batches the training process did not acknowledge would fill
    it with pins (until a lease after their pass), and the next epoch would stall."""
    server = start_joaderd({"demo": demo_root}, cache_items=32, lease_s=120.0)
    result = subprocess.run([sys.executable, "-c", _HANDOFF_SCRIPT, server.address, "76"],
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
    assert "without a transform" not in result.stderr  # batched workers are not the slow case
    assert server.status()["cache"]["pinned_items"] == 0


_THREADS_SCRIPT = r"""
import logging, sys, torch
from joader import JoaderDataset
from joader.errors import InvalidArgumentError
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
address = sys.argv[1]
torch.set_num_threads(2)
with JoaderDataset("demo", indices=range(4), address=address, batch_size=4):
    assert torch.get_num_threads() == 1, torch.get_num_threads()  # the default: one, once
torch.set_num_threads(2)
with JoaderDataset("demo", indices=range(4), address=address, batch_size=4, threads=None):
    assert torch.get_num_threads() == 2  # left alone, with a warning
with JoaderDataset("demo", indices=range(4), address=address, batch_size=4):
    assert torch.get_num_threads() == 1  # set again, without a second warning
try:
    JoaderDataset("demo", address=address, threads="many")
    raise SystemExit("no error")
except InvalidArgumentError as error:
    assert "threads" in str(error)
print("ok")
"""


def test_the_dataset_sets_one_torch_thread_unless_told_not_to(demo_root: Path, start_joaderd: Any) -> None:
    """The plain script must not fall into the multi-threaded collate on busy cores (issue 10)."""
    server = start_joaderd({"demo": demo_root}, cache_items=32)
    result = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, server.address],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
    # A warning (at INFO nobody saw it), once per process.
    assert result.stderr.count("WARNING:joader.client.dataset:joader: torch.set_num_threads(1) in this process (it was 2)") == 1
    assert "torch uses 2 intra-op threads" in result.stderr


_WORKERS_SCRIPT = r"""
import logging, sys, torch
from torch.utils.data import DataLoader
from joader import JoaderDataset
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
address, transform = sys.argv[1], sys.argv[2] == "transform"
ds = JoaderDataset("demo", indices=range(24), address=address, batch_size=4,
                   transform=(lambda image: image.flip(-1)) if transform else None)
loader = DataLoader(ds, batch_size=4, num_workers=2)
for epoch in range(3):
    assert sum(len(labels) for _, labels in loader) == 24
ds.close()
print("ok")
"""


@pytest.mark.parametrize("transform", [False, True])
def test_workers_without_a_transform_are_called_slow_once(demo_root: Path, start_joaderd: Any,
                                                         transform: bool) -> None:
    """A configuration joader knows to be slow is named once per job, not once per worker and
    epoch (the workers share the client board); with a transform, workers have work to do."""
    server = start_joaderd({"demo": demo_root}, cache_items=32)
    result = subprocess.run([sys.executable, "-c", _WORKERS_SCRIPT, server.address,
                             "transform" if transform else "plain"],
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
    count = result.stderr.count("DataLoader workers without a transform")
    assert count == (0 if transform else 1), result.stderr
