"""Peers: what puts and gets go through."""

from __future__ import annotations

from asyncio import _get_running_loop
from collections.abc import Awaitable, Iterable
from functools import partial
from threading import get_ident as _get_ident
from typing import Any, Protocol, Union

import anyio

from . import _control as c
from . import _wire as w
from ._engine import Engine
from ._native import lib, status_error
from .descriptor import RegionInfo, decode
from .errors import (
    AccessDenied,
    ClosedError,
    ConnectionLost,
    HixlError,
    InvalidArgument,
    InvalidDescriptor,
    LengthMismatch,
    ProtocolError,
    RegionUnavailable,
)
from .memory import Access, Region, RegionSlice
from .notifications import note_bytes
from .remote import RemoteRegion, RemoteSlice
from .transports.base import Link, Pair

_PUT, _GET = int(lib.HX_OP_PUT), int(lib.HX_OP_GET)

__all__ = ["Peer"]

LocalRef = Union[Region, RegionSlice]
RemoteRef = Union[RemoteRegion, RemoteSlice]


class PeerOwner(Protocol):
    """What a peer needs of the agent it belongs to."""

    id: bytes
    name: str
    engine: Engine
    _closed: bool

    def check_open(self, what: str) -> None: ...

    def published_remote(self, name: str, what: str) -> RemoteRegion: ...

    def forget_peer(self, peer: Peer) -> None: ...

    def heartbeat(self) -> tuple[float, float]: ...

    async def notes_room(self) -> None: ...


