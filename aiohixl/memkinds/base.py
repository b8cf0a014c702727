"""A pinned piece of memory: its address, its size, and what keeps it still."""

from __future__ import annotations

import mmap
import os
from typing import Any

from .._loop.native import ffi

# Unmapping a mapping of GiBs at once holds the process's mmap lock for tens of milliseconds,
# and any thread that maps or unmaps meanwhile waits for it: the event loop's, whose allocator
# maps arenas, while a worker thread releases a region. madvise(MADV_DONTNEED) drops the
# page-table entries first, holding the lock for reading, this much at a time (measured with a
# thread mapping 1 MiB beside the release of 1 GiB: its worst wait 32-38 ms -> 6-7 ms).
_ZAP = 32 << 20


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
            elif isinstance(obj, mmap.mmap):  # our own MAP_SHARED mapping of a memfd (memfd.py)
                _zap(obj)  # its pages stay in the memfd: a view still held sees them
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


def _zap(mm: mmap.mmap) -> None:
    size = len(mm)
    for off in range(0, size, _ZAP):
        mm.madvise(mmap.MADV_DONTNEED, off, min(_ZAP, size - off))


def address_of(cdata: Any) -> int:
    return int(ffi.cast("uintptr_t", cdata))
