"""Peers: what puts and gets go through."""

from __future__ import annotations

import os
import struct
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

_FD_REQUEST = struct.Struct("<I16s")
_FD_ANSWER = struct.Struct("<BQ")

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
        # same-host paths (set by _enable_shm)
        self._shm: Any = None
        self._uds: Any = None
        self._cma = False
        self._routes: dict[int, str] = {}
        self._resolving: dict[int, anyio.Event] = {}
        self._freed = False
        self._one_sge = ffi.new("hx_sge *")
        self._verbs_h: Any = None  # the RC queue pair, when verbs is used
        self._ops = 0  # ops posted and not yet completed (counted by the engine)
        self._free_pending = False

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
        rid = r.u32()
        r.end()
        self._withdrawn.add(rid)
        route = self._routes.pop(rid, None)
        self.agent._engine.backend.spawn(lambda: self._release_route(rid, route), "aiohixl-withdraw")

    def _on_session_end(self, reason: HixlError) -> None:
        if self._broken is None:
            self._broken = reason if isinstance(reason, ConnectionLost) else ConnectionLost(str(reason))
        if not self._closed:
            for handle in self._handles():
                lib.hx_peer_fail(handle, lib.HX_E_CONNLOST)
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
        remote = await self._ask(w.BY_NAME, name, 0, f"Peer.region({name!r})")
        if remote is None:
            raise RegionUnavailable(f"Peer.region({name!r}): peer {self.name!r} publishes no region of that name")
        self._withdrawn.discard(remote.id)
        if self._shm is not None:
            await self._resolve(remote.info)  # map it now, so the first op is fast
        return remote

    async def _ask(self, by: int, name: str, region_id: int, what: str) -> RemoteRegion | None:
        """Ask the peer about one of its regions (by name or id); None if it has none."""
        req = self._next_lookup
        self._next_lookup += 1
        slot: list[Any] = [anyio.Event(), None]
        self._lookups[req] = slot
        try:
            await self._session.send(w.Writer().u32(req).u8(by).str(name).u32(region_id).frame(w.LOOKUP))
            await slot[0].wait()
        finally:
            self._lookups.pop(req, None)
        if slot[1] is None:
            raise self._lost(what)
        status, desc = slot[1]
        if status != w.LOOKUP_OK:
            return None
        try:
            return self.remote_region(desc)
        except InvalidDescriptor as exc:
            raise ProtocolError(f"{what}: the peer sent a bad descriptor: {exc}") from None

    # ---- same-host paths ----

    def _handles(self) -> list[Any]:
        return [h for h in (self._handle, self._shm, self._verbs_h) if h is not None]

    def _enable_verbs(self, handle: Any) -> None:
        self._verbs_h = handle
        self.transport = "verbs"

    def _default_route(self, info: Any, what: str) -> str:
        """The path for a region no same-host path reaches: verbs when it has an rkey, else tcp."""
        if self._verbs_h is not None and len(info.keys.get(1, b"")) == 4:
            return "verbs"
        if self._handle is not None:
            return "tcp"
        raise RegionUnavailable(
            f"{what}: no path to region {info.region_id} of peer {self.name!r}"
            " (it has no RDMA key and tcp is not allowed)"
        )

    def _enable_shm(self, handle: Any, uds: Any, cma: bool) -> None:
        self._shm = handle
        self._uds = uds
        self._uds_lock = anyio.Lock()
        self._cma = cma
        self.transport = "shm"

    async def path(self, remote: RemoteRef) -> str:
        """How ops on ``remote`` travel: "shm-memfd", "shm-cma", "tcp" or "loopback"."""
        rs = self._remote_slice(remote, "Peer.path")
        if self._shm is None:
            if self._verbs_h is None and self._handle is not None:
                return self.transport
            return self._default_route(rs.region.info, "Peer.path")
        return self._routes.get(rs.region.id) or await self._resolve(rs.region.info)

    async def _resolve(self, claimed: Any) -> str:
        """Pick and set up the path to a region, once; concurrent callers share the work."""
        rid = claimed.region_id
        route = self._routes.get(rid)
        if route is not None:
            return route
        pending = self._resolving.get(rid)
        if pending is not None:
            await pending.wait()
            return self._routes.get(rid) or self._default_route(claimed, "Peer.path")
        self._resolving[rid] = done = anyio.Event()
        try:
            route = await self._setup_route(rid, "Peer.path")
            self._routes[rid] = route
            return route
        finally:
            del self._resolving[rid]
            done.set()

    async def _setup_route(self, rid: int, what: str) -> str:
        # The target's own word on the region, never the caller's descriptor:
        # a forged size or address must not reach a copy into its memory.
        remote = await self._ask(w.BY_ID, "", rid, what)
        if remote is None:
            raise RegionUnavailable(f"{what}: peer {self.name!r} has no region {rid}")
        info = remote.info
        if info.kind == "memfd" and self._uds is not None:
            fd = await self._fetch_fd(rid)
            if fd is not None:
                try:
                    rc = lib.hx_shm_map(self._shm, rid, fd, info.nbytes, int(info.access))
                finally:
                    os.close(fd)
                if rc == 0:
                    return "shm-memfd"
                c.log.info("aiohixl: peer %r region %d: mapping refused (status %d)", self.name, rid, rc)
        if self._cma and lib.hx_shm_attach(self._shm, rid, info.address, info.nbytes, int(info.access)) == 0:
            return "shm-cma"
        return self._default_route(info, what)

    async def _fetch_fd(self, rid: int) -> int | None:
        async with self._uds_lock:
            try:
                await self._uds.send(_FD_REQUEST.pack(rid, self.info.session))
                msg, fds = await self._uds.receive_fds(_FD_ANSWER.size, 1)
            except (*c._STREAM_ERRORS, ValueError):
                return None
        if len(msg) != _FD_ANSWER.size:
            for fd in fds:
                os.close(fd)
            return None
        status, _size = _FD_ANSWER.unpack(msg)
        if status != w.FD_OK or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return None
        return fds[0]

    async def _release_route(self, rid: int, route: str | None) -> None:
        """After a withdrawal: stop using the region, then tell the target."""
        try:
            if route is not None and route.startswith("shm") and self._shm is not None and not self._freed:
                await anyio.to_thread.run_sync(lib.hx_shm_forget, self._shm, rid, 1)
            if self._session is not None and self._session.ended is None:
                await self._session.send(w.Writer().u32(rid).frame(w.WITHDRAWN_ACK))
        except HixlError:
            pass

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

    async def put(
        self, remote: RemoteRef, local: LocalRef, *, timeout: float | None = None, imm: int | None = None
    ) -> None:
        """Write ``local`` into ``remote``. Returns once the bytes are in the peer's memory.

        ``imm`` (verbs only): send it as an RDMA WRITE WITH IMM; the target's
        ``agent.notification()`` then yields it once the bytes are in place.
        """
        await self._transfer(lib.HX_OP_PUT, ((remote, local),), timeout, "Peer.put", imm)

    async def get(self, local: LocalRef, remote: RemoteRef, *, timeout: float | None = None) -> None:
        """Read ``remote`` into ``local``. Returns once the bytes are in local memory."""
        await self._transfer(lib.HX_OP_GET, ((remote, local),), timeout, "Peer.get")

    async def put_many(
        self, pairs: Iterable[tuple[RemoteRef, LocalRef]], *, timeout: float | None = None,
        imm: int | None = None,
    ) -> None:
        """Many puts, ``(remote, local)`` pairs, in one native submission and one awaitable.

        With ``imm`` (verbs only) the last write carries it, after all the others.
        """
        await self._transfer(lib.HX_OP_PUT, tuple(pairs), timeout, "Peer.put_many", imm)

    async def get_many(
        self, pairs: Iterable[tuple[LocalRef, RemoteRef]], *, timeout: float | None = None
    ) -> None:
        """Many gets, ``(local, remote)`` pairs, in one native submission and one awaitable."""
        await self._transfer(
            lib.HX_OP_GET, tuple((r, l) for l, r in pairs), timeout, "Peer.get_many"
        )

    async def _transfer(
        self, opcode: int, pairs: tuple[tuple[Any, Any], ...], timeout: float | None, what: str,
        imm: int | None = None,
    ) -> None:
        self._check_open(what)
        engine = self.agent._engine
        if len(engine._ops) >= engine.capacity:
            await engine.admit()
            self._check_open(what)
        elif engine.backend is None:
            engine.attach()
        put = opcode == 1  # HX_OP_PUT
        need = 1 if put else 2  # Access.REMOTE_WRITE / REMOTE_READ, as plain ints: this is the hot path
        checked = []
        for remote, local in pairs:
            rs = self._remote_slice(remote, what)
            ls = _local_slice(local, what)
            region = ls.region
            if region.agent is not self.agent:
                raise InvalidArgument(f"{what}: local region {region._label()} belongs to another agent")
            if region._closed:
                region._check_open(what)
            if rs.nbytes != ls.nbytes:
                raise LengthMismatch(
                    f"{what}: remote range is {rs.nbytes} bytes, local range is {ls.nbytes} bytes"
                )
            rr = rs.region
            if rr._id in self._withdrawn:
                raise RegionUnavailable(f"{what}: peer {self.name!r} withdrew remote region {rr._label()}")
            if not rr._access & need:
                raise AccessDenied(
                    f"{what}: remote region {rr._label()} was registered without {Access(need).name}"
                )
            if not put and region._pinned.readonly:
                raise AccessDenied(f"{what}: local region {region._label()} is read-only")
            if rs.nbytes:
                checked.append((rs, ls))
        if not checked:
            return
        if imm is not None and not 0 <= imm <= 0xFFFFFFFF:
            raise InvalidArgument(f"{what}: imm={imm} is not a 32-bit unsigned value")
        if self._shm is None and self._verbs_h is None and imm is None:
            waiter = self._post(engine, self._handle, opcode, checked, what)
            if waiter is None:
                return
            waiters = [waiter]
        else:
            groups: dict[Any, list] = {}
            for pair in checked:
                rr = pair[0].region
                route = self._routes.get(rr._id)
                if route is None:
                    if self._shm is not None:
                        route = await self._resolve(rr.info)
                    else:
                        route = self._default_route(rr.info, what)
                if rr._id in self._withdrawn:  # withdrawn while the path was set up
                    raise RegionUnavailable(f"{what}: peer {self.name!r} withdrew remote region {rr._label()}")
                groups.setdefault(route, []).append(pair)
            self._check_open(what)
            if imm is not None and list(groups) != ["verbs"]:
                raise InvalidArgument(f"{what}: imm= needs the verbs transport; this op goes over {sorted(groups)}")
            waiters = []
            for route, group in groups.items():
                if route == "verbs":
                    waiters += self._post_verbs(engine, opcode, group, what, imm)
                    continue
                waiter = self._post(engine, self._handle if route == "tcp" else self._shm, opcode, group, what)
                if waiter is not None:
                    waiters.append(waiter)
            if not waiters:
                return
        try:
            await engine.wait_all(waiters, timeout, what)
        except HixlError as exc:
            if self._verbs_h is not None and self._broken is None and lib.hx_peer_status(self._verbs_h):
                # RC semantics: an error puts the queue pair in error; connect again.
                self._broken = ConnectionLost(f"RDMA queue pair in error after {type(exc).__name__}")
            if isinstance(exc, ConnectionLost) and self._broken is not None:
                raise self._lost(what) from None  # say why, when it is known
            raise

    _VERBS_CHAIN = 128  # pairs per work-request chain; the send queue holds 512 WRs

    def _post_verbs(self, engine: Any, opcode: int, group: list, what: str, imm: int | None) -> list:
        """One WR chain per 128 pairs, in order; ``imm`` rides on the very last write."""
        waiters = []
        for start in range(0, len(group), self._VERBS_CHAIN):
            chunk = group[start : start + self._VERBS_CHAIN]
            n = len(chunk)
            sges = ffi.new("hx_sge[]", n)
            for i, (rs, ls) in enumerate(chunk):
                rr = rs.region
                sge = sges[i]
                sge.local_region = ls.region.id
                sge.remote_region = rr._id
                sge.remote_off = rs.offset
                sge.rkey = rr._rkey  # what the remote NIC checks: the rkey
                sge.raddr = rr.info.address + rs.offset  # and the remote virtual address
                sge.local_off = ls.offset
                sge.len = rs.nbytes
            keep = tuple(ls.region for _, ls in chunk)
            last = start + n >= len(group)
            if imm is not None and last:
                waiters.append(engine.post_imm(self._verbs_h, sges, n, keep, what, imm, self))
            else:
                waiters.append(engine.post(self._verbs_h, opcode, sges, n, keep, what, self))
        return [w_ for w_ in waiters if w_ is not None]

    def _post(self, engine: Any, handle: Any, opcode: int, group: list, what: str) -> Any:
        n = len(group)
        if n == 1:
            sges = self._one_sge  # read by the native side during the call only
            rs, ls = group[0]
            sges.local_region = ls.region.id
            sges.remote_region = rs.region._id
            sges.local_off = ls.offset
            sges.remote_off = rs.offset
            sges.len = rs.nbytes
            keep: tuple = (ls.region,)
        else:
            sges = ffi.new("hx_sge[]", n)
            for i, (rs, ls) in enumerate(group):
                sge = sges[i]
                sge.local_region = ls.region.id
                sge.remote_region = rs.region._id
                sge.local_off = ls.offset
                sge.remote_off = rs.offset
                sge.len = rs.nbytes
            keep = tuple(ls.region for _, ls in group)
        return engine.post(handle, opcode, sges, n, keep, what, self)

    def _remote_slice(self, remote: Any, what: str) -> RemoteSlice:
        if isinstance(remote, RemoteRegion):
            remote = remote.as_slice()
        elif not isinstance(remote, RemoteSlice):
            raise InvalidArgument(
                f"{what}: expected a RemoteRegion or a slice of one, got {type(remote).__name__}"
            )
        if remote.region._agent_id != self.remote_id:
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
        self._close_native()  # before the session ends: ops fail as closed, not lost
        if self._session is not None and self._session.ended is None:
            with anyio.move_on_after(1.0):
                try:
                    await self._session.send(w.Writer().frame(w.BYE))
                except HixlError:
                    pass
            self._session.cancel()
        await self._close_uds()
        # Native handles go once the last op is back: a native thread may
        # still be finishing (or flushing) one.
        if self._ops == 0:
            self._free()
        else:
            self._free_pending = True

    def _close_native(self) -> None:
        for handle in self._handles():
            lib.hx_peer_close(handle)

    async def _close_uds(self) -> None:
        if self._uds is not None:
            uds, self._uds = self._uds, None
            with anyio.CancelScope(shield=True):
                await uds.aclose()

    def _free(self) -> None:
        self._closed = True
        self._freed = True
        self._free_pending = False
        self.agent._peers.discard(self)
        for handle in self._handles():
            lib.hx_peer_free(handle)
        self._handle = self._shm = self._verbs_h = None

    def __repr__(self) -> str:
        return f"<Peer {self.name or self.remote_id.hex()} via {self.transport}>"


def _local_slice(local: Any, what: str) -> RegionSlice:
    if isinstance(local, Region):
        return local.as_slice()
    if isinstance(local, RegionSlice):
        return local
    raise InvalidArgument(f"{what}: expected a Region or a slice of one, got {type(local).__name__}")
