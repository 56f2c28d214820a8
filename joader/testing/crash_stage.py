"""A user stage that kills its decode worker on some files (`os._exit`), as a native decoder
crash or an OOM kill would, and is joader's center-crop on every other file.

    stage = "joader.testing.crash_stage:factory"
    options = { size = 64, crash_on = ["class_0/img_0003.jpg", ...] }
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from joader.stages import build_stage


class CrashOn:
    def __init__(self, options: dict[str, Any]) -> None:
        self.inner = build_stage("center-crop", size=int(options.get("size", 64)))
        self.spec = self.inner.spec
        self.name = f"crash-on({self.inner.name})"
        self.crash_on = tuple(options.get("crash_on", ()))

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        if path.endswith(self.crash_on):
            os._exit(3)
        return self.inner.prepare(data, path)


def factory(options: dict[str, Any]) -> CrashOn:
    return CrashOn(options)
