"""User text shown by `joader top` and `joader status` is text, never markup: a job named
`exp[/data/imagenet]` made `joader top` exit with rich's MarkupError for everyone on the host,
and `resnet50[lr=0.1]` showed as `resnet50`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

NAMES = ("exp[/data/imagenet]", "resnet50[lr=0.1]", "[bold]loud")

_HOLD = r"""
import sys
from joader import JoaderDataset
address = sys.argv[1]
datasets = [JoaderDataset("demo", indices=range(20), address=address, batch_size=4, name=name)
            for name in sys.argv[2:]]
print("attached", flush=True)
sys.stdin.read()  # attached until the test closes stdin
"""


def test_job_names_with_brackets_are_shown_as_written(demo_root: Path, start_joaderd: Any) -> None:
    server = start_joaderd({"demo": demo_root}, cache_items=32)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, server.address, *NAMES], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "attached"
        for command in (["top", "--once", "--interval", "0.2"], ["status"]):
            result = subprocess.run([sys.executable, "-m", "joader.client.cli", *command, "--address", server.address],
                                    capture_output=True, text=True, timeout=60, env={"COLUMNS": "200", "PATH": ""})
            assert result.returncode == 0, result.stderr[-2000:]
            for name in NAMES:
                assert name in result.stdout, (command, name, result.stdout)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