class Peer:
    """A connection to an agent (possibly this one) that ops go through.

    Ops on one peer are started in the order they are called and, over tcp,
    executed by the target in that order; each awaitable finishes only once
    its bytes are in the destination. ``transport`` says which path ops take.
    """

    def __init__(
        self,
        agent: PeerOwner,
        links: list[Link],
        remote_id: bytes,
        name: str | None,
        info: c.PeerInfo | None = None,
        channel: Link | None = None,
    ):
        self.agent = agent
        self.links = links  # in order of preference: a region goes over the first that reaches it
        # Carries notifications and heartbeats: one of the links, or a link of its own.
        self.channel = channel or links[0]
        self._own_channel = self.channel not in links
        # Every notification goes one way, so they arrive in order: on the preferred
        # link when it keeps them behind its data (tcp, verbs), else on the channel.
        self._notes = links[0] if links[0].ordered_notes else self.channel
        # notify() needs no fence when every op goes the way the notifications do.
        self._ordered = len(links) == 1 and links[0] is self._notes
        self.remote_id = remote_id
        self.transport = links[0].name
        self.name = name
        self.info = info
        self.closed = False
        self._broken: HixlError | None = None
        self._session: c.Session | None = None
        self._withdrawn: set[int] = set()
        self._lookups: dict[int, list[Any]] = {}
        self._next_lookup = 1
        # (region id, key) -> (link, path name), decided once per region: a
        # descriptor with another key is another (unknown) region, asked anew
        self._routes: dict[tuple[int, int], tuple[Link, str]] = {}
        self._resolving: dict[tuple[int, int], anyio.Event] = {}
        # one link that reaches every region as it is: no routing per op
        self._one_route = links[0] if len(links) == 1 and links[0].reaches_all else None
        self._freed = False

    @property
    def broken(self) -> HixlError | None:
        """Why the connection to the peer ended (None while it works)."""
        return self._broken

    # ---- control session (connected peers) ----

    def start_session(self, ch: c.Channel) -> None:
        interval, timeout = self.agent.heartbeat()

        def silent() -> str | None:
            # The channel's native side hears the peer's heartbeats, whatever
            # either event loop is doing.
            status = self.channel.failed if not self._freed else 0
            if status == lib.HX_E_SILENT:
                return f"no heartbeat for {timeout} s"
            return None if not status else "its channel broke"

        self._session = c.Session(
            ch,
            interval,
            {w.REGION: self._on_region, w.WITHDRAWN: self._on_withdrawn},
            self._on_session_end,
            f"peer {self.name!r}",
            silent,
        )
        self.agent.engine.attach().spawn(self._session.run, f"aiohixl-peer-{self.name}")

    @property
    def label(self) -> str:
        return f"peer {self.name!r}"

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
        routed = [k for k in self._routes if k[0] == rid]
        route = self._routes.pop(routed[0]) if routed else None
        for k in routed[1:]:
            self._routes.pop(k)
        self.agent.engine.attach().spawn(lambda: self._release_route(rid, route), "aiohixl-withdraw")

    async def _release_route(self, rid: int, route: tuple[Link, str] | None) -> None:
        """After a withdrawal: stop using the region, then tell the target."""
        try:
            if route is not None and not self._freed:
                await route[0].forget(rid)
            if self._session is not None and self._session.ended is None:
                await self._session.send(w.Writer().u32(rid).frame(w.WITHDRAWN_ACK))
        except HixlError:
            pass

    def _on_session_end(self, reason: HixlError) -> None:
        if self._broken is None:
            self._broken = reason if isinstance(reason, ConnectionLost) else ConnectionLost(str(reason))
        if not self.closed:
            for link in self._all_links():
                link.fail(lib.HX_E_CONNLOST)
        for event, _ in self._lookups.values():
            event.set()

    def end_session(self) -> None:
        if self._session is not None:
            self._session.cancel()

    # ---- remote regions ----

    async def region(self, name: str) -> RemoteRegion:
        """The region the peer published under ``name``."""
        self._check_open("Peer.region")
        if self._session is None:
            return self.agent.published_remote(name, "Peer.region")
        remote = await self._ask(w.BY_NAME, name, 0, 0, f"Peer.region({name!r})")
        if remote is None:
            raise RegionUnavailable(f"Peer.region({name!r}): {self.label} publishes no region of that name")
        self._withdrawn.discard(remote.id)
        if self._one_route is None:
            try:
                await self._route(remote.info, "Peer.region")  # set the path up now: the first op is fast
            except RegionUnavailable:
                pass  # said by the first op on it, which is where it matters
        return remote

    async def region_info(self, info: RegionInfo, what: str) -> RegionInfo | None:
        """The peer's own word on one of its regions (for links setting up a path).

        Asked by id and key: the peer answers only a caller that holds the region's descriptor.
        """
        remote = await self._ask(w.BY_ID, "", info.region_id, info.key, what)
        return None if remote is None else remote.info

    async def send(self, frame: bytes) -> None:
        if self._session is None:
            raise ClosedError(f"{self.label} has no control session")
        await self._session.send(frame)

    async def _ask(self, by: int, name: str, region_id: int, key: int, what: str) -> RemoteRegion | None:
        """Ask the peer about one of its regions (by name or id); None if it has none."""
        assert self._session is not None
        req = self._next_lookup
        self._next_lookup += 1
        slot: list[Any] = [anyio.Event(), None]
        self._lookups[req] = slot
        try:
            await self._session.send(w.Writer().u32(req).u8(by).str(name).u32(region_id).u64(key).frame(w.LOOKUP))
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

    def remote_region(self, descriptor: bytes) -> RemoteRegion:
        """Turn a descriptor from ``Region.descriptor()`` into a RemoteRegion of this peer."""
        info = decode(descriptor)
        if info.agent_id != self.remote_id:
            raise InvalidDescriptor(
                f"Peer.remote_region: descriptor of region {info.region_id} belongs to agent "
                f"{info.agent_id.hex()}, this peer is agent {self.remote_id.hex()}"
            )
        return RemoteRegion(info)

    # ---- routing: which link carries ops on a region ----

    async def path(self, remote: RemoteRef) -> str:
        """How ops on ``remote`` travel: "shm-memfd", "shm-cma", "verbs", "tcp" or "loopback"."""
        rs = self._remote_slice(remote, "Peer.path")
        return (await self._route(rs.region.info, "Peer.path"))[1]

    async def _route(self, info: RegionInfo, what: str) -> tuple[Link, str]:
        """The link for a region, decided once; concurrent callers share the work."""
        rid = info.region_id
        rkey = (rid, info.key)
        route = self._routes.get(rkey)
        if route is not None:
            return route
        pending = self._resolving.get(rkey)
        if pending is not None:
            await pending.wait()
            return self._routes.get(rkey) or await self._route(info, what)
        self._resolving[rkey] = done = anyio.Event()
        try:
            control = self if self._session is not None else None
            for link in self.links:
                path = await link.reach(info, control, what)
                if path is not None:
                    route = self._routes[rkey] = (link, path)
                    return route
            raise RegionUnavailable(
                f"{what}: no path to region {rid} of {self.label} (tried {', '.join(link.name for link in self.links)})"
            )
        finally:
            del self._resolving[rkey]
            done.set()

    # ---- ops ----

    def put(
        self,
        remote: RemoteRef,
        local: LocalRef,
        *,
        timeout: float | None = None,
        notify: bytes | None = None,
        imm: int | None = None,
    ) -> Awaitable[None]:
        """Write ``local`` into ``remote``; await it: it finishes once the bytes are in the peer's memory.

        ``notify`` (up to 4 KiB): the target's ``agent.notification()`` yields it
        once every byte of this put is in place (and never if the put fails); the
        call returns once it is queued there. ``imm`` (verbs only): send the last
        write as an RDMA WRITE WITH IMM, which the target's ``notification()``
        yields with ``.imm`` set.

        Under asyncio a plain put on a path already set up is checked and posted
        at the call and returns its Future (``gather`` takes it as it is: no Task
        per op); a refusal is raised at the call.
        """
        if timeout is None and notify is None and imm is None:
            future = self._post_now(_PUT, remote, local, "Peer.put")
            if future is not None:
                return future
        return self._transfer(lib.HX_OP_PUT, ((remote, local),), timeout, "Peer.put", imm, notify)

    def get(self, local: LocalRef, remote: RemoteRef, *, timeout: float | None = None) -> Awaitable[None]:
        """Read ``remote`` into ``local``; await it: it finishes once the bytes are in local memory.

        Posted at the call under asyncio, like ``put``."""
        if timeout is None:
            future = self._post_now(_GET, remote, local, "Peer.get")
            if future is not None:
                return future
        return self._transfer(lib.HX_OP_GET, ((remote, local),), timeout, "Peer.get")

    def _post_now(self, opcode: int, remote: Any, local: Any, what: str) -> Any:
        """The op's Future, posted now, when nothing needs awaiting first: asyncio, room in
        the ring, the path of its region known. None otherwise (the coroutine path does it).

        The hot path of every single put and get: the checks of ``_check`` written out for
        the usual arguments (slices), ``_check`` itself for anything else or to raise."""
        agent = self.agent
        engine = agent.engine
        loop = engine.loop
        if loop is None or len(engine._ops) >= engine.capacity:
            return None
        # Called from the loop's own thread while it runs. asyncio's get_running_loop()
        # asks the kernel for the pid on every call (0.2 us here); the thread id is free.
        if loop._thread_id != _get_ident() if engine.loop_is_base else loop is not _get_running_loop():
            return None
        if self.closed or self._broken is not None:
            self._check_open(what)
        if agent._closed:
            agent.check_open(what)
        put = opcode == _PUT
        if type(remote) is RemoteSlice and type(local) is RegionSlice:
            rs, ls = remote, local
            rr, region = rs.region, ls.region
            if (
                rr.agent_id != self.remote_id
                or (region.agent is not agent and region.agent.id != agent.id)  # type: ignore[comparison-overlap]
                or region.closed
                or rs.nbytes != ls.nbytes
                or rr.id in self._withdrawn
                or not rr.rights & (1 if put else 2)
                or (not put and region.readonly)
            ):
                rs, ls = self._check(put, remote, local, what)  # raises, naming what is wrong
        else:
            rs, ls = self._check(put, remote, local, what)
            rr = rs.region
        if rs.nbytes:
            link = self._one_route
            if link is None:
                route = self._routes.get(rr.route_key)
                if route is None:
                    return None  # its path is set up on first use: that awaits
                link = route[0]
            waiter = (
                engine.post1(link.handle, opcode, rs, ls, what, self)  # Link.post_one, minus one call
                if link.plain_post
                else link.post_one(engine, opcode, rs, ls, what, self)
            )
            if waiter is not None:
                return waiter
        return engine.backend.done_waiter()  # type: ignore[union-attr]  # attached: loop is set

    async def put_many(
        self,
        pairs: Iterable[tuple[RemoteRef, LocalRef]],
        *,
        timeout: float | None = None,
        notify: bytes | None = None,
        imm: int | None = None,
    ) -> None:
        """Many puts, ``(remote, local)`` pairs, in one native submission and one awaitable.

        ``notify``: one message, delivered once every pair has landed. With ``imm``
        (verbs only) the last write carries it, after all the others.
        """
        await self._transfer(lib.HX_OP_PUT, tuple(pairs), timeout, "Peer.put_many", imm, notify)

    async def notify(self, data: bytes, *, timeout: float | None = None) -> None:
        """Send ``data`` (up to 4 KiB) alone: the target's ``agent.notification()`` yields it
        after every op issued earlier on this peer has landed. Returns once it is queued there."""
        what = "Peer.notify"
        data = note_bytes(data, what, "data")
        self._check_open(what)
        engine = self.agent.engine
        if engine.full:
            await engine.admit()
            self._check_open(what)
        if not self._ordered:
            await self._fence()  # earlier ops travel other ways: wait until they landed
        await self._send_note(data, 0, timeout, what)

    async def get_many(self, pairs: Iterable[tuple[LocalRef, RemoteRef]], *, timeout: float | None = None) -> None:
        """Many gets, ``(local, remote)`` pairs, in one native submission and one awaitable."""
        await self._transfer(lib.HX_OP_GET, tuple((r, loc) for loc, r in pairs), timeout, "Peer.get_many")

    async def _transfer(
        self,
        opcode: int,
        pairs: tuple[tuple[Any, Any], ...],
        timeout: float | None,
        what: str,
        imm: int | None = None,
        notify: bytes | None = None,
    ) -> None:
        if notify is not None:
            notify = note_bytes(notify, what)
        self._check_open(what)
        engine = self.agent.engine
        engine.attach(what)  # the agent's own loop only: nothing may be posted from another
        if engine.full:
            await engine.admit(what)
            self._check_open(what)
        checked = self._checked(opcode, pairs, what)
        if not checked:
            if notify is not None:  # nothing to wait for: the message alone
                await self._send_note(notify, 0, timeout, what)
            return
        if imm is not None and not 0 <= imm <= 0xFFFFFFFF:
            raise InvalidArgument(f"{what}: imm={imm} is not a 32-bit unsigned value")
        if self._one_route is not None and imm is None:
            waiters = self._one_route.post(engine, opcode, checked, what, self, None)
            behind = self._ordered  # the message can follow this op's data on its link
        else:
            waiters = []
            groups = await self._group(checked, what)
            for (link, path), group in groups.items():
                if imm is not None and not link.carries_imm:
                    raise InvalidArgument(f"{what}: imm= needs the verbs transport; this op goes over {path}")
                waiters += link.post(engine, opcode, group, what, self, imm)
            behind = self._notes.ordered_notes and all(link is self._notes for link, _ in groups)
        refused: HixlError | None = None
        if notify is not None and behind and waiters:
            # Behind the data on the same ordered connection: the target places
            # the data first, and drops the message if the op was refused.
            try:
                note = self._notes.note(engine, notify, engine.last_op_id, what, self)
            except HixlError as exc:  # e.g. the data already broke the path: say why, below
                note, refused = None, exc
            if note is not None and note is not engine.BUSY:
                waiters.append(note)
            notify = None if note is not engine.BUSY else notify
        if waiters:
            try:
                await engine.wait_all(waiters, timeout, what)
            except HixlError as exc:
                raise self._explain(exc, what) from None
            if refused is not None:
                raise self._explain(refused, what)
        if notify is not None:  # the data has landed; now the message
            await self._send_note(notify, 0, timeout, what)

    async def _send_note(self, data: bytes, dep: int, timeout: float | None, what: str) -> None:
        engine = self.agent.engine
        while True:
            self._check_open(what)
            waiter = self._notes.note(engine, data, dep, what, self)
            if waiter is not engine.BUSY:
                break
            await self.agent.notes_room()  # a loopback peer's own queue is full: wait for room
        if waiter is not None:
            try:
                await engine.wait_all([waiter], timeout, what)
            except HixlError as exc:
                raise self._explain(exc, what) from None

    async def _fence(self) -> None:
        """Return once every op this peer posted before the call has completed."""
        engine = self.agent.engine
        backend = engine.attach()
        waiter = backend.new_waiter()
        engine.when_none(self._owns, partial(backend.resolve, waiter, None), up_to=engine.last_posted)
        await backend.wait(waiter)

    def _checked(self, opcode: int, pairs: tuple[tuple[Any, Any], ...], what: str) -> list[Pair]:
        """Each pair checked as far as this side can (``_check``); empty ones dropped."""
        put = opcode == _PUT
        checked = []
        for remote, local in pairs:
            pair = self._check(put, remote, local, what)
            if pair[0].nbytes:
                checked.append(pair)
        return checked

    def _check(self, put: bool, remote: Any, local: Any, what: str) -> Pair:
        """One pair checked as far as this side can: lengths, ownership, rights, liveness."""
        rs = remote if type(remote) is RemoteSlice else self._remote_slice(remote, what)
        if rs.region.agent_id != self.remote_id:
            self._remote_slice(remote, what)  # raises, naming it
        ls = local if type(local) is RegionSlice else _local_slice(local, what)
        region = ls.region
        if region.agent.id != self.agent.id:
            raise InvalidArgument(f"{what}: local region {region.label()} belongs to another agent")
        if region.closed:
            region.check_open(what)
        if rs.nbytes != ls.nbytes:
            raise LengthMismatch(f"{what}: remote range is {rs.nbytes} bytes, local range is {ls.nbytes} bytes")
        rr = rs.region
        need = 1 if put else 2  # Access.REMOTE_WRITE / REMOTE_READ, as plain ints: this is the hot path
        if rr.id in self._withdrawn:
            raise RegionUnavailable(f"{what}: {self.label} withdrew remote region {rr.label()}")
        if not rr.rights & need:
            raise AccessDenied(
                f"{what}: remote region {rr.label()} was registered without {Access(need).name}"
                " (register() gives peers no access unless access= says so)"
            )
        if not put and region.readonly:
            raise AccessDenied(f"{what}: local region {region.label()} is read-only")
        return rs, ls

    async def _group(self, checked: list[Pair], what: str) -> dict[tuple[Link, str], list[Pair]]:
        """Pairs by route: one native submission reaches its regions one way (e.g. all mapped)."""
        groups: dict[tuple[Link, str], list[Pair]] = {}
        for pair in checked:
            rr = pair[0].region
            route = self._routes.get((rr.id, rr.key)) or await self._route(rr.info, what)
            if rr.id in self._withdrawn:  # withdrawn while the path was set up
                raise RegionUnavailable(f"{what}: {self.label} withdrew remote region {rr.label()}")
            groups.setdefault(route, []).append(pair)
        self._check_open(what)
        return groups

    def _explain(self, exc: HixlError, what: str) -> HixlError:
        """The error to raise for a failed op: a broken path says so, and why."""
        if self._broken is None:
            for link in self._all_links():
                status = link.failed
                if status:
                    # e.g. RC semantics: an error puts the queue pair in error; connect again.
                    self._broken = ConnectionLost(f"{link.name}: {status_error(status, 'path in error')}")
                    break
        if isinstance(exc, ConnectionLost) and self._broken is not None:
            return self._lost(what)
        return exc

    def _remote_slice(self, remote: Any, what: str) -> RemoteSlice:
        if isinstance(remote, RemoteRegion):
            remote = remote.as_slice()
        elif not isinstance(remote, RemoteSlice):
            raise InvalidArgument(f"{what}: expected a RemoteRegion or a slice of one, got {type(remote).__name__}")
        if remote.region.agent_id != self.remote_id:
            raise InvalidArgument(
                f"{what}: remote region {remote.region.label()} belongs to another agent than this peer's"
            )
        return remote

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ClosedError(f"{what}: peer {self.name or self.remote_id.hex()} is closed")
        self.agent.check_open(what)
        if self._broken is not None:
            raise self._lost(what)

    def _lost(self, what: str) -> ConnectionLost:
        return ConnectionLost(f"{what}: connection to {self.label} lost ({self._broken})")

    # ---- accounting and lifetime ----

    def _owns(self, op: tuple[Any, ...]) -> bool:
        return op[3] is self  # posted by this peer

    def op_failed(self, exc: BaseException) -> None:
        if isinstance(exc, HixlError):
            self._explain(exc, "")

    def _all_links(self) -> list[Link]:
        return [*self.links, self.channel] if self._own_channel else self.links

    async def aclose(self) -> None:
        """Close the peer; its outstanding ops fail with ClosedError."""
        if self.closed:
            return
        self.closed = True
        self.close_links()  # before the session ends: ops fail as closed, not lost
        if self._session is not None and self._session.ended is None:
            with anyio.move_on_after(1.0):
                try:
                    await self._session.send(w.Writer().frame(w.BYE))
                except HixlError:
                    pass
            self._session.cancel()
        await self.release_links()
        # Native handles go once the last op is back: a native thread may
        # still be finishing (or flushing) one.
        self.agent.engine.when_none(self._owns, self.free)

    def close_links(self) -> None:
        self.closed = True
        for link in self._all_links():
            link.close()

    async def release_links(self) -> None:
        for link in self._all_links():
            await link.aclose()

    def free(self) -> None:
        self.closed = True
        if self._freed:
            return
        self._freed = True
        self.agent.forget_peer(self)
        for link in self._all_links():
            link.free()

    def __repr__(self) -> str:
        return f"<Peer {self.name or self.remote_id.hex()} via {self.transport}>"


def _local_slice(local: Any, what: str) -> RegionSlice:
    if isinstance(local, Region):
        return local.as_slice()
    if isinstance(local, RegionSlice):
        return local
    raise InvalidArgument(f"{what}: expected a Region or a slice of one, got {type(local).__name__}")
