"""What an Agent points at: its engine, transports, regions, peers and inbox, and their lifetime.

It is the ``AgentView`` its transports get and the agent its peers' plumbing belongs to.
"""

from __future__ import annotations

import collections
import os
import uuid
import warnings
from typing import Any

from .. import transports as tr
from .._control import handshake as c
from .._control.listener import Listener
from .._loop.backends import current_backend
from .._loop.engine import Engine
from .._loop.native import ffi, lib
from ..errors import ClosedError
from ..memory import Region
from ..notifications import Inbox
from .peer_core import PeerCore
from .regions import Regions


class AgentCore:
    def __init__(
        self,
        agent: Any,
        name: str | None,
        allowed: tuple[str, ...],
        max_inflight: int,
        copy_threads: int,
        max_notifications: int,
        transport_options: tr.Options,
        notify_poll_us: int,
    ) -> None:
        self.agent = agent  # the public Agent: what a region names as its own
        self.id = uuid.uuid4().bytes
        self.name = name or f"agent-{os.getpid()}-{self.id[:4].hex()}"
        self.allowed = allowed
        self.host_identity = c.HostIdentity.local()
        self.heartbeat = transport_options.heartbeat
        self.engine = Engine(max_inflight, copy_threads)
        self.threads = copy_threads
        # senders' (name, agent id), by session key
        self._names: collections.OrderedDict[int, tuple[str, bytes]] = collections.OrderedDict()
        self.inbox = Inbox(self.engine, max_notifications, self._names, (self.name, self.id), notify_poll_us)
        self.engine.on_wake = self.inbox.pull
        self.transports = tr.make(self, allowed, transport_options)
        self.regions = Regions(self)
        self.peers: set[PeerCore] = set()
        self.listener: Listener | None = None
        self.closed = False
        self._closed_waiter: tuple[Any, Any] | None = None  # (backend, waiter) once aclose began

    def check_open(self, what: str) -> None:
        if self.closed:
            raise ClosedError(f"{what}: agent {self.name!r} is closed")

    # ---- what transports see (AgentView) ----

    def live_region(self, region_id: int) -> Region | None:
        return self.regions.live(region_id)

    def live_regions(self) -> list[Region]:
        return self.regions.live_all()

    # ---- transports and who we are ----

    def open_transports(self) -> None:
        for transport in self.transports.values():
            transport.open()

    @property
    def unavailable(self) -> dict[str, str]:
        return {n: t.unavailable for n, t in self.transports.items() if t.unavailable and n in self.allowed}

    def identity(self) -> c.Identity:
        offered = [n for n in self.allowed if n not in self.unavailable]
        me = c.Identity(self.id, self.name, self.host_identity, offered)
        for transport in self.transports.values():
            transport.advertise(me)
        return me

    def loopback(self) -> PeerCore:
        link = tr.self_link(self.transports)
        assert link is not None  # the loopback transport is always there
        peer = PeerCore(self, [link], self.id, self.name)
        self.peers.add(peer)
        return peer

    # ---- listening ----

    async def listen(self, host: str, port: int, token: bytes, spawn: Any) -> None:
        listener = Listener(
            host,
            port,
            token,
            self.transports.values(),
            self.identity,
            self.regions.lookup,
            self.regions.published,
            self.heartbeat,
            spawn,
            self._on_session,
        )
        try:
            await listener.start()
        except OSError as exc:
            raise OSError(exc.errno, f"Agent.start: cannot listen on {host}:{port}: {exc.strerror}") from None
        self.listener = listener

    def _on_session(self, sid: bytes, name: str, agent_id: bytes) -> None:
        self._names[int.from_bytes(sid[:8], "little")] = (name, agent_id)
        while len(self._names) > 4096:  # names of ended sessions go, oldest first
            self._names.popitem(last=False)

    # ---- stats ----

    def stats(self) -> dict[str, Any]:
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
            "tcp_send": self._tcp_send(),
        }

    def _tcp_send(self) -> dict[str, int]:
        out = ffi.new("uint64_t[2]")
        lib.hx_tcp_send_stats(self.engine.native, out, out + 1)
        return {"spliced": int(out[0]), "copied": int(out[1])}

    # ---- lifetime ----

    async def aclose(self) -> None:
        if self._closed_waiter is not None:  # closing or closed: returns once it is closed
            await self._closed_waiter[0].wait_to_end(self._closed_waiter[1])
            return
        if self.closed:  # close_abandoned freed it
            return
        self.engine.check_loop("Agent.aclose")
        backend = self.engine.backend or current_backend()
        self._closed_waiter = (backend, backend.new_waiter())
        self.closed = True
        try:
            # To its end, even when the caller is cancelled meanwhile (a task group or a
            # timeout cancelling a task in its `async with Agent()` exit): cut short, the
            # agent would stay closed with its regions never released.
            await backend.run_steps_to_end(self._close(backend))
        finally:
            backend.resolve(self._closed_waiter[1], None)

    async def _close(self, backend: Any) -> None:
        self.engine.closing()
        self.inbox.close()
        if self.listener is not None:
            await self.listener.aclose()
        for peer in list(self.peers):
            # Closed before its session ends, so its ops fail as closed, not lost.
            peer.close_links()
            peer.end_session()
            await peer.release_links()
        await self.engine.shutdown()
        peers = list(self.peers)
        self.peers.clear()
        # Unmapping GiBs takes a second: off the loop (a shm peer's free unmaps its mappings).
        try:
            await backend.run_to_end(_free, peers)
        finally:
            self.engine.free()
            await self.regions.release_all_off_loop(backend)

    def close_abandoned(self, agent: Any) -> None:
        """An agent nobody closed (collected, or open at exit): warn, then free everything, synchronously.

        Native threads stop first, so nothing touches registered memory any
        more; then the peers' native handles, then the agent's; the pinned
        buffers last, each cffi buffer before the memoryview it exports, so the
        garbage collector never clears a view that is still exported.
        """
        if self.closed:
            return
        self.closed = True
        self.inbox.closed = True
        warnings.warn(
            f"unclosed {agent!r}: close it with 'await agent.aclose()'", ResourceWarning, stacklevel=3, source=agent
        )
        engine = self.engine
        if engine.native is not None:  # else the engine was finalized first, and took its threads with it
            lib.hx_agent_shutdown(engine.native)
            for peer in list(self.peers):
                peer.free()
            try:
                engine.free()
            except Exception:  # the loop is gone: only the native side is left to free
                lib.hx_agent_free(engine.native)
                engine.native = None
        self.peers.clear()
        self.regions.release_all()


def _free(peers: list[Any]) -> None:
    for peer in peers:
        peer.free()


# The transports' slots in hx_stats, in the native order.
_STAT_TRANSPORTS = tuple(ffi.string(lib.hx_transport_name(i)).decode() for i in range(lib.HX_STATS_TRANSPORTS))
