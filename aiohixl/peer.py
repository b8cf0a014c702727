"""Peers: what puts and gets go through."""

from __future__ import annotations

import collections
from asyncio import _get_running_loop
from collections.abc import Awaitable, Coroutine, Iterable
from functools import partial
from threading import get_ident as _get_ident
from typing import Any, Union

from . import _args
from ._agent.peer_core import PeerCore
from ._construct import NoPublicConstructor
from ._control import wire as w
from ._loop.backends import DoneOp as _DoneOp
from ._loop.backends import Op as _Op
from ._loop.backends import PolledOp as _PolledOp
from ._loop.native import lib
from .errors import (
    AccessDenied,
    ClosedError,
    HixlError,
    InvalidArgument,
    LengthMismatch,
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


class _Message:
    """A ``put(notify=)`` message to send once its data has landed (``Peer._deliver``)."""

    __slots__ = ("data", "what", "waiter", "ready", "error")

    def __init__(self, data: bytes, what: str, waiter: Any) -> None:
        self.data, self.what, self.waiter = data, what, waiter
        self.ready = False  # its data's ops have ended
        self.error: HixlError | None = None  # why it is not sent


class Peer(metaclass=NoPublicConstructor):
    """A connection to an agent (possibly this one) that ops go through.

    Ops on one peer are started in the order they are called and, over tcp,
    executed by the target in that order; each awaitable finishes only once
    its bytes are in the destination. ``transport`` says which path ops take,
    ``transport_reason`` why: what each transport preferred to it could not do.
    Peers come from ``Agent.connect()`` and ``Agent.loopback()``.
    """

    made_by = "Agent.connect() or Agent.loopback()"

    def __init__(self, agent: Any, core: PeerCore) -> None:
        self._agent = agent
        self._core = core  # links, control session, routing: the plumbing behind the ops
        self._engine = core.engine
        self.remote_id = core.remote_id
        self.transport = core.links[0].name
        self.transport_reason = core.transport_reason
        self.name = core.name
        self.info = core.info
        # The core's own objects (never rebound), read here on every op.
        self._withdrawn = core.withdrawn
        self._routes = core.routes
        self._one_route = core.one_route
        # Messages waiting for their data, in call order (_deliver); while there are any, a
        # later one queues behind them, whichever way it would go.
        self._messages: collections.deque[_Message] = collections.deque()
        self._sending = False  # a task is sending the ready head of _messages

    @property
    def broken(self) -> HixlError | None:
        """Why the connection to the peer ended (None while it works)."""
        return self._core.broken

    @property
    def closed(self) -> bool:
        return self._core.closed

    # ---- remote regions ----

    async def region(self, name: str) -> RemoteRegion:
        """The region the peer published under ``name``."""
        _args.text(name, "Peer.region", "name", w.MAX_STR)
        self._engine.check_loop("Peer.region")  # its answer would wake another loop's waiter
        self._check_open("Peer.region")
        core = self._core
        if core.session is None:
            return core.agent.regions.published_remote(name, "Peer.region")
        remote = await core.ask(w.BY_NAME, name, 0, 0, f"Peer.region({name!r})")
        if remote is None:
            raise RegionUnavailable(f"Peer.region({name!r}): {core.label} publishes no region of that name")
        self._withdrawn.discard(remote.id)
        if self._one_route is None:
            try:
                await core.route(remote.info, "Peer.region")  # set the path up now: the first op is fast
            except RegionUnavailable:
                pass  # said by the first op on it, which is where it matters
        return remote

    def remote_region(self, descriptor: bytes) -> RemoteRegion:
        """Turn a descriptor from ``Region.descriptor()`` into a RemoteRegion of this peer."""
        return self._core.remote_region(descriptor, "Peer.remote_region")

    # ---- routing ----

    async def path(self, remote: RemoteRef) -> str:
        """How ops on ``remote`` travel: "shm-memfd", "shm-cma", "verbs", "tcp" or "loopback"."""
        self._engine.check_loop("Peer.path")
        self._check_open("Peer.path")  # a closed or lost peer has no path left to report
        rs = self._remote_slice(remote, "Peer.path")
        return (await self._core.route(rs.region.info, "Peer.path"))[1]

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

        Under asyncio a put on a path already set up is checked and posted at the call
        (a refusal is raised there) and returns its own awaitable, which asyncio's
        combinators take as a coroutine. So is one with ``notify`` where the message
        goes the data's own way (shm's doorbell; tcp or verbs as the peer's one path).
        """
        if timeout is None and imm is None:
            op = self._post_now(_PUT, remote, local, "Peer.put", notify)
            if op is not None:
                return op
        return self._transfer(lib.HX_OP_PUT, ((remote, local),), timeout, "Peer.put", imm, notify)

    def get(self, local: LocalRef, remote: RemoteRef, *, timeout: float | None = None) -> Awaitable[None]:
        """Read ``remote`` into ``local``; await it: it finishes once the bytes are in local memory.

        Posted at the call under asyncio, like ``put``."""
        if timeout is None:
            op = self._post_now(_GET, remote, local, "Peer.get")
            if op is not None:
                return op
        return self._transfer(lib.HX_OP_GET, ((remote, local),), timeout, "Peer.get")

    def _post_now(self, opcode: int, remote: Any, local: Any, what: str, notify: Any = None) -> Any:
        """The op's awaitable (``backends.Op``), posted now, when nothing needs awaiting
        first: asyncio, room in the ring, the path of its region known. None otherwise (the coroutine path does it).

        The hot path of every single put and get: the checks of ``_check`` written out for
        the usual arguments (slices), ``_check`` itself for anything else or to raise.
        With ``notify``, only where the message can go the data's own way: behind it on
        the peer's one ordered connection (tcp, verbs), or by shm's doorbell once the copy
        has ended (``_then_note``)."""
        engine = self._engine
        if notify is not None:
            notify = note_bytes(notify, what)
        loop = engine.loop
        # A message is an op of its own: room for two (the ring must never overflow).
        if loop is None or len(engine._ops) + (notify is not None) >= engine.capacity:
            if self._core.agent.closed:  # a closing agent took the loop away (Engine.closing)
                self._check_open(what)  # refused at the call, as ever
            return None
        # Called from the loop's own thread while it runs. asyncio's get_running_loop()
        # asks the kernel for the pid on every call; the thread id is free.
        if (loop._thread_id != _get_ident()) if engine.loop_is_base else (loop is not _get_running_loop()):
            return None
        core = self._core
        if core.closed or core.broken is not None:
            self._check_open(what)
        agent = self._agent
        put = opcode == _PUT
        if type(remote) is RemoteSlice and type(local) is RegionSlice:
            rs, ls = remote, local
            rr, region = rs.region, ls.region
            if (
                rr.agent_id != self.remote_id
                or (region.agent is not agent and region.agent.id != agent.id)
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
            flags, behind = 0, False
            if notify is not None:
                if link is not core.notes:  # not around the data's path
                    return None
                # Behind the data (a ring of one failed the room check above), unless messages
                # still wait for their data: then after those (_then_note).
                if link.ordered_notes and not self._messages:
                    if not core.ordered:
                        return None
                    if link.put_note:  # one op, nothing held: no Task, no flush
                        waiter = engine.put_note(link.handle, rs, ls, notify, what, core)
                        if waiter is None:
                            return _DoneOp()
                        return waiter if type(waiter) is _PolledOp else _Op(waiter)
                    flags, behind = engine.note_next, True
            waiter = (
                engine.post1(link.handle, opcode | flags, rs, ls, what, core)  # Link.post_one, minus one call
                if link.plain_post
                else link.post_one(engine, opcode | flags, rs, ls, what, core)
            )
            if notify is not None:
                return self._then_note(waiter, notify, what, behind)
            if waiter is not None:
                return waiter if type(waiter) is _PolledOp else _Op(waiter)
        elif notify is not None:
            return None  # the message alone: the coroutine path
        return _DoneOp()

    def _then_note(self, waiter: Any, notify: bytes, what: str, behind: bool) -> Any:
        """The awaitable of a put ``_post_now`` posted with a message: the message posted
        ``behind`` its data on their connection; else rung now if the copy has ended (shm)
        and no message waits ahead of it, else sent once both hold (``_deliver``)."""
        engine = self._engine
        waiters = [] if waiter is None else [waiter]
        if behind:
            refused, left = self._note_behind(waiters, notify, what) if waiters else (None, notify)
            if left is not None:  # the receiver had no room
                return _Op(self._deliver(waiters, refused, left, what))
            return self._as_op(self._finish(waiters, refused, None, None, what))
        if waiter is None and not self._messages:
            core = self._core
            note = core.notes.note(engine, notify, 0, what, core)
            if note is None:
                return _DoneOp()
            if note is not engine.BUSY:
                return self._as_op(self._finish([note], None, None, None, what))
        # The copy is still going, or messages wait ahead of it, or the receiver has no room
        # yet (loopback).
        return _Op(self._deliver(waiters, None, notify, what))

    def _as_op(self, steps: Coroutine[Any, Any, None]) -> Any:
        """``steps`` as an op's awaitable: a Task, which runs to its end whether or not the
        op is awaited."""
        return _Op(self._engine.loop.create_task(steps))

    def _deliver(self, waiters: list[Any], refused: HixlError | None, data: bytes, what: str) -> Any:
        """Send ``data`` once the ops of ``waiters`` have ended, unless one failed (or
        ``refused`` is set), and after this peer's messages called for before it: in call
        order, whoever awaits what. A task of its own sends it, so that neither a timeout
        nor a cancellation of the caller loses it (the data lands all the same, as a tcp
        message posted behind its data is delivered). Returns the waiter of its outcome."""
        backend = self._engine.attach(what)
        message = _Message(data, what, backend.new_waiter())
        self._messages.append(message)

        async def steps() -> None:
            try:
                await self._finish(waiters, refused, None, None, what)
            except HixlError as exc:
                message.error = exc
            except BaseException:  # the loop is ending: nothing will be sent
                self._messages.remove(message)
                backend.resolve(message.waiter, ClosedError(f"{what}: the event loop ended first"))
                raise
            message.ready = True
            await self._send_ready()

        backend.spawn(steps, what)
        return message.waiter

    async def _send_ready(self) -> None:
        """Send the messages at the head of ``_messages`` whose data has ended, in order:
        one task at a time does it."""
        if self._sending:
            return  # that task sends this one too once those ahead of it are sent
        self._sending = True
        backend = self._engine.attach()
        messages = self._messages
        try:
            while messages and messages[0].ready:
                message = messages[0]
                if message.error is None:
                    try:
                        await self._send_note(message.data, 0, None, message.what)
                    except HixlError as exc:
                        message.error = exc
                messages.popleft()
                backend.resolve(message.waiter, message.error)
        finally:
            self._sending = False

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
        await self._transfer(lib.HX_OP_PUT, _pairs(pairs, "Peer.put_many"), timeout, "Peer.put_many", imm, notify)

    async def notify(self, data: bytes, *, timeout: float | None = None) -> None:
        """Send ``data`` (up to 4 KiB) alone: the target's ``agent.notification()`` yields it
        after every op issued earlier on this peer has landed. Returns once it is queued there."""
        what = "Peer.notify"
        timeout = _args.timeout(timeout, what)
        data = note_bytes(data, what, "data")
        self._check_open(what)
        if not self._core.ordered:
            await self._fence()  # earlier ops travel other ways: wait until they landed
        if self._messages:  # behind those waiting for their data
            await self._finish([], None, data, timeout, what)
        else:
            await self._send_note(data, 0, timeout, what)  # room for it in the ring first

    async def get_many(self, pairs: Iterable[tuple[LocalRef, RemoteRef]], *, timeout: float | None = None) -> None:
        """Many gets, ``(local, remote)`` pairs, in one native submission and one awaitable."""
        local_first = _pairs(pairs, "Peer.get_many")
        await self._transfer(lib.HX_OP_GET, tuple((r, loc) for loc, r in local_first), timeout, "Peer.get_many")

    async def _transfer(
        self,
        opcode: int,
        pairs: tuple[tuple[Any, Any], ...],
        timeout: float | None,
        what: str,
        imm: int | None = None,
        notify: bytes | None = None,
    ) -> None:
        timeout = _args.timeout(timeout, what)
        if notify is not None:
            notify = note_bytes(notify, what)
        self._check_open(what)
        core = self._core
        engine = self._engine
        engine.attach(what)  # the agent's own loop only: nothing may be posted from another
        room = 1 + (notify is not None)  # a message is an op of its own
        if len(engine._ops) + room > engine.capacity:
            await engine.admit(what, room)
            self._check_open(what)
        checked = self._checked(opcode, pairs, what)
        if not checked:
            if notify is not None:  # nothing to wait for: the message alone
                await self._finish([], None, notify, timeout, what)
            return
        if imm is not None and (isinstance(imm, bool) or not isinstance(imm, int) or not 0 <= imm <= 0xFFFFFFFF):
            raise InvalidArgument(f"{what}: imm={imm!r} is not a 32-bit unsigned value")
        if self._one_route is not None and imm is None:
            # The message can follow this op's data on its link (unless the ring holds one op,
            # or earlier messages still wait for their data: it goes after them).
            behind = core.ordered and engine.capacity > 1 and not self._messages
            # Then the op is held for the message (tcp), to go out and be answered with it.
            flags = engine.note_next if notify is not None and behind and len(checked) == 1 else 0
            waiters = self._one_route.post(engine, opcode | flags, checked, what, core, None)
        else:
            waiters = []
            groups = await self._group(checked, what)
            for link, path in groups:
                if imm is not None and not link.carries_imm:
                    raise InvalidArgument(f"{what}: imm= needs the verbs transport; this op goes over {path}")
            behind = (
                core.notes.ordered_notes
                and engine.capacity > 1
                and not self._messages
                and all(link is core.notes for link, _ in groups)
            )
            # An op per group, and the message one more if it goes behind them: the check above
            # counted one group (and _group may have awaited). Room for all of them at once
            # where the ring holds that many, so that nothing is posted before a wait that may
            # raise; a smaller ring takes them in turn.
            n, note_room = len(groups), int(notify is not None and behind)
            at_once = n + note_room <= engine.capacity
            for i, ((link, _), group) in enumerate(groups.items()):
                room = (n + note_room if i == 0 else 0) if at_once else 1 + (note_room if i == n - 1 else 0)
                if room and len(engine._ops) + room > engine.capacity:
                    await engine.admit(what, room)
                    self._check_open(what)
                waiters += link.post(engine, opcode, group, what, core, imm)
        refused: HixlError | None = None
        if notify is not None and behind and waiters:
            refused, notify = self._note_behind(waiters, notify, what)
        await self._finish(waiters, refused, notify, timeout, what)

    def _note_behind(self, waiters: list[Any], notify: bytes, what: str) -> tuple[HixlError | None, bytes | None]:
        """Post ``notify`` behind the op just posted, on its ordered connection: the target
        places the data first, and drops the message if the op was refused. Its waiter
        joins ``waiters``. Returns the error that refused the message (raised once the op
        has ended), and the message if it is still to send (the receiver had no room)."""
        core = self._core
        engine = self._engine
        try:
            note = core.notes.note(engine, notify, engine.last_op_id, what, core)
        except HixlError as exc:  # e.g. the data already broke the path: say why once it ended
            return exc, None
        if note is engine.BUSY:
            return None, notify
        if note is not None:
            waiters.append(note)
        return None, None

    async def _finish(
        self, waiters: list[Any], refused: HixlError | None, notify: bytes | None, timeout: float | None, what: str
    ) -> None:
        """Wait for the ops posted (``waiters``); raise ``refused``; ``notify``: the message
        sent once they have landed (``_deliver``)."""
        core = self._core
        if notify is not None:
            await self._engine.wait(self._deliver(waiters, refused, notify, what), timeout, what)
            return
        if waiters:
            try:
                await self._engine.wait_all(waiters, timeout, what)
            except HixlError as exc:
                raise core.explain(exc, what) from None
            if refused is not None:
                raise core.explain(refused, what)

    async def _send_note(self, data: bytes, dep: int, timeout: float | None, what: str) -> None:
        core = self._core
        engine = self._engine
        while True:
            if engine.full:  # a message is an op of its own (where it goes through the ring)
                await engine.admit(what)
            self._check_open(what)
            waiter = core.notes.note(engine, data, dep, what, core)
            if waiter is not engine.BUSY:
                break
            await core.agent.inbox.room()  # a loopback peer's own queue is full: wait for room
        if waiter is not None:
            try:
                await engine.wait_all([waiter], timeout, what)
            except HixlError as exc:
                raise core.explain(exc, what) from None

    async def _fence(self) -> None:
        """Return once every op this peer posted before the call has completed."""
        engine = self._engine
        backend = engine.attach()
        waiter = backend.new_waiter()
        engine.when_none(self._core.owns, partial(backend.resolve, waiter, None), up_to=engine.last_posted)
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
        if region.agent.id != self._agent.id:
            raise InvalidArgument(f"{what}: local region {region.label()} belongs to another agent")
        if region.closed:
            region.check_open(what)
        if rs.nbytes != ls.nbytes:
            raise LengthMismatch(f"{what}: remote range is {rs.nbytes} bytes, local range is {ls.nbytes} bytes")
        rr = rs.region
        need = 1 if put else 2  # Access.REMOTE_WRITE / REMOTE_READ, as plain ints: this is the hot path
        if rr.id in self._withdrawn:
            raise RegionUnavailable(f"{what}: {self._core.label} withdrew remote region {rr.label()}")
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
            route = self._routes.get((rr.id, rr.key)) or await self._core.route(rr.info, what)
            if rr.id in self._withdrawn:  # withdrawn while the path was set up
                raise RegionUnavailable(f"{what}: {self._core.label} withdrew remote region {rr.label()}")
            groups.setdefault(route, []).append(pair)
        self._check_open(what)
        return groups

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
        core = self._core
        if core.closed:
            raise ClosedError(f"{what}: peer {self.name or self.remote_id.hex()} is closed")
        core.agent.check_open(what)
        if core.broken is not None:
            raise core.lost(what)

    async def aclose(self) -> None:
        """Close the peer; its outstanding ops fail with ClosedError."""
        self._engine.check_loop("Peer.aclose")
        await self._core.aclose()

    def __repr__(self) -> str:
        return f"<Peer {self.name or self.remote_id.hex()} via {self.transport}>"


def _pairs(pairs: Any, what: str) -> tuple[tuple[Any, Any], ...]:
    """``pairs`` as a tuple of 2-tuples, or InvalidArgument: not a TypeError from an unpacking."""
    try:
        out = tuple(pairs)
    except TypeError:
        raise InvalidArgument(f"{what}: pairs must be an iterable of 2-tuples, not {type(pairs).__name__}") from None
    for pair in out:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidArgument(f"{what}: each pair must be a 2-tuple, not {type(pair).__name__} {pair!r:.60}")
    return out


def _local_slice(local: Any, what: str) -> RegionSlice:
    if isinstance(local, Region):
        return local.as_slice()
    if isinstance(local, RegionSlice):
        return local
    raise InvalidArgument(f"{what}: expected a Region or a slice of one, got {type(local).__name__}")
