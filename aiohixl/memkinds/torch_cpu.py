"""torch tensors in host memory (CPU). Device tensors are refused by ``device``."""

from __future__ import annotations

from typing import Any

from .._native import ffi
from ..errors import UnsupportedMemory
from .base import Pinned


def is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def pin(obj: Any, what: str) -> Pinned | None:
    if not is_tensor(obj) or obj.device.type != "cpu":
        return None
    if not obj.is_contiguous():
        raise UnsupportedMemory(f"{what}: tensor is not contiguous (call .contiguous())")
    nbytes = obj.numel() * obj.element_size()
    address = obj.data_ptr()
    memory = ffi.buffer(ffi.cast("char *", address), nbytes)
    return Pinned(address, nbytes, False, "cpu", (obj,), memory)
