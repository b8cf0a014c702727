"""Registered memory: access rights, regions, slices, and pinning of user buffers."""

from __future__ import annotations

import enum
import fcntl
import mmap
import os
from typing import TYPE_CHECKING, Any

from ._native import ffi
from .errors import ClosedError, OutOfBounds, UnsupportedMemory

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["Access", "Region", "RegionSlice", "slice_range"]


class Access(enum.IntFlag):
    """What a *remote* peer may do to a region. Local access is always allowed."""

    NONE = 0
    REMOTE_WRITE = 1
    REMOTE_READ = 2


def slice_range(key: Any, length: int, what: str) -> tuple[int, int]:
    """``(offset, nbytes)`` of ``key`` (a slice) inside ``[0, length)``.

    Unlike Python sequences, a range reaching past the end is an error, not
    clamped: a silently shortened transfer is a bug waiting to happen.
    """
    if not isinstance(key, slice):
        raise TypeError(f"{what}[...] takes a slice like [start:stop], not {type(key).__name__}")
    if key.step not in (None, 1):
        raise UnsupportedMemory(f"{what}[...]: a step of {key.step} is not contiguous")
    start = 0 if key.start is None else key.start.__index__()
    stop = length if key.stop is None else key.stop.__index__()
    if start < 0:
        start += length
    if stop < 0:
        stop += length
    if not 0 <= start <= stop <= length:
        raise OutOfBounds(f"{what}[{key.start}:{key.stop}] is outside [0, {length})")
    return start, stop - start


class _Pinned:
    """A user buffer held still for as long as it is registered."""

    __slots__ = ("address", "nbytes", "readonly", "kind", "_holds")

    def __init__(self, address: int, nbytes: int, readonly: bool, kind: str, holds: tuple) -> None:
        self.address = address
        self.nbytes = nbytes
        self.readonly = readonly
        self.kind = kind
        self._holds = holds

    def release(self) -> None:
        for obj in self._holds:
            if isinstance(obj, memoryview):
                obj.release()
            elif isinstance(obj, mmap.mmap):
                try:
                    obj.close()
                except BufferError:
                    pass  # the user still holds a view; the mapping dies with it
            elif isinstance(obj, int):
                os.close(obj)
            elif isinstance(obj, ffi.CData):
                ffi.release(obj)
        self._holds = ()


def _is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def pin(obj: Any, what: str) -> _Pinned:
    """Pin ``obj`` (buffer-protocol object or torch CPU tensor) for registration."""
    if _is_torch_tensor(obj):
        if obj.device.type != "cpu":
            raise UnsupportedMemory(
                f"{what}: tensor on {obj.device} is not supported yet (CPU tensors only)"
            )
        if not obj.is_contiguous():
            raise UnsupportedMemory(f"{what}: tensor is not contiguous (call .contiguous())")
        nbytes = obj.numel() * obj.element_size()
        return _Pinned(obj.data_ptr(), nbytes, False, "cpu", (obj,))
    try:
        view = memoryview(obj)
    except TypeError:
        raise UnsupportedMemory(
            f"{what}: {type(obj).__name__} does not support the buffer protocol"
        ) from None
    if not view.c_contiguous:
        view.release()
        raise UnsupportedMemory(f"{what}: {type(obj).__name__} buffer is not C-contiguous")
    view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    cdata = ffi.from_buffer(view, require_writable=not view.readonly)
    address = int(ffi.cast("uintptr_t", cdata))
    return _Pinned(address, view.nbytes, view.readonly, "cpu", (cdata, view))


def allocate_shared(nbytes: int, name: str | None) -> tuple[_Pinned, mmap.mmap]:
    """Zero-filled, page-aligned memory in a memfd, so another process can map it."""
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
    address = int(ffi.cast("uintptr_t", cdata))
    # mmap objects refuse to close while exported; the memoryview goes first.
    return _Pinned(address, nbytes, False, "memfd", (cdata, view, mm, fd)), mm


class Region:
    """Memory registered with an agent. Slice it (``region[a:b]``) to name part of it."""

    def __init__(
        self, agent: Agent, region_id: int, pinned: _Pinned, access: Access, name: str | None,
        memory: Any,
    ) -> None:
        self.agent = agent
        self.id = region_id
        self.name = name
        self.access = access
        self._pinned = pinned
        self._memory = memory
        self._closed = False
        self._inflight = 0
        self._idle_waiters: list[Any] = []
        self._rkey: int | None = None  # verbs memory registration, when the agent has a device

    @property
    def address(self) -> int:
        return self._pinned.address

    @property
    def _fd(self) -> int | None:
        """The memfd behind an allocated region (None for user memory)."""
        holds = self._pinned._holds
        return holds[3] if self.kind == "memfd" and len(holds) == 4 else None

    @property
    def nbytes(self) -> int:
        return self._pinned.nbytes

    @property
    def kind(self) -> str:
        """Where the memory lives: ``"cpu"`` (user memory) or ``"memfd"`` (from allocate)."""
        return self._pinned.kind

    @property
    def readonly(self) -> bool:
        return self._pinned.readonly

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def memory(self) -> memoryview:
        """A writable (unless registered read-only) view of the whole region."""
        self._check_open("Region.memory")
        return memoryview(self._memory).cast("B")

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> RegionSlice:
        offset, nbytes = slice_range(key, self.nbytes, f"Region {self._label()}")
        return RegionSlice(self, offset, nbytes)

    def as_slice(self) -> RegionSlice:
        return RegionSlice(self, 0, self.nbytes)

    def descriptor(self) -> bytes:
        """A compact, versioned description a peer can turn into a RemoteRegion."""
        self._check_open("Region.descriptor")
        from .descriptor import encode_region

        return encode_region(self)

    async def close(self) -> None:
        """Deregister. Waits until no op in flight uses the region (local or remote).

        New ops naming the region fail with ClosedError (locally) or
        RegionUnavailable (for peers) from the moment this is called.
        """
        if self._closed:
            return
        await self.agent._close_region(self)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: region {self._label()} is closed")

    def _label(self) -> str:
        return f"{self.name!r} (id {self.id})" if self.name else f"id {self.id}"

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<Region {self._label()} {self.nbytes} bytes {self.access!s}{state}>"


class RegionSlice:
    """``nbytes`` bytes of a local region starting at ``offset``. A view: no copy."""

    __slots__ = ("region", "offset", "nbytes")

    def __init__(self, region: Region, offset: int, nbytes: int) -> None:
        self.region = region
        self.offset = offset
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> RegionSlice:
        offset, nbytes = slice_range(key, self.nbytes, f"slice of region {self.region._label()}")
        return RegionSlice(self.region, self.offset + offset, nbytes)

    @property
    def memory(self) -> memoryview:
        return self.region.memory[self.offset : self.offset + self.nbytes]

    def __repr__(self) -> str:
        return f"<RegionSlice {self.region._label()} [{self.offset}:{self.offset + self.nbytes}]>"
