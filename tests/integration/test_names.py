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
            result = subprocess.run([sys.executable, "-m", "joader.client.tools.cli", *command, "--address", server.address],
                                    capture_output=True, text=True, timeout=60, env={"COLUMNS": "200", "PATH": ""})
            assert result.returncode == 0, result.stderr[-2000:]
            for name in NAMES:
                assert name in result.stdout, (command, name, result.stdout)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


_SAME_NAME = r"""
import sys
from joader import JoaderDataset
ds = JoaderDataset("demo", indices=range(20), address=sys.argv[1], batch_size=4, name="trial", return_index=True)
print(ds.job_id, flush=True)
assert sorted(int(index) for index, _, _ in ds) == list(range(20))  # served as any job is
print("read", flush=True)
sys.stdin.read()  # attached until the test closes stdin
"""


def test_a_second_live_job_of_a_name_is_served_and_both_sides_say_so(demo_root: Path, start_joaderd: Any) -> None:
    """NOTE [ Two live jobs of one name ] (server/registry/jobs.py): accepted, but no longer silently."""
    server = start_joaderd({"demo": demo_root}, cache_items=32)
    holders = []
    try:
        for _ in range(2):
            holder = subprocess.Popen([sys.executable, "-c", _SAME_NAME, server.address], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            holders.append(holder)
            assert holder.stdout is not None
            job_id = holder.stdout.readline().strip()
            assert holder.stdout.readline().strip() == "read", holder.communicate()[1][-3000:]
            holder.job_id = job_id  # type: ignore[attr-defined]
        first, second = (h.job_id for h in holders)  # type: ignore[attr-defined]
        named = sorted(job["job_id"] for job in server.status()["jobs"] if job["name"] == "trial")
        assert named == sorted([first, second])
    finally:
        errors = []
        for holder in holders:
            assert holder.stdin is not None and holder.stderr is not None
            holder.stdin.close()
            holder.wait(timeout=30)
            errors.append(holder.stderr.read())
            holder.stderr.close()
            holder.stdout.close()  # type: ignore[union-attr]
    notice = (f"a job named 'trial' is already attached (job id {first}); this one ({second}) is served as a "
              "separate job under the same name. Pass each JoaderDataset its own name= to tell them apart in "
              "joader status")
    assert "already attached" not in errors[0], errors[0]
    assert errors[1].count(notice) == 1 and f"JoaderDataset('demo'), job {second}: {notice}" in errors[1], errors[1]
    assert f"job {second}: {notice}" in server.log()
