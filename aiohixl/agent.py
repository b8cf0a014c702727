"""The agent: registered memory, peers, and the native engine and transports behind them."""

from __future__ import annotations

import atexit
import collections
import hmac
import os
import secrets
import uuid
import warnings
import weakref
from collections.abc import AsyncIterator, Iterable
from functools import partial
from typing import Any

import anyio

from . import _control as c
from . import _wire as w
from . import transports as tr
from ._backends import current_backend
from ._engine import Engine
from ._listener import Listener
from ._native import check, ffi, lib
from .descriptor import RegionInfo, encode_info
from .errors import ClosedError, ConnectFailed, ConnectionLost, ConnectTimeout, InvalidArgument, RegionUnavailable
from .memkinds import Pinned, pin
from .memkinds.memfd import allocate as allocate_memfd
from .memory import Access, Region, parse_access
from .notifications import Inbox, Notification
from .peer import Peer
from .remote import RemoteRegion

__all__ = ["Agent"]

_BUSY_POLL_MAX_US = 1_000_000  # Agent(busy_poll_us=...): at most a second


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
    wake. It costs CPU (a core's worth while ops keep coming); nothing spins
    with it off. Set it on both sides for the lowest latency.
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
    ) -> None:
        allowed = _transport_names(transports, "Agent(transports=...)")
        if not 1 <= max_inflight <= 1 << 24:
            raise InvalidArgument(f"Agent(max_inflight={max_inflight}): must be in [1, 2**24]")
        if copy_threads is None:
            copy_threads = min(4, os.cpu_count() or 1)
        if not 1 <= copy_threads <= 64:
            raise InvalidArgument(f"Agent(copy_threads={copy_threads}): must be in [1, 64]")
        if not 1 <= max_notifications <= 1 << 20:
            raise InvalidArgument(f"Agent(max_notifications={max_notifications}): must be in [1, 2**20]")
        if (
            not isinstance(busy_poll_us, int)
            or isinstance(busy_poll_us, bool)
            or not 0 <= busy_poll_us <= _BUSY_POLL_MAX_US
        ):
            raise InvalidArgument(
                f"Agent(busy_poll_us={busy_poll_us!r}): must be an int in [0, {_BUSY_POLL_MAX_US}] (0: off)"
            )
        if not 0 < heartbeat_interval < heartbeat_timeout:
            raise InvalidArgument(
                f"Agent(heartbeat_interval={heartbeat_interval}, heartbeat_timeout={heartbeat_timeout}):"
                " need 0 < interval < timeout"
            )
        self._listen = c.parse_address(listen, "Agent(listen=...)") if listen is not None else None
        self._token = token
        if listen is not None:
            c.resolve_token(token, "Agent(listen=...)")
        self.id = uuid.uuid4().bytes
        self.name = name or f"agent-{os.getpid()}-{self.id[:4].hex()}"
        self.transports = allowed
        self.host_identity = c.HostIdentity.local()
        self._heartbeat = (heartbeat_interval, heartbeat_timeout)
        self._listener: Listener | None = None
        self.engine = Engine(max_inflight, copy_threads)
        self._threads = copy_threads
        # senders' (name, agent id), by session key
        self._names: collections.OrderedDict[int, tuple[str, bytes]] = collections.OrderedDict()
        self._inbox = Inbox(self.engine, max_notifications, self._sender)
        self.engine.on_wake = self._inbox.pull
        self._transports = tr.make(
            self,
            allowed,
            dict(
                rdma_device=rdma_device,
                rdma_port=rdma_port,
                rdma_gid_index=rdma_gid_index,
                rdma_timeout=rdma_timeout,
                rdma_retry_count=rdma_retry_count,
                stall_timeout=stall_timeout,
                busy_poll_us=busy_poll_us,
                heartbeat=self._heartbeat,
            ),
        )
        self._regions: dict[int, Region] = {}
        self._named: dict[str, Region] = {}
        self._peers: set[Peer] = set()
        self._next_region = 1
        self._closed = False
        _OPEN.add(self)

    # ---- lifetime ----

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def start(self) -> None:
        """Bind to the running event loop and start listening (if ``listen`` was given)."""
        self.check_open("Agent.start")
        backend = self.engine.attach("Agent.start")
        self._open_transports()
        if self._listen is not None and self._listener is None:
            host, port = self._listen
            listener = Listener(
                host,
                port,
                c.resolve_token(self._token, "Agent.start"),
                self._transports.values(),
                self._identity,
                self._lookup,
                self._published,
                self._heartbeat,
                backend.spawn,
                self._on_session,
            )
            try:
                await listener.start()
            except OSError as exc:
                raise OSError(exc.errno, f"Agent.start: cannot listen on {host}:{port}: {exc.strerror}") from None
            self._listener = listener

    def _open_transports(self) -> None:
        for transport in self._transports.values():
            transport.open()

    @property
    def unavailable(self) -> dict[str, str]:
        """Why each allowed transport this agent cannot use is unavailable."""
        return {n: t.unavailable for n, t in self._transports.items() if t.unavailable and n in self.transports}

    @property
    def verbs_unavailable(self) -> str | None:
        """Why RDMA (verbs) is not used, once tried; None when it is ready."""
        return self.unavailable.get("verbs")

    def _identity(self) -> c.Identity:
        offered = [n for n in self.transports if n not in self.unavailable]
        me = c.Identity(self.id, self.name, self.host_identity, offered)
        for transport in self._transports.values():
            transport.advertise(me)
        return me

    def heartbeat(self) -> tuple[float, float]:
        return self._heartbeat

    # ---- notifications ----

    async def notification(self, timeout: float | None = None, *, match: bytes | None = None) -> Notification:
        """The next notification that arrived for this agent (waits for one).

        ``match``: the first one whose data equals it, leaving the others queued.
        ``timeout``: NotificationTimeout after that many seconds. On a closed
        agent, ClosedError.
        """
        self.check_open("Agent.notification")
        return await self._inbox.get(timeout, match, "Agent.notification")

    async def notifications(self) -> AsyncIterator[Notification]:
        """Every notification, in arrival order, until the agent closes."""
        self.check_open("Agent.notifications")
        while True:
            try:
                yield await self._inbox.get(None, None, "Agent.notifications")
            except ClosedError:
                return

    @property
    def notifications_dropped(self) -> int:
        """Notifications the native side received but could not keep: held back (queue
        full) when their verbs session ended, or no memory to queue them. Senders are held
        back while the queue is full, so this stays 0 in normal operation."""
        return self._inbox.dropped

    async def notes_room(self) -> None:
        await self._inbox.room()

    def _sender(self, source: int) -> tuple[str, bytes] | tuple[None, None]:
        return (self.name, self.id) if source == 0 else self._names.get(source, (None, None))

    def _on_session(self, sid: bytes, name: str, agent_id: bytes) -> None:
        self._names[int.from_bytes(sid[:8], "little")] = (name, agent_id)
        while len(self._names) > 4096:  # names of ended sessions go, oldest first
            self._names.popitem(last=False)

    @property
    def address(self) -> str | None:
        """``host:port`` peers connect to, once started with ``listen``; else None."""
        return self._listener.address if self._listener else None

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, Any]:
        """Counters kept natively since the agent was made, read in one call (cheap: no lock).
        Safe from any thread (a metrics exporter's), unlike the methods that change the agent.

        ``{"transports": {name: {"ops", "bytes", "errors"}}, "notifications": {"received",
        "sent", "dropped"}, "outstanding": n}``: ops (and their bytes) posted through this
        agent's peers per transport, errors (posts refused natively and ops that failed),
        notifications queued here, sent by this agent's peers, and dropped; ops outstanding
        now. Checks done in Python before an op reaches the native layer are not counted.
        """
        self.check_open("Agent.stats")
        out = ffi.new("hx_stats *")  # one per call: callers on two threads never share it
        lib.hx_agent_stats(self.engine.native, out)
        transports = {}
        for i, name in enumerate(_STAT_TRANSPORTS):
            t = out.transports[i]
            transports[name] = {"ops": int(t.ops), "bytes": int(t.bytes), "errors": int(t.errors)}
        return {
            "transports": transports,
            "notifications": {
                "received": int(out.notes_received),
                "sent": int(out.notes_sent),
                "dropped": int(out.notes_dropped),
            },
            "outstanding": self.engine.outstanding,
        }

    @property
    def outstanding(self) -> int:
        """Ops posted whose completion has not arrived yet (cancelled ones included)."""
        return self.engine.outstanding

    async def aclose(self) -> None:
        """Close every peer, end every op in flight, deregister every region.

        Ops still queued fail with ClosedError; copies already running finish
        first, so no memory is released while a native thread touches it.
        """
        if self._closed:
            return
        self.engine.check_loop("Agent.aclose")
        self._closed = True
        self._inbox.close()
        if self._listener is not None:
            await self._listener.aclose()
        for peer in list(self._peers):
            # Closed before its session ends, so its ops fail as closed, not lost.
            peer.close_links()
            peer.end_session()
            await peer.release_links()
        await self.engine.shutdown()
        peers, regions = list(self._peers), list(self._regions.values())
        self._peers.clear()
        self._regions.clear()
        self._named.clear()
        for region in regions:
            region.closed = True
        # Unmapping GiBs takes a second: off the loop (a shm peer's free unmaps its mappings).
        backend = self.engine.backend or current_backend()
        try:
            await backend.run_to_end(_free_all, peers)
        finally:
            self.engine.free()
            await backend.run_to_end(_release_all, regions)

    def _close_abandoned(self) -> None:
        """An agent nobody closed (collected, or open at exit): warn, then free everything, synchronously.

        Native threads stop first, so nothing touches registered memory any
        more; then the peers' native handles, then the agent's; the pinned
        buffers last, each cffi buffer before the memoryview it exports, so the
        garbage collector never clears a view that is still exported.
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        warnings.warn(
            f"unclosed {self!r}: close it with 'await agent.aclose()'", ResourceWarning, stacklevel=2, source=self
        )
        engine = self.engine
        if engine.native is not None:  # else the engine was finalized first, and took its threads with it
            lib.hx_agent_shutdown(engine.native)
            for peer in list(self._peers):
                peer.free()
            try:
                engine.free()
            except Exception:  # the loop is gone: only the native side is left to free
                lib.hx_agent_free(engine.native)
                engine.native = None
        self._peers.clear()
        for region in self._regions.values():
            region.closed = True
            region.pinned.release()
        self._regions.clear()
        self._named.clear()

    def __del__(self) -> None:
        self._close_abandoned()

    def check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: agent {self.name!r} is closed")

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
        pinned, rights = self._pin(obj, access, name, "Agent.register")
        self._prefault(pinned)
        return self._add_region(pinned, rights, name, "Agent.register")

    async def register_async(self, obj: Any, *, access: Access | str | None = None, name: str | None = None) -> Region:
        """``register()``, its pages faulted in on a worker thread: the event loop runs
        meanwhile, and the region exists (peers find it) once they all are."""
        pinned, rights = self._pin(obj, access, name, "Agent.register_async")
        await self._prefault_off_loop(pinned, "Agent.register_async")
        return self._add_region(pinned, rights, name, "Agent.register_async")

    def allocate(self, nbytes: int, *, access: Access | str | None = None, name: str | None = None) -> Region:
        """Allocate ``nbytes`` of zero-filled, page-aligned memory (memfd-backed) and register it.

        ``access`` defaults to REMOTE_READ|REMOTE_WRITE: allocated memory is made
        for peers to reach (by its ``name`` or its descriptor), and holds nothing
        of the program's until it is written. Its pages are faulted in now, with
        the kernel's bulk populate over the copy threads (``allocate_async``
        does that off the event loop: a KV pool of many GiB takes seconds).
        """
        pinned, rights, what = self._memfd(nbytes, access, name, "Agent.allocate")
        self._prefault(pinned)
        return self._add_region(pinned, rights, name, what)

    async def allocate_async(
        self, nbytes: int, *, access: Access | str | None = None, name: str | None = None
    ) -> Region:
        """``allocate()``, its pages faulted in on a worker thread: the event loop runs
        meanwhile, and the region exists (peers find it) once they all are."""
        pinned, rights, what = self._memfd(nbytes, access, name, "Agent.allocate_async")
        await self._prefault_off_loop(pinned, what)
        return self._add_region(pinned, rights, name, what)

    def _pin(self, obj: Any, access: Access | str | None, name: str | None, call: str) -> tuple[Pinned, Access]:
        self.check_open(call)
        self.engine.check_loop(call)
        access = _check_region_args(access, name, call)
        pinned = pin(obj, call)
        if access is None:
            access = Access.NONE  # nothing a peer can do unless asked for
        if pinned.readonly and access & Access.REMOTE_WRITE:
            pinned.release()
            raise InvalidArgument(f"{call}: {type(obj).__name__} is read-only but access asks for REMOTE_WRITE")
        return pinned, Access(access)

    def _memfd(
        self, nbytes: int, access: Access | str | None, name: str | None, call: str
    ) -> tuple[Pinned, Access, str]:
        self.check_open(call)
        self.engine.check_loop(call)
        what = f"{call}({nbytes!r})"
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise InvalidArgument(f"{what}: size must be an int, not {type(nbytes).__name__}")
        if nbytes < 0:
            raise InvalidArgument(f"{what}: size must be >= 0")
        access = _check_region_args(access, name, what)
        try:
            pinned = allocate_memfd(nbytes, name)
        except OSError as exc:
            raise MemoryError(f"{what}: cannot allocate {nbytes} bytes: {exc.strerror or exc}") from exc
        if access is None:
            access = Access.REMOTE_READ | Access.REMOTE_WRITE
        return pinned, Access(access), what

    def _prefault(self, pinned: Pinned, threads: int | None = None) -> None:
        # A first copy into cold memory runs at a fraction of the speed of one into warm memory.
        write = 0 if pinned.readonly else 1
        lib.hx_prefault(ffi.cast("void *", pinned.address), pinned.nbytes, write, threads or self._threads)

    async def _prefault_off_loop(self, pinned: Pinned, what: str) -> None:
        # One core is left to the event loop, which must not stall meanwhile.
        threads = max(1, min(self._threads, (os.cpu_count() or 1) - 1))
        try:
            with anyio.CancelScope(shield=True):  # the thread cannot be stopped: the memory stays pinned until done
                await anyio.to_thread.run_sync(self._prefault, pinned, threads)
            self.check_open(what)
        except BaseException:
            pinned.release()
            raise

    def _add_region(self, pinned: Pinned, access: Access, name: str | None, what: str) -> Region:
        if name is not None:
            if not name or len(name.encode()) > 255:
                pinned.release()
                raise InvalidArgument(f"{what}: name must be 1 to 255 bytes of UTF-8")
            if name in self._named:
                pinned.release()
                raise InvalidArgument(f"{what}: a region named {name!r} is already registered")
        region_id = self._next_region
        self._next_region += 1
        # Ids count up and are easy to guess; the key is not. Every access a
        # peer makes carries it, and the native registry checks it.
        key = secrets.randbits(64)
        rc = lib.hx_region_add(self.engine.native, region_id, pinned.address, pinned.nbytes, int(access), key)
        if rc < 0:
            pinned.release()
            check(rc, what)
        region = Region(self, region_id, pinned, access, name, key)
        self._regions[region_id] = region
        for transport in self._transports.values():
            transport.region_added(region)
        if name is not None:
            self._named[name] = region
        return region

    def live_region(self, region_id: int) -> Region | None:
        region = self._regions.get(region_id)
        return None if region is None or region.closed else region

    def live_regions(self) -> Iterable[Region]:
        return [r for r in self._regions.values() if not r.closed]

    def describe(self, region: Region) -> bytes:
        return encode_info(self._info(region))

    def _info(self, region: Region) -> RegionInfo:
        keys: dict[int, bytes] = {}
        for transport in self._transports.values():
            keys.update(transport.descriptor_keys(region))
        return RegionInfo(
            agent_id=self.id,
            region_id=region.id,
            nbytes=region.nbytes,
            address=region.address,
            access=region.access,
            kind=region.kind,
            name=region.name,
            key=region.key,
            keys=keys,
        )

    async def close_region(self, region: Region) -> None:
        self.engine.check_loop("Region.close")  # before anything changes
        region.closed = True
        if region.name is not None:
            self._named.pop(region.name, None)
        if self._closed:
            return
        backend = self.engine.attach("Region.close")
        if self._listener is not None:
            await self._listener.withdraw(region.id)

        def uses(op: tuple[Any, ...]) -> bool:
            return any(r is region for r in op[1])

        # Again once woken: a pair checked before close() was called may have been posted meanwhile.
        while self.engine.oldest_op(uses) is not None:
            waiter = backend.new_waiter()
            self.engine.when_none(uses, partial(backend.resolve, waiter, None))
            await backend.wait(waiter)
        if self._closed:
            return
        rc = lib.hx_region_remove(self.engine.native, region.id, 0)
        if rc == lib.HX_E_BUSY:
            # A remote access is still running on a native thread.
            rc = await backend.run_to_end(lib.hx_region_remove, self.engine.native, region.id, 1)
        for transport in self._transports.values():
            transport.region_removed(region)
        self._regions.pop(region.id, None)
        # Unmapping a pool of GiBs takes a second: off the loop, and gone when close() returns.
        await backend.run_to_end(region.pinned.release)

    def _lookup(self, by_name: bool, name: str, region_id: int, key: int) -> bytes | None:
        """A published region by name, or any region by id and key (from its descriptor): never by id alone."""
        if by_name:
            region = self._named.get(name)
        else:
            region = self.live_region(region_id)
            if region is not None and not hmac.compare_digest(
                region.key.to_bytes(8, "little"), key.to_bytes(8, "little")
            ):
                region = None
        return None if region is None else self.describe(region)

    def _published(self) -> list[bytes]:
        return [self.describe(r) for r in self._named.values()]

    def published_remote(self, name: str, what: str) -> RemoteRegion:
        region = self._named.get(name)
        if region is None:
            raise RegionUnavailable(f"{what}({name!r}): no region of that name is published")
        return RemoteRegion(self._info(region))

    # ---- peers ----

    def loopback(self) -> Peer:
        """A peer that is this agent: ops copy between its own regions."""
        self.check_open("Agent.loopback")
        self.engine.check_loop("Agent.loopback")
        link = tr.self_link(self._transports)
        assert link is not None  # the loopback transport is always there
        peer = Peer(self, [link], self.id, self.name)
        self._peers.add(peer)
        return peer

    def forget_peer(self, peer: Peer) -> None:
        self._peers.discard(peer)

    async def connect(
        self,
        address: str,
        token: str | bytes | None = None,
        *,
        timeout: float = 10.0,
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
        self.check_open("Agent.connect")
        key = c.resolve_token(token if token is not None else self._token, what)
        host, port = c.parse_address(address, what)
        wanted = self.transports if transports is None else _transport_names(tuple(transports), what)
        self.engine.attach(what)
        self._open_transports()
        me = self._identity()
        links: list[tr.Link] = []
        ch: c.Channel | None = None
        try:
            with anyio.fail_after(timeout):
                ch = c.Channel(await c.connect_tcp(host, port, what))
                info = await c.client_handshake(ch, key, w.ROLE_CONTROL, bytes(16), me, what)
                assert info is not None
                usable = [t for n, t in self._transports.items() if n in wanted and t.usable_with(info)]
                if not usable:
                    why = "".join(f" ({n} here: {why})" for n, why in self.unavailable.items() if n in wanted)
                    raise InvalidArgument(
                        f"{what}: no transport in common: we allow {wanted}{why}, the peer offers {info.transports}"
                    )
                dial = tr.Dial(self, me, info, host, port, key, ch, what)
                for transport in usable:
                    link = await transport.dial(dial)
                    if link is not None:
                        links.append(link)
                if links and not any(link.is_channel for link in links):
                    # Heartbeats and notifications need a native channel of their own.
                    maker = next(t for t in self._transports.values() if t.makes_channels)
                    channel = await maker.dial(dial)
                    if channel is None:
                        raise ConnectionLost(f"{what}: could not open the native channel")
                    links.append(channel)
        except TimeoutError:
            await _abandon(ch, links)
            raise ConnectTimeout(f"{what}: no answer within {timeout} s") from None
        except ConnectFailed:
            await _abandon(ch, links)
            raise
        except c.STREAM_ERRORS as exc:
            await _abandon(ch, links)
            raise ConnectionLost(
                f"{what}: the connection broke during the handshake ({exc or type(exc).__name__})"
            ) from None
        except BaseException:
            await _abandon(ch, links)
            raise
        if not links:
            await _abandon(ch, links)
            raise InvalidArgument(f"{what}: no usable transport (allowed {wanted}, peer offers {info.transports})")
        channel = next(link for link in links if link.is_channel)
        if channel is links[-1] and len(links) > 1 and channel.name not in wanted:
            links.pop()  # a channel only, not a path for data
        peer = Peer(self, links, info.agent_id, info.name, info=info, channel=channel)
        self._peers.add(peer)
        peer.start_session(ch)
        return peer

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._regions)} regions, {len(self._peers)} peers"
        return f"<Agent {self.name!r} {state}>"


# The transports' slots in hx_stats, in the native order.
_STAT_TRANSPORTS = tuple(ffi.string(lib.hx_transport_name(i)).decode() for i in range(lib.HX_STATS_TRANSPORTS))

# Agents not closed yet: closed (with a ResourceWarning) at interpreter exit,
# before module teardown and the last garbage collection free things in no order.
_OPEN: weakref.WeakSet[Agent] = weakref.WeakSet()


@atexit.register
def _close_open_agents() -> None:
    for agent in list(_OPEN):
        agent._close_abandoned()


def _check_region_args(access: Any, name: Any, what: str) -> Access | None:
    """``access`` (flags or words, as parse_access takes) and ``name`` of register()/allocate(),
    checked before anything is pinned; the access as flags."""
    access = parse_access(access, what)
    if access is not None and (int(access) & ~int(Access.REMOTE_READ | Access.REMOTE_WRITE) or int(access) < 0):
        raise InvalidArgument(f"{what}: access={int(access):#x} has bits outside REMOTE_READ|REMOTE_WRITE")
    if name is not None and not isinstance(name, str):
        raise InvalidArgument(f"{what}: name must be a str, not {type(name).__name__}")
    return access


def _transport_names(transports: str | tuple[str, ...], what: str) -> tuple[str, ...]:
    if transports == "auto":
        return tr.NAMES
    if isinstance(transports, str) or any(t not in tr.NAMES for t in transports):
        raise InvalidArgument(f"{what}: choose 'auto' or a tuple of {tr.NAMES}, not {transports!r}")
    return tuple(transports)


async def _abandon(ch: c.Channel | None, links: list[tr.Link]) -> None:
    """A connection that failed half-way: let go of what it had made."""
    for link in links:
        link.close()
        await link.aclose()
        link.free()
    if ch is not None:
        await ch.aclose()


def _free_all(peers: list[Peer]) -> None:
    for peer in peers:
        peer.free()


def _release_all(regions: list[Region]) -> None:
    for region in regions:
        region.pinned.release()
