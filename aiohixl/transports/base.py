"""What a transport is, and the narrow views of the agent and the peer it gets.

A transport has two halves:

- ``Transport``: one per agent. Opens what the transport needs (a device),
  tells peers how to reach this agent, serves the listener's side of a
  connection (data connections, control frames of its own, side sockets), and
  on the initiator's side joins a new connection with a ``Link``.
- ``Link``: one per peer. Owns the native handle ops are posted to, decides
  whether it reaches a remote region (``reach``), and posts groups of pairs.

Neither ever sees an Agent or a Peer: they get the views below.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from .._control.handshake import Channel, HostIdentity, Identity, PeerInfo
from .._loop.engine import Engine, OpOwner
from .._loop.native import ffi, lib
from ..descriptor import RegionInfo
from ..memory import Region, RegionSlice
from ..remote import RemoteSlice

Pair = tuple[RemoteSlice, RegionSlice]
Handler = Callable[[Any], Awaitable[None] | None]


@dataclass(frozen=True)
class Options:
    """What ``Agent(...)`` says of its transports, checked there (its signature holds the
    defaults: one place)."""

    heartbeat: tuple[float, float]  # (interval, timeout), seconds
    stall_timeout: float
    busy_poll_us: int
    serve_poll_us: int
    tcp_send: str
    rdma_device: str | None
    rdma_port: int | None
    rdma_gid_index: int | None
    rdma_timeout: int
    rdma_retry_count: int


class AgentView(Protocol):
    """What a transport may use of its agent."""

    id: bytes
    name: str
    engine: Engine
    host_identity: HostIdentity

    def live_region(self, region_id: int) -> Region | None: ...

    def live_regions(self) -> Iterable[Region]: ...


class SessionView(Protocol):
    """The listener's side of one authenticated control session."""

    sid: bytes
    info: PeerInfo

    @property
    def label(self) -> str: ...

    async def send(self, frame: bytes) -> None: ...


class ListenerView(Protocol):
    """What a transport's side servers may ask of the listener."""

    address: str | None

    def session(self, sid: bytes) -> SessionView | None: ...


class ControlView(Protocol):
    """A link's view of its peer's control session."""

    @property
    def label(self) -> str: ...

    async def region_info(self, info: RegionInfo, what: str) -> RegionInfo | None:
        """The peer's own word on the region ``info`` names (its id and key), or None."""
        ...

    async def send(self, frame: bytes) -> None: ...


@dataclass
class Dial:
    """What a transport needs to join a connection the initiator is making."""

    agent: AgentView
    me: Identity
    info: PeerInfo  # the target's word on itself
    host: str
    port: int
    key: bytes
    control: Channel  # before the session starts: a transport may trade set-up frames on it
    what: str
    # Why a transport's dial() made no link, by its name (for Peer.transport_reason).
    refused: dict[str, str] = field(default_factory=dict)


class Transport:
    """One transport of one agent. Every hook has a do-nothing default."""

    name: ClassVar[str]
    # Preference on connect: the lowest usable rank carries a peer's ops.
    rank: ClassVar[int]
    # Whether this transport takes the listener's data connections (role DATA).
    takes_data_connections: ClassVar[bool] = False
    # Always made, whatever the agent allows for data: loopback (it never
    # leaves the agent) and tcp (it carries every peer's native channel).
    always: ClassVar[bool] = False
    # Makes the native channel of a peer that has none among its links (tcp).
    makes_channels: ClassVar[bool] = False

    def __init__(self, agent: AgentView, options: Options) -> None:
        self.agent = agent
        self.unavailable: str | None = None  # why this agent cannot use it; None when it can

    def open(self) -> None:
        """Acquire what the transport needs (once, at Agent.start); set ``unavailable`` if it can't."""

    def advertise(self, me: Identity) -> None:
        """Add to the identity what peers need to reach this agent."""

    def region_added(self, region: Region) -> None: ...

    def region_removed(self, region: Region) -> None: ...

    def descriptor_keys(self, region: Region) -> dict[int, bytes]:
        """Transport keys of a region that go into its descriptor."""
        return {}

    # ---- the listener's side ----

    async def serve(self, listener: ListenerView, start_soon: Callable[..., Any]) -> None:
        """Start side servers (they run in the listener's task group)."""

    async def take_data_connection(self, ch: Channel, session: SessionView) -> bool:
        """Take over an authenticated data connection; True once it owns the socket."""
        return False

    def session_handlers(self, session: SessionView) -> dict[int, Handler]:
        """Control frames of this transport that a session answers."""
        return {}

    def session_alive(self, session: SessionView) -> int:
        """For the transport that takes data connections: 1 while the session's is up,
        0 once it ended, -1 before it was made."""
        return -1

    def session_ended(self, session: SessionView) -> None: ...

    def acknowledges_withdrawal(self, info: PeerInfo) -> bool:
        """Whether a peer reaches our memory without us, so must confirm it stopped."""
        return False

    async def stop_serving(self) -> None: ...

    # ---- the initiator's side ----

    def why_not(self, info: PeerInfo) -> str | None:
        """Why this transport cannot reach the peer ``info`` describes; None when it may."""
        if self.unavailable is not None:
            return f"not here: {self.unavailable}"
        if self.name not in info.transports:
            return "the peer does not offer it"
        return None

    def self_link(self) -> Link | None:
        """A link from this agent to itself, if this transport makes those."""
        return None

    async def dial(self, dial: Dial) -> Link | None:
        """A link to the peer being connected, or None (a log line, and why in ``dial.refused``)."""
        return None


