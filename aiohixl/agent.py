"""The agent: registered memory, peers, and the native engine behind them."""

from __future__ import annotations

import os
import uuid
from typing import Any

import anyio

from . import _control as c
from . import _wire as w
from ._engine import Engine
from ._native import check, ffi, lib
from ._server import Listener
from .descriptor import RegionInfo
from .errors import ClosedError, ConnectionLost, ConnectTimeout, InvalidArgument, RegionUnavailable
from .memory import Access, Region, allocate_shared, pin
from .peer import Peer
from .remote import RemoteRegion

__all__ = ["Agent"]

_TRANSPORTS = ("loopback", "tcp", "shm")


class Agent:
    """One endpoint of aiohixl: owns registered memory and the peers ops go through.

    Use it as ``async with Agent() as agent:`` (or ``await agent.start()`` and
    ``await agent.aclose()``).

    ``listen="host:port"`` makes peers able to connect (port 0 picks a free
    port; ``agent.address`` tells which). ``token`` is the shared secret both
    sides of a connection prove they hold (default: ``AIOHIXL_TOKEN``).
    Every ``heartbeat_interval`` seconds each side of a control connection
    pings; after ``heartbeat_timeout`` seconds of silence the connection is
    given up and its ops fail with ConnectionLost.
    ``max_inflight`` bounds the ops outstanding at once (the completion ring's
    size); a call beyond it waits for room. ``copy_threads`` is the number of
    native threads that run large copies.
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
    ) -> None:
        if transports != "auto":
            unknown = [t for t in transports if t not in _TRANSPORTS]
            if isinstance(transports, str) or unknown:
                raise InvalidArgument(
                    f"Agent(transports={transports!r}): choose 'auto' or a tuple of {_TRANSPORTS}"
                )
        if not 1 <= max_inflight <= 1 << 24:
            raise InvalidArgument(f"Agent(max_inflight={max_inflight}): must be in [1, 2**24]")
        if copy_threads is None:
            copy_threads = min(4, os.cpu_count() or 1)
        if not 1 <= copy_threads <= 64:
            raise InvalidArgument(f"Agent(copy_threads={copy_threads}): must be in [1, 64]")
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
        self.transports = _TRANSPORTS if transports == "auto" else tuple(transports)
        self.host_identity = c.HostIdentity.local()
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_timeout = heartbeat_timeout
        self._listener: Listener | None = None
        self._engine = Engine(max_inflight, copy_threads)
        # 16 bytes a same-host peer reads with process_vm_readv to learn
        # whether cross-memory attach to this process is permitted.
        self._probe = ffi.new("uint8_t[16]", self.id)
        self._regions: dict[int, Region] = {}
        self._named: dict[str, Region] = {}
        self._peers: set[Peer] = set()
        self._next_region = 1
        self._closed = False

    # ---- lifetime ----

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def start(self) -> None:
        """Bind to the running event loop and start listening (if ``listen`` was given)."""
        self._check_open("Agent.start")
        self._engine.attach()
        if self._listen is not None and self._listener is None:
            host, port = self._listen
            listener = Listener(self, host, port, c.resolve_token(self._token, "Agent.start"))
            try:
                await listener.start()
            except OSError as exc:
                raise OSError(exc.errno, f"Agent.start: cannot listen on {host}:{port}: {exc.strerror}") from None
            self._listener = listener

    @property
    def address(self) -> str | None:
        """``host:port`` peers connect to, once started with ``listen``; else None."""
        return self._listener.address if self._listener else None

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def outstanding(self) -> int:
        """Ops posted whose completion has not arrived yet (cancelled ones included)."""
        return self._engine.outstanding

    async def aclose(self) -> None:
        """Close every peer, end every op in flight, deregister every region.

        Ops still queued fail with ClosedError; copies already running finish
        first, so no memory is released while a native thread touches it.
        """
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            await self._listener.aclose()
        for peer in list(self._peers):
            # Closed before its session ends, so its ops fail as closed, not lost.
            peer._closed = True
            peer._close_native()
            peer._end_session()
            await peer._close_uds()
        await self._engine.shutdown()
        for peer in list(self._peers):
            peer._free()
        self._peers.clear()
        self._engine.free()
        for region in self._regions.values():
            region._closed = True
            region._pinned.release()
            self._wake_region_waiters(region)
        self._regions.clear()
        self._named.clear()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: agent {self.name!r} is closed")

    # ---- memory ----

    def register(self, obj: Any, *, access: Access | None = None, name: str | None = None) -> Region:
        """Register a C-contiguous buffer (bytearray, memoryview, mmap, numpy) or torch CPU tensor.

        ``access`` says what peers may do; by default REMOTE_READ|REMOTE_WRITE,
        or REMOTE_READ alone for a read-only buffer. The buffer is pinned
        (a bytearray cannot be resized) until the region is closed.
        """
        self._check_open("Agent.register")
        pinned = pin(obj, "Agent.register")
        if access is None:
            access = Access.REMOTE_READ if pinned.readonly else Access.REMOTE_READ | Access.REMOTE_WRITE
        if pinned.readonly and access & Access.REMOTE_WRITE:
            pinned.release()
            raise InvalidArgument(
                f"Agent.register: {type(obj).__name__} is read-only but access asks for REMOTE_WRITE"
            )
        memory = obj
        if pinned._holds and not isinstance(pinned._holds[-1], memoryview):
            memory = ffi.buffer(ffi.cast("char *", pinned.address), pinned.nbytes)  # torch
        # Fault the pages in now: a first copy into cold memory runs at a
        # fraction of the speed of one into warm memory.
        lib.hx_prefault(ffi.cast("void *", pinned.address), pinned.nbytes, 0 if pinned.readonly else 1)
        return self._add_region(pinned, Access(access), name, memory, "Agent.register")

    def allocate(self, nbytes: int, *, access: Access | None = None, name: str | None = None) -> Region:
        """Allocate ``nbytes`` of zero-filled, page-aligned memory (memfd-backed) and register it."""
        self._check_open("Agent.allocate")
        if nbytes < 0:
            raise InvalidArgument(f"Agent.allocate({nbytes}): size must be >= 0")
        pinned, mm = allocate_shared(nbytes, name)
        lib.hx_prefault(ffi.cast("void *", pinned.address), nbytes, 1)
        if access is None:
            access = Access.REMOTE_READ | Access.REMOTE_WRITE
        return self._add_region(pinned, Access(access), name, mm, "Agent.allocate")

    def _add_region(self, pinned: Any, access: Access, name: str | None, memory: Any, what: str) -> Region:
        if name is not None:
            if not name or len(name.encode()) > 255:
                pinned.release()
                raise InvalidArgument(f"{what}: name must be 1 to 255 bytes of UTF-8")
            if name in self._named:
                pinned.release()
                raise InvalidArgument(f"{what}: a region named {name!r} is already registered")
        region_id = self._next_region
        self._next_region += 1
        rc = lib.hx_region_add(self._engine.native, region_id, pinned.address, pinned.nbytes, int(access))
        if rc < 0:
            pinned.release()
            check(rc, what)
        region = Region(self, region_id, pinned, access, name, memory)
        self._regions[region_id] = region
        if name is not None:
            self._named[name] = region
        return region

    async def _close_region(self, region: Region) -> None:
        region._closed = True
        if region.name is not None:
            self._named.pop(region.name, None)
        if self._closed:
            return
        backend = self._engine.attach()
        if self._listener is not None:
            await self._listener.withdraw(region.id)
        while region._inflight:
            waiter = backend.new_waiter()
            region._idle_waiters.append(waiter)
            await backend.wait(waiter)
        if self._closed:
            return
        rc = lib.hx_region_remove(self._engine.native, region.id, 0)
        if rc == lib.HX_E_BUSY:
            # A remote access is still running on a native thread.
            rc = await anyio.to_thread.run_sync(lib.hx_region_remove, self._engine.native, region.id, 1)
        self._regions.pop(region.id, None)
        region._pinned.release()

    def _wake_region_waiters(self, region: Region) -> None:
        waiters, region._idle_waiters = region._idle_waiters, []
        backend = self._engine.backend
        for w in waiters:
            backend.resolve(w, None)

    def _transport_keys(self, region: Region) -> dict[int, bytes]:
        return {}

    def _shm_socket_name(self) -> str:
        return self._listener.shm_socket if self._listener else ""

    def _probe_address(self) -> int:
        return int(ffi.cast("uintptr_t", self._probe))

    def _published_remote(self, name: str, what: str) -> RemoteRegion:
        region = self._named.get(name)
        if region is None:
            raise RegionUnavailable(f"{what}({name!r}): no region of that name is published")
        return RemoteRegion(
            RegionInfo(
                agent_id=self.id, region_id=region.id, nbytes=region.nbytes, address=region.address,
                access=region.access, kind=region.kind, name=region.name,
                keys=self._transport_keys(region),
            )
        )

    # ---- peers ----

    def loopback(self) -> Peer:
        """A peer that is this agent: ops copy between its own regions."""
        self._check_open("Agent.loopback")
        status = ffi.new("int *")
        handle = lib.hx_loopback_new(self._engine.native, status)
        if handle == ffi.NULL:
            check(status[0], "Agent.loopback")
        peer = Peer(self, handle, self.id, "loopback", self.name)
        self._peers.add(peer)
        return peer

    async def connect(
        self, address: str, token: str | bytes | None = None, *, timeout: float = 10.0,
        transports: tuple[str, ...] | None = None,
    ) -> Peer:
        """Connect to the agent listening at ``address`` ("host:port") and authenticate.

        Raises AuthenticationError when the tokens differ, ConnectionLost when
        nothing answers, TransferTimeout when the handshake takes longer than
        ``timeout`` seconds.
        """
        what = f"Agent.connect({address!r})"
        self._check_open("Agent.connect")
        key = c.resolve_token(token if token is not None else self._token, what)
        host, port = c.parse_address(address, what)
        wanted = self.transports if transports is None else tuple(transports)
        self._engine.attach()
        channels: list[c.Channel] = []
        ok = False
        try:
            with anyio.fail_after(timeout):
                ch = c.Channel(await anyio.connect_tcp(host, port))
                channels.append(ch)
                info = await c.client_handshake(ch, key, w.ROLE_CONTROL, bytes(16), self, what)
                chosen = [t for t in ("tcp",) if t in wanted and t in info.transports]
                if not chosen:
                    raise InvalidArgument(
                        f"{what}: no transport in common (we allow {wanted}, the peer offers {info.transports})"
                    )
                data = c.Channel(await anyio.connect_tcp(host, port))
                channels.append(data)
                await c.client_handshake(data, key, w.ROLE_DATA, info.session, self, what)
                fd = data.fileno_for_handoff()
                ok = True
        except TimeoutError:
            raise ConnectTimeout(f"{what}: no answer within {timeout} s") from None
        except c._STREAM_ERRORS as exc:
            raise ConnectionLost(f"{what}: {exc or type(exc).__name__}") from None
        finally:
            for ch_ in channels[1:] if ok else channels:
                await ch_.aclose()
        status = ffi.new("int *")
        handle = lib.hx_tcp_connect_fd(self._engine.native, fd, status)
        if handle == ffi.NULL:
            await ch.aclose()
            check(status[0], what)
        peer = Peer(self, handle, info.agent_id, chosen[0], info.name, info=info)
        self._peers.add(peer)
        if "shm" in wanted and "shm" in info.transports and self.host_identity.same_host(info.host):
            await self._setup_shm(peer, info, what)
        peer._start_session(ch)
        return peer

    async def _setup_shm(self, peer: Peer, info: c.PeerInfo, what: str) -> None:
        """Same host: memfd regions are mapped here, user memory reached by cross-memory attach.

        Each path is tried and kept only if it works; what is missing falls back
        to tcp, and a log line says why.
        """
        cma = False
        reasons = []
        if self.host_identity.same_namespaces(info.host):
            got = ffi.new("uint8_t[16]")
            rc = lib.hx_cma_probe(info.pid, info.probe, got, 16)
            cma = rc == 0 and bytes(got) == info.agent_id
            if not cma:
                reasons.append(f"cross-memory attach to pid {info.pid} refused ({os.strerror(-rc) if rc else 'mismatch'})")
        else:
            reasons.append("different pid/user/net namespaces: no cross-memory attach")
        uds = None
        if info.shm_socket:
            try:
                uds = await anyio.connect_unix(info.shm_socket)
            except OSError as exc:
                reasons.append(f"memfd socket unreachable ({exc.strerror})")
        else:
            reasons.append("the peer shares no memfds")
        if not cma and uds is None:
            c.log.warning("aiohixl %s: same host, but no shared memory path (%s); using tcp", what, "; ".join(reasons))
            return
        status = ffi.new("int *")
        handle = lib.hx_shm_new(self._engine.native, info.pid if cma else 0, status)
        if handle == ffi.NULL:
            if uds is not None:
                await uds.aclose()
            c.log.warning("aiohixl %s: shared memory unavailable (status %d); using tcp", what, status[0])
            return
        if reasons:
            c.log.info("aiohixl %s: shared memory with fallbacks to tcp: %s", what, "; ".join(reasons))
        peer._enable_shm(handle, uds, cma)

    def _forget_peer(self, peer: Peer) -> None:
        # Native resources go with the agent: ops of the peer may still be completing.
        pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._regions)} regions, {len(self._peers)} peers"
        return f"<Agent {self.name!r} {state}>"

