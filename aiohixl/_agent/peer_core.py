"""What a Peer points at: its links, its control session with the peer, routing, and their lifetime.

Also the ``ControlView`` its links get (``label``, ``region_info``, ``send``) and the owner the
engine is told about when one of its ops fails (``op_failed``).
"""

from __future__ import annotations

from typing import Any, Protocol

import anyio

from .._control import handshake as c
from .._control import wire as w
from .._control.session import Session
from .._loop.engine import Engine
from .._loop.native import lib, status_error
from ..descriptor import RegionInfo, decode
from ..errors import ClosedError, ConnectionLost, HixlError, InvalidDescriptor, ProtocolError, RegionUnavailable
from ..notifications import Inbox
from ..remote import RemoteRegion
from ..transports.base import Link
from .regions import Regions


class PeersOwner(Protocol):
    """What a peer's plumbing needs of its agent (``core.AgentCore``)."""

    engine: Engine
    heartbeat: tuple[float, float]
    peers: set[PeerCore]
    regions: Regions
    inbox: Inbox
    closed: bool

    def check_open(self, what: str) -> None: ...


class PeerCore:
    """One peer's plumbing. ``closed``, ``broken``, ``withdrawn``, ``routes`` are the state its ops check."""

    def __init__(
        self,
        agent: PeersOwner,
        links: list[Link],
        remote_id: bytes,
        name: str | None,
        info: c.PeerInfo | None = None,
        channel: Link | None = None,
        transport_reason: str | None = None,
    ) -> None:
        self.agent = agent
        self.engine = agent.engine
        self.links = links  # in order of preference: a region goes over the first that reaches it
        # Carries notifications and heartbeats: one of the links, or a link of its own.
        self.channel = channel or links[0]
        self._own_channel = self.channel not in links
        # Every notification goes one way, so they arrive in order: on the preferred
        # link when it keeps them behind its data (tcp, verbs) or rings the target
        # itself (shm), else on the channel.
        first = links[0]
        self.notes = first if first.ordered_notes or first.take_notes(self.channel) else self.channel
        # notify() needs no fence when every op goes the way the notifications do, behind them.
        self.ordered = len(links) == 1 and first is self.notes and first.ordered_notes
        self.remote_id = remote_id
        self.name = name
        self.info = info
        # Why links[0] carries the ops: what each transport preferred to it could not do (connect()).
        self.transport_reason = transport_reason or f"{links[0].name} (the agent itself)"
        self.closed = False
        self.broken: HixlError | None = None  # why the connection ended
        self.session: Session | None = None
        self.withdrawn: set[int] = set()
        self._lookups: dict[int, list[Any]] = {}
        self._next_lookup = 1
        # (region id, key) -> (link, path name), decided once per region: a
        # descriptor with another key is another (unknown) region, asked anew
        self.routes: dict[tuple[int, int], tuple[Link, str]] = {}
        self._resolving: dict[tuple[int, int], anyio.Event] = {}
        # one link that reaches every region as it is: no routing per op
        self.one_route = links[0] if len(links) == 1 and links[0].reaches_all else None
        self._freed = False

    @property
    def label(self) -> str:
        return f"peer {self.name!r}"

    # ---- the control session (connected peers) ----

    def start_session(self, ch: c.Channel) -> None:
        interval, timeout = self.agent.heartbeat

        def silent() -> str | None:
            # The channel's native side hears the peer's heartbeats, whatever
            # either event loop is doing.
            status = self.channel.failed if not self._freed else 0
            if status == lib.HX_E_SILENT:
                return f"no heartbeat for {timeout} s"
            return None if not status else "its channel broke"

        self.session = Session(
            ch,
            interval,
            {w.REGION: self._on_region, w.WITHDRAWN: self._on_withdrawn},
            self._on_session_end,
            self.label,
            silent,
        )
        self.engine.attach().spawn(self.session.run, f"aiohixl-peer-{self.name}")

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
        self.withdrawn.add(rid)
        routed = [k for k in self.routes if k[0] == rid]
        route = self.routes.pop(routed[0]) if routed else None
        for k in routed[1:]:
            self.routes.pop(k)
        self.engine.attach().spawn(lambda: self._release_route(rid, route), "aiohixl-withdraw")

    async def _release_route(self, rid: int, route: tuple[Link, str] | None) -> None:
        """After a withdrawal: stop using the region, then tell the target."""
        try:
            if route is not None and not self._freed:
                await route[0].forget(rid)
            if self.session is not None and self.session.ended is None:
                await self.session.send(w.Writer().u32(rid).frame(w.WITHDRAWN_ACK))
        except HixlError:
            pass

    def _on_session_end(self, reason: HixlError) -> None:
        if self.broken is None:
            self.broken = reason if isinstance(reason, ConnectionLost) else ConnectionLost(str(reason))
        if not self.closed:
            for link in self.all_links():
                link.fail(lib.HX_E_CONNLOST)
        for event, _ in self._lookups.values():
            event.set()

    def end_session(self) -> None:
        if self.session is not None:
            self.session.cancel()

    # ---- asking the peer (ControlView) ----

    async def region_info(self, info: RegionInfo, what: str) -> RegionInfo | None:
        """The peer's own word on one of its regions (for links setting up a path).

        Asked by id and key: the peer answers only a caller that holds the region's descriptor.
        """
        remote = await self.ask(w.BY_ID, "", info.region_id, info.key, what)
        return None if remote is None else remote.info

    async def send(self, frame: bytes) -> None:
        """Send a control frame of a transport's own to the peer."""
        if self.session is None:
            raise ClosedError(f"{self.label} has no control session")
        await self.session.send(frame)

    async def ask(self, by: int, name: str, region_id: int, key: int, what: str) -> RemoteRegion | None:
        """Ask the peer about one of its regions (by name or id); None if it has none."""
        assert self.session is not None
        req = self._next_lookup
        self._next_lookup += 1
        slot: list[Any] = [anyio.Event(), None]
        self._lookups[req] = slot
        try:
            await self.session.send(w.Writer().u32(req).u8(by).str(name).u32(region_id).u64(key).frame(w.LOOKUP))
            await slot[0].wait()
        finally:
            self._lookups.pop(req, None)
        if slot[1] is None:
            raise self.lost(what)
        status, desc = slot[1]
        if status != w.LOOKUP_OK:
            return None
        try:
            return self.remote_region(desc, "Peer.remote_region")
        except InvalidDescriptor as exc:
            raise ProtocolError(f"{what}: the peer sent a bad descriptor: {exc}") from None

    def remote_region(self, descriptor: bytes, what: str) -> RemoteRegion:
        info = decode(descriptor)
        if info.agent_id != self.remote_id:
            raise InvalidDescriptor(
                f"{what}: descriptor of region {info.region_id} belongs to agent "
                f"{info.agent_id.hex()}, this peer is agent {self.remote_id.hex()}"
            )
        return RemoteRegion(info)

    # ---- routing: which link carries ops on a region ----

    async def route(self, info: RegionInfo, what: str) -> tuple[Link, str]:
        """The link for a region, decided once; concurrent callers share the work."""
        rid = info.region_id
        rkey = (rid, info.key)
        route = self.routes.get(rkey)
        if route is not None:
            return route
        pending = self._resolving.get(rkey)
        if pending is not None:
            await pending.wait()
            return self.routes.get(rkey) or await self.route(info, what)
        self._resolving[rkey] = done = anyio.Event()
        try:
            control = self if self.session is not None else None
            for link in self.links:
                path = await link.reach(info, control, what)
                if path is not None:
                    route = self.routes[rkey] = (link, path)
                    return route
            raise RegionUnavailable(
                f"{what}: no path to region {rid} of {self.label} (tried {', '.join(link.name for link in self.links)})"
            )
        finally:
            del self._resolving[rkey]
            done.set()

    # ---- failures ----

    def explain(self, exc: HixlError, what: str) -> HixlError:
        """The error to raise for a failed op: a broken path says so, and why."""
        if self.broken is None:
            for link in self.all_links():
                status = link.failed
                if status:
                    # e.g. RC semantics: an error puts the queue pair in error; connect again.
                    self.broken = ConnectionLost(f"{link.name}: {status_error(status, 'path in error')}")
                    break
        if isinstance(exc, ConnectionLost) and self.broken is not None:
            return self.lost(what)
        return exc

    def lost(self, what: str) -> ConnectionLost:
        return ConnectionLost(f"{what}: connection to {self.label} lost ({self.broken})")

    def op_failed(self, exc: BaseException) -> None:
        """The engine's word that one of our ops failed: a broken path is noticed now."""
        if isinstance(exc, HixlError):
            self.explain(exc, "")

    def owns(self, op: tuple[Any, ...]) -> bool:
        return op[3] is self  # posted by this peer

    # ---- lifetime ----

    def all_links(self) -> list[Link]:
        return [*self.links, self.channel] if self._own_channel else self.links

    async def aclose(self) -> None:
        """Peer.aclose(): its outstanding ops fail with ClosedError."""
        if self.closed:
            return
        self.closed = True
        self.close_links()  # before the session ends: ops fail as closed, not lost
        if self.session is not None and self.session.ended is None:
            with anyio.move_on_after(1.0):
                try:
                    await self.session.send(w.Writer().frame(w.BYE))
                except HixlError:
                    pass
            self.session.cancel()
        await self.release_links()
        # Native handles go once the last op is back: a native thread may
        # still be finishing (or flushing) one.
        self.engine.when_none(self.owns, self.free)

    def close_links(self) -> None:
        self.closed = True
        for link in self.all_links():
            link.close()

    async def release_links(self) -> None:
        for link in self.all_links():
            await link.aclose()

    def free(self) -> None:
        self.closed = True
        if self._freed:
            return
        self._freed = True
        self.agent.peers.discard(self)
        for link in self.all_links():
            link.free()
