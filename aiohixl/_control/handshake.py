"""The control plane: authenticated handshake, region lookups, withdrawals.

Every connection to a listener starts with the same exchange::

    client -> HELLO      magic, versions it speaks, role (control|data), nonce_c
    server -> CHALLENGE  version chosen, nonce_s, HMAC(token, "server" nonce_c nonce_s)
    client -> AUTH       HMAC(token, "client" nonce_s nonce_c role session), who it is
    server -> WELCOME    who it is, session id, published regions      (control)
              DATA_OK    sent by the native layer once it owns the socket (data),
                         or by the rendezvous store (role store, docs/ranks.md)

Each side proves it holds the token before the other says anything that
matters; MACs are compared in constant time. Whether the peer is alive is
told by its native channel (the data connection), whose heartbeats both
native threads answer: see Session.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

from .._files import read_text
from ..errors import AuthenticationError, ConnectFailed, InvalidArgument, ProtocolError
from . import wire as w

log = logging.getLogger("aiohixl")

STREAM_ERRORS = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)


ACCEPT_BACKOFF_MAX = 1.0


async def accept_forever(
    listener: Any, handler: Callable[[Any], Any], start_soon: Callable[..., Any], what: str
) -> None:
    """Accept connections on an anyio listener (or MultiListener) until it is closed.

    An accept that fails (EMFILE when the process is out of fds, ENOBUFS, a
    connection aborted before it was accepted) is survived: logged once, then
    retried with a growing pause, so the listener, and every connection it
    already serves, outlives it. Each connection runs ``handler(stream)`` in
    ``start_soon``'s task group and must catch its own errors.
    """
    listeners = getattr(listener, "listeners", [listener])

    async def one(lst: Any) -> None:
        pause = 0.0
        while True:
            try:
                stream = await lst.accept()
            except (anyio.ClosedResourceError, anyio.get_cancelled_exc_class()):
                raise
            except (OSError, anyio.BrokenResourceError) as exc:
                if not pause:
                    log.warning("aiohixl %s: cannot accept connections (%s); retrying", what, exc)
                pause = min(ACCEPT_BACKOFF_MAX, pause * 2 or 0.01)
                await anyio.sleep(pause)
                continue
            if pause:
                log.warning("aiohixl %s: accepting connections again", what)
                pause = 0.0
            start_soon(handler, stream)

    async with anyio.create_task_group() as tg:
        for lst in listeners:
            tg.start_soon(one, lst)


def resolve_token(token: str | bytes | None, what: str, spelled: str = "token=") -> bytes:
    """``token``, else AIOHIXL_TOKEN; ``spelled``: how the caller gives one (``--token`` on the CLI)."""
    if token is None:
        token = os.environ.get("AIOHIXL_TOKEN")
    if not token:
        raise InvalidArgument(f"{what}: a shared token is required ({spelled} or AIOHIXL_TOKEN)")
    if isinstance(token, str):
        try:
            return token.encode()
        except UnicodeEncodeError:
            raise InvalidArgument(f"{what}: the token is not valid Unicode (a lone surrogate)") from None
    if not isinstance(token, (bytes, bytearray, memoryview)):
        # bytes(4) would be four zero bytes: a token anyone could guess
        raise InvalidArgument(f"{what}: a token is str or bytes, not {type(token).__name__}")
    return bytes(token)


def parse_address(address: str, what: str) -> tuple[str, int]:
    if not isinstance(address, str):
        raise InvalidArgument(f"{what}: an address is 'host:port', not {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgument(f"{what}: address {address!r} is not 'host:port'")
    host = host.strip("[]")
    try:
        host.encode("idna")  # what the resolver will be given
    except UnicodeError:
        raise InvalidArgument(f"{what}: {host!r} is no host name") from None
    return host or "0.0.0.0", int(port)


async def connect_tcp(host: str, port: int, what: str) -> Any:
    """``anyio.connect_tcp``; when no connection can be made, ConnectFailed saying why."""
    try:
        return await anyio.connect_tcp(host, port)
    except OSError as exc:
        raise connect_failed(exc, what) from None


def connect_failed(exc: OSError, what: str) -> ConnectFailed:
    """ConnectFailed for ``exc``, in words, its errno kept."""
    # anyio says "All connection attempts failed" and keeps the real error as the cause.
    cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    if isinstance(cause, ConnectionRefusedError) or cause.errno == errno.ECONNREFUSED:
        words = "connection refused (nothing listens there)"
    elif isinstance(cause, socket.gaierror):
        words = f"cannot resolve the host name ({cause.strerror})"
    else:
        words = cause.strerror or str(cause) or type(cause).__name__
    if cause.errno is None:
        return ConnectFailed(f"{what}: {words}")
    return ConnectFailed(cause.errno, f"{what}: {words}")


@dataclass(frozen=True)
class HostIdentity:
    """What decides whether two agents share a host, a kernel boot and namespaces.

    Same ``host`` and ``boot``: shared memory is possible. Same ``ns`` (pid,
    user and network namespaces) as well: pids mean the same process, abstract
    unix sockets reach each other, cross-memory attach may be permitted.
    """

    host: str
    boot: str
    ns: str

    @classmethod
    def local(cls) -> HostIdentity:
        machine = read_text("/etc/machine-id") or socket.gethostname()
        ns = []
        for kind in ("pid", "user", "net"):
            try:
                ns.append(os.readlink(f"/proc/self/ns/{kind}"))
            except OSError:
                ns.append(f"{kind}:?")
        return cls(
            host=f"{socket.gethostname()}/{machine}",
            boot=read_text("/proc/sys/kernel/random/boot_id"),
            ns=",".join(ns),
        )

    def same_host(self, other: HostIdentity) -> bool:
        return self.host == other.host and self.boot == other.boot and bool(self.boot)

    def same_namespaces(self, other: HostIdentity) -> bool:
        return self.same_host(other) and self.ns == other.ns and "?" not in self.ns

    def _namespace(self, kind: str) -> str:
        return next((n for n in self.ns.split(",") if n.startswith(f"{kind}:")), f"{kind}:?")

    def why_not_shared_memory(self, other: HostIdentity) -> str | None:
        """Why an agent with ``other`` cannot share memory with this one; None when it can.

        Same machine id and kernel boot is not enough: the memfd socket is an abstract unix
        socket, which only reaches agents in the same network namespace (containers and
        ``ip netns`` hosts on one kernel each have their own).
        """
        if self.host != other.host:
            return f"another host ({other.host.partition('/')[0] or '?'})"
        if self.boot != other.boot or not self.boot:
            return "another kernel boot (same machine id: a VM image or a container's copy)"
        mine, theirs = self._namespace("net"), other._namespace("net")
        if mine != theirs or "?" in mine:
            return f"another network namespace ({theirs}, here {mine}): no shared unix sockets"
        return None


@dataclass
class PeerInfo:
    agent_id: bytes
    name: str
    host: HostIdentity
    transports: list[str]
    session: bytes
    pid: int = 0
    shm_socket: str = ""  # abstract unix socket that hands out memfds ("" if none)
    probe: int = 0  # address of 16 bytes (the agent id) to test cross-memory attach
    regions: list[bytes] = field(default_factory=list)


def _server_mac(token: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(token, b"aiohixl-server" + nonce_c + nonce_s, hashlib.sha256).digest()


def _client_mac(token: bytes, nonce_s: bytes, nonce_c: bytes, role: int, session: bytes) -> bytes:
    msg = b"aiohixl-client" + nonce_s + nonce_c + bytes([role]) + session
    return hmac.new(token, msg, hashlib.sha256).digest()


class Channel:
    """Frames over an anyio byte stream; one sender at a time."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.send_lock = anyio.Lock()

    async def send(self, frame: bytes) -> None:
        async with self.send_lock:
            await self.stream.send(frame)

    async def recv(self, limit: int, first: str | None = None) -> tuple[int, w.Reader]:
        """The next frame. ``first``: what the other side should be, when this is the first
        frame it sends; one that speaks another protocol is named as such."""
        head = await self.reader.receive_exactly(w.HEAD_SIZE)
        try:
            n, ftype = w.split_head(head, limit)
        except ProtocolError as exc:
            if first is None:
                raise
            raise ProtocolError(f"is this {first}? {w.foreign_head(head)} ({exc})") from None
        body = await self.reader.receive_exactly(n) if n else b""
        return ftype, w.Reader(body, w.NAMES[ftype])

    async def expect(self, ftype: int, limit: int, first: str | None = None) -> w.Reader:
        got, r = await self.recv(limit, first)
        if got == w.ERROR:
            _raise_error(r)
        if got != ftype:
            raise ProtocolError(f"expected {w.NAMES[ftype]}, got {w.NAMES[got]}")
        return r

    def fileno_for_handoff(self) -> int:
        """A duplicate of the socket's fd, for the native layer to own."""
        if self.reader.buffer:
            raise ProtocolError("peer sent data before the handshake finished")
        sock = self.stream.extra(anyio.abc.SocketAttribute.raw_socket)
        return os.dup(sock.fileno())

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.stream.aclose()
            except STREAM_ERRORS:
                pass


