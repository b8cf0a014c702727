"""The listening side: accepts control and data connections for an agent.

A control connection becomes a Session that answers region lookups and
carries withdrawals. A data connection of an authenticated session is handed
to the native I/O thread, which from then on serves the ops arriving on it
without the event loop. Same-host peers of an authenticated session get the
fds of memfd regions from an abstract unix socket.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from . import _control as c
from . import _wire as w
from ._native import ffi, lib
from .errors import HixlError

if TYPE_CHECKING:
    from .agent import Agent

HANDSHAKE_TIMEOUT = 5.0
# How long a region close waits for same-host peers to stop using the region.
WITHDRAW_TIMEOUT = 5.0
_FD_REQUEST = struct.Struct("<I16s")
_FD_ANSWER = struct.Struct("<BQ")


@dataclass
class _Served:
    session: c.Session
    info: c.PeerInfo
    acks: dict[int, anyio.Event] = field(default_factory=dict)


class Listener:
    def __init__(self, agent: Agent, host: str, port: int, token: bytes) -> None:
        self.agent = agent
        self.host = host
        self.port = port
        self.token = token
        self.address: str | None = None
        self.sessions: dict[bytes, _Served] = {}
        self.shm_socket = f"\0aiohixl-{agent.id.hex()}" if "shm" in agent.transports else ""
        self._unix: Any = None
        self._listener: Any = None
        self._scope: anyio.CancelScope | None = None
        self._stopped = anyio.Event()

    async def start(self) -> None:
        self._listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        port = self._listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
        self.address = f"{self.host}:{port}"
        if self.shm_socket:
            try:
                self._unix = await anyio.create_unix_listener(self.shm_socket)
            except OSError as exc:
                c.log.warning("aiohixl %s: no memfd sharing (unix socket: %s)", self.address, exc)
                self.shm_socket = ""
        self.agent._engine.backend.spawn(self._serve, f"aiohixl-listener-{self.address}")

    async def _serve(self) -> None:
        try:
            with anyio.CancelScope() as self._scope:
                async with anyio.create_task_group() as tg:
                    if self._unix is not None:
                        tg.start_soon(self._unix.serve, self._handle_fd_requests)
                    await self._listener.serve(self._handle)
        except Exception:  # noqa: BLE001 - a background task must not crash the loop
            c.log.exception("aiohixl listener %s stopped", self.address)
        finally:
            with anyio.CancelScope(shield=True):
                await self._listener.aclose()
                if self._unix is not None:
                    await self._unix.aclose()
            self._stopped.set()

    async def _handle_fd_requests(self, stream: Any) -> None:
        """Hands memfds to the authenticated, same-host process that asks."""
        try:
            sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
            pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            while True:
                request = await _receive_exactly(stream, _FD_REQUEST.size)
                region_id, sid = _FD_REQUEST.unpack(request)
                served = self.sessions.get(sid)
                if served is None or served.info.pid != pid or uid != os.getuid():
                    await stream.send(_FD_ANSWER.pack(w.FD_REFUSED, 0))
                    return
                region = self.agent._regions.get(region_id)
                if region is None or region.closed or region._fd is None:
                    await stream.send(_FD_ANSWER.pack(w.FD_UNKNOWN, 0))
                    continue
                if not region.access:
                    await stream.send(_FD_ANSWER.pack(w.FD_ACCESS, 0))
                    continue
                from .memory import Access

                # A peer without REMOTE_WRITE gets a read-only fd: it cannot map it writable.
                flags = os.O_RDWR if region.access & Access.REMOTE_WRITE else os.O_RDONLY
                fd = os.open(f"/proc/self/fd/{region._fd}", flags | os.O_CLOEXEC)
                try:
                    await stream.send_fds(_FD_ANSWER.pack(w.FD_OK, region.nbytes), [fd])
                finally:
                    os.close(fd)
        except (HixlError, *c._STREAM_ERRORS, struct.error):
            pass
        except Exception:  # noqa: BLE001
            c.log.exception("aiohixl %s: fd request handler failed", self.address)
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()

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
            req, by, name, region_id = r.u32(), r.u8(), r.str(), r.u32()
            r.end()
            if by == w.BY_NAME:
                region = agent._named.get(name)
            else:
                region = agent._regions.get(region_id)
                region = None if region is None or region.closed else region
            if region is None:
                frame = w.Writer().u32(req).u8(w.LOOKUP_UNKNOWN).blob(b"").frame(w.REGION)
            else:
                frame = w.Writer().u32(req).u8(w.LOOKUP_OK).blob(region.descriptor()).frame(w.REGION)
            await session.send(frame)

        def on_end(reason: HixlError) -> None:
            self.sessions.pop(sid, None)
            for event in served.acks.values():  # a gone peer copies nothing more
                event.set()
            if agent._engine.native is not None:
                lib.hx_tcp_drop_session(agent._engine.native, _session_key(sid))
                lib.hx_verbs_drop_session(agent._engine.native, _session_key(sid))
            c.log.info("aiohixl %s: session with %s ended: %s", self.address, label, reason)

        async def on_verbs_qp(r: w.Reader) -> None:
            qpn, psn, gid, lid, mtu = w.read_qp_info(r)
            r.end()
            reply = w.Writer()
            native = agent._engine.native
            if agent._verbs is None:
                await session.send(reply.u8(1).frame(w.VERBS_QP_OK))
                return
            lqpn, lpsn = ffi.new("uint32_t *"), ffi.new("uint32_t *")
            rc = lib.hx_verbs_accept(native, _session_key(sid), qpn, psn, gid, lid, mtu, lqpn, lpsn)
            if rc != 0:
                c.log.warning("aiohixl %s: no queue pair for %s: %s", self.address, label,
                              ffi.string(lib.hx_verbs_error()).decode(errors="replace"))
                await session.send(reply.u8(1).frame(w.VERBS_QP_OK))
                return
            mygid, mylid, mymtu = ffi.new("uint8_t[16]"), ffi.new("uint16_t *"), ffi.new("int *")
            lib.hx_verbs_local(native, mygid, mylid, mymtu)
            w.qp_info(reply.u8(0), lqpn[0], lpsn[0], bytes(mygid), mylid[0], mymtu[0])
            await session.send(reply.frame(w.VERBS_QP_OK))

        def on_ack(r: w.Reader) -> None:
            region_id = r.u32()
            r.end()
            event = served.acks.pop(region_id, None)
            if event is not None:
                event.set()

        session = c.Session(
            ch, agent._heartbeat_interval, agent._heartbeat_timeout,
            {w.LOOKUP: on_lookup, w.WITHDRAWN_ACK: on_ack, w.VERBS_QP: on_verbs_qp}, on_end, label,
        )
        served = _Served(session, hello.info)
        self.sessions[sid] = served
        regions = [r.descriptor() for r in agent._named.values()]
        await ch.send(c.welcome_frame(agent, sid, regions))
        await session.run()

    async def withdraw(self, region_id: int) -> None:
        """Tell every session a region is gone; wait until same-host peers stopped using it.

        Remote peers reach the region only through this agent's I/O thread,
        which the registry already stops. A same-host peer copies on its own,
        so it must acknowledge: it stops new ops, waits for those in flight and
        unmaps. One that does not answer within WITHDRAW_TIMEOUT is
        disconnected, which stops its ops as well.
        """
        frame = w.Writer().u32(region_id).frame(w.WITHDRAWN)
        waiting = []
        me = self.agent.host_identity
        for served in list(self.sessions.values()):
            local = served.info.host.same_host(me)
            if local:
                served.acks[region_id] = anyio.Event()
            try:
                with anyio.move_on_after(1.0):
                    await served.session.send(frame)
            except HixlError:
                continue
            if local:
                waiting.append(served)
        for served in waiting:
            event = served.acks.get(region_id)
            if event is None:
                continue
            with anyio.move_on_after(WITHDRAW_TIMEOUT) as scope:
                await event.wait()
            if scope.cancelled_caught:
                c.log.warning("aiohixl %s: %s did not release region %d in time; disconnecting it",
                              self.address, served.session.label, region_id)
                served.session.cancel()

    async def aclose(self) -> None:
        for served in list(self.sessions.values()):
            served.session.cancel()
        if self._scope is not None:
            self._scope.cancel()
            await self._stopped.wait()


def _session_key(sid: bytes) -> int:
    return int.from_bytes(sid[:8], "little")


async def _receive_exactly(stream: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += await stream.receive(n - len(data))
    return data
