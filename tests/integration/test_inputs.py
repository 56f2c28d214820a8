"""Labels as a careless user writes them, end to end: a list file whose integer labels are
sparse and one of them huge. Before the fix, the label 10,000,000 built ten million class names
(1.3 GB, 7 s) and then every Attach failed with an UnboundLocalError."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from joader.sources.base import open_source

CLIENT = r"""
import json, sys
from joader import JoaderDataset
ds = JoaderDataset("listed", address=sys.argv[1], batch_size=4)
print(json.dumps({"classes": ds.classes, "class_to_idx": ds.class_to_idx, "targets": ds.targets,
                  "labels": sorted(int(label) for _, label in ds)}))
"""


def test_sparse_and_huge_integer_labels_are_classes_that_occur(demo_root: Path, start_joaderd: Any) -> None:
    paths = list(open_source(str(demo_root)).paths)[:6]
    labels = [3, 10_000_000, 3, 7, 10_000_000, 7]
    listed = demo_root.parent / "sparse-labels.tsv"
    listed.write_text("".join(f"{demo_root.name}/{p}\t{label}\n" for p, label in zip(paths, labels, strict=True)))
    try:
        server = start_joaderd({"listed": listed}, cache_items=16)
        run = subprocess.run([sys.executable, "-c", CLIENT, server.address], capture_output=True, text=True,
                             timeout=120)
    finally:
        listed.unlink()
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["classes"] == ["3", "7", "10000000"]
    assert got["class_to_idx"] == {"3": 3, "7": 7, "10000000": 10_000_000}
    assert got["targets"] == labels and got["labels"] == sorted(labels)
