"""Buffer-protocol objects: bytearray, memoryview, mmap, numpy arrays."""

from __future__ import annotations

import re
from typing import Any

from .._loop.native import ffi
from ..errors import UnsupportedMemory
from .base import Pinned, address_of


def pin(obj: Any, what: str) -> Pinned | None:
    try:
        view = memoryview(obj)
    except TypeError:
        return None
    except ValueError as exc:  # a released memoryview
        raise UnsupportedMemory(f"{what}: {type(obj).__name__}: {exc}") from None
    if "O" in re.sub(r":[^:]*:", "", view.format):  # field names aside
        fmt = view.format
        view.release()
        # Its bytes are pointers to Python objects: bytes written there would be followed.
        raise UnsupportedMemory(f"{what}: {type(obj).__name__} holds Python objects (format {fmt!r})")
    if not view.c_contiguous:
        view.release()
        raise UnsupportedMemory(f"{what}: {type(obj).__name__} buffer is not C-contiguous")
    if view.nbytes == 0:
        # memoryview cannot cast an empty N-d view; nothing to point at either.
        readonly = view.readonly
        view.release()
        return Pinned(0, 0, readonly, "cpu", (), b"" if readonly else bytearray())
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    cdata = ffi.from_buffer(view, require_writable=not view.readonly)
    return Pinned(address_of(cdata), view.nbytes, view.readonly, "cpu", (cdata, view), obj)
