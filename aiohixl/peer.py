"""Peers: what puts and gets go through."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Union

from ._native import ffi, lib
from .descriptor import decode
from .errors import AccessDenied, ClosedError, InvalidArgument, InvalidDescriptor, LengthMismatch
from .memory import Access, Region, RegionSlice
from .remote import RemoteRegion, RemoteSlice

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["Peer"]

LocalRef = Union[Region, RegionSlice]
RemoteRef = Union[RemoteRegion, RemoteSlice]


class Peer:
    """A connection to an agent (possibly this one) that ops go through.

    Ops on one peer are started in the order they are called; each awaitable
    finishes only once its bytes are in the destination.
    """

    def __init__(self, agent: Agent, handle: Any, remote_id: bytes, transport: str, name: str | None):
        self.agent = agent
        self._handle = handle
        self.remote_id = remote_id
        self.transport = transport
        self.name = name
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- remote regions ----

    async def region(self, name: str) -> RemoteRegion:
        """The region the peer published under ``name``."""
        self._check_open("Peer.region")
        return await self._lookup(name)

    async def _lookup(self, name: str) -> RemoteRegion:
        return self.agent._published_remote(name, "Peer.region")

    def remote_region(self, descriptor: bytes) -> RemoteRegion:
        """Turn a descriptor from ``Region.descriptor()`` into a RemoteRegion of this peer."""
        info = decode(descriptor)
        if info.agent_id != self.remote_id:
            raise InvalidDescriptor(
                f"Peer.remote_region: descriptor of region {info.region_id} belongs to agent "
                f"{info.agent_id.hex()}, this peer is agent {self.remote_id.hex()}"
            )
        return RemoteRegion(info)

    # ---- ops ----

    async def put(self, remote: RemoteRef, local: LocalRef, *, timeout: float | None = None) -> None:
        """Write ``local`` into ``remote``. Returns once the bytes are in the peer's memory."""
        await self._transfer(lib.HX_OP_PUT, ((remote, local),), timeout, "Peer.put")

    async def get(self, local: LocalRef, remote: RemoteRef, *, timeout: float | None = None) -> None:
        """Read ``remote`` into ``local``. Returns once the bytes are in local memory."""
        await self._transfer(lib.HX_OP_GET, ((remote, local),), timeout, "Peer.get")

    async def put_many(
        self, pairs: Iterable[tuple[RemoteRef, LocalRef]], *, timeout: float | None = None
    ) -> None:
        """Many puts, ``(remote, local)`` pairs, in one native submission and one awaitable."""
        await self._transfer(lib.HX_OP_PUT, tuple(pairs), timeout, "Peer.put_many")

    async def get_many(
        self, pairs: Iterable[tuple[LocalRef, RemoteRef]], *, timeout: float | None = None
    ) -> None:
        """Many gets, ``(local, remote)`` pairs, in one native submission and one awaitable."""
        await self._transfer(
            lib.HX_OP_GET, tuple((r, l) for l, r in pairs), timeout, "Peer.get_many"
        )

    async def _transfer(
        self, opcode: int, pairs: tuple[tuple[Any, Any], ...], timeout: float | None, what: str
    ) -> None:
        self._check_open(what)
        engine = self.agent._engine
        if len(engine._ops) >= engine.capacity:
            await engine.admit()
            self._check_open(what)
        else:
            engine.attach()
        put = opcode == lib.HX_OP_PUT
        sges = ffi.new("hx_sge[]", len(pairs)) if pairs else None
        regions: list[Region] = []
        n = 0
        for remote, local in pairs:
            rs = self._remote_slice(remote, what)
            ls = _local_slice(local, what)
            region = ls.region
            if region.agent is not self.agent:
                raise InvalidArgument(f"{what}: local region {region._label()} belongs to another agent")
            region._check_open(what)
            if rs.nbytes != ls.nbytes:
                raise LengthMismatch(
                    f"{what}: remote range is {rs.nbytes} bytes, local range is {ls.nbytes} bytes"
                )
            need = Access.REMOTE_WRITE if put else Access.REMOTE_READ
            if not rs.region.access & need:
                raise AccessDenied(
                    f"{what}: remote region {rs.region._label()} was registered without {need.name}"
                )
            if not put and region.readonly:
                raise AccessDenied(f"{what}: local region {region._label()} is read-only")
            if rs.nbytes == 0:
                continue
            sge = sges[n]
            sge.local_region = region.id
            sge.remote_region = rs.region.id
            sge.local_off = ls.offset
            sge.remote_off = rs.offset
            sge.len = rs.nbytes
            n += 1
            regions.append(region)
        if n == 0:
            return
        keep = tuple(regions)
        for region in keep:
            region._inflight += 1
        waiter = engine.post(
            self._handle, opcode, sges, n, keep, what, lambda: _release(keep)
        )
        if waiter is not None:
            await engine.wait(waiter, timeout, what)

    def _remote_slice(self, remote: Any, what: str) -> RemoteSlice:
        if isinstance(remote, RemoteRegion):
            remote = remote.as_slice()
        elif not isinstance(remote, RemoteSlice):
            raise InvalidArgument(
                f"{what}: expected a RemoteRegion or a slice of one, got {type(remote).__name__}"
            )
        if remote.region.info.agent_id != self.remote_id:
            raise InvalidArgument(
                f"{what}: remote region {remote.region._label()} belongs to another agent than this peer's"
            )
        return remote

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: peer {self.name or self.remote_id.hex()} is closed")
        self.agent._check_open(what)

    async def aclose(self) -> None:
        """Close the peer; its queued ops fail with ClosedError."""
        if self._closed:
            return
        self._closed = True
        lib.hx_peer_close(self._handle)
        self.agent._forget_peer(self)

    def _free(self) -> None:
        self._closed = True
        if self._handle is not None:
            lib.hx_peer_free(self._handle)
            self._handle = None

    def __repr__(self) -> str:
        return f"<Peer {self.name or self.remote_id.hex()} via {self.transport}>"


def _local_slice(local: Any, what: str) -> RegionSlice:
    if isinstance(local, Region):
        return local.as_slice()
    if isinstance(local, RegionSlice):
        return local
    raise InvalidArgument(f"{what}: expected a Region or a slice of one, got {type(local).__name__}")


def _release(regions: tuple[Region, ...]) -> None:
    for region in regions:
        region._inflight -= 1
        if region._inflight == 0 and region._idle_waiters:
            region.agent._wake_region_waiters(region)
