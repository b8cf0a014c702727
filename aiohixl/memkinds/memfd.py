"""Memory the agent allocates: a sealed memfd, so a process on the same host can map it."""

from __future__ import annotations

import fcntl
import mmap
import os

from .._loop.native import ffi
from .base import Pinned, address_of


def allocate(nbytes: int, name: str | None) -> Pinned:
    """Zero-filled, page-aligned memory in a memfd."""
    fd = os.memfd_create(f"aiohixl:{name or 'region'}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        # Sealed so that no process mapping it can ever be made to fault (SIGBUS)
        # by the file shrinking under it.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    view = memoryview(mm)
    cdata = ffi.from_buffer(view, require_writable=True)
    # mmap objects refuse to close while exported; the memoryview goes first.
    return Pinned(address_of(cdata), nbytes, False, "memfd", (cdata, view, mm), mm, fd=fd)
