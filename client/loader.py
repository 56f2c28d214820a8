"""`JoaderDataLoader`: a StatefulDataLoader whose checkpoint holds every DDP rank's state.

Why it exists. Under DDP each rank of a job reads its own share of every epoch, so each rank's
loader state is different, but a DDP job usually writes ONE checkpoint, from rank 0, and every
rank loads that file. With torchdata's StatefulDataLoader that puts rank 0's state into every
rank: JoaderDataset refuses it on rank 1 ("the state is of rank 0 of 2 ..."), and a dataset
without such a check resumes rank 0's share on every rank (items repeated, others skipped).
`JoaderDataLoader.state_dict()` gathers every rank's state into the one dict rank 0 writes;
`load_state_dict()` picks this rank's entry out of it.

What Lightning 2.6 does with a loader's state (read in lightning/pytorch, 2.6.6, and observed on
a 2-rank CPU/gloo DDP run with ModelCheckpoint(every_n_train_steps=4) and an epoch checkpoint):

Saving. Every checkpoint goes through `Trainer.save_checkpoint` (trainer/trainer.py; "needs to
be called on all processes"): `_CheckpointConnector.dump_checkpoint`
(trainer/connectors/checkpoint_connector.py) runs on EVERY rank and builds the whole dict,
including `_get_loops_state_dict` -> `fit_loop.state_dict()` (`_Loop.state_dict`, loops/loop.py)
-> `_FitLoop.on_save_checkpoint` (loops/fit_loop.py) -> `CombinedLoader._state_dicts`
(utilities/combined_loader.py), which calls `state_dict()` of each training loader that has
`state_dict`/`load_state_dict`; it lands in checkpoint["loops"]["fit_loop"]["state_dict"]
["combined_loader"] (also with weights_only=True). Only then does `Strategy.save_checkpoint`
(strategies/strategy.py) write, `if self.is_global_zero`: rank 0's dict alone reaches the file
(FSDP/ModelParallel sharded checkpoints likewise put it in a metadata file written by rank 0),
and `strategy.barrier("Trainer.save_checkpoint")` follows. So `state_dict()` is called on all
ranks at the same point, and the gather in it is safe. ModelCheckpoint (callbacks/
model_checkpoint.py) calls `_save_checkpoint` -> `trainer.save_checkpoint` on every rank with
the same decision: mid-epoch from `on_train_batch_end` when `every_n_train_steps` divides
`trainer.global_step` (the same on every rank; a `train_time_interval` decision is broadcast
from rank 0), at an epoch's end from `on_train_epoch_end` (after that epoch's validation), or
from `on_validation_end` when it does not save at the train epoch's end; top-k choices go through
`strategy.reduce_boolean_decision`. Observed: the training loader's `state_dict()` ran on both
ranks at steps 4, 8 and 12 and at each epoch's end. Validation loaders: never; the evaluation
loops save no loader state (no `on_save_checkpoint` that calls `_state_dicts`).
The exception: `ModelCheckpoint(save_on_exception=True)` and `OnExceptionCheckpoint` save from
`on_exception`, on the rank(s) that raised only; there the gather waits for the others until
the process group's timeout, as `Trainer.save_checkpoint`'s own barrier would.

Resuming (`trainer.fit(..., ckpt_path=...)`). Every rank reads the same file
(`_CheckpointConnector.resume_start` -> `strategy.load_checkpoint`); `restore_loops` ->
`fit_loop.load_state_dict` -> `_FitLoop.on_load_checkpoint` keeps the states in
`_combined_loader_states_to_load`, and `_FitLoop.setup_data` (after `train_dataloader()`, on
every rank) calls `_load_combined_loader_states` -> `CombinedLoader._load_state_dicts` ->
`loader.load_state_dict(state)`: the same state (rank 0's) on every rank. Only while
`fit_loop.restarting`, which its setter makes true for an unfinished epoch, or always with
`max_steps` set (`_iteration_based_training`). Observed, with this class:
- a mid-epoch checkpoint: loaded; each rank resumed exactly its own rest (0 and 2 workers);
- a checkpoint from `on_train_epoch_end`: not loaded (the epoch is finished), the loader starts
  a fresh pass; with `max_steps` set it is loaded, its epoch's rest is empty, and Lightning's
  next epoch gets no batches (the steps still add up to max_steps);
- a checkpoint from `on_train_batch_end` at an epoch's last batch: loaded, but Lightning counts
  that epoch as done (`_FitLoop.reset`) and its next epoch gets the empty rest of the saved
  one: that epoch trains nothing. Also with a plain StatefulDataLoader on one device: it is
  Lightning's pairing with StatefulDataLoader, not the gather. So `JoaderDataLoader.state_dict()`,
  called by a Lightning fit loop that has processed every batch of its epoch
  (`joader.client.frameworks.lightning_epoch_done`), saves a rank entry that loads as a fresh
  pass: the next epoch is whole (test_frameworks, a checkpoint every 10 of 10 steps).
- `_PrefetchDataFetcher` (loops/fetchers.py) reads one batch ahead when the loader has no
  length, and then a checkpoint's state includes a batch not yet trained (one batch per rank is
  skipped on resume; observed); with a length (JoaderDataset has `__len__`) it does not.
With a plain StatefulDataLoader the same 2-rank mid-epoch resume failed on rank 1 at its first
`iter()` (in `setup_data`), with the dataset's own rank check refusing rank 0's state.

On another layout (`Trainer(devices=3)` resuming a checkpoint of 2 devices, torchrun with
another --nproc-per-node or --nnodes, or another num_workers): `load_state_dict` gives the
dataset every rank's states, and the rest of the epoch is dealt anew to the new ranks (or
workers: each worker's state is its part of the rank's share) (`joader.client.relayout`); the
loader's own StatefulDataLoader state is not restored (its counts are the old rank's), so its
next iterator starts afresh and reads that rest. Lightning's restored count of the epoch's
batches is the old rank's too, and its epoch ends when that count reaches the loader's length
(`_TrainingEpochLoop._num_ready_batches_reached`): the count is set to the length less the
batches of this rank's share of the rest (`frameworks.lightning_resume_at`), so the epoch ends
with the rest, not before it (items never trained) or after it.
"""

