"""Handles on a peer's regions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._span import Span
from .descriptor import RegionInfo, encode_info
from .memory import Access, access_names, check_slice

__all__ = ["RemoteRegion", "RemoteSlice"]


class RemoteRegion(Span):
    """A region of a peer's agent, as its descriptor describes it. Slice it like a Region."""

    __slots__ = ("info", "id", "agent_id", "rights", "key", "route_key")
    _what = "RemoteRegion {}"
    if TYPE_CHECKING:

        def __getitem__(self, key: slice) -> RemoteSlice: ...

    def __init__(self, info: RegionInfo) -> None:
        super().__init__(None, 0, info.nbytes, RemoteSlice)  # offset 0, nbytes: slicing's bounds
        self.info = info
        # what every op checks, as plain values: this is the hot path
        self.id = info.region_id
        self.agent_id = info.agent_id
        self.rights = int(info.access)
        self.key = info.key
        self.route_key = (self.id, self.key)  # a peer's routes are by (id, key): one tuple, not one per op

    @property
    def name(self) -> str | None:
        return self.info.name

    @property
    def access(self) -> Access:
        return self.info.access

    def as_slice(self) -> RemoteSlice:
        return RemoteSlice(self, 0, self.info.nbytes)

    def descriptor(self) -> bytes:
        return encode_info(self.info)

    def label(self) -> str:
        return f"{self.name!r} (id {self.id})" if self.name else f"id {self.id}"

    def __repr__(self) -> str:
        return f"<RemoteRegion {self.label()} {self.nbytes} bytes {access_names(self.access)}>"


class RemoteSlice(Span):
    """``nbytes`` bytes of a remote region starting at ``offset``."""

    __slots__ = ()
    _what = "slice of remote region {}"
    if TYPE_CHECKING:
        region: RemoteRegion

        def __getitem__(self, key: slice) -> RemoteSlice: ...

    def __init__(self, region: RemoteRegion, offset: int, nbytes: int) -> None:
        check_slice("RemoteSlice", region, RemoteRegion, offset, nbytes)  # region[a:b] skips this
        super().__init__(region, offset, nbytes)

    def __repr__(self) -> str:
        return f"<RemoteSlice {self.region.label()} [{self.offset}:{self.offset + self.nbytes}]>"
