"""JoaderDataLoader (joader.client.loader): one checkpoint that holds every DDP rank's loader state.

The ranks are real: two processes in a gloo group (a FileStore in the test's tmp dir), each with
a real StatefulDataLoader (0 or 2 workers) over `RankedStream`, a small IterableDataset that
reads its rank's share and, like JoaderDataset, refuses another rank's state. The checkpoint is
saved as Lightning saves it: `state_dict()` on every rank, rank 0 alone writes the file, every
rank loads that file.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from joader.client.loader import LOADER_STATE_VERSION, JoaderDataLoader, rank_state
from joader.errors import InvalidArgumentError

WORLD = 2
ITEMS = 40  # 20 per rank: 10 batches of 2
BATCH = 2
READ = 3  # batches each rank reads before its checkpoint


class RankedStream(IterableDataset):
    """Items rank, rank + W, ... of range(n); DataLoader workers split the rank's share.

    `state_dict()` is where this reader (the process, or one worker) is in its share of the
    epoch; `load_state_dict()` makes the next `iter()` go on from there, and refuses a state of
    another rank as JoaderDataset does (that refusal is what crashes rank 1 when it is handed
    rank 0's state)."""

    def __init__(self, n: int, rank: int, world_size: int) -> None:
        self.n, self.rank, self.world_size = n, rank, world_size
        self._start = self._pos = 0

    def _share(self) -> list[int]:
        worker = get_worker_info()
        worker_id, workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        return list(range(self.rank, self.n, self.world_size))[worker_id::workers]

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        self._pos = start
        for item in self._share()[start:]:
            self._pos += 1
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {"stream": True, "rank": self.rank, "world_size": self.world_size, "pos": self._pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"the state is of rank {state['rank']} of {state['world_size']}, this dataset is "
                f"rank {self.rank} of {self.world_size}")
        self._start = self._pos = state["pos"]


def make_loader(rank: int, world_size: int, workers: int, cls: type = JoaderDataLoader) -> Any:
    return cls(RankedStream(ITEMS, rank, world_size), batch_size=BATCH, num_workers=workers)


def read(loader: Any, batches: int | None = None) -> list[list[int]]:
    """The next `batches` batches of a new pass over `loader` (all of them with None)."""
    got = []
    for batch in loader:
        got.append(batch.tolist())
        if batches is not None and len(got) == batches:
            break
    return got


def stream_states(state: Any) -> list[dict[str, Any]]:
    """The RankedStream states inside a loader state (StatefulDataLoader nests one per worker
    under private keys: found by shape, not by those keys)."""
    if isinstance(state, dict):
        if state.get("stream") is True:
            return [state]
        return [found for value in state.values() for found in stream_states(value)]
    if isinstance(state, list | tuple):
        return [found for value in state for found in stream_states(value)]
    return []


def close(loaders: list[Any]) -> None:
    """Stops the workers of loaders whose pass was left unfinished (as Lightning's
    `_shutdown_workers_and_reset_iterator` does), so that none is killed at the process's exit."""
    for loader in loaders:
        iterator = loader._iterator
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def run_rank(rank: int, store_path: str, workers: int, out: str) -> None:
    """One rank of the 2-process job (in its own process, started by the test)."""
    opened: list[Any] = []

    def loader_of(rank: int, world_size: int, cls: type = JoaderDataLoader) -> Any:
        opened.append(make_loader(rank, world_size, workers, cls))
        return opened[-1]

    out_dir = Path(out)
    # Before the process group exists: a one-process state (world size 1, one entry).
    alone = loader_of(0, 1)
    read(alone, READ)
    alone_state = alone.state_dict()
    assert alone_state["world_size"] == 1 and len(alone_state["ranks"]) == 1

    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    try:
        reference = read(loader_of(rank, WORLD))  # the whole share, uninterrupted
        assert sorted(sum(reference, [])) == list(range(rank, ITEMS, WORLD))

        # Every rank reads READ batches, then checkpoints at the same step.
        loader = loader_of(rank, WORLD)
        before = read(loader, READ)
        assert before == reference[:READ]
        state = loader.state_dict()  # a collective: on every rank
        assert state["joader_loader"] == LOADER_STATE_VERSION and state["world_size"] == WORLD
        for entry_rank, entry in enumerate(state["ranks"]):
            found = stream_states(entry)
            assert len(found) == max(workers, 1), found
            assert all(part["rank"] == entry_rank for part in found), (entry_rank, found)
        if rank == 0:  # rank 0 alone writes, as Lightning's Strategy.save_checkpoint does
            torch.save(state, out_dir / "gathered.pt")
        dist.barrier()

        # Every rank loads rank 0's file and resumes its own share where it was.
        saved = torch.load(out_dir / "gathered.pt", weights_only=False)
        resumed = loader_of(rank, WORLD)
        resumed.load_state_dict(saved)
        rest = read(resumed)
        assert rest == reference[READ:], (rank, rest, reference)
        # ... and the job's epoch is every item exactly once.
        seen: list[Any] = [None] * WORLD
        dist.all_gather_object(seen, sum(before + rest, []))
        assert sorted(sum(seen, [])) == list(range(ITEMS))
        # The next pass is a whole new epoch.
        assert read(resumed) == reference

        # A state gathered on another world size is refused, naming both sizes.
        with pytest.raises(InvalidArgumentError, match="world size 1, this job has world size 2"):
            loader_of(rank, WORLD).load_state_dict(alone_state)

        # A plain StatefulDataLoader state (an older checkpoint) loads as this rank's own.
        plain = loader_of(rank, WORLD, StatefulDataLoader)
        read(plain, READ)
        plain_state = plain.state_dict()
        assert "joader_loader" not in plain_state
        from_plain = loader_of(rank, WORLD)
        from_plain.load_state_dict(plain_state)
        assert read(from_plain) == reference[READ:]

        # Why the class exists: rank 0's plain state, loaded on rank 1, is refused by the dataset.
        if rank == 0:
            torch.save(plain_state, out_dir / "plain-rank0.pt")
        dist.barrier()
        if rank == 1:
            wrong = loader_of(rank, WORLD, StatefulDataLoader)
            wrong.load_state_dict(torch.load(out_dir / "plain-rank0.pt", weights_only=False))
            with pytest.raises(ValueError, match="the state is of rank 0 of 2, this dataset is rank 1"):
                read(wrong)
        dist.barrier()
        (out_dir / f"done-{rank}").write_text("ok")
    finally:
        close(opened)
        dist.destroy_process_group()


_CHILD = "import sys; from tests.unit.client.test_loader import run_rank; run_rank(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])"
_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_one_checkpoint(tmp_path: Path, workers: int) -> None:
    """Rank 0's state_dict() holds both ranks' states; that one dict, loaded on both ranks,
    resumes each where it was; a one-process state is refused in the 2-rank job; a plain
    StatefulDataLoader state still loads; and the gathered state is refused in one process.

    The ranks are plain subprocesses (not multiprocessing's spawn, whose children would spawn
    their DataLoader workers too, and whose resource tracker outlives the test)."""
    ranks = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(rank), str(tmp_path / "store"),
                          str(workers), str(tmp_path)],
                         cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(WORLD)
    ]
    try:
        outputs = [proc.communicate(timeout=60)[0] for proc in ranks]
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [f"rank {rank} exited with {proc.returncode}:\n{output}"
              for rank, (proc, output) in enumerate(zip(ranks, outputs, strict=True)) if proc.returncode]
    assert not failed, "\n".join(failed)
    assert (tmp_path / "done-0").exists() and (tmp_path / "done-1").exists()

    gathered = torch.load(tmp_path / "gathered.pt", weights_only=False)
    loader = make_loader(0, 1, workers)
    with pytest.raises(InvalidArgumentError) as refused:
        loader.load_state_dict(gathered)
    message = str(refused.value)
    assert "world size 2, this job has world size 1" in message
    assert "no torch.distributed process group" in message and "with world size 2" in message


