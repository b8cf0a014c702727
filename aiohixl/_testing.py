"""Test hooks: the internal states the library's tests check, named in this one place.

Not part of the API (nothing here is exported by ``aiohixl``); it changes with the internals.
"""

from __future__ import annotations

from ._agent.core import AgentCore
from ._agent.peer_core import PeerCore
from ._control.handshake import Identity
from ._loop import backends
from ._loop.engine import Engine
from ._loop.native import ffi, lib
from .agent import Agent
from .descriptor import RegionInfo
from .memory import Region
from .peer import Peer
from .transports.base import Link, Transport

__all__ = [
    "engine",
    "forge_bell_record",
    "held_ops",
    "identity",
    "in_flight_on",
    "links",
    "live_regions",
    "notes_link",
    "peer_tracked",
    "polled",
    "ended_without_future",
    "completions_unseen",
    "region_info",
    "tracked_peers",
    "transport",
]


def engine(agent: Agent) -> Engine:
    """The agent's completion engine: ``completed``, ``unknown_completions``, ``drain()``, ``native``."""
    return _agent(agent).engine


def held_ops(agent: Agent) -> int:
    """Ops held for the burst's flush right now."""
    return engine(agent).held


def polled(op: object) -> bool:
    """Whether a put/get's awaitable is of an op whose answer its awaiting task reads itself
    (HX_POSTED_POLL) and nobody has come to read yet."""
    return type(op) is backends.PolledOp and op.state == backends.FRESH


def ended_without_future(op: object) -> bool:
    """Whether a polled op's awaiting ended with no Future made for it (its answer read by the
    awaiting task, or drained before the task had to wait)."""
    return type(op) is backends.PolledOp and op.state == backends.OK


def completions_unseen(agent: Agent) -> bool:
    """Whether a completion waits in the agent's ring with no wake-up owed for it: one a flush
    left for its caller to drain and the caller did not (the loop would never see it)."""
    return bool(lib.hx_test_ring_unseen(engine(agent).native))


def in_flight_on(agent: Agent, region: Region) -> bool:
    """Whether an op in flight keeps ``region`` (as its local end)."""
    return engine(agent).oldest_op(lambda op: any(r is region for r in op[1])) is not None


def identity(agent: Agent) -> Identity:
    """Who the agent says it is in a handshake (for tests that speak the protocol by hand)."""
    return _agent(agent).identity()


def region_info(region: Region) -> RegionInfo:
    """What a peer learns of ``region``: its descriptor, decoded."""
    return _agent(region.agent).regions.info(region)


def live_regions(agent: Agent) -> list[Region]:
    return _agent(agent).regions.live_all()


def transport(agent: Agent, name: str) -> Transport:
    """The agent's transport object ``name`` (e.g. ``"shm"``: its ``socket_name``)."""
    return _agent(agent).transports[name]


def tracked_peers(agent: Agent) -> int:
    """Peers whose native handles the agent still holds (a closed peer's go once its ops are back)."""
    return len(_agent(agent).peers)


def peer_tracked(agent: Agent, peer: Peer) -> bool:
    return _peer(peer) in _agent(agent).peers


def links(peer: Peer) -> list[Link]:
    """The peer's data links, in order of preference."""
    return _peer(peer).links


def notes_link(peer: Peer) -> Link:
    """The link the peer's notifications travel on."""
    return _peer(peer).notes


def forge_bell_record(peer: Peer, seq_skew: int, length: int, tail_step: int) -> int:
    """Write what a hostile initiator could into the target's doorbell ring (shm): a record at
    the next slot numbered ``seq_skew`` off its own, of ``length``, the tail moved ``tail_step``."""
    return int(lib.hx_test_shm_forge(_peer(peer).notes.handle, seq_skew, length, tail_step))


def answers_left_to_poster(peer: Peer) -> bool:
    """tcp: whether the answers on the way on ``peer`` are left for the task that awaits
    them to read (HX_POSTED_POLL), not its agent's I/O thread."""
    return bool(lib.hx_test_tcp_poll_owed(_peer(peer).notes.handle))


def tcp_served(agent: Agent) -> tuple[int, int]:
    """tcp: (target connections the agent's event loop reads itself now, target connections open)."""
    return tcp_serving(agent)[:2]


def tcp_serving(agent: Agent) -> tuple[int, int, int]:
    """tcp_served, and how many times the loop gave a connection back with more to read."""
    open_, back = ffi.new("int *"), ffi.new("uint64_t *")
    served = int(lib.hx_test_tcp_served(_agent(agent).engine.native, open_, back))
    return served, int(open_[0]), int(back[0])


def _agent(agent: Agent) -> AgentCore:
    return agent._core  # the one reach into an Agent


def _peer(peer: Peer) -> PeerCore:
    return peer._core  # the one reach into a Peer
