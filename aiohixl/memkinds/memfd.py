"""Memory the agent allocates: a sealed memfd, so a process on the same host can map it."""

from __future__ import annotations

import fcntl
import mmap
import os

from .._loop.native import ffi
from .base import Pinned, address_of


def room() -> int | None:
    """Bytes this host could back now (MemAvailable + SwapFree); None when it does not say.
    An allocation is populated at once: one larger would have the kernel kill a process
    (this one, likely) instead of failing."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return sum(int(info[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree"))
    except (OSError, KeyError, ValueError, IndexError):
        return None


def allocate(nbytes: int, name: str | None) -> Pinned:
    """Zero-filled, page-aligned memory in a memfd."""
    # The name is a label in /proc/PID/fd only; the kernel takes at most 249 bytes of it.
    label = f"aiohixl:{name or 'region'}".encode()[:249].decode(errors="ignore")
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
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
