"""A user stage that hangs its decode worker on some files (it sleeps for good, as a read from a
hung mount or a decoder stuck in a loop would), and is joader's center-crop on every other file.

A file hangs if its name ends with one of `hang_on`, or if its bytes start with `HANG_MARK`
(so that a test can "fix" a file by writing an image over it).

    stage = "joader.testing.hang_stage:factory"
    options = { size = 64, hang_on = ["class_0/img_0003.jpg", ...] }
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from joader.stages import build_stage

HANG_MARK = b"JOADER-HANG"


class HangOn:
    def __init__(self, options: dict[str, Any]) -> None:
        self.inner = build_stage("center-crop", size=int(options.get("size", 64)))
        self.spec = self.inner.spec
        self.name = f"hang-on({self.inner.name})"
        self.hang_on = tuple(options.get("hang_on", ()))

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        if data.startswith(HANG_MARK) or (self.hang_on and path.endswith(self.hang_on)):
            while True:  # until the pool's decode timeout kills this worker
                time.sleep(1.0)
        return self.inner.prepare(data, path)


def factory(options: dict[str, Any]) -> HangOn:
    return HangOn(options)
