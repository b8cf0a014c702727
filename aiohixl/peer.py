"""Peers: what puts and gets go through."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Union

import anyio

from . import _control as c
from . import _wire as w
from ._native import ffi, lib
from .descriptor import decode
from .errors import (
    AccessDenied, ClosedError, ConnectionLost, HixlError, InvalidArgument, InvalidDescriptor,
    LengthMismatch, ProtocolError, RegionUnavailable,
)
from .memory import Access, Region, RegionSlice
from .remote import RemoteRegion, RemoteSlice

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["Peer"]

LocalRef = Union[Region, RegionSlice]
RemoteRef = Union[RemoteRegion, RemoteSlice]


class Peer:
    """A connection to an agent (possibly this one) that ops go through.

    Ops on one peer are started in the order they are called and, over tcp,
    executed by the target in that order; each awaitable finishes only once
    its bytes are in the destination. ``transport`` says which path ops take.
    """

    def __init__(
        self, agent: Agent, handle: Any, remote_id: bytes, transport: str, name: str | None,
        info: c.PeerInfo | None = None,
    ):
        self.agent = agent
        self._handle = handle
        self.remote_id = remote_id
        self.transport = transport
        self.name = name
        self.info = info
        self._closed = False
        self._broken: HixlError | None = None
        self._session: c.Session | None = None
        self._withdrawn: set[int] = set()
        self._lookups: dict[int, list[Any]] = {}
        self._next_lookup = 1

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> HixlError | None:
        """Why the connection to the peer ended (None while it works)."""
        return self._broken

    # ---- control session (connected peers) ----

    def _start_session(self, ch: c.Channel) -> None:
        agent = self.agent
        self._session = c.Session(
            ch, agent._heartbeat_interval, agent._heartbeat_timeout,
            {w.REGION: self._on_region, w.WITHDRAWN: self._on_withdrawn},
            self._on_session_end, f"peer {self.name!r}",
        )
        agent._engine.backend.spawn(self._session.run, f"aiohixl-peer-{self.name}")

    def _on_region(self, r: w.Reader) -> None:
        req, status, desc = r.u32(), r.u8(), r.blob()
        r.end()
        slot = self._lookups.get(req)
        if slot is None:
            raise ProtocolError(f"answer to lookup {req} that was never asked")
        slot[1] = (status, desc)
        slot[0].set()

    def _on_withdrawn(self, r: w.Reader) -> None:
        self._withdrawn.add(r.u32())
        r.end()

    def _on_session_end(self, reason: HixlError) -> None:
        if self._broken is None:
            self._broken = reason if isinstance(reason, ConnectionLost) else ConnectionLost(str(reason))
        if self._handle is not None and not self._closed:
            lib.hx_peer_fail(self._handle, lib.HX_E_CONNLOST)
        for event, _ in self._lookups.values():
            event.set()

    def _end_session(self) -> None:
        if self._session is not None:
            self._session.cancel()

    # ---- remote regions ----

    async def region(self, name: str) -> RemoteRegion:
        """The region the peer published under ``name``."""
        self._check_open("Peer.region")
        return await self._lookup(name)

    async def _lookup(self, name: str) -> RemoteRegion:
        if self._session is None:
            return self.agent._published_remote(name, "Peer.region")
        req = self._next_lookup
        self._next_lookup += 1
        slot: list[Any] = [anyio.Event(), None]
        self._lookups[req] = slot
        try:
            await self._session.send(w.Writer().u32(req).str(name).frame(w.LOOKUP))
            await slot[0].wait()
        finally:
            self._lookups.pop(req, None)
        if slot[1] is None:
            raise self._lost("Peer.region")
        status, desc = slot[1]
        if status != w.LOOKUP_OK:
            raise RegionUnavailable(f"Peer.region({name!r}): peer {self.name!r} publishes no region of that name")
        try:
            remote = self.remote_region(desc)
        except InvalidDescriptor as exc:
            raise ProtocolError(f"Peer.region({name!r}): the peer sent a bad descriptor: {exc}") from None
        self._withdrawn.discard(remote.id)
        return remote

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
            if rs.region.id in self._withdrawn:
                raise RegionUnavailable(
                    f"{what}: peer {self.name!r} withdrew remote region {rs.region._label()}"
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
            try:
                await engine.wait(waiter, timeout, what)
            except ConnectionLost:
                if self._broken is not None:  # say why, when the control plane knows
                    raise self._lost(what) from None
                raise

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
        if self._broken is not None:
            raise self._lost(what)

    def _lost(self, what: str) -> ConnectionLost:
        return ConnectionLost(f"{what}: connection to peer {self.name!r} lost ({self._broken})")

    async def aclose(self) -> None:
        """Close the peer; its outstanding ops fail with ClosedError."""
        if self._closed:
            return
        self._closed = True
        if self._session is not None and self._session.ended is None:
            with anyio.move_on_after(1.0):
                try:
                    await self._session.send(w.Writer().frame(w.BYE))
                except HixlError:
                    pass
            self._session.cancel()
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
