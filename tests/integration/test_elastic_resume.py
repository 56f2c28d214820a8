"""Elastic resume (issue 40): a mid-epoch checkpoint resumed on another number of ranks or hosts.

The README's torchrun example (`<!-- readme-check: torchrun -->`), run as written but for what
a test must see: the items' indices (`return_index=True`), a record of every sample the loop
receives (epoch, index, label, crc32 of its pixels), a batch of 8, a note of the share each rank
resumed, and a preemption right after the checkpoint of a given step (every rank SIGKILLs itself
once the checkpoint is written, as a preempted job dies). Then the same script resumes on
another layout. The item count (144) and the steps are chosen so that a share on one host needs
no padding (a copy counts as a duplicate): 144 - 48 = 96 is 3 x 32 and 1 x 96. And Lightning,
`Trainer(devices=2)` resumed with `devices=3`.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyroaring import BitMap

from joader.sampling.hosts import HostLayout, host_part, source_salt
from joader.testing.integrity import check_records, read_records
from tests.support.processes import Clients, free_port, wait_for

README = Path(__file__).resolve().parents[2] / "README.md"
pytestmark = pytest.mark.slow
ITEMS = 144

# What the test adds to the README's script: (the README's text, what replaces it).
EDITS = [
    ('ds = JoaderDataset("demo")', 'ds = JoaderDataset("demo", indices=range(ITEMS), return_index=True)'),
    ("batch_size=32, num_workers=2", "batch_size=8, num_workers=WORKERS"),
    ("for epoch in range(start, 2):", "for epoch in range(start, EPOCHS):"),
    ("for step, (images, labels) in enumerate(loader):",
     "for step, (indices, images, labels) in enumerate(loader):"),
    ("...  # forward, backward (DDP all-reduces the gradients), optimizer step",
     "record(epoch, indices, images, labels)\n        dist.all_reduce(torch.ones(1))  # DDP's step"),
    ("            dist.barrier()\n", "            dist.barrier()\n            preempt_at(epoch, step)\n"),
    ('loader.load_state_dict(state["loader"])  # this rank\'s own entry',
     'loader.load_state_dict(state["loader"])  # this rank\'s own entry\n    note_resume(ds)'),
]
PRELUDE = '''
import json, os, signal, zlib
ITEMS, WORKERS, EPOCHS = int(os.environ["ITEMS"]), int(os.environ["WORKERS"]), int(os.environ["EPOCHS"])
_out = open(os.environ["RECORDS"] + f"-{os.environ['RANK']}.jsonl", "a")

def record(epoch, indices, images, labels):
    for index, image, label in zip(indices.tolist(), images, labels.tolist()):
        _out.write(json.dumps({"kind": "sample", "epoch": epoch + 1, "index": index, "label": label,
                               "crc": zlib.crc32(image.contiguous().numpy().tobytes())}) + "\\n")
    _out.flush()

def note_resume(ds):
    rest = ds.resuming.rest if ds.resuming is not None else None
    with open(os.environ["RECORDS"] + f"-{os.environ['RANK']}.resume.json", "w") as out:
        json.dump({"share": rest.share if rest else None, "hosts": ds.hosts.as_dict() if ds.hosts else None}, out)

def preempt_at(epoch, step):
    if os.environ.get("PREEMPT") == f"{epoch}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
'''


def _script() -> str:
    block = dict(re.findall(r"<!-- readme-check: (\w+) -->\n```python\n(.*?)```", README.read_text(), re.S))["torchrun"]
    for old, new in EDITS:
        assert block.count(old) == 1, f"the README's torchrun example no longer has {old!r}: update EDITS"
        block = block.replace(old, new)
    head, _, rest = block.partition("dist.init_process_group")
    return head + PRELUDE + "dist.init_process_group" + rest


def _run(clients: Clients, tmp_path: Path, nodes: list[tuple[Any, int]], name: str, workers: int,
         preempt: str | None, epochs: int) -> None:
    """The script under torchrun: one agent per (joaderd, ranks) node, over c10d when several
    (each node's ranks read through its own joaderd, as JOADER_ADDRESS says on a real node)."""
    endpoint = f"127.0.0.1:{free_port()}"
    runs = []
    for index, (server, ranks) in enumerate(nodes):
        env = {"JOADER_ADDRESS": server.address, "ITEMS": str(ITEMS), "WORKERS": str(workers),
               "EPOCHS": str(epochs), "RECORDS": str(tmp_path / name), "PREEMPT": preempt or ""}
        where = (["--nnodes", str(len(nodes)), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                  "--rdzv-id", name] if len(nodes) > 1 else
                 ["--master_addr", "127.0.0.1", "--master_port", str(free_port())])
        runs.append(clients.popen(f"{name}-{index}", [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), *where,
            "--max-restarts", "0", str(tmp_path / "train.py")], cwd=tmp_path, env=env))
    for run in runs:
        clients.wait(run, timeout_s=240, expect=None if preempt else 0)
    for server, _ in nodes:
        wait_for(lambda server=server: server.status()["jobs"] == [], 30, f"{name}'s job to end")