from __future__ import annotations

from typing import Any

import torch

from joader.client import frameworks
from joader.client.checkpoint import JOB_TAG
from joader.errors import InvalidArgumentError

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError as error:  # torchdata is not a dependency of joader itself
    raise ImportError(
        "joader.client.loader needs torchdata (its StatefulDataLoader); install it with "
        "`pip install 'torchdata>=0.11'`"
    ) from error

__all__ = ["LOADER_STATE_VERSION", "JoaderDataLoader", "rank_state"]

LOADER_STATE_VERSION = 1
_TAG = "joader_loader"  # the key (holding the version) that marks a gathered state
_FRESH = "joader_fresh"  # a rank's entry: nothing to resume (see `JoaderDataLoader.state_dict`)


def _process_rank() -> tuple[int, int]:
    """(rank, world_size) of this process in the default process group, or (0, 1) without one.

    Not RANK / WORLD_SIZE from the environment: gathering needs a process group, and without
    one each process saves and loads only its own state."""
    if _has_group():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _has_group() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_state(state: Any, rank: int | None = None, world_size: int | None = None) -> dict[str, Any]:
    """The plain StatefulDataLoader state of one rank in `state`.

    `state` is what `JoaderDataLoader.state_dict()` returned (every rank's state), or a plain
    StatefulDataLoader state, which is returned as it is: it was saved by one rank, and is that
    rank's own (as StatefulDataLoader itself would load it). `rank` and `world_size` default to
    this process's place in torch.distributed (0 and 1 without a process group); a gathered
    state must be of that world size.
    """
    if rank is None or world_size is None:
        found_rank, found_size = _process_rank()
        rank = found_rank if rank is None else rank
        world_size = found_size if world_size is None else world_size
    if not isinstance(state, dict):
        raise InvalidArgumentError(
            f"JoaderDataLoader.load_state_dict: the state is a {type(state).__name__}, not a dict; "
            "load what JoaderDataLoader.state_dict() (or StatefulDataLoader.state_dict()) returned")
    if _TAG not in state:
        return state  # a plain StatefulDataLoader state (an older checkpoint): this rank's own
    version = state[_TAG]
    if not isinstance(version, int) or isinstance(version, bool) or version != LOADER_STATE_VERSION:
        raise InvalidArgumentError(
            f"JoaderDataLoader.load_state_dict: loader state version {version!r}; this joader reads "
            f"version {LOADER_STATE_VERSION}. Resume with the joader version that saved it.")
    unknown = sorted(str(key) for key in state if key not in (_TAG, "world_size", "ranks"))
    if unknown:
        raise InvalidArgumentError(
            f"JoaderDataLoader.load_state_dict: unknown key(s) {', '.join(map(repr, unknown))} in the "
            f"state (a gathered state has {_TAG!r}, 'world_size' and 'ranks'); load what "
            "JoaderDataLoader.state_dict() returned, or start without one")
    saved_size, ranks = state.get("world_size"), state.get("ranks")
    if (not isinstance(saved_size, int) or isinstance(saved_size, bool) or saved_size < 1
            or not isinstance(ranks, list) or len(ranks) != saved_size
            or not all(isinstance(entry, dict) for entry in ranks)):
        raise InvalidArgumentError(
            f"JoaderDataLoader.load_state_dict: the state is malformed (world_size {saved_size!r}, "
            f"{len(ranks) if isinstance(ranks, list) else 'no'} rank entries); load a state saved by "
            "JoaderDataLoader.state_dict()")
    if saved_size != world_size:
        alone = "" if _has_group() else (
            " (this process has no torch.distributed process group: call load_state_dict after "
            "init_process_group)")
        raise InvalidArgumentError(
            f"JoaderDataLoader.load_state_dict: the state was saved by a job of world size "
            f"{saved_size}, this job has world size {world_size}{alone}; each rank's state is its "
            f"share of the epoch as dealt to the saving job's ranks, so resume it with world size "
            f"{saved_size} (torchrun --nproc_per_node {saved_size}, Trainer(devices={saved_size})), "
            "or do not load the loader state")
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"JoaderDataLoader.load_state_dict: rank {rank} is not in 0..{world_size - 1}; pass "
            "rank= and world_size= consistently")
    return _checked_entry(ranks[rank], rank)


