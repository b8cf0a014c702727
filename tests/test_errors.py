"""What a user meets when something is wrong: each error says what, where, and what to do."""

import asyncio
import errno
import http.client
import logging
import math
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


async def test_a_host_the_resolver_cannot_be_given_is_invalid_argument(agent):
    for host in ("\udcff", "a" * 64 + ".example"):  # not encodable; a label over 63 characters
        with pytest.raises(aiohixl.InvalidArgument, match="is no host name"):
            await agent.connect(f"{host}:5000", token="t")


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


@pytest.mark.parametrize(
    "kw, text",
    [
        ({"name": 123}, "name must be a str, not int"),
        ({"name": "n" * 1025}, "name is 1025 bytes in UTF-8, at most 1024"),
        ({"name": "\udcff"}, "lone surrogate"),
        ({"max_inflight": "x"}, "max_inflight must be an int, not str"),
        ({"copy_threads": 1.5}, "copy_threads must be an int, not float"),
        ({"max_notifications": None}, "max_notifications must be an int, not NoneType"),
        ({"rdma_timeout": 0}, r"rdma_timeout=0 must be in \[1, 31\]"),
        ({"rdma_retry_count": "7"}, "rdma_retry_count must be an int"),
        ({"rdma_port": "x"}, "rdma_port must be an int"),
        ({"tcp_send": "auto"}, "tcp_send must be one of 'copy', 'splice', not 'auto'"),
        ({"tcp_send": ["copy"]}, "tcp_send must be one of"),
        ({"stall_timeout": float("inf")}, "stall_timeout=inf must be in"),
        ({"heartbeat_timeout": float("nan")}, "heartbeat_timeout=nan must be in"),
        ({"transports": 123}, "choose 'auto' or a tuple"),
        ({"token": 4}, "a token is str or bytes, not int"),  # bytes(4): four zero bytes
        ({"token": True}, "a token is str or bytes, not bool"),
        ({"token": "\udcff"}, "lone surrogate"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_agent_settings_of_the_wrong_type_are_invalid_argument_at_construction(kw, text):
    """Each of these was a TypeError, AttributeError or OverflowError, some only at connect()
    or at a peer's first connection; an int token was taken as that many zero bytes."""
    with pytest.raises(aiohixl.InvalidArgument, match=text):
        aiohixl.Agent(**kw)


@pytest.mark.parametrize("timeout", ["1", math.nan, [1]], ids=["str", "nan", "list"])
async def test_a_wrong_timeout_is_refused_before_the_op_is_posted(agent, timeout):
    """Checked first, not when the wait begins: a put that raised had its bytes land anyway."""
    src = agent.register(bytearray(b"x" * 64))
    dst = agent.allocate(64)
    peer = agent.loopback()
    remote = peer.remote_region(dst.descriptor())
    for call in (
        lambda: peer.put(remote, src, timeout=timeout),
        lambda: peer.get(src, remote, timeout=timeout),
        lambda: peer.put_many([(remote, src)], timeout=timeout),
        lambda: peer.get_many([(src, remote)], timeout=timeout),
        lambda: peer.notify(b"x", timeout=timeout),
        lambda: agent.notification(timeout=timeout),  # NaN: a wait that never ended
        lambda: agent.connect("127.0.0.1:1", token="t", timeout=timeout),
    ):
        with pytest.raises(aiohixl.InvalidArgument, match="timeout (must be a number|is NaN)"):
            await asyncio.wait_for(call(), 10)
    assert not any(dst.memory), "nothing was posted"
    assert agent.notifications_dropped == 0


async def test_malformed_op_arguments_are_invalid_argument(agent):
    src = agent.register(bytearray(64))
    peer = agent.loopback()
    remote = peer.remote_region(agent.allocate(64).descriptor())
    for call, text in [
        (lambda: peer.put_many(None), "pairs must be an iterable of 2-tuples, not NoneType"),
        (lambda: peer.put_many([None]), "each pair must be a 2-tuple, not NoneType"),
        (lambda: peer.put_many([(remote,)]), "each pair must be a 2-tuple, not tuple"),
        (lambda: peer.get_many("ab"), "each pair must be a 2-tuple, not str"),
        (lambda: peer.put(remote, src, imm="x"), "imm='x' is not a 32-bit unsigned value"),
        (lambda: peer.region(123), "name must be a str, not int"),
    ]:
        with pytest.raises(aiohixl.InvalidArgument, match=text):
            await call()
    for descriptor, text in [(None, "a descriptor is bytes"), ("kv", "a descriptor is bytes")]:
        with pytest.raises(aiohixl.InvalidDescriptor, match=text):
            peer.remote_region(descriptor)
    forged = bytearray(agent.allocate(8).descriptor())
    forged[12:20] = (1 << 63).to_bytes(8, "little")  # nbytes
    with pytest.raises(aiohixl.InvalidDescriptor, match="cannot exist"):
        peer.remote_region(bytes(forged))


async def test_a_tcp_peer_asked_for_a_region_by_a_name_of_the_wrong_type_says_so():
    async with aiohixl.Agent("target", listen="127.0.0.1:0", token="t") as target:
        async with aiohixl.Agent("initiator", token="t", transports=("tcp",)) as agent:
            peer = await agent.connect(target.address)
            with pytest.raises(aiohixl.InvalidArgument, match=r"Peer.region: name must be a str, not bytes"):
                await peer.region(b"kv")
            assert peer.broken is None  # refused here, nothing sent
