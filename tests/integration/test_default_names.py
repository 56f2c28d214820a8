"""Default job names that tell a bash loop's trials apart (issue 38): `train.py --lr 0.1` and
`train.py --lr 0.2`, not `train.py-14907` and `train.py-14910`; the same command run twice is
told apart by the pid of the later one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import ROOT

pytestmark = pytest.mark.timeout(120)

_TRAIN = r"""
import sys
from joader import JoaderDataset
ds = JoaderDataset("demo", indices=range(8), batch_size=4, threads=None)  # no name=: the default
print(ds.job_id, flush=True)
sys.stdin.read()  # attached until the test closes stdin
"""


def test_a_bash_loops_trials_are_named_by_their_arguments(tmp_path: Path, demo_root: Path, start_joaderd: Any) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=32)
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    env = dict(os.environ, JOADER_ADDRESS=server.address,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    trials = []
    try:
        for lr in ("0.1", "0.2", "0.1"):  # started one after another, as `for lr in ...; do ... &` does
            trial = subprocess.Popen([sys.executable, str(script), "--lr", lr], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
            trials.append(trial)
            assert trial.stdout is not None
            trial.job_id = trial.stdout.readline().strip()  # type: ignore[attr-defined]
            assert trial.job_id, f"trial --lr {lr} did not attach"  # type: ignore[attr-defined]
        names = {job["job_id"]: job["name"] for job in server.status()["jobs"]}
        assert [names[t.job_id] for t in trials] == [  # type: ignore[attr-defined]
            "train.py --lr 0.1", "train.py --lr 0.2", f"train.py --lr 0.1 (pid {trials[2].pid})"]
    finally:
        for trial in trials:
            assert trial.stdin is not None and trial.stdout is not None
            trial.stdin.close()
            trial.wait(timeout=30)
            trial.stdout.close()
