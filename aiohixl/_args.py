"""Checks of the public API's plain arguments (numbers, names, timeouts): each returns the
value as the library uses it, or raises InvalidArgument naming the call and the argument.

One place for them, so that a wrong type is refused before anything is posted, never found
later as a TypeError from deep inside (or, for NaN, as a wait that never ends)."""

from __future__ import annotations

import math
from typing import Any

from .errors import InvalidArgument

FOREVER = 1e9  # seconds: the longest setting (the native side counts nanoseconds in 64 bits)


def timeout(value: Any, what: str, arg: str = "timeout") -> float | None:
    """Seconds to wait (None: no limit). A negative one has passed already, as asyncio's."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what}: {arg} must be a number of seconds or None, not {type(value).__name__}")
    if math.isnan(value):
        raise InvalidArgument(f"{what}: {arg} is NaN")
    return value


def integer(value: Any, what: str, arg: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what}: {arg} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidArgument(f"{what}: {arg}={value} must be in [{low}, {high}]")
    return value


def seconds(value: Any, what: str, arg: str, high: float) -> float:
    """A positive, finite duration (a setting, not a wait): at most ``high``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what}: {arg} must be a number of seconds, not {type(value).__name__}")
    if not 0 < value <= high:  # NaN fails this too
        raise InvalidArgument(f"{what}: {arg}={value} must be in (0, {high:g}] seconds")
    return float(value)


def text(value: Any, what: str, arg: str, max_bytes: int) -> str:
    """A name: a str of at most ``max_bytes`` UTF-8 bytes, no NUL."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what}: {arg} must be a str, not {type(value).__name__}")
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what}: {arg}={value!r} is not valid Unicode (a lone surrogate)") from None
    if size > max_bytes:
        raise InvalidArgument(f"{what}: {arg} is {size} bytes in UTF-8, at most {max_bytes}")
    if "\x00" in value:
        raise InvalidArgument(f"{what}: {arg}={value!r} holds a NUL character")
    return value


def choice(value: Any, what: str, arg: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgument(f"{what}: {arg} must be one of {', '.join(map(repr, choices))}, not {value!r}")
    return value
