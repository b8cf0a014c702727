"""tcp: any two hosts. A second, authenticated connection per peer carries the data.

The initiator hands that connection's socket to its agent's native I/O thread,
which posts ops on it; the target's listener hands its end to the target's
I/O thread, which checks each request against the registry and places
payloads straight into registered memory. Neither event loop is involved in
moving bytes.
"""

from __future__ import annotations

from .._control import handshake as c
from .._control import wire as w
from .._loop.native import check, ffi, lib
from .base import AgentView, Dial, Link, Options, SessionView, Transport

_TCP_SEND = {"copy": lib.HX_TCP_SEND_COPY, "splice": lib.HX_TCP_SEND_SPLICE}


class TcpLink(Link):
    """Data, notifications and heartbeats on one ordered connection."""

    reaches_all = True
    is_channel = True
    ordered_notes = True
    put_note = True
    name = "tcp"


class TcpTransport(Transport):
    name = "tcp"
    rank = 3
    takes_data_connections = True
    always = True
    makes_channels = True

    def __init__(self, agent: AgentView, options: Options) -> None:
        super().__init__(agent, options)
        native = agent.engine.native
        lib.hx_agent_set_stall(native, int(options.stall_timeout * 1e9))
        interval, timeout = options.heartbeat
        lib.hx_agent_set_heartbeat(native, int(interval * 1e9), int(timeout * 1e9))
        lib.hx_agent_set_busy_poll(native, options.busy_poll_us)
        lib.hx_agent_set_serve_poll(native, options.serve_poll_us)
        lib.hx_agent_set_tcp_send(native, _TCP_SEND[options.tcp_send])

    async def take_data_connection(self, ch: c.Channel, session: SessionView) -> bool:
        fd = ch.fileno_for_handoff()
        # The stream is closed before the native side says DATA_OK, so the
        # client's first request can only be read by the native thread.
        await ch.stream.aclose()
        rc = lib.hx_tcp_serve_fd(
            self.agent.engine.native, fd, session_key(session.sid), w.DATA_OK_FRAME, len(w.DATA_OK_FRAME)
        )
        if rc < 0:  # the native side closed the socket it was given
            c.log.warning("aiohixl %s: could not serve a data connection (status %d)", self.agent.name, rc)
            return False
        return True

    def session_alive(self, session: SessionView) -> int:
        """1 while a data connection of the session is up, 0 once all ended, -1 before the first."""
        native = self.agent.engine.native
        return int(lib.hx_tcp_session_alive(native, session_key(session.sid))) if native is not None else 0

    def session_ended(self, session: SessionView) -> None:
        native = self.agent.engine.native
        if native is not None:  # else the agent is gone, and its connections with it
            lib.hx_tcp_drop_session(native, session_key(session.sid))

    async def dial(self, dial: Dial) -> TcpLink | None:
        ch = c.Channel(await c.connect_tcp(dial.host, dial.port, f"{dial.what}: the data connection"))
        try:
            await c.client_handshake(ch, dial.key, w.ROLE_DATA, dial.info.session, dial.me, dial.what)
            fd = ch.fileno_for_handoff()
        finally:
            await ch.aclose()
        status = ffi.new("int *")
        handle = lib.hx_tcp_connect_fd(self.agent.engine.native, fd, status)
        if handle == ffi.NULL:
            check(status[0], dial.what)
        return TcpLink(handle)


def session_key(sid: bytes) -> int:
    """The native side's name for a control session (its data connections go with it)."""
    return int.from_bytes(sid[:8], "little")
