"""The examples run as a user runs them: `python examples/real_job.py` against a real joaderd.

real_job.py sizes its model from what the source serves (`ds.item_shape`, `ds.item_dtype`,
`ds.class_to_idx`); here it trains one short epoch on a source whose user stage yields float32
(1, S, S) items (examples/userstage.py) and on a list file whose integer labels are not 0..K-1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from joader.sources.imagefolder import list_image_folder
from tests.support.processes import NUM_DEMO_ITEMS

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
REAL_JOB = ROOT / "examples" / "real_job.py"
# What a torchrun or a caller's environment could leak into the example and make it a DDP rank
# or send it to another joaderd.
_SCRUBBED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "JOADER_ADDRESS")


def run_real_job(address: str, source: str, tmp_path: Path) -> str:
    env = {key: value for key, value in os.environ.items() if key not in _SCRUBBED}
    try:
        done = subprocess.run(
            [sys.executable, str(REAL_JOB), "--address", address, "--source", source, "--epochs", "1",
             "--batch-size", "16", "--workers", "0", "--checkpoint", str(tmp_path / f"{source}.ckpt")],
            capture_output=True, text=True, timeout=45, env=env, cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"examples/real_job.py on {source!r} did not finish within 45 s:\n{error.stderr}")
    assert done.returncode == 0, f"examples/real_job.py on {source!r} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_real_job_runs_on_a_gray_float32_user_stage_and_on_sparse_integer_labels(
        demo_root: Path, start_joaderd: Any, tmp_path: Path) -> None:
    listing = list_image_folder(demo_root)
    # A list file's paths stay inside its folder: it goes beside the shared demo images, and away
    # again once joaderd has listed it. Its labels (5, 15, 25, 35) are delivered as written.
    sparse = demo_root.parent / "sparse-labels.tsv"
    sparse.write_text("".join(f"{demo_root.name}/{path}\t{10 * int(label) + 5}\n"
                              for path, label in zip(listing.paths, listing.labels.tolist(), strict=True)))
    config = tmp_path / "joaderd.toml"
    config.write_text(
        f'[sources.gray]\npath = "{demo_root}"\nstage = "examples.userstage:factory"\noptions = {{ size = 40 }}\n'
        f'[sources.sparse]\npath = "{sparse}"\n'
    )
    try:
        server = start_joaderd({}, cache_items=400, extra=["--config", str(config)],
                               env={"PYTHONPATH": str(ROOT)})
    finally:
        sparse.unlink()
    for source in ("gray", "sparse"):
        out = run_real_job(server.address, source, tmp_path)
        assert f"rank 0: epoch 1: {NUM_DEMO_ITEMS} samples" in out, out
        assert (tmp_path / f"{source}.ckpt.rank0").exists()
