"""Handles on a peer's regions."""

from __future__ import annotations

from .descriptor import RegionInfo, encode_info
from .memory import Access, slice_range

__all__ = ["RemoteRegion", "RemoteSlice"]


class RemoteRegion:
    """A region of a peer's agent, as its descriptor describes it. Slice it like a Region."""

    __slots__ = ("info", "_id", "_access", "_agent_id", "_rkey")

    def __init__(self, info: RegionInfo) -> None:
        self.info = info
        # copies of what every op checks, kept as plain values for speed
        self._id = info.region_id
        self._access = int(info.access)
        self._agent_id = info.agent_id
        key = info.keys.get(1)  # the verbs rkey, when the owner has an RDMA device
        self._rkey = int.from_bytes(key, "little") if key is not None and len(key) == 4 else None

    @property
    def name(self) -> str | None:
        return self.info.name

    @property
    def id(self) -> int:
        return self.info.region_id

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    @property
    def access(self) -> Access:
        return self.info.access

    def __len__(self) -> int:
        return self.info.nbytes

    def __getitem__(self, key: slice) -> RemoteSlice:
        offset, nbytes = slice_range(key, self.info.nbytes, f"RemoteRegion {self._label()}")
        return RemoteSlice(self, offset, nbytes)

    def as_slice(self) -> RemoteSlice:
        return RemoteSlice(self, 0, self.info.nbytes)

    def descriptor(self) -> bytes:
        return encode_info(self.info)

    def _label(self) -> str:
        return f"{self.name!r} (id {self.id})" if self.name else f"id {self.id}"

    def __repr__(self) -> str:
        return f"<RemoteRegion {self._label()} {self.nbytes} bytes {self.access!s}>"


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
        offset, nbytes = slice_range(key, self.nbytes, f"slice of remote region {self.region._label()}")
        return RemoteSlice(self.region, self.offset + offset, nbytes)

    def __repr__(self) -> str:
        return f"<RemoteSlice {self.region._label()} [{self.offset}:{self.offset + self.nbytes}]>"
