"""The control plane in one process: the handshake and a session over a socketpair, and
the refusals a listener gives, without a target process."""

import os
import socket

import anyio
import anyio.abc
import pytest

import aiohixl
from aiohixl._control import handshake as c
from aiohixl._control import wire as w
from aiohixl._control.session import Session

TOKEN = b"in-process-token"


def identity(name: str) -> c.Identity:
    return c.Identity(os.urandom(16), name, c.HostIdentity.local(), ["tcp"])


async def channels() -> tuple[c.Channel, c.Channel]:
    a, b = socket.socketpair()
    return (
        c.Channel(await anyio.abc.SocketStream.from_socket(a)),
        c.Channel(await anyio.abc.SocketStream.from_socket(b)),
    )


async def handshake(client_token: bytes = TOKEN, role: int = w.ROLE_CONTROL, roles=(w.ROLE_CONTROL, w.ROLE_DATA)):
    """Both halves at once: (client's result or exception, server's result or exception)."""
    client, server = await channels()
    me, them = identity("client"), identity("server")
    out: dict = {}

    async def run_client():
        try:
            out["client"] = await c.client_handshake(client, client_token, role, bytes(16), me, "in-process")
        except Exception as exc:
            out["client"] = exc
            await client.aclose()

    async def run_server():
        try:
            hello = out["server"] = await c.server_handshake(server, TOKEN, roles, "a test listener")
        except Exception as exc:
            out["server"] = exc
            await server.aclose()
            return
        if hello.role == w.ROLE_CONTROL:
            await server.send(c.welcome_frame(them, os.urandom(16), [b"descriptor-1", b"descriptor-2"]))
        else:
            await server.send(w.DATA_OK_FRAME)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_server)
            tg.start_soon(run_client)
    return out["client"], out["server"], me, them, client, server


async def test_a_control_handshake_tells_each_side_who_the_other_is():
    info, hello, me, them, client, server = await handshake()
    assert isinstance(info, c.PeerInfo) and isinstance(hello, c.Hello)
    assert (info.agent_id, info.name, info.host, info.transports) == (them.agent_id, "server", them.host, ["tcp"])
    assert info.regions == [b"descriptor-1", b"descriptor-2"] and len(info.session) == 16
    assert (hello.role, hello.info.agent_id, hello.info.name, hello.info.pid) == (
        w.ROLE_CONTROL,
        me.agent_id,
        "client",
        os.getpid(),
    )
    await client.aclose()
    await server.aclose()


async def test_a_data_handshake_ends_with_data_ok():
    info, hello, *_ = await handshake(role=w.ROLE_DATA)
    assert info is None and hello.role == w.ROLE_DATA


async def test_a_wrong_token_is_refused_on_both_sides():
    info, hello, *_ = await handshake(client_token=b"another token")
    # The listener's CHALLENGE proves it holds the token: the client stops there.
    assert isinstance(info, aiohixl.AuthenticationError), info
    assert isinstance(hello, anyio.IncompleteRead), hello  # the client left before AUTH: no MAC tried


async def test_a_role_the_listener_does_not_take_is_refused_with_its_reason():
    info, hello, *_ = await handshake(role=w.ROLE_STORE)
    assert isinstance(hello, aiohixl.ProtocolError) and "a store connection" in str(hello)
    assert isinstance(info, aiohixl.ProtocolError) and "it takes no store connection" in str(info), info


@pytest.mark.parametrize(
    ("sent", "match"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "frame of 542393671 bytes"),  # "GET " read as a length
        (w.Writer().raw(b"NOPE").u16(2).u16(2).u8(0).raw(bytes(32)).frame(w.HELLO), "bad magic"),
        (w.Writer().raw(w.MAGIC).u16(9).u16(9).u8(0).raw(bytes(32)).frame(w.HELLO), "versions 9-9"),
        (w.Writer().raw(w.MAGIC).u16(2).u16(2).u8(7).raw(bytes(32)).frame(w.HELLO), "unknown role 7"),
        (w.Writer().frame(w.PING), "expected HELLO, got PING"),
        (w.Writer().raw(w.MAGIC).frame(w.HELLO), "HELLO: frame truncated"),
    ],
    ids=["http", "magic", "version", "role", "not-hello", "truncated"],
)
async def test_a_listener_refuses_what_is_not_a_client_hello(sent, match):
    client, server = await channels()
    await client.stream.send(sent)
    with anyio.fail_after(10), pytest.raises(aiohixl.ProtocolError, match=match):
        await c.server_handshake(server, TOKEN)
    await client.aclose()
    await server.aclose()


@pytest.mark.parametrize(
    ("last", "kind", "match"),
    [
        (w.Writer().frame(w.STORE_JOIN), aiohixl.ProtocolError, "unexpected STORE_JOIN frame"),
        (w.Writer().frame(w.BYE), aiohixl.ConnectionLost, "the peer closed the connection"),
        (w.Writer().u32(1).frame(w.LOOKUP), aiohixl.ProtocolError, "LOOKUP: 4 trailing bytes"),
    ],
    ids=["unexpected", "bye", "malformed"],
)
async def test_a_session_dispatches_frames_and_ends_on_what_it_cannot_take(last, kind, match):
    """Handlers get their frames in order; PING is absorbed; an unexpected or malformed
    frame ends the session as a ProtocolError, and BYE as the peer having closed."""
    here, there = await channels()
    got: list[int] = []
    ended: list[aiohixl.HixlError] = []

    def on_withdrawn(r: w.Reader) -> None:
        got.append(r.u32())
        r.end()

    def on_lookup(r: w.Reader) -> None:
        r.end()  # a LOOKUP with a body is malformed here

    handlers = {w.WITHDRAWN: on_withdrawn, w.LOOKUP: on_lookup}
    session = Session(here, 60.0, handlers, ended.append, "test session", lambda: None)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(session.run)
            for rid in (3, 1, 2):
                await there.send(w.Writer().u32(rid).frame(w.WITHDRAWN))
                await there.send(w.Writer().frame(w.PING))
            await there.send(last)
    assert got == [3, 1, 2]
    assert len(ended) == 1 and isinstance(ended[0], kind) and match in str(ended[0]), ended
    assert "test session" in str(ended[0]) and session.ended is ended[0]
    await there.aclose()


async def test_a_session_whose_peer_goes_away_ends_as_connection_lost():
    here, there = await channels()
    ended: list[aiohixl.HixlError] = []
    session = Session(here, 60.0, {}, ended.append, "test session", lambda: None)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(session.run)
            await there.aclose()
    assert len(ended) == 1 and isinstance(ended[0], aiohixl.ConnectionLost), ended
    with pytest.raises(aiohixl.ConnectionLost, match="test session: control connection lost"):
        await session.send(w.Writer().frame(w.PING))


async def test_a_session_ends_when_its_silence_check_says_so():
    here, there = await channels()
    ended: list[aiohixl.HixlError] = []
    session = Session(here, 0.01, {}, ended.append, "test session", lambda: "no heartbeat for 3 s")
    with anyio.fail_after(10):
        await session.run()
    assert isinstance(ended[0], aiohixl.ConnectionLost) and "no heartbeat for 3 s" in str(ended[0])
    await there.aclose()
