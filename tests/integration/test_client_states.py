"""`load_state_dict` with states that are not this job's: each refused with an error that names
the fix, before anything is read. Run in a client process (the pytest process holds no gRPC)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

CLIENT = r"""
import json, sys
from pyroaring import BitMap
from joader.client.dataset import JoaderDataset

address = sys.argv[1]
ds = JoaderDataset("demo", indices=range(0, 40), address=address, seed=3, batch_size=4)
good = ds.state_dict()
other_indices = JoaderDataset("demo", indices=range(0, 41), address=address, batch_size=4).state_dict()
other_seed = JoaderDataset("demo", indices=range(0, 40), address=address, seed=4, batch_size=4).state_dict()
cases = {
    "own": good,
    "other_indices": other_indices,
    "other_seed": other_seed,
    "other_source": dict(good, source="imagenet"),
    "huge_epoch": dict(good, epoch=2**40),
    "negative_epoch": dict(good, epoch=-1),
    "forged_parts": dict(good, parts=10**6),
    "not_a_state": {"epoch": 1},
}
out = {}
for name, state in cases.items():
    try:
        ds.load_state_dict(state)
        out[name] = "ok"
    except Exception as error:
        out[name] = f"{type(error).__name__}: {error}"
print(json.dumps(out))
"""


def test_states_of_other_jobs_and_impossible_values_are_refused(demo_root: Path, start_joaderd: Any) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=32)
    run = subprocess.run([sys.executable, "-c", CLIENT, server.address], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out.pop("own") == "ok"
    expected = {
        "other_indices": "other indices",
        "other_seed": "seed 4, not 3",
        "other_source": "source 'imagenet'",
        "huge_epoch": "is not an epoch number",
        "negative_epoch": "is not an epoch number",
        "forged_parts": "is not a number of readers",
        "not_a_state": "not a JoaderDataset state",
    }
    for case, words in expected.items():
        assert out[case].startswith("InvalidArgumentError") and words in out[case], (case, out[case])


READ_AHEAD = r"""
import json, sys, time, zlib
import torch
from pyroaring import BitMap
from joader.client.dataset import JoaderDataset

address = sys.argv[1]
ds = JoaderDataset("demo", indices=range(0, 40), address=address, return_index=True, prefetch=3)
loader = torch.utils.data.DataLoader(ds, batch_size=4)
taken = []
for indices, images, labels in loader:
    taken += [(int(i), int(l), zlib.crc32(x.contiguous().numpy().tobytes())) for i, x, l in zip(indices, images, labels)]
    if len(taken) == 8:
        time.sleep(0.5)  # the thread reads ahead meanwhile
        ahead = len(ds._connection.board.received(ds._progress.epoch))
        state = ds.state_dict()
        break
ds.close()
again = JoaderDataset("demo", indices=range(0, 40), address=address, return_index=True)
again.load_state_dict(state)
rest = [(int(i), int(l), zlib.crc32(x.contiguous().numpy().tobytes()))
        for indices, images, labels in torch.utils.data.DataLoader(again, batch_size=4)
        for i, x, l in zip(indices, images, labels)]
print(json.dumps({"taken": taken, "rest": rest, "ahead": ahead,
                  "consumed": sorted(BitMap.deserialize(state["consumed"]))}))
"""


def test_a_checkpoint_counts_what_the_loop_took_not_what_was_read_ahead(demo_root: Path, start_joaderd: Any,
                                                                        expected: Any) -> None:
    """With read-ahead (`prefetch`, num_workers=0), replies beyond the loop's batch are already
    copied out and received; a checkpoint taken after two batches must hold those 8 items only,
    and the resumed epoch must give the other 32, each once, with the right pixels and label."""
    server = start_joaderd({"demo": demo_root}, cache_items=64)
    run = subprocess.run([sys.executable, "-c", READ_AHEAD, server.address], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    taken = [i for i, _, _ in out["taken"]]
    assert out["ahead"] > 8  # the thread had read beyond the loop
    assert out["consumed"] == sorted(taken)
    rest = [i for i, _, _ in out["rest"]]
    assert sorted(taken + rest) == list(range(40))
    for index, label, crc in out["taken"] + out["rest"]:
        assert (label, crc) == (expected[index].label, expected[index].crc), index