def test_a_checkpoint_moves_between_layouts_of_ranks_and_hosts_every_epoch_exactly_once(
        demo_root: Path, start_joaderd: Any, clients: Clients, expected: Any, tmp_path: Path) -> None:
    """The README's script, preempted after a mid-epoch checkpoint and resumed on another layout,
    four times: 2 hosts x 1 rank -> 1 host x 3 ranks with 2 DataLoader workers each -> 2 hosts x
    1 rank with 2 workers -> 1 process (two joaderds, torchrun over c10d for 2 hosts). Every
    epoch: every item, every sample's pixels and label, and no copy beyond the padding of the
    one share that needs it (2 hosts: a host whose part has fewer left pads, so that every rank
    gets as many; `joader.client.relayout`). On 2 hosts each rank reads only its host's part of
    the new layout."""
    servers = [start_joaderd({"demo": demo_root}, cache_items=ITEMS) for _ in range(2)]
    (tmp_path / "train.py").write_text(_script())
    two_hosts = [(servers[0], 1), (servers[1], 1)]
    chain = [("hosts", two_hosts, 0, "0:2"),           # epoch 0: 3 batches of 8 per rank
             ("three", [(servers[0], 3)], 2, "1:2"),   # epoch 0's rest, 32 per rank; epoch 1 to step 2
             ("hosts-again", two_hosts, 2, "2:2"),     # epoch 1's rest, about 36 per rank; epoch 2 to step 2
             ("one", [(servers[0], 1)], 0, None)]      # epoch 2's rest, 96; epoch 3 whole
    for name, nodes, workers, preempt in chain:
        _run(clients, tmp_path, nodes, name, workers, preempt, epochs=4)
    ranks = {name: sum(local for _, local in nodes) for name, nodes, _, _ in chain}
    records = {name: {rank: read_records(tmp_path / f"{name}-{rank}.jsonl") for rank in range(ranks[name])}
               for name in ranks}
    shares = {name: {json.loads((tmp_path / f"{name}-{rank}.resume.json").read_text())["share"]
                     for rank in range(ranks[name])} for name in list(ranks)[1:]}
    per_run = {name: Counter(r["epoch"] for rank in runs.values() for r in rank) for name, runs in records.items()}
    print(f"samples per epoch, by run: {per_run}; shares of the rest: {shares}")
    findings = check_records([r for runs in records.values() for rank in runs.values() for r in rank],
                             expected, set(range(ITEMS)), 4, "2 hosts -> 3 ranks -> 2 hosts -> 1")
    assert not (findings.wrong_pixels or findings.wrong_labels or findings.missing), findings.summary()
    assert shares["three"] == {32} and shares["one"] == {96} and len(shares["hosts-again"]) == 1
    padding = 2 * shares["hosts-again"].pop() - 72  # epoch 1's rest on 2 hosts: the one share that pads
    assert findings.duplicated == padding <= 8, findings.summary()
    assert per_run == {"hosts": Counter({1: 48}), "three": Counter({1: 96, 2: 72}),
                       "hosts-again": Counter({2: 72 + padding, 3: 48}), "one": Counter({3: 96, 4: 144})}
    for rank in range(2):
        part = host_part(BitMap(range(ITEMS)), source_salt("demo"), HostLayout(2, rank, 1, 0), drop_last=False)
        read = BitMap(r["index"] for r in records["hosts-again"][rank])
        assert read <= part, f"rank {rank} read {len(read - part)} items outside its host's part"


# ------------------------------------------------------------------------------ Lightning

JOB = "tests.support.framework_jobs"


