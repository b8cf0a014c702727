"""A pinned piece of memory: its address, its size, and what keeps it still."""

from __future__ import annotations

import mmap
import os
from typing import Any

from .._loop.native import ffi, lib


class Pinned:
    """Memory held still for as long as it is registered.

    ``holds`` are the objects that keep it alive and unmoved, released in
    order; ``memory`` is what ``Region.memory`` views; ``fd`` the memfd behind
    it, when there is one (a same-host peer can map it).
    """

    __slots__ = ("address", "nbytes", "readonly", "kind", "memory", "fd", "_holds")

    def __init__(
        self,
        address: int,
        nbytes: int,
        readonly: bool,
        kind: str,
        holds: tuple[Any, ...],
        memory: Any,
        fd: int | None = None,
    ) -> None:
        self.address = address
        self.nbytes = nbytes
        self.readonly = readonly
        self.kind = kind
        self.memory = memory
        self.fd = fd
        self._holds = holds

    def release(self) -> None:
        for obj in self._holds:
            if isinstance(obj, memoryview):
                obj.release()
            elif isinstance(obj, mmap.mmap):
                # Our own MAP_SHARED mapping of a memfd, at self.address (memfd.py): its pages
                # stay in the file, a view still held sees them. The unmap of GiBs at once holds
                # the mmap lock long enough to stall the loop (hx_unpopulate says why).
                lib.hx_unpopulate(ffi.cast("void *", self.address), self.nbytes)
                try:
                    obj.close()
                except BufferError:
                    pass  # the user still holds a view; the mapping dies with it
            elif isinstance(obj, ffi.CData):
                ffi.release(obj)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._holds = ()


def address_of(cdata: Any) -> int:
    return int(ffi.cast("uintptr_t", cdata))
