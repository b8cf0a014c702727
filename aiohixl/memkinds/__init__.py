"""The memory-kind seam: what ``Agent.register()`` can take, one module per kind.

``pin(obj)`` asks each kind in turn; the first that recognises the object pins
it or refuses it. A new kind (device memory) is one module added to ``KINDS``
plus the hooks its transports need.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedMemory
from . import buffer, device, torch_cpu
from .base import Pinned

__all__ = ["Pinned", "pin"]

# Device objects first: some also export a (host) buffer interface.
KINDS = (torch_cpu, device, buffer)


def pin(obj: Any, what: str) -> Pinned:
    """Pin ``obj`` for as long as it is registered, or raise UnsupportedMemory saying why not."""
    for kind in KINDS:
        pinned = kind.pin(obj, what)
        if pinned is not None:
            return pinned
    raise UnsupportedMemory(f"{what}: {type(obj).__name__} does not support the buffer protocol")