def _raise_error(r: w.Reader) -> None:
    code = r.u8()
    message = r.str()
    if code == w.ERR_AUTH:
        raise AuthenticationError(f"the listener refused: {message}")
    raise ProtocolError(f"the listener refused: {message}")


def error_frame(code: int, message: str) -> bytes:
    return w.Writer().u8(code).str(message).frame(w.ERROR)


@dataclass
class Identity:
    """Who an agent is and how peers reach it, as it tells them in the handshake.

    Transports fill in their parts (``shm_socket``, ``probe``) before it is sent.
    """

    agent_id: bytes
    name: str
    host: HostIdentity
    transports: list[str]
    pid: int = field(default_factory=os.getpid)
    shm_socket: str = ""
    probe: int = 0


def _write_identity(wr: w.Writer, me: Identity) -> w.Writer:
    host = me.host
    wr.raw(me.agent_id).str(me.name).str(host.host).str(host.boot).str(host.ns).strs(me.transports)
    return wr.u32(me.pid).str(me.shm_socket).raw(me.probe.to_bytes(8, "little"))


def _read_identity(r: w.Reader, session: bytes) -> PeerInfo:
    agent_id, name = r.raw(16), r.str()
    host = HostIdentity(r.str(), r.str(), r.str())
    transports = r.strs()
    pid, shm_socket, probe = r.u32(), r.str(), int.from_bytes(r.raw(8), "little")
    return PeerInfo(agent_id, name, host, transports, session, pid, shm_socket, probe)


