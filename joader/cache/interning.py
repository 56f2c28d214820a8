"""One object per distinct value, for values held per cached item (NOTE [ An item's footprint ]
in server/books/records.py): an item's form (its size, shape and dtype, one tuple) repeated for hundreds of
thousands of items costs an object each unless they share one."""

from __future__ import annotations

from typing import Any, TypeVar

_T = TypeVar("_T")


class Interner:
    """`get(value)`: the first object seen equal to `value` (bounded: beyond `limit` distinct
    values, each new one is returned as it is and not kept)."""

    __slots__ = ("_limit", "_values")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._values: dict[Any, Any] = {}

    def get(self, value: _T) -> _T:
        shared = self._values.get(value)
        if shared is None:
            shared = value
            if len(self._values) < self._limit:
                self._values[value] = value
        return shared  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self._values)
