"""shm: agents on one host; the target does nothing at all.

A region the target allocated (a sealed memfd) is mapped here once, from an
fd the target's agent passes over an abstract unix socket; user memory is
reached with cross-memory attach (process_vm_writev/readv) when the kernel
permits it. Either way ranges and rights come from the target's own answer,
never from a caller's descriptor, and every op is checked against them. A
region reachable neither way falls back to the next link (verbs, tcp).
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

import anyio

from .._control import handshake as c
from .._control.handshake import Identity, PeerInfo
from .._loop.backends import current_backend
from .._loop.engine import Engine, OpOwner
from .._loop.native import ffi, lib
from ..descriptor import RegionInfo
from ..errors import HixlError
from ..memory import Access
from .base import AgentView, ControlView, Dial, Link, ListenerView, Options, SessionView, Transport
from .tcp import session_key

# The unix socket that hands out memfds: request region u32 + key u64 +
# session[16], answer status u8 + size u64 (+ the fd when status is FD_OK).
_FD_REQUEST = struct.Struct("<IQ16s")
_FD_ANSWER = struct.Struct("<BQ")
FD_OK, FD_UNKNOWN, FD_ACCESS, FD_REFUSED = 0, 1, 2, 3
# A request for region 0 (no region has that id) asks for the session's doorbell:
# two fds, its ring's memfd and the initiator's end of its socket pair.
BELL_REGION = 0
# A connection must name a live session this soon; one process may hold this many.
HANDSHAKE_TIMEOUT = 5.0
MAX_PER_PID = 8


class ShmLink(Link):
    name = "shm"

    def __init__(self, handle: Any, uds: Any, cma: bool, session: bytes) -> None:
        super().__init__(handle)
        self._uds = uds
        self._uds_lock = anyio.Lock()
        self._cma = cma
        self._session = session
        self._freed = False
        self._mapped: set[int] = set()  # memfd regions mapped here
        self.bell = False  # notes ring the target's doorbell
        self._channel: Link | None = None  # where notes go while the ring is full
        self._detour = 0  # the id of the last note sent the channel's way, while in flight

    async def attach_bell(self) -> None:
        """Ask the target for its doorbell; without one, notes take the native channel."""
        async with self._uds_lock:
            try:
                await self._uds.send(_FD_REQUEST.pack(BELL_REGION, 0, self._session))
                msg, fds = await self._uds.receive_fds(_FD_ANSWER.size, 2)
            except (*c.STREAM_ERRORS, ValueError):
                return
        try:
            if len(msg) == _FD_ANSWER.size and _FD_ANSWER.unpack(msg)[0] == FD_OK and len(fds) == 2:
                self.bell = lib.hx_shm_bell(self.handle, fds[0], fds[1]) == 0
        finally:
            for fd in fds:
                os.close(fd)

    def take_notes(self, channel: Link) -> bool:
        self._channel = channel
        return self.bell

    def note(self, engine: Engine, data: bytes, dep: int, what: str, owner: OpOwner) -> Any:
        assert self._channel is not None  # take_notes said yes
        if not self._detour or not engine.in_flight(self._detour):
            self._detour = 0
            waiter = engine.post_note(self.handle, dep, data, what, owner)
            if waiter is not engine.BUSY:
                return waiter
        # The ring is full, or notes already went around it and are not all there yet.
        waiter = self._channel.note(engine, data, dep, what, owner)
        if waiter is not None and waiter is not engine.BUSY:
            self._detour = engine.last_op_id
        return waiter

    async def reach(self, info: RegionInfo, control: ControlView | None, what: str) -> str | None:
        if control is None:
            return None
        rid = info.region_id
        # The target's own word on the region, never the caller's descriptor:
        # a forged size or address must not reach a copy into its memory.
        own = await control.region_info(info, what)
        if own is None:
            return None
        if own.kind == "memfd" and self._uds is not None:
            fd = await self._fetch_fd(rid, own.key)
            if fd is not None:
                try:
                    rc = lib.hx_shm_map(self.handle, rid, fd, own.nbytes, int(own.access))
                finally:
                    os.close(fd)
                if rc == 0:
                    self._mapped.add(rid)
                    return "shm-memfd"
                c.log.info("aiohixl: %s region %d: mapping refused (status %d)", control.label, rid, rc)
        if self._cma and lib.hx_shm_attach(self.handle, rid, own.address, own.nbytes, int(own.access)) == 0:
            return "shm-cma"
        return None

    async def _fetch_fd(self, rid: int, key: int) -> int | None:
        async with self._uds_lock:
            try:
                await self._uds.send(_FD_REQUEST.pack(rid, key, self._session))
                msg, fds = await self._uds.receive_fds(_FD_ANSWER.size, 1)
            except (*c.STREAM_ERRORS, ValueError):
                return None
        if len(msg) != _FD_ANSWER.size or _FD_ANSWER.unpack(msg)[0] != FD_OK or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return None
        return int(fds[0])

    async def forget(self, region_id: int) -> None:
        self._mapped.discard(region_id)
        if not self._freed:
            # Waits for the copies still running in it: to their end, or free() would pull the registry away.
            await current_backend().run_to_end(lib.hx_shm_forget, self.handle, region_id, 1)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._uds is not None:
                uds, self._uds = self._uds, None
                await uds.aclose()
            # Unmapping GiBs takes a second: here, off the loop, rather than in free() on it.
            mapped, self._mapped = self._mapped, set()
            if mapped and not self._freed:
                await current_backend().run_to_end(self._forget_all, mapped)

    def _forget_all(self, region_ids: set[int]) -> None:
        for rid in region_ids:
            lib.hx_shm_forget(self.handle, rid, 1)  # waits for the copies still running in it

    def free(self) -> None:
        self._freed = True
        super().free()


class ShmTransport(Transport):
    name = "shm"
    rank = 1

    def __init__(self, agent: AgentView, options: Options) -> None:
        super().__init__(agent, options)
        # 16 bytes a same-host peer reads with process_vm_readv to learn
        # whether cross-memory attach to this process is permitted.
        self._probe = ffi.new("uint8_t[16]", agent.id)
        self.socket_name = ""
        self._unix: Any = None
        self._per_pid: dict[int, int] = {}
        self._bells: dict[bytes, Any] = {}  # session id -> the doorbell it rings (native)

    def advertise(self, me: Identity) -> None:
        me.probe = int(ffi.cast("uintptr_t", self._probe))
        me.shm_socket = self.socket_name

    def why_not(self, info: PeerInfo) -> str | None:
        return super().why_not(info) or self.agent.host_identity.why_not_shared_memory(info.host)

    def acknowledges_withdrawal(self, info: PeerInfo) -> bool:
        return self.agent.host_identity.why_not_shared_memory(info.host) is None

    # ---- the listener's side: memfds for authenticated same-host peers ----

    async def serve(self, listener: ListenerView, start_soon: Callable[..., Any]) -> None:
        name = f"\0aiohixl-{self.agent.id.hex()}"
        try:
            self._unix = await anyio.create_unix_listener(name)
        except OSError as exc:
            c.log.warning("aiohixl %s: no memfd sharing (unix socket: %s)", listener.address, exc)
            return
        self.socket_name = name
        start_soon(
            c.accept_forever,
            self._unix,
            lambda stream: self._hand_out_fds(stream, listener),
            start_soon,
            f"{listener.address} (memfd socket)",
        )

    def session_ended(self, session: SessionView) -> None:
        bell = self._bells.pop(session.sid, None)
        native = self.agent.engine.native
        if bell is not None and native is not None:  # else the agent is gone, and its bells with it
            lib.hx_shm_bell_close(native, bell)  # what it holds is queued first

    async def _hand_out_bell(self, stream: Any, sid: bytes) -> None:
        if sid in self._bells:
            await stream.send(_FD_ANSWER.pack(FD_REFUSED, 0))
            return
        out = ffi.new("int[3]")  # ring memfd, the initiator's socket, status
        bell = lib.hx_shm_bell_serve(self.agent.engine.native, session_key(sid), out, out + 1, out + 2)
        if bell == ffi.NULL:
            await stream.send(_FD_ANSWER.pack(FD_UNKNOWN, 0))
            return
        self._bells[sid] = bell
        try:
            await stream.send_fds(_FD_ANSWER.pack(FD_OK, 0), [out[0], out[1]])
        finally:
            os.close(out[0])
            os.close(out[1])

    async def stop_serving(self) -> None:
        if self._unix is not None:
            with anyio.CancelScope(shield=True):
                await self._unix.aclose()

    async def _hand_out_fds(self, stream: Any, listener: ListenerView) -> None:
        """Hands memfds to the authenticated, same-host process that asks.

        The peer's credentials are checked before anything is read: only this
        uid, at most MAX_PER_PID connections per process, and a first request
        naming a live session within HANDSHAKE_TIMEOUT. After that the
        connection lives as long as that session.
        """
        pid = 0
        try:
            sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
            pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid() or self._per_pid.get(pid, 0) >= MAX_PER_PID:
                pid = 0
                return
            self._per_pid[pid] = self._per_pid.get(pid, 0) + 1
            bound: bytes | None = None
            while True:
                with anyio.fail_after(HANDSHAKE_TIMEOUT if bound is None else None):
                    request = await _receive_exactly(stream, _FD_REQUEST.size)
                region_id, key, sid = _FD_REQUEST.unpack(request)
                if bound is not None and sid != bound:
                    await stream.send(_FD_ANSWER.pack(FD_REFUSED, 0))
                    return
                session = listener.session(sid)
                if session is None or session.info.pid != pid:
                    await stream.send(_FD_ANSWER.pack(FD_REFUSED, 0))
                    return
                bound = sid
                if region_id == BELL_REGION:
                    await self._hand_out_bell(stream, sid)
                    continue
                region = self.agent.live_region(region_id)
                if region is not None and not hmac.compare_digest(_key_bytes(region.key), _key_bytes(key)):
                    region = None  # a guessed id is no region at all
                if region is None or region.pinned.fd is None:
                    await stream.send(_FD_ANSWER.pack(FD_UNKNOWN, 0))
                    continue
                if not region.access:
                    await stream.send(_FD_ANSWER.pack(FD_ACCESS, 0))
                    continue
                # A peer without REMOTE_WRITE gets a read-only fd: it cannot map it writable.
                flags = os.O_RDWR if region.access & Access.REMOTE_WRITE else os.O_RDONLY
                fd = os.open(f"/proc/self/fd/{region.pinned.fd}", flags | os.O_CLOEXEC)
                try:
                    await stream.send_fds(_FD_ANSWER.pack(FD_OK, region.nbytes), [fd])
                finally:
                    os.close(fd)
        except (HixlError, TimeoutError, *c.STREAM_ERRORS, struct.error):
            pass
        except Exception:
            c.log.exception("aiohixl %s: fd request handler failed", listener.address)
        finally:
            if pid:
                if self._per_pid.get(pid, 0) <= 1:
                    self._per_pid.pop(pid, None)
                else:
                    self._per_pid[pid] -= 1
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    # ---- the initiator's side ----

    async def dial(self, dial: Dial) -> ShmLink | None:
        """Each path is tried and kept only if it works; a log line says what falls back and why."""
        info, what = dial.info, dial.what
        cma = False
        reasons = []
        if self.agent.host_identity.same_namespaces(info.host):
            got = ffi.new("uint8_t[16]")
            rc = lib.hx_cma_probe(info.pid, info.probe, got, 16)
            cma = rc == 0 and bytes(got) == info.agent_id
            if not cma:
                why = os.strerror(-rc) if rc else "mismatch"
                reasons.append(f"cross-memory attach to pid {info.pid} refused ({why})")
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
            dial.refused[self.name] = "; ".join(reasons)
            c.log.warning("aiohixl %s: same host, but no shared memory path (%s)", what, dial.refused[self.name])
            return None
        status = ffi.new("int *")
        handle = lib.hx_shm_new(self.agent.engine.native, info.pid if cma else 0, status)
        if handle == ffi.NULL:
            if uds is not None:
                await uds.aclose()
            c.log.warning("aiohixl %s: shared memory unavailable (status %d)", what, status[0])
            return None
        link = ShmLink(handle, uds, cma, info.session)
        if uds is not None:
            await link.attach_bell()
        if not link.bell:
            reasons.append("no doorbell: notifications take the native channel")
        if reasons:
            c.log.info("aiohixl %s: shared memory with fallbacks: %s", what, "; ".join(reasons))
        return link


def _key_bytes(key: int) -> bytes:
    return key.to_bytes(8, "little")


async def _receive_exactly(stream: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += await stream.receive(n - len(data))
    return data