def _checked_entry(entry: dict[str, Any], rank: int) -> dict[str, Any]:
    """A rank's entry: `{_FRESH: True}` or a StatefulDataLoader state (never empty, never both)."""
    if entry == {_FRESH: True} or (entry and _FRESH not in entry):
        return entry
    raise InvalidArgumentError(
        f"JoaderDataLoader.load_state_dict: ranks[{rank}] is {_short(entry)}, neither a "
        f"StatefulDataLoader state nor {{{_FRESH!r}: True}} (a fresh pass); load what "
        "JoaderDataLoader.state_dict() returned, or start without one")


def _saved_workers(own: dict[str, Any]) -> Any:
    """The num_workers of the loader that saved `own` (torchdata's format: a multi-process state
    has it in `_snapshot._main_snapshot`, a single-process one has no `_snapshot`); None if
    the state does not say (torchdata checks the rest)."""
    snapshot = own.get("_snapshot")
    if snapshot is None:
        return 0
    main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else None
    return main.get("_num_workers") if isinstance(main, dict) else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class JoaderDataLoader(StatefulDataLoader):
    """torchdata's StatefulDataLoader, with a `state_dict()` that holds every rank's state.

    Use it in place of StatefulDataLoader (same arguments) when the ranks of a DDP job save ONE
    checkpoint, written by rank 0, as Lightning and the usual `if rank == 0: torch.save(...)`
    code do. A plain StatefulDataLoader's state is one rank's: saved by rank 0 only and loaded
    on every rank, it would make rank 1 resume rank 0's share of the epoch (JoaderDataset
    refuses that: "the state is of rank 0 of 2 ..."; a dataset without that check silently
    repeats rank 0's items and skips rank 1's).

    `state_dict()` is a COLLECTIVE under torch.distributed with world size > 1: every rank must
    call it, at the same point (the same step), or the ranks that did wait for the others until
    the process group's timeout. Lightning does (see the module docstring); in your own loop,
    call it on every rank and let rank 0 write:

        state = {"model": model.state_dict(), "loader": loader.state_dict()}  # every rank
        if rank == 0:
            torch.save(state, path)
        torch.distributed.barrier()

    `load_state_dict(state)` (on every rank, from the same file) takes this rank's own entry.
    The ranks are the default process group's (torch.distributed.get_rank()), which is also the
    rank JoaderDataset takes by default. With the NCCL backend the gather goes through the
    current CUDA device (torch.cuda.set_device(local_rank), as torchrun scripts and Lightning
    set it). Without a process group, or with world size 1, the state has the same format with
    one entry, so a checkpoint's format does not depend on how the job was launched.
    """

    def state_dict(self) -> dict[str, Any]:
        """Every rank's StatefulDataLoader state, gathered: {"joader_loader": 1, "world_size": W,
        "ranks": [state of rank 0, ..., state of rank W - 1]}. A collective (see the class)."""
        # Lightning resumes a checkpoint taken after an epoch's last batch at the next epoch,
        # where the loaded state's empty rest of the saved epoch made a whole epoch train
        # nothing: such a state starts afresh (a new pass: a whole epoch, still exactly once).
        own = {_FRESH: True} if frameworks.lightning_epoch_done(skip=2) else super().state_dict()
        _, world_size = _process_rank()
        if world_size == 1:
            ranks: list[Any] = [own]
        else:
            ranks = [None] * world_size
            torch.distributed.all_gather_object(ranks, own)
        return {_TAG: LOADER_STATE_VERSION, "world_size": world_size, "ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads this rank's entry of a gathered state, or a plain StatefulDataLoader state as
        this rank's own; a state gathered on another layout of ranks or hosts resumes the rest
        of its epoch dealt anew to this job's ranks (the module docstring). Not a collective."""
        if _saved_elsewhere(state_dict, self.dataset, self.num_workers):
            self._load_on_new_layout(state_dict)
            return
        own = rank_state(state_dict)
        if own.get(_FRESH):
            return  # saved after its epoch's last batch, under Lightning: a fresh pass
        saved_workers = _saved_workers(own)
        if saved_workers is not None and saved_workers != self.num_workers:
            # torchdata would raise a bare AssertionError at the next iter(), far from here.
            raise InvalidArgumentError(
                f"JoaderDataLoader.load_state_dict: this rank's state was saved by a loader with "
                f"num_workers={saved_workers!r}, this loader has num_workers={self.num_workers}; each "
                f"worker's state is its own part of the epoch, so build the loader with "
                f"num_workers={saved_workers!r}, or start without the loader state")
        super().load_state_dict(own)

    def _load_on_new_layout(self, state: dict[str, Any]) -> None:
        """Every rank's JoaderDataset states to the dataset (`joader.client.relayout`); under
        Lightning, its epoch's batch count set to resume with this rank's share of the rest."""
        if any(entry == {_FRESH: True} for entry in state["ranks"]):
            return  # saved after its epoch's last batch, under Lightning: a fresh pass
        states = [found for entry in state["ranks"] for found in dataset_states(entry)]
        self.dataset.load_state_dict(states)
        resume = self.dataset.resuming
        if resume is not None and resume.rest is not None:
            size = self.batch_size or self.dataset.batch_size
            batches = resume.rest.share // size if self.drop_last else -(-resume.rest.share // size)
            frameworks.lightning_resume_at(max(0, len(self) - batches), skip=2)


def dataset_states(value: Any) -> list[dict[str, Any]]:
    """Every JoaderDataset state in a StatefulDataLoader state: the training process's
    (`dataset_state`) or each DataLoader worker's (in `_snapshot`), wherever torchdata keeps it."""
    if isinstance(value, dict):
        if value.get("job") == JOB_TAG and "consumed" in value:
            return [value]
        return [found for item in value.values() for found in dataset_states(item)]
    if isinstance(value, (list, tuple)):
        return [found for item in value for found in dataset_states(item)]
    return []


def _saved_elsewhere(state: Any, dataset: Any, num_workers: int) -> bool:
    """Whether `state` is a gathered state of another layout than `dataset`'s job: another world
    size, or this rank's entry saved with its ranks on other hosts or by another number of
    DataLoader workers (each worker's state is its part of the rank's share: the rest is dealt
    anew, to these workers, as to new ranks). Malformed states are not (`rank_state` refuses
    them, naming the problem)."""
    if not isinstance(state, dict) or _TAG not in state or not isinstance(state.get("ranks"), list):
        return False
    if not hasattr(dataset, "resuming"):
        return False  # not a JoaderDataset: its own states, loaded as StatefulDataLoader does
    world_size = dataset.world_size
    if state.get("world_size") != world_size:
        return True
    rank = dataset.rank or 0
    entry = state["ranks"][rank] if 0 <= rank < len(state["ranks"]) else None
    hosts = dataset.hosts.as_dict() if dataset.hosts is not None else None
    found = dataset_states(entry)
    if any(saved.get("hosts") != hosts for saved in found):
        return True
    saved_workers = _saved_workers(entry) if isinstance(entry, dict) and entry != {_FRESH: True} else None
    return saved_workers is not None and saved_workers != num_workers
