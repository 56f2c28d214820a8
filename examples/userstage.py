"""A user stage: grayscale, resized to S x S, normalized to zero mean and unit variance, float32.

Serve it with a config file (user stages are named in joaderd's own config, never by a client):

    [sources.digits]
    path = "/data/digits"
    stage = "examples.userstage:factory"
    options = { size = 64 }

and `PYTHONPATH=. joaderd --config joaderd.toml` (the module must be importable by joaderd).
Each item is a float32 array of shape (1, S, S); every job gets the same arrays, computed once.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from joader.stages import ItemSpec


class NormalizedGray:
    """prepare(data, path) -> float32 (1, S, S); `spec` tells joaderd the fixed item size."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.name = f"normalized-gray:{size}"
        self.spec = ItemSpec.fixed((1, size, size), "float32")

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as image:
            gray = image.convert("L").resize((self.size, self.size), Image.Resampling.BILINEAR)
        pixels = np.asarray(gray, dtype=np.float32)
        pixels = (pixels - pixels.mean()) / (pixels.std() + 1e-6)
        return pixels[np.newaxis]


def factory(options: dict[str, Any]) -> NormalizedGray:
    return NormalizedGray(int(options.get("size", 64)))
