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
from .errors import ClosedError, ConnectionLost, ConnectTimeout, InvalidArgument, ProtocolError, RegionUnavailable
from .memory import Access, Region, allocate_shared, pin
from .peer import Peer
from .remote import RemoteRegion

__all__ = ["Agent"]

_TRANSPORTS = ("loopback", "tcp", "shm", "verbs")
KEY_RKEY = 1  # descriptor key: the verbs rkey of the region (u32 little endian)


class Notification:
    """A WRITE WITH IMM that landed in this agent's memory: its immediate and length."""

    __slots__ = ("imm", "nbytes")

    def __init__(self, imm: int, nbytes: int) -> None:
        self.imm = imm
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<Notification imm={self.imm:#x} nbytes={self.nbytes}>"


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

    ``transports`` ("auto" or a tuple) says which data paths may be used:
    "shm" (same host), "verbs" (RDMA), "tcp", "loopback"; on connect the
    first usable of shm, verbs, tcp is taken, tcp also serving as fallback.
    ``rdma_device``/``rdma_port``/``rdma_gid_index`` pick the RDMA port (see
    docs/rdma.md; default: first active port, RoCE v2 IPv4 GID preferred),
    ``rdma_timeout`` is the QP's local ACK timeout exponent (4.096 us * 2**t)
    and ``rdma_retry_count`` its retry count: a dead peer's ops fail after
    about (retry_count + 1) * timeout.
    ``stall_timeout``: a tcp peer that stops sending in the middle of a put's
    payload for this many seconds is disconnected (the region it was writing
    stays busy, and Region.close() waiting, until then).
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
        if not 1 <= rdma_timeout <= 31 or not 0 <= rdma_retry_count <= 7:
            raise InvalidArgument(
                f"Agent(rdma_timeout={rdma_timeout}, rdma_retry_count={rdma_retry_count}):"
                " need timeout in [1, 31] and retry count in [0, 7]"
            )
        self._rdma_args = (rdma_device, rdma_port, rdma_gid_index, rdma_timeout, rdma_retry_count)
        self._verbs: Any = None  # the RdmaChoice once the device is open
        self.verbs_unavailable: str | None = None  # why verbs is not used, once tried
        self._notifications: Any = None
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
        self._engine.on_notify = self._on_notify
        if not stall_timeout > 0:
            raise InvalidArgument(f"Agent(stall_timeout={stall_timeout}): must be > 0")
        lib.hx_agent_set_stall(self._engine.native, int(stall_timeout * 1e9))
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
        self._open_verbs()
        if self._listen is not None and self._listener is None:
            host, port = self._listen
            listener = Listener(self, host, port, c.resolve_token(self._token, "Agent.start"))
            try:
                await listener.start()
            except OSError as exc:
                raise OSError(exc.errno, f"Agent.start: cannot listen on {host}:{port}: {exc.strerror}") from None
            self._listener = listener

    def _open_verbs(self) -> None:
        """Open the RDMA device once, if verbs is allowed and there is one; else say why not."""
        if "verbs" not in self.transports or self._verbs is not None or self.verbs_unavailable:
            return
        from . import _rdma

        device, port, gid_index, timeout, retries = self._rdma_args
        try:
            choice = _rdma.choose(device, port, gid_index)
        except ValueError as exc:
            self.verbs_unavailable = str(exc)
            return
        rc = lib.hx_verbs_open(self._engine.native, choice.device.encode(), choice.port, choice.gid_index,
                               timeout, retries)
        if rc != 0:
            self.verbs_unavailable = ffi.string(lib.hx_verbs_error()).decode(errors="replace")
            c.log.info("aiohixl %s: verbs unavailable: %s", self.name, self.verbs_unavailable)
            return
        self._verbs = choice
        for region in self._regions.values():
            self._register_mr(region)

    def _register_mr(self, region: Region) -> None:
        rkey = ffi.new("uint32_t *")
        rc = lib.hx_verbs_reg(self._engine.native, region.id, 1 if region.readonly else 0, rkey)
        if rc == 0:
            region._rkey = rkey[0]
        else:
            c.log.warning("aiohixl %s: region %s not registered with the RDMA device: %s", self.name,
                          region._label(), ffi.string(lib.hx_verbs_error()).decode(errors="replace"))

    def _offered_transports(self) -> list[str]:
        return [t for t in self.transports if t != "verbs" or self._verbs is not None]

    # ---- notifications (RDMA WRITE WITH IMM) ----

    async def notification(self) -> Notification:
        """The next WRITE WITH IMM that landed in this agent's memory (waits for one)."""
        self._check_open("Agent.notification")
        backend = self._engine.attach()
        q = self._notify_queue()
        while not q[0]:
            waiter = backend.new_waiter()
            q[1].append(waiter)
            await backend.wait(waiter)
            self._check_open("Agent.notification")
        return q[0].popleft()

    def _notify_queue(self) -> Any:
        if self._notifications is None:
            import collections

            self._notifications = (collections.deque(), [])
        return self._notifications

    def _on_notify(self, imm: int, nbytes: int) -> None:
        q = self._notify_queue()
        q[0].append(Notification(imm, nbytes))
        waiters, q[1][:] = list(q[1]), []
        for waiter in waiters:
            self._engine.backend.resolve(waiter, None)

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
        if self._verbs is not None:
            self._register_mr(region)
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
        if region._rkey is None:
            return {}
        return {KEY_RKEY: region._rkey.to_bytes(4, "little")}

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
        unknown = [t for t in wanted if t not in _TRANSPORTS]
        if unknown:
            raise InvalidArgument(f"{what}: unknown transports {unknown}; choose from {_TRANSPORTS}")
        self._engine.attach()
        self._open_verbs()
        channels: list[c.Channel] = []
        ok = False
        fd = -1
        try:
            with anyio.fail_after(timeout):
                ch = c.Channel(await anyio.connect_tcp(host, port))
                channels.append(ch)
                info = await c.client_handshake(ch, key, w.ROLE_CONTROL, bytes(16), self, what)
                offered = info.transports
                use_shm = "shm" in wanted and "shm" in offered and self.host_identity.same_host(info.host)
                use_verbs = "verbs" in wanted and "verbs" in offered and self._verbs is not None
                use_tcp = "tcp" in wanted and "tcp" in offered
                if not (use_shm or use_verbs or use_tcp):
                    why = "" if "verbs" not in wanted else f" (verbs here: {self.verbs_unavailable or 'ready'})"
                    raise InvalidArgument(
                        f"{what}: no transport in common: we allow {wanted}{why}, the peer offers {offered}"
                    )
                if use_tcp:
                    data = c.Channel(await anyio.connect_tcp(host, port))
                    channels.append(data)
                    await c.client_handshake(data, key, w.ROLE_DATA, info.session, self, what)
                    fd = data.fileno_for_handoff()
                handle = None
                if fd >= 0:
                    status = ffi.new("int *")
                    handle = lib.hx_tcp_connect_fd(self._engine.native, fd, status)
                    if handle == ffi.NULL:
                        check(status[0], what)
                peer = Peer(self, handle, info.agent_id, "tcp", info.name, info=info)
                self._peers.add(peer)
                if use_verbs:
                    await self._setup_verbs(peer, ch, what)
                ok = True
        except TimeoutError:
            raise ConnectTimeout(f"{what}: no answer within {timeout} s") from None
        except c._STREAM_ERRORS as exc:
            raise ConnectionLost(f"{what}: {exc or type(exc).__name__}") from None
        finally:
            for ch_ in channels[1:] if ok else channels:
                await ch_.aclose()
        if use_shm:
            await self._setup_shm(peer, info, what)
        if peer._handle is None and peer._verbs_h is None and peer._shm is None:
            await peer.aclose()
            raise InvalidArgument(f"{what}: no usable transport (allowed {wanted}, peer offers {offered})")
        peer._start_session(ch)
        return peer

    async def _setup_verbs(self, peer: Peer, ch: c.Channel, what: str) -> None:
        """Create our RC QP, trade QP facts with the target over the control channel, connect."""
        native = self._engine.native
        qpn, psn, status = ffi.new("uint32_t *"), ffi.new("uint32_t *"), ffi.new("int *")
        handle = lib.hx_verbs_peer_new(native, qpn, psn, status)
        if handle == ffi.NULL:
            c.log.warning("aiohixl %s: no queue pair: %s", what, ffi.string(lib.hx_verbs_error()).decode(errors="replace"))
            return
        gid, lid, mtu = ffi.new("uint8_t[16]"), ffi.new("uint16_t *"), ffi.new("int *")
        lib.hx_verbs_local(native, gid, lid, mtu)
        await ch.send(w.qp_info(w.Writer(), qpn[0], psn[0], bytes(gid), lid[0], mtu[0]).frame(w.VERBS_QP))
        while True:  # the target's session may ping meanwhile
            ftype, r = await ch.recv(w.MAX_FRAME)
            if ftype == w.PING:
                continue
            if ftype != w.VERBS_QP_OK:
                raise ProtocolError(f"{what}: expected VERBS_QP_OK, got {w.NAMES[ftype]}")
            break
        if r.u8() != 0:
            r.end()
            lib.hx_peer_close(handle)
            c.log.warning("aiohixl %s: the peer could not make a queue pair; not using verbs", what)
            return
        rqpn, rpsn, rgid, rlid, rmtu = w.read_qp_info(r)
        r.end()
        rc = lib.hx_verbs_peer_connect(handle, rqpn, rpsn, rgid, rlid, rmtu)
        if rc != 0:
            lib.hx_peer_close(handle)
            c.log.warning("aiohixl %s: connecting the queue pair failed: %s", what,
                          ffi.string(lib.hx_verbs_error()).decode(errors="replace"))
            return
        peer._enable_verbs(handle)

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

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._regions)} regions, {len(self._peers)} peers"
        return f"<Agent {self.name!r} {state}>"

