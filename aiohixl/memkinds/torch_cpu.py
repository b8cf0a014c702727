"""torch tensors in host memory (CPU). Device tensors are refused by ``device``.

A tensor's storage can be reallocated under it (``t.resize_()`` to a larger
size frees the old memory) or swapped (``t.set_()``). While registered, the
tensor is moved onto an alias of the same memory that torch cannot resize,
and the original storage is kept alive by that alias: growing the tensor
raises torch's "storage that is not resizable" error, ``set_()`` merely
stops the tensor from aliasing the region, and the region's memory stays
valid either way. The tensor stays on the alias after the region is closed:
views made of it meanwhile share that storage, and a tensor put back on a
resizable storage could free their memory.
"""

from __future__ import annotations

import ctypes
from typing import Any

from .._loop.native import ffi
from ..errors import UnsupportedMemory
from .base import Pinned


def is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _pin_storage(tensor: Any) -> Any:
    """Move ``tensor`` onto a non-resizable alias of its storage's memory; the alias, which keeps the
    original storage alive (and so the memory), is returned."""
    import torch

    original = tensor.untyped_storage()
    nbytes = original.nbytes()
    if nbytes == 0:
        return original
    # A buffer over the storage's memory that owns a reference to the storage:
    # the alias, and every view of the tensor made from now on, keeps it alive.
    holder = (ctypes.c_char * nbytes).from_address(original.data_ptr())
    holder.keep = original
    alias = torch.frombuffer(holder, dtype=torch.uint8).untyped_storage()
    with torch.no_grad():
        tensor.set_(alias, tensor.storage_offset(), tensor.size(), tensor.stride())
    return alias


def pin(obj: Any, what: str) -> Pinned | None:
    if not is_tensor(obj) or obj.device.type != "cpu":
        return None
    if not obj.is_contiguous():
        raise UnsupportedMemory(f"{what}: tensor is not contiguous (call .contiguous())")
    nbytes = obj.numel() * obj.element_size()
    address = obj.data_ptr()
    try:
        hold = _pin_storage(obj)
    except RuntimeError as exc:
        raise UnsupportedMemory(f"{what}: cannot pin the tensor's storage: {exc}") from None
    memory = ffi.buffer(ffi.cast("char *", address), nbytes)
    return Pinned(address, nbytes, False, "cpu", (hold, obj), memory)