# ---------- client side ----------


async def client_handshake(
    ch: Channel, token: bytes, role: int, session: bytes, me: Identity, where: str
) -> PeerInfo | None:
    """Runs the client half; returns the server's PeerInfo (control) or None (data, store).

    Its ProtocolErrors name ``where`` (the address dialled)."""
    try:
        return await _client_handshake(ch, token, role, session, me, where)
    except ProtocolError as exc:
        raise ProtocolError(f"{where}: {exc}") from None


async def _client_handshake(
    ch: Channel, token: bytes, role: int, session: bytes, me: Identity, where: str
) -> PeerInfo | None:
    nonce_c = os.urandom(32)
    hello = w.Writer().raw(w.MAGIC).u16(w.VERSION_MIN).u16(w.VERSION_MAX).u8(role).raw(nonce_c)
    await ch.send(hello.frame(w.HELLO))
    r = await ch.expect(w.CHALLENGE, w.MAX_UNAUTH_FRAME, first="an aiohixl listener")
    version, nonce_s, mac_s = r.u16(), r.raw(32), r.raw(32)
    r.end()
    if not w.VERSION_MIN <= version <= w.VERSION_MAX:
        raise ProtocolError(f"listener chose protocol version {version}")
    if not hmac.compare_digest(mac_s, _server_mac(token, nonce_c, nonce_s)):
        raise AuthenticationError(f"{where}: the listener does not hold the same token")
    auth = w.Writer().raw(_client_mac(token, nonce_s, nonce_c, role, session)).raw(session)
    _write_identity(auth, me)
    await ch.send(auth.frame(w.AUTH))
    if role != w.ROLE_CONTROL:
        r = await ch.expect(w.DATA_OK, w.MAX_UNAUTH_FRAME)
        r.end()
        return None
    r = await ch.expect(w.WELCOME, w.MAX_FRAME)
    info = _read_identity(r, b"")
    info.session = r.raw(16)
    info.regions = [r.blob() for _ in range(r.u16())]
    r.end()
    return info


