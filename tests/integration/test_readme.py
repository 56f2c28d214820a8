"""The README's framework examples, run as they are written (issue 18: "the code that works,
checked by running it"). Each block marked `<!-- readme-check: NAME -->` is written to a file
and run against a real joaderd (JOADER_ADDRESS, source "demo") with the launcher its text names:
Lightning as a plain script (its DDP launcher starts the second rank), accelerate and the
torchrun example under torchrun with 2 ranks; the torchrun one is then run again and resumes
from the checkpoint the first run wrote.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import NUM_DEMO_ITEMS, Clients, free_port

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"<!-- readme-check: (\w+) -->\n```python\n(.*?)```", re.S)
pytestmark = pytest.mark.slow


def _blocks() -> dict[str, str]:
    return dict(BLOCK.findall(README.read_text()))


def test_the_readme_marks_its_framework_examples() -> None:
    assert set(_blocks()) == {"lightning", "accelerate", "torchrun"}


@pytest.mark.parametrize("name", ["lightning", "accelerate", "torchrun"])
def test_a_readme_example_runs_as_written(name: str, demo_root: Path, start_joaderd: Any,
                                          tmp_path: Path) -> None:
    # A cache of whole batches for every queue (batch 32, 2 ranks): with less, replies come
    # short and the ranks may count their batches differently (joaderd warns).
    server = start_joaderd({"demo": demo_root}, cache_items=NUM_DEMO_ITEMS)
    script = tmp_path / "train.py"
    script.write_text(_blocks()[name])
    runner = Clients(tmp_path)
    env = {"JOADER_ADDRESS": server.address}

    def launch() -> list[str]:
        if name == "lightning":
            return [sys.executable, str(script)]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script)]

    try:
        runner.wait(runner.popen(name, launch(), cwd=tmp_path, env=env), timeout_s=240)
        if name == "torchrun":  # again: it resumes from the checkpoint the first run wrote
            assert (tmp_path / "checkpoint.pt").exists()
            runner.wait(runner.popen(f"{name}-again", launch(), cwd=tmp_path, env=env), timeout_s=240)
    finally:
        runner.close()
    assert server.status()["jobs"] == [], "every job of the example ended with it"
