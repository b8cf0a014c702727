"""Handles on a peer's regions."""

from __future__ import annotations

from .descriptor import RegionInfo, encode_info
from .memory import Access, slice_range

__all__ = ["RemoteRegion", "RemoteSlice"]


class RemoteRegion:
    """A region of a peer's agent, as its descriptor describes it. Slice it like a Region."""

    __slots__ = ("info", "id", "agent_id", "rights", "key", "route_key", "_len")

    def __init__(self, info: RegionInfo) -> None:
        self.info = info
        # what every op checks, as plain values: this is the hot path
        self.id = info.region_id
        self.agent_id = info.agent_id
        self.rights = int(info.access)
        self.key = info.key
        self.route_key = (self.id, self.key)  # a peer's routes are by (id, key): one tuple, not one per op
        self._len = info.nbytes

    @property
    def name(self) -> str | None:
        return self.info.name

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    @property
    def access(self) -> Access:
        return self.info.access

    def __len__(self) -> int:
        return self.info.nbytes

    def __getitem__(self, key: slice) -> RemoteSlice:
        if type(key) is slice:  # the usual [a:b] of ints in range, on every op: no call
            start, stop = key.start, key.stop
            start = 0 if start is None else start
            stop = self._len if stop is None else stop
            if type(start) is int and type(stop) is int and key.step is None and 0 <= start <= stop <= self._len:
                return RemoteSlice(self, start, stop - start)
        offset, nbytes = slice_range(key, self.nbytes, "RemoteRegion {}", self)
        return RemoteSlice(self, offset, nbytes)

    def as_slice(self) -> RemoteSlice:
        return RemoteSlice(self, 0, self.info.nbytes)

    def descriptor(self) -> bytes:
        return encode_info(self.info)

    def label(self) -> str:
        return f"{self.name!r} (id {self.id})" if self.name else f"id {self.id}"

    def __repr__(self) -> str:
        return f"<RemoteRegion {self.label()} {self.nbytes} bytes {self.access!s}>"


class RemoteSlice:
    """``nbytes`` bytes of a remote region starting at ``offset``."""

    __slots__ = ("region", "offset", "nbytes")

    def __init__(self, region: RemoteRegion, offset: int, nbytes: int) -> None:
        self.region = region
        self.offset = offset
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> RemoteSlice:
        if type(key) is slice:  # as RemoteRegion.__getitem__
            start, stop = key.start, key.stop
            start = 0 if start is None else start
            stop = self.nbytes if stop is None else stop
            if type(start) is int and type(stop) is int and key.step is None and 0 <= start <= stop <= self.nbytes:
                return RemoteSlice(self.region, self.offset + start, stop - start)
        offset, nbytes = slice_range(key, self.nbytes, "slice of remote region {}", self.region)
        return RemoteSlice(self.region, self.offset + offset, nbytes)

    def __repr__(self) -> str:
        return f"<RemoteSlice {self.region.label()} [{self.offset}:{self.offset + self.nbytes}]>"
