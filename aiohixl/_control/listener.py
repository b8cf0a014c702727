"""The listening side of an agent: authenticated control sessions, and what transports add.

A control connection becomes a session that answers region lookups, carries
withdrawals and whatever control frames the transports define. A data
connection (role DATA) of an authenticated session is handed to the
transport that takes those. Transports may run side servers of their own in
the listener's task group.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..errors import HixlError
from ..transports.base import Transport
from . import handshake as c
from . import wire as w
from .session import Session

HANDSHAKE_TIMEOUT = 5.0
# Connections from one address still in their handshake; more are closed at once.
MAX_PENDING_PER_SOURCE = 32
# How long a region close waits for same-host peers to stop using the region.
WITHDRAW_TIMEOUT = 5.0


@dataclass
class Served:
    """One authenticated control session, as the listener and the transports see it."""

    sid: bytes
    info: c.PeerInfo
    session: Session = field(init=False)
    acks: dict[int, anyio.Event] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.session.label

    async def send(self, frame: bytes) -> None:
        await self.session.send(frame)


class Listener:
    """``lookup(by_name, name, region_id, key)`` gives a region's descriptor, or None when there is none
    (or the key is not the region's)."""

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        transports: Iterable[Transport],
        identity: Callable[[], c.Identity],
        lookup: Callable[[bool, str, int, int], bytes | None],
        published: Callable[[], list[bytes]],
        heartbeat: tuple[float, float],
        spawn: Callable[..., None],
        on_session: Callable[[bytes, str, bytes], None],
    ) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.transports = list(transports)
        self.identity = identity
        self.lookup = lookup
        self.published = published
        self.heartbeat = heartbeat
        self.spawn = spawn
        self.on_session = on_session
        self.address: str | None = None
        self.sessions: dict[bytes, Served] = {}
        self._listener: Any = None
        self._scope: anyio.CancelScope | None = None
        self._stopped = anyio.Event()
        self._pending: dict[str, int] = {}

    def session(self, sid: bytes) -> Served | None:
        return self.sessions.get(sid)

    async def start(self) -> None:
        self._listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        port = self._listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
        self.address = f"{self.host}:{port}"
        self.spawn(self._serve, f"aiohixl-listener-{self.address}")

    async def _serve(self) -> None:
        try:
            with anyio.CancelScope() as self._scope:
                async with anyio.create_task_group() as tg:
                    for transport in self.transports:
                        await transport.serve(self, tg.start_soon)
                    await c.accept_forever(self._listener, self._handle, tg.start_soon, str(self.address))
        except Exception:
            c.log.exception("aiohixl listener %s stopped", self.address)
        finally:
            with anyio.CancelScope(shield=True):
                await self._listener.aclose()
                for transport in self.transports:
                    await transport.stop_serving()
            self._stopped.set()

    async def _handle(self, stream: Any) -> None:
        """One incoming connection. Whatever it sends, only it can be closed."""
        ch = c.Channel(stream)
        handed_off = False
        try:
            source = str(stream.extra(anyio.abc.SocketAttribute.remote_address, ("?",))[0])
        except Exception:
            source = "?"
        try:
            if self._pending.get(source, 0) >= MAX_PENDING_PER_SOURCE:
                c.log.warning("aiohixl %s: too many handshakes from %s at once; closed one", self.address, source)
                return
            self._pending[source] = self._pending.get(source, 0) + 1
            try:
                with anyio.fail_after(HANDSHAKE_TIMEOUT):
                    hello = await c.server_handshake(ch, self.token)
            finally:
                if self._pending[source] <= 1:
                    del self._pending[source]
                else:
                    self._pending[source] -= 1
            if hello.role == w.ROLE_DATA:
                handed_off = await self._take_data(ch, hello)
            else:
                await self._run_session(ch, hello)
        except (HixlError, TimeoutError, *c.STREAM_ERRORS) as exc:
            c.log.info("aiohixl %s: closed a connection: %s", self.address, exc)
        except Exception:
            c.log.exception("aiohixl %s: connection handler failed", self.address)
        finally:
            if not handed_off:
                await ch.aclose()

    async def _take_data(self, ch: c.Channel, hello: c.Hello) -> bool:
        served = self.sessions.get(hello.session)
        takers = [t for t in self.transports if t.takes_data_connections]
        if served is None or not takers:
            await ch.send(c.error_frame(w.ERR_SESSION, "no such control session"))
            return False
        return await takers[0].take_data_connection(ch, served)

    async def _run_session(self, ch: c.Channel, hello: c.Hello) -> None:
        served = Served(os.urandom(16), hello.info)
        label = f"peer {hello.info.name!r}"

        async def on_lookup(r: w.Reader) -> None:
            req, by, name, region_id, key = r.u32(), r.u8(), r.str(), r.u32(), r.u64()
            r.end()
            desc = self.lookup(by == w.BY_NAME, name, region_id, key)
            if desc is None:
                frame = w.Writer().u32(req).u8(w.LOOKUP_UNKNOWN).blob(b"").frame(w.REGION)
            else:
                frame = w.Writer().u32(req).u8(w.LOOKUP_OK).blob(desc).frame(w.REGION)
            await served.send(frame)

        def on_ack(r: w.Reader) -> None:
            region_id = r.u32()
            r.end()
            event = served.acks.pop(region_id, None)
            if event is not None:
                event.set()

        def on_end(reason: HixlError) -> None:
            self.sessions.pop(served.sid, None)
            for event in served.acks.values():  # a gone peer copies nothing more
                event.set()
            for transport in self.transports:
                transport.session_ended(served)
            c.log.info("aiohixl %s: session with %s ended: %s", self.address, label, reason)

        interval, timeout = self.heartbeat
        channel = next((t for t in self.transports if t.takes_data_connections), None)
        started, seen = time.monotonic(), False

        def silent() -> str | None:
            # The peer's native channel tells: its heartbeats reach our native
            # thread, blocked event loop or not.
            nonlocal seen
            state = channel.session_alive(served) if channel is not None else 1
            if state == 1:
                seen = True
                return None
            if seen or state == 0:
                return f"its channel ended (no heartbeat for {timeout} s, or closed)"
            if time.monotonic() - started > max(timeout, HANDSHAKE_TIMEOUT):
                return "it never opened its channel"
            return None

        handlers: dict[int, Any] = {w.LOOKUP: on_lookup, w.WITHDRAWN_ACK: on_ack}
        served.session = Session(ch, interval, handlers, on_end, label, silent)
        for transport in self.transports:
            handlers.update(transport.session_handlers(served))
        self.sessions[served.sid] = served
        self.on_session(served.sid, hello.info.name, hello.info.agent_id)
        await ch.send(c.welcome_frame(self.identity(), served.sid, self.published()))
        await served.session.run()

    async def withdraw(self, region_id: int) -> None:
        """Tell every session a region is gone; wait until peers that reach it without us stopped.

        Remote peers reach the region only through this agent's native side,
        which the registry already stops. A peer whose transport copies on its
        own (same host) must acknowledge: it stops new ops, waits for those in
        flight and unmaps. One that does not answer within WITHDRAW_TIMEOUT is
        disconnected, which stops its ops as well.
        """
        frame = w.Writer().u32(region_id).frame(w.WITHDRAWN)
        waiting = []
        for served in list(self.sessions.values()):
            must_ack = any(t.acknowledges_withdrawal(served.info) for t in self.transports)
            if must_ack:
                served.acks[region_id] = anyio.Event()
            try:
                with anyio.move_on_after(1.0):
                    await served.send(frame)
            except HixlError:
                continue
            if must_ack:
                waiting.append(served)
        for served in waiting:
            event = served.acks.get(region_id)
            if event is None:
                continue
            with anyio.move_on_after(WITHDRAW_TIMEOUT) as scope:
                await event.wait()
            if scope.cancelled_caught:
                c.log.warning(
                    "aiohixl %s: %s did not release region %d in time; disconnecting it",
                    self.address,
                    served.label,
                    region_id,
                )
                served.session.cancel()

    async def aclose(self) -> None:
        for served in list(self.sessions.values()):
            served.session.cancel()
        if self._scope is not None:
            self._scope.cancel()
            await self._stopped.wait()
