"""The agent: registered memory, peers, and the native engine and transports behind them."""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from . import _args
from ._agent.connect import connect, transport_names
from ._agent.core import AgentCore
from ._control import handshake as c
from ._control.wire import MAX_STR
from .errors import ClosedError, InvalidArgument
from .memory import Access, Region, RegionSlice, parse_access
from .notifications import Notification
from .peer import Peer
from .rc import RcExport, RcPeer
from .transports import Options as TransportOptions

__all__ = ["Agent"]

_POLL_MAX_US = 1_000_000  # Agent(busy_poll_us=..., serve_poll_us=..., notify_poll_us=...): at most a second


class Agent:
    """One endpoint of aiohixl: owns registered memory and the peers ops go through.

    Use it as ``async with Agent() as agent:`` (or ``await agent.start()`` and
    ``await agent.aclose()``).

    An agent belongs to the event loop that starts it (or first uses it): from
    then on every call that changes it or moves data (register/allocate and their
    _async forms, loopback, connect, notification, ops, Region.close, aclose)
    raises WrongEventLoop from another thread or loop. Safe from any thread: the
    read-only ``stats()``, ``outstanding``, ``notifications_dropped``, ``address``,
    ``closed``, and a region's ``memory``. Before it is started, regions may be
    registered from plain (non-async) code.

    ``listen="host:port"`` makes peers able to connect (port 0 picks a free
    port; ``agent.address`` tells which). ``token`` is the shared secret both
    sides of a connection prove they hold (default: ``AIOHIXL_TOKEN``).
    Every ``heartbeat_interval`` seconds each side of a control connection
    pings; after ``heartbeat_timeout`` seconds of silence the connection is
    given up and its ops fail with ConnectionLost.
    ``max_inflight`` bounds the ops outstanding at once (the completion ring's
    size); a call beyond it waits for room. ``copy_threads`` is the number of
    native threads that run large copies.

    ``transports`` ("auto" or a tuple) says which data paths may be used:
    "shm" (same host), "verbs" (RDMA), "tcp", "loopback"; on connect the
    first usable of shm, verbs, tcp is taken, tcp also serving as fallback.
    ``rdma_device``/``rdma_port``/``rdma_gid_index`` pick the RDMA port (see
    docs/rdma.md; default: first active port, RoCE v2 IPv4 GID preferred),
    ``rdma_timeout`` is the QP's local ACK timeout exponent (4.096 us * 2**t)
    and ``rdma_retry_count`` its retry count: a dead peer's ops fail after
    about (retry_count + 1) * timeout.
    ``stall_timeout``: a tcp peer that stops sending in the middle of a put's
    payload, or leaves one of our answers (a get's data) unread, for this many
    seconds is disconnected (the region the frame touches stays busy, and
    Region.close() waiting, until then).
    ``busy_poll_us`` (0: off, the default) is an opt-in latency mode for tcp,
    like Linux's SO_BUSY_POLL: the agent's native I/O thread polls its sockets
    this many microseconds after activity before it sleeps, and a small put or
    get whose request the calling thread sent itself polls up to this long for
    its answer, ending inline (its Future is already done) with no thread to
    wake. It costs CPU (a core's worth while ops keep coming); with it off
    only the short poll below runs. Set it on both sides for the lowest latency.
    ``serve_poll_us`` (20 by default, 0: never): after reading peers' tcp
    requests, the I/O thread polls that long for the next before it sleeps,
    as long as they come within five times that of each other; a request to
    a sleeping thread pays for waking it (docs/tcp.md, "The target's poll").
    Sparser requests, and an idle agent, cost nothing.
    ``notify_poll_us`` (50 by default, 0: never): after notifications arrive
    by shm's doorbell, the event loop keeps turning about that long (its
    selector does not block; other tasks run as usual) so that the next is
    seen without waking it. The window doubles, up to 4x, while messages
    find the loop blocked soon after it stopped, and is set back after a gap
    of more than 4x (docs/api.md, "Notifications"). A lone notification, and
    an idle agent, cost nothing.
    ``tcp_send`` says how a tcp put's payload of 64 KiB or more leaves:
    "copy" (the default: sendmsg copies it into the socket) or "splice" (the
    kernel takes its pages, so the sender copies nothing). Which is faster
    depends on the host; ``python -m aiohixl bench`` measures both
    (docs/tcp.md, "Sending").
    ``stats()["tcp_send"]`` says how many bytes went each way.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        listen: str | None = None,
        token: str | bytes | None = None,
        transports: str | tuple[str, ...] = "auto",
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        max_inflight: int = 65536,
        copy_threads: int | None = None,
        rdma_device: str | None = None,
        rdma_port: int | None = None,
        rdma_gid_index: int | None = None,
        rdma_timeout: int = 14,
        rdma_retry_count: int = 7,
        stall_timeout: float = 10.0,
        max_notifications: int = 4096,
        busy_poll_us: int = 0,
        serve_poll_us: int = 20,
        notify_poll_us: int = 50,
        tcp_send: str = "copy",
    ) -> None:
        allowed = transport_names(transports, "Agent(transports=...)")
        if name is not None:
            _args.text(name, "Agent", "name", MAX_STR)
        _args.integer(max_inflight, "Agent", "max_inflight", 1, 1 << 24)
        if copy_threads is None:
            copy_threads = min(4, os.cpu_count() or 1)
        _args.integer(copy_threads, "Agent", "copy_threads", 1, 64)
        _args.integer(max_notifications, "Agent", "max_notifications", 1, 1 << 20)
        _args.integer(rdma_timeout, "Agent", "rdma_timeout", 1, 31)
        _args.integer(rdma_retry_count, "Agent", "rdma_retry_count", 0, 7)
        if rdma_port is not None:
            _args.integer(rdma_port, "Agent", "rdma_port", 1, 255)
        if rdma_gid_index is not None:
            _args.integer(rdma_gid_index, "Agent", "rdma_gid_index", 0, 255)
        if rdma_device is not None:
            _args.text(rdma_device, "Agent", "rdma_device", 64)
        _args.seconds(stall_timeout, "Agent", "stall_timeout", _args.FOREVER)
        _args.seconds(heartbeat_interval, "Agent", "heartbeat_interval", _args.FOREVER)
        _args.seconds(heartbeat_timeout, "Agent", "heartbeat_timeout", _args.FOREVER)
        _args.integer(busy_poll_us, "Agent", "busy_poll_us", 0, _POLL_MAX_US)  # 0: off
        _args.integer(serve_poll_us, "Agent", "serve_poll_us", 0, _POLL_MAX_US)  # 0: off
        _args.integer(notify_poll_us, "Agent", "notify_poll_us", 0, _POLL_MAX_US)  # 0: off
        _args.choice(tcp_send, "Agent", "tcp_send", ("copy", "splice"))
        if not 0 < heartbeat_interval < heartbeat_timeout:
            raise InvalidArgument(
                f"Agent(heartbeat_interval={heartbeat_interval}, heartbeat_timeout={heartbeat_timeout}):"
                " need 0 < interval < timeout"
            )
        self._listen = c.parse_address(listen, "Agent(listen=...)") if listen is not None else None
        self._token = token
        if listen is not None or token is not None:
            c.resolve_token(token, "Agent(listen=...)" if listen is not None else "Agent(token=...)")
        options = TransportOptions(
            heartbeat=(heartbeat_interval, heartbeat_timeout),
            stall_timeout=stall_timeout,
            busy_poll_us=busy_poll_us,
            serve_poll_us=serve_poll_us,
            tcp_send=tcp_send,
            rdma_device=rdma_device,
            rdma_port=rdma_port,
            rdma_gid_index=rdma_gid_index,
            rdma_timeout=rdma_timeout,
            rdma_retry_count=rdma_retry_count,
        )
        core = AgentCore(self, name, allowed, max_inflight, copy_threads, max_notifications, options, notify_poll_us)
        self._core = core
        self.id = core.id
        self.name = core.name
        self.transports = allowed
        self.host_identity = core.host_identity
        _OPEN.add(self)

    # ---- lifetime ----

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def start(self) -> None:
        """Bind to the running event loop and start listening (if ``listen`` was given)."""
        core = self._core
        core.check_open("Agent.start")
        backend = core.engine.attach("Agent.start")
        core.open_transports()
        if self._listen is not None and core.listener is None:
            host, port = self._listen
            await core.listen(host, port, c.resolve_token(self._token, "Agent.start"), backend.spawn)

    @property
    def unavailable(self) -> dict[str, str]:
        """Why each allowed transport this agent cannot use is unavailable."""
        return self._core.unavailable

    @property
    def verbs_unavailable(self) -> str | None:
        """Why RDMA (verbs) is not used, once tried; None when it is ready."""
        return self.unavailable.get("verbs")

    # ---- notifications ----

    def notification(
        self, timeout: float | None = None, *, match: bytes | None = None
    ) -> Coroutine[Any, Any, Notification]:
        """The next notification that arrived for this agent (waits for one): a coroutine.

        ``match``: the first one whose data equals it, leaving the others queued.
        ``timeout``: NotificationTimeout after that many seconds. On a closed
        agent, ClosedError.
        """
        # The inbox's coroutine itself, not one around it: a waiting task resumes through one
        # frame fewer, and the first thing after a wake-up is the first thing that is cold.
        return self._core.inbox.get(timeout, match, "Agent.notification")

    async def notifications(self) -> AsyncIterator[Notification]:
        """Every notification, in arrival order, until the agent closes."""
        self._core.check_open("Agent.notifications")
        while True:
            try:
                yield await self._core.inbox.get(None, None, "Agent.notifications")
            except ClosedError:
                return

    @property
    def notifications_dropped(self) -> int:
        """Notifications the native side received but could not keep: held back (queue
        full) when their verbs session ended, or no memory to queue them. Senders are held
        back while the queue is full, so this stays 0 in normal operation."""
        return self._core.inbox.dropped

    @property
    def address(self) -> str | None:
        """``host:port`` peers connect to, once started with ``listen``; else None."""
        listener = self._core.listener
        return listener.address if listener else None

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def stats(self) -> dict[str, Any]:
        """Counters kept natively since the agent was made (cheap: no lock). Safe from any
        thread (a metrics exporter's), unlike the methods that change the agent.

        ``{"transports": {name: {"ops", "bytes", "errors"}}, "notifications": {"received",
        "sent", "dropped"}, "outstanding": n, "tcp_send": {"spliced", "copied"}}``: ops (and
        their bytes) posted through this agent's peers per transport, errors (posts refused
        natively and ops that failed), notifications queued here, sent by this agent's peers,
        and dropped; ops outstanding now; bytes of tcp puts' frames of 64 KiB or more sent each
        way (``tcp_send``). Checks done in Python before an op reaches the native layer are not
        counted.
        """
        self._core.check_open("Agent.stats")
        return self._core.stats()

    @property
    def outstanding(self) -> int:
        """Ops posted whose completion has not arrived yet (cancelled ones included)."""
        return self._core.engine.outstanding

    async def aclose(self) -> None:
        """Close every peer, end every op in flight, deregister every region.

        Ops still queued fail with ClosedError; copies already running finish
        first, so no memory is released while a native thread touches it.
        """
        await self._core.aclose()

    def _close_abandoned(self) -> None:
        core = getattr(self, "_core", None)  # None: __init__ refused its arguments
        if core is not None:
            core.close_abandoned(self)

    def __del__(self) -> None:
        self._close_abandoned()

    # ---- memory ----

    def register(self, obj: Any, *, access: Access | str | None = None, name: str | None = None) -> Region:
        """Register a C-contiguous buffer (bytearray, memoryview, mmap, numpy) or torch CPU tensor.

        ``access`` says what peers may do (``Access`` flags, or words: "remote_write" or
        "w", "remote_read" or "r", "rw", "none", joined by "|"); by default nothing (``Access.NONE``):
        memory registered as the local end of ops. Give ``REMOTE_WRITE`` and/or
        ``REMOTE_READ`` for memory peers should reach; they reach it by its
        ``name`` (published) or by its descriptor, never by guessing. The
        buffer is pinned (a bytearray cannot be resized) until the region is
        closed, and its pages are faulted in now (``register_async`` does that
        off the event loop).
        """
        regions = self._core.regions
        pinned, rights = regions.pin(obj, access, name, "Agent.register")
        regions.prefault(pinned)
        return regions.add(pinned, rights, name, "Agent.register")

    async def register_async(self, obj: Any, *, access: Access | str | None = None, name: str | None = None) -> Region:
        """``register()``, its pages faulted in on a worker thread: the event loop runs
        meanwhile, and the region exists (peers find it) once they all are."""
        regions = self._core.regions
        pinned, rights = regions.pin(obj, access, name, "Agent.register_async")
        await regions.prefault_off_loop(pinned, "Agent.register_async")
        return regions.add(pinned, rights, name, "Agent.register_async")

    def allocate(self, nbytes: int, *, access: Access | str | None = None, name: str | None = None) -> Region:
        """Allocate ``nbytes`` of zero-filled, page-aligned memory (memfd-backed) and register it.

        ``access`` defaults to REMOTE_READ|REMOTE_WRITE: allocated memory is made
        for peers to reach (by its ``name`` or its descriptor), and holds nothing
        of the program's until it is written. Its pages are faulted in now, with
        the kernel's bulk populate over the copy threads (``allocate_async``
        does that off the event loop: a KV pool of many GiB takes seconds).
        """
        regions = self._core.regions
        pinned, rights, what = regions.memfd(nbytes, access, name, "Agent.allocate")
        regions.prefault(pinned)
        return regions.add(pinned, rights, name, what)

    async def allocate_async(
        self, nbytes: int, *, access: Access | str | None = None, name: str | None = None
    ) -> Region:
        """``allocate()``, its pages faulted in on a worker thread: the event loop runs
        meanwhile, and the region exists (peers find it) once they all are."""
        regions = self._core.regions
        pinned, rights, what = regions.memfd(nbytes, access, name, "Agent.allocate_async")
        await regions.prefault_off_loop(pinned, what)
        return regions.add(pinned, rights, name, what)

    # ---- peers ----

    def loopback(self) -> Peer:
        """A peer that is this agent: ops copy between its own regions."""
        core = self._core
        core.check_open("Agent.loopback")
        core.engine.check_loop("Agent.loopback")
        return Peer.construct(self, core.loopback())

    async def connect(
        self,
        address: str,
        token: str | bytes | None = None,
        *,
        timeout: float | None = 10.0,
        transports: tuple[str, ...] | None = None,
    ) -> Peer:
        """Connect to the agent listening at ``address`` ("host:port") and authenticate.

        Raises ConnectFailed (an OSError, errno kept) when no connection can be made
        (refused, the host name does not resolve, unreachable), ConnectionLost when
        the connection breaks during the handshake, AuthenticationError when the
        tokens differ, ProtocolError when what answers is not an aiohixl listener,
        ConnectTimeout when the handshake takes longer than ``timeout`` seconds,
        InvalidArgument when no transport is usable by both.
        """
        what = f"Agent.connect({address!r})"
        self._core.check_open("Agent.connect")
        key = c.resolve_token(token if token is not None else self._token, what)
        host, port = c.parse_address(address, what)
        wanted = self.transports if transports is None else transport_names(transports, what)
        timeout = _args.timeout(timeout, what)
        return Peer.construct(self, await connect(self._core, host, port, key, timeout, wanted, what))

    def export_rc(self, target: Region | RegionSlice, *, access: Access | str, label: str = "rc") -> RcExport:
        """Export ``target`` (a region or a slice of one) to one RC peer that is not aiohixl
        (docs/rdma.md, "Raw RC peers"): its own queue pair and memory registration, covering
        exactly that range with exactly ``access`` (a part of the region's rights). Give the
        peer ``export.info()`` (JSON); ``export.connect()`` its {gid, qpn, psn}. Verbs only."""
        what = "Agent.export_rc"
        self._core.engine.check_loop(what)
        rights = parse_access(access, what)
        if rights is None:
            raise InvalidArgument(f"{what}: access= is required")
        return RcExport(self._core, target, rights, label)

    def rc_peer(self) -> RcPeer:
        """A queue pair toward an RC program that is not aiohixl: give it ``rc.endpoint``,
        ``rc.connect()`` its {gid, qpn, psn}, then put into / get from the ranges it registered
        (``rc.region({addr, rkey, length})``). Verbs only."""
        self._core.engine.check_loop("Agent.rc_peer")
        return RcPeer(self._core)

    def __repr__(self) -> str:
        core = getattr(self, "_core", None)
        state = "closed" if core is None or core.closed else f"{len(core.regions)} regions, {len(core.peers)} peers"
        return f"<Agent {self.name!r} {state}>"


# Agents not closed yet: closed (with a ResourceWarning) at interpreter exit,
# before module teardown and the last garbage collection free things in no order.
_OPEN: weakref.WeakSet[Agent] = weakref.WeakSet()


@atexit.register
def _close_open_agents() -> None:
    for agent in list(_OPEN):
        agent._close_abandoned()