class Link:
    """One transport's path to one peer: a native handle, and the ops posted to it."""

    name: ClassVar[str]
    carries_imm: ClassVar[bool] = False  # whether put(imm=) can travel this way
    reaches_all: ClassVar[bool] = False  # reaches every region of the peer with no set-up per region
    # Can be a peer's channel: carries notifications to it and its heartbeats.
    is_channel: ClassVar[bool] = False
    # Notifications on this link follow its data in order, so need no fence.
    ordered_notes: ClassVar[bool] = False
    # post_one is Link's own (Peer's fast path calls Engine.post1 itself), not a transport's override.
    plain_post: ClassVar[bool] = True
    # A put and its message behind it go as one native op (Engine.put_note).
    put_note: ClassVar[bool] = False

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def reach(self, info: RegionInfo, control: ControlView | None, what: str) -> str | None:
        """The path name if this link reaches the region, else None. Called once per region."""
        return self.name

    async def forget(self, region_id: int) -> None:
        """The target withdrew the region: return once no op of ours touches it."""

    def post(
        self, engine: Engine, opcode: int, group: list[Pair], what: str, owner: OpOwner, imm: int | None
    ) -> list[Any]:
        """Post one group of checked pairs; the waiters of what did not finish inline."""
        if len(group) == 1:
            waiter = self.post_one(engine, opcode, *group[0], what, owner)
        else:
            waiter = engine.post(self.handle, opcode, self.pack(group), len(group), _keep(group), what, owner)
        return [] if waiter is None else [waiter]

    def post_one(self, engine: Engine, opcode: int, rs: RemoteSlice, ls: RegionSlice, what: str, owner: OpOwner) -> Any:
        """Post one checked pair; its waiter, or None when it finished inline."""
        return engine.post1(self.handle, opcode, rs, ls, what, owner)

    def pack(self, group: list[Pair]) -> Any:
        """The native scatter list of a group: local region/offset <-> remote region/offset."""
        sges = ffi.new("hx_sge[]", len(group))
        for sge, (rs, ls) in zip(sges, group, strict=True):
            sge.local_region = ls.region.id
            sge.remote_region = rs.region.id
            sge.local_off = ls.offset
            sge.remote_off = rs.offset
            sge.len = rs.nbytes
            sge.remote_key = rs.region.key
        return sges

    def take_notes(self, channel: Link) -> bool:
        """Whether this link carries its peer's notifications itself, once the ops they follow
        completed (shm's doorbell), with ``channel`` the way around when it cannot take one."""
        return False

    def note(self, engine: Engine, data: bytes, dep: int, what: str, owner: OpOwner) -> Any:
        """Post a notification (after op ``dep`` when not 0): its waiter, None when it is
        already delivered, or ``Engine.BUSY`` when the receiving queue has no room."""
        return engine.post_note(self.handle, dep, data, what, owner)

    def close(self) -> None:
        """Queued ops fail as closed; ops already moving bytes finish."""
        lib.hx_peer_close(self.handle)

    def fail(self, status: int) -> None:
        lib.hx_peer_fail(self.handle, status)

    @property
    def failed(self) -> int:
        """0 while the path works, else the status its ops now fail with."""
        return int(lib.hx_peer_status(self.handle)) if self.handle is not None else 0

    async def aclose(self) -> None:
        """Let go of what the link holds besides the native handle (sockets)."""

    def free(self) -> None:
        lib.hx_peer_free(self.handle)
        self.handle = None


def _keep(group: list[Pair]) -> tuple[Region, ...]:
    return tuple(ls.region for _, ls in group)
