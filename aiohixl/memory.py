"""Registered memory: access rights, regions and slices of them."""

from __future__ import annotations

import enum
import operator
from typing import TYPE_CHECKING, Any, Protocol

from ._construct import NoPublicConstructor
from ._span import Span, set_fallback
from .errors import ClosedError, InvalidArgument, OutOfBounds, UnsupportedMemory
from .memkinds import Pinned

__all__ = ["Access", "Region", "RegionSlice", "slice_range", "parse_access", "access_names"]


class Access(enum.IntFlag):
    """What a *remote* peer may do to a region. Local access is always allowed."""

    NONE = 0
    REMOTE_WRITE = 1
    REMOTE_READ = 2


_ACCESS_WORDS = {
    "remote_write": Access.REMOTE_WRITE,
    "remote_read": Access.REMOTE_READ,
    "remote_read_write": Access.REMOTE_READ | Access.REMOTE_WRITE,
    "none": Access.NONE,
    "w": Access.REMOTE_WRITE,
    "r": Access.REMOTE_READ,
    "rw": Access.REMOTE_READ | Access.REMOTE_WRITE,
}


def parse_access(access: Access | str | None, what: str) -> Access | None:
    """``Access`` flags (or their int), or words joined by "|": "remote_write" ("w"),
    "remote_read" ("r"), "remote_read_write" ("rw"), "none"."""
    if access is None or isinstance(access, Access):
        return access
    if isinstance(access, int) and not isinstance(access, bool):
        if access & ~int(Access.REMOTE_READ | Access.REMOTE_WRITE) or access < 0:
            raise InvalidArgument(f"{what}: access={access:#x} has bits outside REMOTE_READ|REMOTE_WRITE")
        return Access(access)
    if isinstance(access, str):
        flags = Access.NONE
        for word in access.replace(",", "|").split("|"):
            flag = _ACCESS_WORDS.get(word.strip().lower())
            if flag is None:
                raise InvalidArgument(f"{what}: access {access!r}: use {sorted(_ACCESS_WORDS)} or Access flags")
            flags |= flag
        return flags
    raise InvalidArgument(f"{what}: access must be Access flags or a string, not {type(access).__name__}")


def access_names(access: Access) -> str:
    """``"REMOTE_WRITE|REMOTE_READ"``, ``"NONE"``: what ``str()`` of a flag says on 3.10 only."""
    return "|".join(flag.name or "" for flag in (Access.REMOTE_WRITE, Access.REMOTE_READ) if flag in access) or "NONE"


class _Labelled(Protocol):
    def label(self) -> str: ...


def slice_range(key: Any, length: int, what: str, of: _Labelled) -> tuple[int, int]:
    """``(offset, nbytes)`` of ``key`` (a slice) inside ``[0, length)``.

    Unlike Python sequences, a range reaching past the end is an error, not
    clamped: a silently shortened transfer is a bug waiting to happen. The
    error names ``what.format(of.label())``, made only when there is one: a
    user slices on every op.
    """
    if not isinstance(key, slice):
        raise TypeError(f"{what.format(of.label())}[...] takes a slice like [start:stop], not {type(key).__name__}")
    start, stop, step = key.start, key.stop, key.step
    if step is not None and step != 1:
        raise UnsupportedMemory(f"{what.format(of.label())}[...]: a step of {step!r} is not contiguous")
    try:
        start = 0 if start is None else operator.index(start)
        stop = length if stop is None else operator.index(stop)
    except TypeError:
        raise TypeError(f"{what.format(of.label())}[{key.start!r}:{key.stop!r}]: bounds are ints") from None
    if start < 0:
        start += length
    if stop < 0:
        stop += length
    if not 0 <= start <= stop <= length:
        raise OutOfBounds(f"{what.format(of.label())}[{key.start}:{key.stop}] is outside [0, {length})")
    return start, stop - start


def _slice_by_rule(span: Any, key: Any) -> Any:
    """What the native ``Span[...]`` leaves to Python: negative or open bounds, a step,
    no slice at all, out of range. The same span as the C path, or the library's error."""
    region = span if span.region is None else span.region
    offset, nbytes = slice_range(key, span.nbytes, span._what, region)
    return (span._sliced_as or type(span))(region, span.offset + offset, nbytes)