@pytest.mark.parametrize("workers", [0, 2])
def test_one_process_round_trip(workers: int) -> None:
    """Without a process group the state has the same format, with one entry, and resumes."""
    reference = read(make_loader(0, 1, workers))
    loader = make_loader(0, 1, workers)
    assert read(loader, READ) == reference[:READ]
    state = loader.state_dict()
    assert state["joader_loader"] == LOADER_STATE_VERSION
    assert state["world_size"] == 1 and len(state["ranks"]) == 1
    assert [part["rank"] for part in stream_states(state)] == [0] * max(workers, 1)
    resumed = make_loader(0, 1, workers)
    resumed.load_state_dict(state)
    assert read(resumed) == reference[READ:]


def test_plain_state_loads_in_one_process() -> None:
    reference = read(make_loader(0, 1, 0))
    plain = make_loader(0, 1, 0, cls=StatefulDataLoader)
    read(plain, READ)
    loader = make_loader(0, 1, 0)
    loader.load_state_dict(plain.state_dict())
    assert read(loader) == reference[READ:]
    empty = make_loader(0, 1, 0)
    empty.load_state_dict({})  # StatefulDataLoader's "no state": a fresh epoch
    assert read(empty) == reference


def test_rank_state_picks_and_refuses() -> None:
    gathered = {"joader_loader": LOADER_STATE_VERSION, "world_size": 3,
                "ranks": [{"r": 0}, {"r": 1}, {"r": 2}]}
    assert rank_state(gathered, rank=2, world_size=3) == {"r": 2}
    assert rank_state({"r": 9}, rank=1, world_size=3) == {"r": 9}  # plain: this rank's own
    with pytest.raises(InvalidArgumentError, match="world size 3, this job has world size 2"):
        rank_state(gathered, rank=1, world_size=2)
    with pytest.raises(InvalidArgumentError, match="version 2.*Resume with the joader version"):
        rank_state(dict(gathered, joader_loader=2), rank=0, world_size=3)
    with pytest.raises(InvalidArgumentError, match="malformed.*2 rank entries"):
        rank_state(dict(gathered, ranks=[{}, {}]), rank=0, world_size=3)
    with pytest.raises(InvalidArgumentError, match="is a list, not a dict"):
        rank_state([gathered], rank=0, world_size=3)
