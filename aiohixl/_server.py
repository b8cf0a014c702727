"""The listening side: accepts control and data connections for an agent.

A control connection becomes a Session that answers region lookups and
carries withdrawals. A data connection of an authenticated session is handed
to the native I/O thread, which from then on serves the ops arriving on it
without the event loop.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import anyio

from . import _control as c
from . import _wire as w
from ._native import lib
from .errors import HixlError

if TYPE_CHECKING:
    from .agent import Agent

HANDSHAKE_TIMEOUT = 5.0


class Listener:
    def __init__(self, agent: Agent, host: str, port: int, token: bytes) -> None:
        self.agent = agent
        self.host = host
        self.port = port
        self.token = token
        self.address: str | None = None
        self.sessions: dict[bytes, c.Session] = {}
        self._listener: Any = None
        self._scope: anyio.CancelScope | None = None
        self._stopped = anyio.Event()

    async def start(self) -> None:
        self._listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        port = self._listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
        self.address = f"{self.host}:{port}"
        self.agent._engine.backend.spawn(self._serve, f"aiohixl-listener-{self.address}")

    async def _serve(self) -> None:
        try:
            with anyio.CancelScope() as self._scope:
                await self._listener.serve(self._handle)
        except Exception:  # noqa: BLE001 - a background task must not crash the loop
            c.log.exception("aiohixl listener %s stopped", self.address)
        finally:
            with anyio.CancelScope(shield=True):
                await self._listener.aclose()
            self._stopped.set()

    async def _handle(self, stream: Any) -> None:
        """One incoming connection. Whatever it sends, only it can be closed."""
        ch = c.Channel(stream)
        handed_off = False
        try:
            with anyio.fail_after(HANDSHAKE_TIMEOUT):
                hello = await c.server_handshake(ch, self.token)
            if hello.role == w.ROLE_DATA:
                handed_off = await self._attach_data(ch, hello)
            else:
                await self._run_session(ch, hello)
        except (HixlError, TimeoutError, *c._STREAM_ERRORS) as exc:
            c.log.info("aiohixl %s: closed a connection: %s", self.address, exc)
        except Exception:  # noqa: BLE001
            c.log.exception("aiohixl %s: connection handler failed", self.address)
        finally:
            if not handed_off:
                await ch.aclose()

    async def _attach_data(self, ch: c.Channel, hello: c.Hello) -> bool:
        if hello.session not in self.sessions:
            await ch.send(c.error_frame(w.ERR_SESSION, "no such control session"))
            return False
        fd = ch.fileno_for_handoff()
        # The stream is closed before the native side says DATA_OK, so the
        # client's first request can only be read by the native thread.
        await ch.stream.aclose()
        rc = lib.hx_tcp_serve_fd(
            self.agent._engine.native, fd, _session_key(hello.session), w.DATA_OK_FRAME, len(w.DATA_OK_FRAME)
        )
        if rc < 0:
            c.log.warning("aiohixl %s: could not serve a data connection (status %d)", self.address, rc)
        return True

    async def _run_session(self, ch: c.Channel, hello: c.Hello) -> None:
        agent = self.agent
        sid = os.urandom(16)
        label = f"peer {hello.info.name!r}"

        async def on_lookup(r: w.Reader) -> None:
            req, name = r.u32(), r.str()
            r.end()
            region = agent._named.get(name)
            if region is None:
                frame = w.Writer().u32(req).u8(w.LOOKUP_UNKNOWN).blob(b"").frame(w.REGION)
            else:
                frame = w.Writer().u32(req).u8(w.LOOKUP_OK).blob(region.descriptor()).frame(w.REGION)
            await session.send(frame)

        def on_end(reason: HixlError) -> None:
            self.sessions.pop(sid, None)
            if agent._engine.native is not None:
                lib.hx_tcp_drop_session(agent._engine.native, _session_key(sid))
            c.log.info("aiohixl %s: session with %s ended: %s", self.address, label, reason)

        session = c.Session(
            ch, agent._heartbeat_interval, agent._heartbeat_timeout, {w.LOOKUP: on_lookup}, on_end, label
        )
        self.sessions[sid] = session
        regions = [r.descriptor() for r in agent._named.values()]
        await ch.send(c.welcome_frame(agent, sid, regions))
        await session.run()

    async def withdraw(self, region_id: int) -> None:
        """Tell every session a region is gone, so their ops fail without a round trip."""
        frame = w.Writer().u32(region_id).frame(w.WITHDRAWN)
        for session in list(self.sessions.values()):
            try:
                with anyio.move_on_after(1.0):
                    await session.send(frame)
            except HixlError:
                pass

    async def aclose(self) -> None:
        for session in list(self.sessions.values()):
            session.cancel()
        if self._scope is not None:
            self._scope.cancel()
            await self._stopped.wait()


def _session_key(sid: bytes) -> int:
    return int.from_bytes(sid[:8], "little")