set_fallback(_slice_by_rule)


def check_slice(what: str, region: Any, kind: Any, offset: Any, nbytes: Any) -> None:
    """The arguments of a slice made by hand (``RegionSlice(region, offset, nbytes)``), as
    ``region[a:b]`` checks its own: else a put would fail on them deep inside."""
    if not isinstance(region, kind):
        raise InvalidArgument(f"{what}: region is a {kind.__name__}, not {type(region).__name__}")
    for name, value in (("offset", offset), ("nbytes", nbytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"{what}: {name} is an int >= 0, not {value!r}")
    if offset + nbytes > region.nbytes:
        raise OutOfBounds(f"{what}: [{offset}:{offset + nbytes}] is outside [0, {region.nbytes}) of {region.label()}")


class RegionOwner(Protocol):
    """The registry a region belongs to (the agent's)."""

    async def close(self, region: Region) -> None: ...

    def describe(self, region: Region) -> bytes: ...


class Region(Span, metaclass=NoPublicConstructor):
    """Memory registered with an agent. Slice it (``region[a:b]``) to name part of it.

    Regions come from ``Agent.register()`` and ``Agent.allocate()``; ``agent`` is that agent.
    """

    _what = "Region {}"
    made_by = "Agent.register() or Agent.allocate()"
    if TYPE_CHECKING:

        def __getitem__(self, key: slice) -> RegionSlice: ...

    def __init__(
        self,
        registry: RegionOwner,
        agent: Any,
        region_id: int,
        pinned: Pinned,
        access: Access,
        name: str | None,
        key: int,
    ) -> None:
        super().__init__(None, 0, pinned.nbytes, RegionSlice)  # offset 0, nbytes: slicing's bounds
        self._registry = registry
        self.agent = agent
        self.id = region_id
        self.key = key  # the secret in its descriptor: peers reach it only with it
        self.name = name
        self.access = access
        self.pinned = pinned
        self.closed = False

    @property
    def address(self) -> int:
        return self.pinned.address

    @property
    def kind(self) -> str:
        """Where the memory lives: ``"cpu"`` (user memory) or ``"memfd"`` (from allocate)."""
        return self.pinned.kind

    @property
    def readonly(self) -> bool:
        return self.pinned.readonly

    @property
    def memory(self) -> memoryview:
        """A writable (unless registered read-only) view of the whole region."""
        self.check_open("Region.memory")
        return memoryview(self.pinned.memory).cast("B")

    def as_slice(self) -> RegionSlice:
        return RegionSlice(self, 0, self.nbytes)

    def descriptor(self) -> bytes:
        """A compact, versioned description a peer can turn into a RemoteRegion."""
        self.check_open("Region.descriptor")
        return self._registry.describe(self)

    async def close(self) -> None:
        """Deregister. Waits until no op in flight uses the region (local or remote).

        New ops naming the region fail with ClosedError (locally) or
        RegionUnavailable (for peers) from the moment this is called.
        """
        if self.closed:
            return
        await self._registry.close(self)

    def check_open(self, what: str) -> None:
        if self.closed:
            raise ClosedError(f"{what}: region {self.label()} is closed")

    def label(self) -> str:
        return f"{self.name!r} (id {self.id})" if self.name else f"id {self.id}"

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<Region {self.label()} {self.nbytes} bytes {access_names(self.access)}{state}>"


class RegionSlice(Span):
    """``nbytes`` bytes of a local region starting at ``offset``. A view: no copy."""

    __slots__ = ()
    _what = "slice of region {}"
    if TYPE_CHECKING:
        region: Region

        def __getitem__(self, key: slice) -> RegionSlice: ...

    def __init__(self, region: Region, offset: int, nbytes: int) -> None:
        check_slice("RegionSlice", region, Region, offset, nbytes)  # region[a:b] skips this
        super().__init__(region, offset, nbytes)

    @property
    def memory(self) -> memoryview:
        return self.region.memory[self.offset : self.offset + self.nbytes]

    def __repr__(self) -> str:
        return f"<RegionSlice {self.region.label()} [{self.offset}:{self.offset + self.nbytes}]>"
