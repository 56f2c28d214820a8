"""User stages: "package.module:factory", where factory(options) returns an object with
`prepare(data: bytes, path: str) -> numpy.ndarray` and, optionally, `spec` (an `ItemSpec`).

Without a spec the items are variable: dtype and ndim are known per item, and each item may
have at most options["max_item_bytes"] bytes (64 MiB by default). Every item is checked
against the spec; a stage that breaks it, or raises, fails that item with a `DecodeError` that
names the stage, the item and the fix, so a faulty stage cannot take joaderd down.

A user stage cannot say an item's size before preparing it (the built-in image stages read it
from the file's header, `ImageStage.item_nbytes`), and need not: joaderd sends the first decode
of each item with no room in the cache (size first), the decode worker keeps what prepare()
returned and says its size, and joaderd places it in exactly that many bytes; it remembers the
size, so every later decode of the item is placed exactly at once (`joader.server.books.item_sizes`).
max_item_bytes stays the bound every item is checked against.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import numpy as np

from joader.errors import DecodeError, InvalidArgumentError
from joader.sources.safe_open import display_path
from joader.stages.base import ItemSpec

__all__ = ["DEFAULT_MAX_ITEM_BYTES", "USER_STAGE_RE", "UserStage", "load_user_stage"]

DEFAULT_MAX_ITEM_BYTES = 64 * 2**20
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
USER_STAGE_RE = re.compile(rf"^({_IDENT}(?:\.{_IDENT})*):({_IDENT}(?:\.{_IDENT})*)$")
_FORM = "'package.module:factory' (a module joaderd can import, and a callable in it)"


class UserStage:
    """A user's stage object behind the `Stage` protocol: output checked, errors made clear."""

    def __init__(self, name: str, impl: Any, spec: ItemSpec) -> None:
        self.name = name
        self.spec = spec
        self.impl = impl
        self._prepare = impl.prepare

    def __repr__(self) -> str:
        return f"<UserStage {self.name} {self.spec}>"

    def prepare(self, data: bytes, path: str) -> np.ndarray:
        try:
            result = self._prepare(data, path)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(
                f"stage {self.name} failed on {display_path(path)}: {type(exc).__name__}: "
                f"{display_path(str(exc))}; if the file is bad, replace or remove it, otherwise "
                "fix the stage's prepare()"
            ) from exc
        item: np.ndarray | None
        problem: str | None
        try:
            item = result if isinstance(result, np.ndarray) else np.asarray(result)
        except Exception as exc:
            item = None
            problem = f"a {type(result).__name__} that is not an array ({exc})"
        else:
            problem = None
        if item is not None:
            if item.dtype.kind not in "biufc":
                problem = f"an array of dtype {item.dtype} (need bool, int or float numbers)"
            else:
                problem = self.spec.check(item)
        if problem is not None:
            raise DecodeError(
                f"stage {self.name} returned {problem} for {display_path(path)}; fix the stage "
                "so that prepare() returns a numpy array matching its spec"
            )
        assert item is not None
        if not item.dtype.isnative:
            item = item.astype(item.dtype.newbyteorder("="))
        return np.ascontiguousarray(item)


def load_user_stage(kind: str, options: dict[str, Any]) -> UserStage:
    """Import `kind` ("package.module:factory"), call factory(options), check the result."""
    match = USER_STAGE_RE.match(kind)
    if match is None:
        raise InvalidArgumentError(f"stage {kind!r}: a user stage is written {_FORM}")
    module_name, attr_path = match.groups()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise InvalidArgumentError(
                f"stage {kind!r}: no module named {missing!r} in joaderd's Python "
                f"environment; install the package that provides {module_name!r} (pip install "
                "...) or add its folder to PYTHONPATH for joaderd"
            ) from exc
        raise InvalidArgumentError(
            f"stage {kind!r}: importing {module_name!r} failed because it needs module "
            f"{missing!r}, which is not installed; pip install it into joaderd's environment"
        ) from exc
    except Exception as exc:
        raise InvalidArgumentError(
            f"stage {kind!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}; fix "
            "the module"
        ) from exc
    factory: Any = module
    for part in attr_path.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError as exc:
            raise InvalidArgumentError(
                f"stage {kind!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
                f"has no {attr_path!r}; check the name after the colon"
            ) from exc
    if not callable(factory):
        raise InvalidArgumentError(
            f"stage {kind!r}: {attr_path!r} is a {type(factory).__name__}, not a callable; "
            "name a function or class that takes the options dict and returns the stage"
        )
    try:
        impl = factory(dict(options))
    except Exception as exc:
        raise InvalidArgumentError(
            f"stage {kind!r}: {attr_path}(options) raised {type(exc).__name__}: {exc}; fix the "
            f"stage's options ({sorted(options)}) or the factory"
        ) from exc
    if not callable(getattr(impl, "prepare", None)):
        raise InvalidArgumentError(
            f"stage {kind!r}: {attr_path}(options) returned {type(impl).__name__}, which has no "
            "prepare() method; return an object with prepare(data: bytes, path: str) -> "
            "numpy.ndarray (and optionally spec: joader.stages.ItemSpec)"
        )
    return UserStage(kind, impl, _user_spec(kind, impl, options))


def _user_spec(kind: str, impl: Any, options: dict[str, Any]) -> ItemSpec:
    spec = getattr(impl, "spec", None)
    if spec is None:
        max_bytes = options.get("max_item_bytes", DEFAULT_MAX_ITEM_BYTES)
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise InvalidArgumentError(
                f"stage {kind!r}: option max_item_bytes must be a positive integer (bytes), got "
                f"{max_bytes!r}"
            )
        return ItemSpec.variable(max_bytes)
    if isinstance(spec, ItemSpec):
        return spec
    try:  # a look-alike (another dataclass, a namedtuple): the same four fields
        return ItemSpec(
            shape=spec.shape, dtype=spec.dtype, ndim=spec.ndim, max_nbytes=spec.max_nbytes
        )
    except AttributeError as exc:
        raise InvalidArgumentError(
            f"stage {kind!r}: its spec is a {type(spec).__name__}, not a "
            "joader.stages.ItemSpec; set spec = ItemSpec.fixed(shape, dtype) or "
            "ItemSpec.variable(max_nbytes), or leave it out"
        ) from exc
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"stage {kind!r}: bad spec: {exc}") from exc
