"""Inputs as a careless user writes them, end to end.

A list file whose integer labels are sparse and one of them huge: before the fix, the label
10,000,000 built ten million class names (1.3 GB, 7 s) and then every Attach failed with an
UnboundLocalError. And sources joaderd must refuse at start, with the line or member and the fix,
never a traceback nor a start that fails later, item by item, blaming the stage.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest

from joader.sources.base import open_source

CLIENT = r"""
import json, sys
from joader import JoaderDataset
ds = JoaderDataset("listed", address=sys.argv[1], batch_size=4)
print(json.dumps({"classes": ds.classes, "class_to_idx": ds.class_to_idx, "targets": ds.targets.tolist(),
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


def _tar(members: list[tuple[str, bytes]], tail: bytes = b"") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    data = out.getvalue().rstrip(b"\0")
    return data + b"\0" * (-len(data) % 512) + tail + b"\0" * 1024


def _huge_json_header() -> bytes:
    info = tarfile.TarInfo("x.json")
    info.size = 2**70  # base-256: a corrupt header tarfile still parses
    return info.tobuf(tarfile.GNU_FORMAT)


BAD_SOURCES = {
    "label beyond int32": ("l.tsv", b"a.jpg\t0\nb.jpg\t100000000000000000000000\n",
                           r"line 2: label 100000000000000000000000 is too large \(at most 2147483647\); number classes"),
    "NUL in a path": ("l.tsv", b"a.jpg\t0\nb\0c.jpg\t1\n", r"line 2: the path .* holds a NUL byte"),
    "NUL in a label": ("l.csv", b"a.jpg,0\nb.jpg,1\0\n", r"line 2: the label .* holds a NUL byte; fix that line"),
    "a folder as a path": ("l.tsv", b"a.jpg\t0\nimages/\t1\n", r"line 2: path 'images/' names a folder"),
    "a signed label": ("l.tsv", b"a.jpg\t-1\n", r"line 1: label '-1' is signed"),
    "a corrupt member size": ("s.tar", _tar([("x.jpg", b"x"), ("x.cls", b"1")], _huge_json_header()),
                              r"member 'x.json': its data ends at byte \d+, past the end of the shard"),
    "NUL in a .cls": ("s.tar", _tar([("x.jpg", b"x"), ("x.cls", b"1\0")]), r"member 'x.cls': the label .* holds a NUL"),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_joaderd_refuses_a_bad_source_at_start_naming_where_and_the_fix(tmp_path: Path, case: str) -> None:
    name, content, message = BAD_SOURCES[case]
    (tmp_path / "a.jpg").write_bytes(b"x")
    (tmp_path / "b.jpg").write_bytes(b"x")
    (tmp_path / name).write_bytes(content)
    with tempfile.TemporaryDirectory(prefix="jd-", dir="/tmp") as sock_dir:  # short: sun_path
        try:
            run = subprocess.run(
                [sys.executable, "-m", "joader.server", "--listen", f"unix:{sock_dir}/s.sock", "--cache-size",
                 "1000000", "--workers", "1", "--source", f"bad={tmp_path / name}"],
                capture_output=True, text=True, timeout=60,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"joaderd served the source ({case}) instead of refusing it")
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert re.search(message, run.stderr), run.stderr[-3000:]
