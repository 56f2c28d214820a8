"""The checks of joaderd's setting values, shared by the TOML file and the flags.

Each check takes (value, where, example) and returns the value in its form (a `Check`), or
raises InvalidArgumentError naming `where` (the key or the flag), the form expected and an
example (`fail`): NOTE in config.py's docstring, "Why so strict". The flags' values come
converted by argparse, the TOML file's as TOML types; the same checks serve both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

from joader.cache.arena import parse_size
from joader.errors import InvalidArgumentError
from joader.process_ref import ProcessRef

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

Check = Callable[[Any, str, str], Any]


def process_ref(value: Any, where: str, example: str) -> str:
    try:
        ProcessRef.parse(str(value))
    except ValueError:
        raise InvalidArgumentError(f"{where} = {value!r} is not PID:START_TICKS; e.g. {where} {example}") from None
    return str(value)


def fraction(value: Any, where: str, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise fail(where, "a number from 0 to 1", value, example)
    return float(value)


def fail(where: str, form: str, value: Any, example: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{where}: expected {form}, got {value!r}; write e.g. {example}")


def workers(value: Any, where: str, example: str) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not is_int(value) or value < 1:
        raise fail(where, '"auto" or a positive integer', value, example)
    return int(value)


def fronts(value: Any, where: str, example: str) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not is_int(value) or value < 0:
        raise fail(where, '"auto" or a count (0: joaderd serves Next itself)', value, example)
    return int(value)


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: Any, where: str, example: str) -> int:
    if not is_int(value) or value < 1:
        raise fail(where, "a positive integer", value, example)
    return int(value)


def non_negative_int(value: Any, where: str, example: str) -> int:
    if not is_int(value) or value < 0:
        raise fail(where, "an integer >= 0", value, example)
    return int(value)


def seconds(value: Any, where: str, example: str, *, zero_ok: bool) -> float:
    number = float(value) if is_int(value) or isinstance(value, float) else math.nan
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        form = "a number of seconds >= 0" if zero_ok else "a positive number of seconds"
        raise fail(where, form, value, example)
    return number


def positive_seconds(value: Any, where: str, example: str) -> float:
    return seconds(value, where, example, zero_ok=False)


def non_negative_seconds(value: Any, where: str, example: str) -> float:
    return seconds(value, where, example, zero_ok=True)


def timeout_seconds(value: Any, where: str, example: str) -> float | None:
    """--decode-timeout-s: "auto" (None: fitted to the decode times, joader.server.pool.timeout)
    or a positive number of seconds."""
    if value == "auto":
        return None
    if isinstance(value, str):
        raise fail(where, '"auto" or a positive number of seconds', value, example)
    return seconds(value, where, example, zero_ok=False)


def seconds_or_auto(text: str) -> float | str:
    """argparse's type of --decode-timeout-s (checked by `timeout_seconds`)."""
    return text if text == "auto" else float(text)


def cache_size(value: Any, where: str, example: str) -> int | str:
    if value == "auto":
        return "auto"
    return size(value, where, example)


def size(value: Any, where: str, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise fail(where, 'a size such as 2GiB, 512MB or a number of bytes, or "auto"', value, example)
    if is_int(value) and value < 1:
        raise fail(where, "a positive size", value, example)
    try:
        size = parse_size(value)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{where}: {error}; or \"auto\" to size it from the data") from None
    if size < 1:
        raise fail(where, "a positive size", value, example)
    return size


def string(value: Any, where: str, example: str) -> str:
    if not isinstance(value, str) or not value:
        raise fail(where, "a non-empty string", value, example)
    return value


def path(value: Any, where: str, example: str) -> Path:
    return Path(string(value, where, example)).expanduser()


def choice(value: Any, where: str, example: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise fail(where, " or ".join(repr(c) for c in choices), value, example)
    return str(value)


def table(value: Any, where: str, example: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise fail(where, "a table", value, example)
    return dict(value)


def boolean(value: Any, where: str, example: str) -> bool:
    if not isinstance(value, bool):
        raise fail(where, "true or false", value, example)
    return value


def log_level(value: Any, where: str, example: str) -> str:
    level = value.upper() if isinstance(value, str) else value
    if level not in LOG_LEVELS:
        raise fail(where, f"one of {', '.join(LOG_LEVELS)}", value, example)
    return str(level)
