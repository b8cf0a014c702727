"""What a user meets when something is wrong: each error says what, where, and what to do."""

import asyncio
import errno
import http.client
import logging
import socket

import pytest

import aiohixl


def _closed_port() -> int:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_refused_connection_is_connect_failed_an_oserror_with_its_errno(agent):
    port = _closed_port()
    with pytest.raises(aiohixl.ConnectFailed, match=f"127.0.0.1:{port}.*connection refused") as info:
        await agent.connect(f"127.0.0.1:{port}", token="t")
    exc = info.value
    assert isinstance(exc, OSError) and isinstance(exc, aiohixl.HixlError)
    assert exc.errno == errno.ECONNREFUSED
    assert isinstance(exc, aiohixl.ConnectionLost)  # `except ConnectionLost` code keeps working


async def test_a_host_name_that_does_not_resolve_is_connect_failed(agent):
    with pytest.raises(aiohixl.ConnectFailed, match="no-such-host.invalid.*cannot resolve") as info:
        await agent.connect("no-such-host.invalid:5000", token="t")
    assert isinstance(info.value, OSError) and info.value.errno is not None  # the resolver's EAI_* code


@pytest.mark.parametrize("address", [None, 5000, b"127.0.0.1:5000"], ids=["none", "int", "bytes"])
async def test_an_address_that_is_no_string_is_invalid_argument(agent, address):
    with pytest.raises(aiohixl.InvalidArgument, match=f"an address is 'host:port', not {type(address).__name__}"):
        await agent.connect(address, token="t")


async def _serve_once(reply: bytes) -> tuple[asyncio.AbstractServer, int]:
    """A listener of another protocol: it answers the first bytes it reads with ``reply``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize(
    "reply, looks_like",
    [
        (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", "look like HTTP"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "look like SSH"),
        (b"\x00\x01\x02\x03\x04\x05", "are no aiohixl frame"),
    ],
    ids=["http", "ssh", "other"],
)
async def test_a_port_of_another_protocol_is_named_with_a_hint(agent, reply, looks_like):
    """Not "frame of 1347703880 bytes" ("HTTP" read as a length): the address, and what answered."""
    server, port = await _serve_once(reply)
    async with server:
        with pytest.raises(aiohixl.ProtocolError) as info:
            await agent.connect(f"127.0.0.1:{port}", token="t", timeout=30)
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "is this an aiohixl listener?" in message, message
    assert looks_like in message, message


async def test_an_http_client_at_a_listener_is_logged_as_such(caplog):
    """The listener's side: a browser or curl pointed at an agent's port is named in the log."""
    caplog.set_level(logging.INFO, logger="aiohixl")
    async with aiohixl.Agent("listening", listen="127.0.0.1:0", token="t") as agent:
        host, port = agent.address.rsplit(":", 1)

        def get() -> BaseException | None:
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            try:
                conn.request("GET", "/")
                conn.getresponse()
            except (http.client.HTTPException, OSError) as exc:
                return exc  # the listener closed the connection without an HTTP answer
            finally:
                conn.close()
            return None

        assert isinstance(await asyncio.to_thread(get), (http.client.RemoteDisconnected, ConnectionResetError))
    logged = [r.getMessage() for r in caplog.records if "closed a connection" in r.getMessage()]
    assert any("is this an aiohixl client?" in m and "look like HTTP" in m for m in logged), logged


async def test_notification_arguments_are_checked_by_name(agent):
    with pytest.raises(aiohixl.InvalidArgument, match=r"Agent.notification: match= takes bytes, not str"):
        await agent.notification(match="ready")
    with pytest.raises(aiohixl.InvalidArgument, match=r"Agent.notification: timeout must be a number"):
        await agent.notification(timeout="1")
    with pytest.raises(aiohixl.InvalidArgument, match=r"Peer.notify: data takes bytes"):
        await agent.loopback().notify("ready")
