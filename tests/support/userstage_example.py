"""A user stage for the tests (`userstage_example:factory`): grey, resized, float32 in [0, 1].

factory(options) takes:
  size (int, default 32): the output side; items are float32 (1, size, size) with a fixed spec.
  variable (bool): no `spec` attribute: joaderd learns dtype/ndim per item (shape (1, h, w)).
  fail_on (str): prepare raises ValueError when the path contains this text.
  bad_shape (bool): prepare returns a shape that contradicts the spec.
  big_endian (bool): prepare returns '>f4' (joaderd must hand out native float32).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from joader.stages import ItemSpec


class GreyFloat:
    def __init__(self, options: dict) -> None:
        self.size = int(options.get("size", 32))
        self.variable = bool(options.get("variable", False))
        self.fail_on = options.get("fail_on")
        self.bad_shape = bool(options.get("bad_shape", False))
        self.big_endian = bool(options.get("big_endian", False))
        if not self.variable:
            self.spec = ItemSpec.fixed((1, self.size, self.size), "float32")

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        if self.fail_on and self.fail_on in path:
            raise ValueError(f"refusing {path}")
        with Image.open(io.BytesIO(data)) as img:
            grey = img.convert("L")
        if self.variable:
            width = self.size
            height = max(1, round(self.size * grey.height / grey.width))
        else:
            width = height = self.size
        if self.bad_shape:
            height += 1
        out = np.asarray(grey.resize((width, height), Image.Resampling.BILINEAR), np.float32)
        out = (out / 255.0)[None]
        return out.astype(">f4") if self.big_endian else out


def factory(options: dict) -> GreyFloat:
    return GreyFloat(options)


def broken_factory(options: dict) -> GreyFloat:
    raise RuntimeError("the model file is missing")


def no_prepare(options: dict) -> object:
    return object()


class BadSpec:
    spec = "float32 please"

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        return np.zeros(1, np.float32)


NOT_CALLABLE = 42


def bad_spec(options: dict) -> BadSpec:
    return BadSpec()
