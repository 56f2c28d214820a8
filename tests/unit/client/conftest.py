"""A real joaderd over a small demo source, for the client's tests that read items."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from joader.client.channel import reset_channel
from joader.client.tools.demo_data import make_demo_data
from joader.launch import JoaderdProcess

ITEMS = 48
IMAGE_SIZE = 16


@pytest.fixture(scope="module")
def joaderd() -> Iterator[str]:
    """joaderd's address."""
    work = Path(tempfile.mkdtemp(prefix="jdc-", dir="/tmp"))  # short: sun_path is 108 bytes
    make_demo_data(work / "demo", ITEMS, num_classes=3, seed=1, progress=False)
    server = JoaderdProcess.start(
        ["--listen", f"unix:{work / 's.sock'}", "--cache-size", str(ITEMS * 3 * IMAGE_SIZE * IMAGE_SIZE),
         "--image-size", str(IMAGE_SIZE), "--workers", "1", "--lease-s", "3", "--source", f"demo={work / 'demo'}"],
        stdout=work / "joaderd.log", ready_timeout_s=60)
    try:
        yield server.address
    finally:
        # NOTE [ No gRPC channel outlives these tests ]
        # This process goes on to fork (the decode pool's tests fork a forker): a child forked
        # while a gRPC channel is open can crash, so the readers' channel is closed here.
        reset_channel(server.address)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
