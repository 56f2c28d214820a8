"""What a stage is: `ItemSpec` (what its items look like) and the `Stage` protocol."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from joader.errors import InvalidArgumentError

__all__ = ["ANY_DTYPE", "ANY_NDIM", "ItemSpec", "Stage"]

ANY_DTYPE = ""  # ItemSpec.dtype of a stage whose items' dtype is only known per item
ANY_NDIM = -1  # ItemSpec.ndim of a stage whose items' ndim is only known per item

_ALLOWED_KINDS = "biufc"  # bool, ints, unsigned, floats, complex: plain numbers in an arena slot


@dataclass(frozen=True)
class ItemSpec:
    """The items a stage produces.

    shape: the fixed shape of every item, or None (variable: each item carries its own shape).
    dtype: a numpy dtype name ("uint8", "float32"), or ANY_DTYPE ("") when known only per item.
    ndim: len(shape) when fixed; for a variable shape the ndim of every item, or ANY_NDIM (-1).
    max_nbytes: an upper bound of any item's bytes; exactly the item's bytes when fixed.
    """

    shape: tuple[int, ...] | None
    dtype: str
    ndim: int
    max_nbytes: int

    def __post_init__(self) -> None:
        shape = self.shape
        if shape is not None:
            try:
                shape = tuple(_nonneg_int(d) for d in shape)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(
                    f"ItemSpec.shape must be a tuple of non-negative ints or None, got "
                    f"{self.shape!r}"
                ) from exc
            object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, str):
            raise InvalidArgumentError(
                f"ItemSpec.dtype must be a numpy dtype name such as 'uint8', got {self.dtype!r}"
            )
        if self.dtype != ANY_DTYPE:
            object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        elif shape is not None:
            raise InvalidArgumentError(
                "ItemSpec with a fixed shape needs a dtype, e.g. ItemSpec.fixed((3, 224, 224), "
                "'float32')"
            )
        if not isinstance(self.ndim, int) or isinstance(self.ndim, bool) or self.ndim < -1:
            raise InvalidArgumentError(f"ItemSpec.ndim must be an int >= -1, got {self.ndim!r}")
        if shape is not None and self.ndim != len(shape):
            raise InvalidArgumentError(
                f"ItemSpec.ndim is {self.ndim} but shape {shape} has {len(shape)} dimensions"
            )
        if not isinstance(self.max_nbytes, int) or isinstance(self.max_nbytes, bool) or (
            self.max_nbytes <= 0
        ):
            raise InvalidArgumentError(
                f"ItemSpec.max_nbytes must be a positive int, got {self.max_nbytes!r}"
            )
        if shape is not None:
            exact = max(1, math.prod(shape) * np.dtype(self.dtype).itemsize)  # 1: never 0
            if self.max_nbytes != exact:
                raise InvalidArgumentError(
                    f"ItemSpec.max_nbytes must be exactly {exact} for shape {shape} of "
                    f"{self.dtype}, got {self.max_nbytes}; use ItemSpec.fixed(shape, dtype)"
                )

    @classmethod
    def fixed(cls, shape: tuple[int, ...], dtype: str) -> ItemSpec:
        """Every item has `shape` and `dtype`."""
        shape = tuple(shape)
        nbytes = math.prod(shape) * np.dtype(_dtype_name(dtype)).itemsize
        return cls(shape=shape, dtype=dtype, ndim=len(shape), max_nbytes=max(nbytes, 1))

    @classmethod
    def variable(cls, max_nbytes: int, dtype: str = ANY_DTYPE, ndim: int = ANY_NDIM) -> ItemSpec:
        """Items of varying shape, at most `max_nbytes` each."""
        return cls(shape=None, dtype=dtype, ndim=ndim, max_nbytes=max_nbytes)

    @property
    def is_fixed(self) -> bool:
        return self.shape is not None

    def check(self, item: np.ndarray) -> str | None:
        """Why `item` does not fit this spec, or None when it fits."""
        if self.shape is not None and item.shape != self.shape:
            return f"shape {item.shape}, but the stage's spec says {self.shape}"
        if self.dtype != ANY_DTYPE and item.dtype.name != self.dtype:
            return f"dtype {item.dtype.name}, but the stage's spec says {self.dtype}"
        if self.ndim != ANY_NDIM and item.ndim != self.ndim:
            return f"{item.ndim} dimensions, but the stage's spec says {self.ndim}"
        if item.nbytes > self.max_nbytes:
            return (
                f"{item.nbytes} bytes (shape {item.shape}, {item.dtype.name}), more than the "
                f"spec's max_nbytes {self.max_nbytes}"
            )
        return None


@runtime_checkable
class Stage(Protocol):
    """The shared stage: bytes of one item -> a C-contiguous array, the same for every job.

    Optional (not part of the protocol, looked up with getattr): `item_nbytes(data: bytes) ->
    int | None`, the exact bytes `prepare(data, ...)` will return, read cheaply (from a file
    header, without decoding), or None. joaderd reads it ahead of an item's first decode (the
    built-in image stages have it); without it, an item is placed once prepared (size first),
    one round trip later (`joader.server.books.item_sizes`).
    """

    name: str  # e.g. "center-crop:256", "resize:256/L/turbo"
    spec: ItemSpec

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        """The prepared item of `data`; `path` only names the item in messages.

        Raises `joader.errors.DecodeError` on bad data.
        """
        ...


def _nonneg_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(value)
    return int(value)


def _dtype_name(dtype: str) -> str:
    try:
        resolved = np.dtype(dtype)
    except TypeError as exc:
        raise InvalidArgumentError(
            f"ItemSpec.dtype {dtype!r} is not a numpy dtype; use a name such as 'uint8' or "
            "'float32'"
        ) from exc
    if resolved.kind not in _ALLOWED_KINDS:
        raise InvalidArgumentError(
            f"ItemSpec.dtype {dtype!r} is not a plain number type; items must be bool, int, "
            "unsigned, float or complex arrays"
        )
    return resolved.name