# ---------- server side ----------


@dataclass
class Hello:
    role: int
    session: bytes
    info: PeerInfo


async def server_handshake(
    ch: Channel, token: bytes, roles: tuple[int, ...] = (w.ROLE_CONTROL, w.ROLE_DATA), serves: str = "an agent"
) -> Hello:
    """Runs the server half up to and including the check of the client's MAC.

    ``roles``: the connection roles this listener takes; another is refused
    with an ERROR frame saying what ``serves`` here.
    """
    r = await ch.expect(w.HELLO, w.MAX_UNAUTH_FRAME, first="an aiohixl client")
    magic, vmin, vmax, role, nonce_c = r.raw(4), r.u16(), r.u16(), r.u8(), r.raw(32)
    r.end()
    if magic != w.MAGIC:
        raise ProtocolError(f"not an aiohixl client (bad magic {magic!r})")
    if role not in w.ROLE_NAMES:
        raise ProtocolError(f"unknown role {role}")
    if role not in roles:
        wanted = w.ROLE_NAMES[role]
        await ch.send(error_frame(w.ERR_ROLE, f"this listener is {serves}; it takes no {wanted} connection"))
        raise ProtocolError(f"a {wanted} connection to {serves}")
    version = min(vmax, w.VERSION_MAX)
    if version < max(vmin, w.VERSION_MIN):
        await ch.send(error_frame(w.ERR_VERSION, f"this agent speaks versions {w.VERSION_MIN}-{w.VERSION_MAX}"))
        raise ProtocolError(f"client speaks versions {vmin}-{vmax} only")
    nonce_s = os.urandom(32)
    await ch.send(w.Writer().u16(version).raw(nonce_s).raw(_server_mac(token, nonce_c, nonce_s)).frame(w.CHALLENGE))
    r = await ch.expect(w.AUTH, w.MAX_UNAUTH_FRAME)
    mac, session = r.raw(32), r.raw(16)
    if not hmac.compare_digest(mac, _client_mac(token, nonce_s, nonce_c, role, session)):
        await ch.send(error_frame(w.ERR_AUTH, "authentication failed"))
        raise AuthenticationError("client failed authentication")
    info = _read_identity(r, session)
    r.end()
    return Hello(role, session, info)


def welcome_frame(me: Identity, session: bytes, regions: list[bytes]) -> bytes:
    wr = _write_identity(w.Writer(), me).raw(session)
    budget = w.MAX_FRAME - 8192  # the rest are reachable by lookup
    kept: list[bytes] = []
    for desc in regions:
        budget -= len(desc) + 4
        if budget < 0 or len(kept) == 0xFFFF:
            break
        kept.append(desc)
    wr.u16(len(kept))
    for desc in kept:
        wr.blob(desc)
    return wr.frame(w.WELCOME)