def test_lightning_ddp_resumes_a_mid_epoch_checkpoint_of_2_devices_on_3(
        demo_root: Path, start_joaderd: Any, clients: Clients, expected: Any, tmp_path: Path) -> None:
    """`Trainer(devices=2)` checkpoints every 5 steps and is killed -9 in epoch 1 (9 batches of 8
    per rank over 144 items; the checkpoint at step 15 is 6 batches into epoch 1); the same
    script with `Trainer(devices=3)` and `ckpt_path=` of that checkpoint. The epoch's rest (48
    items) is 16 per new rank, Lightning's epoch ends with it (its restored batch count is set
    to the new length less the share's batches), and epoch 2 is whole on 3 ranks."""
    server = start_joaderd({"demo": demo_root}, cache_items=ITEMS)
    out = tmp_path / "lightning"
    base = ("lightning", "--address", server.address, "--out", str(out), "--epochs", "3",
            "--batch-size", "8", "--every", "5", "--items", str(ITEMS))
    run = clients.popen("lightning-2", [sys.executable, "-m", JOB, *base, "--devices", "2", "--kill-at", "1:7"])
    assert clients.wait(run, timeout_s=240, expect=None) != 0, "the run was to be killed mid-epoch"
    checkpoint = out / "epoch=1-step=15.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in out.glob("*.ckpt"))
    (out / "mark-2-15.json").write_text(json.dumps({"lines": 0}))  # rank 2 is new: nothing of it to keep
    wait_for(lambda: server.status()["jobs"] == [], 30, "the killed run's job to end")
    resumed = clients.popen("lightning-3", [sys.executable, "-m", JOB, *base, "--devices", "3",
                                            "--resume", str(checkpoint)])
    clients.wait(resumed, timeout_s=240)
    records = [r for rank in range(3) for r in read_records(out / f"records-{rank}.jsonl")]
    per_rank = {rank: Counter(r["epoch"] for r in records if r["rank"] == rank) for rank in range(3)}
    print(f"Lightning 2 -> 3 devices: items per rank per epoch {per_rank}")
    findings = check_records(records, expected, set(range(ITEMS)), 3, "Lightning DDP 2 -> 3 devices")
    assert findings.ok, findings.summary()
    assert per_rank == {0: Counter({1: 72, 2: 48 + 16, 3: 48}), 1: Counter({1: 72, 2: 48 + 16, 3: 48}),
                        2: Counter({2: 16, 3: 48})}
    done = json.loads((out / "done.json").read_text())
    assert done["len_loader"] == done["batches_per_epoch"] == 6


# ------------------------------------------------------------------------------ DataLoader workers

WORKERS_SCRIPT = '''
import json, sys, zlib
from joader import JoaderDataLoader, JoaderDataset

def run(workers, batches, state):
    ds = JoaderDataset("demo", indices=range(int(sys.argv[3])), address=sys.argv[1], return_index=True)
    loader = JoaderDataLoader(ds, batch_size=8, num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    got = []
    for step, (indices, images, labels) in enumerate(loader):
        got += [{"kind": "sample", "epoch": 1, "index": index, "label": label,
                 "crc": zlib.crc32(image.contiguous().numpy().tobytes())}
                for index, image, label in zip(indices.tolist(), images, labels.tolist())]
        if step + 1 == batches:
            break
    saved = loader.state_dict()
    ds.close()
    return got, saved

runs, state = [], None
for workers, batches in ((2, 5), (0, 4), (3, None)):
    got, state = run(workers, batches, state)
    runs.append(got)
json.dump(runs, open(sys.argv[2], "w"))
'''


def test_a_checkpoint_resumes_under_another_number_of_dataloader_workers(
        demo_root: Path, start_joaderd: Any, clients: Clients, expected: Any, tmp_path: Path) -> None:
    """One process, an epoch read by 2 DataLoader workers, checkpointed after 5 batches, resumed
    with none for 4 batches, checkpointed, resumed with 3: each worker's state is its part of
    the rank's share, so the rest is dealt anew to the new readers, and the epoch is exactly
    once over the three loaders, every sample's pixels checked."""
    server = start_joaderd({"demo": demo_root}, cache_items=ITEMS)
    out = tmp_path / "runs.json"
    run = clients.popen("workers", [sys.executable, "-c", WORKERS_SCRIPT, server.address, str(out), str(ITEMS)])
    clients.wait(run, timeout_s=120)
    runs = json.loads(out.read_text())
    assert [len(r) for r in runs] == [40, 32, ITEMS - 72]
    findings = check_records([r for got in runs for r in got], expected, set(range(ITEMS)), 1, "2 -> 0 -> 3 workers")
    assert findings.ok, findings.summary()
