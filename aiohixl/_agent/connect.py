"""Agent.connect(): the handshake, each usable transport's link, the native channel, the session."""

from __future__ import annotations

from typing import Protocol

import anyio

from .. import transports as tr
from .._control import handshake as c
from .._control import wire as w
from .._loop.engine import Engine
from .._loop.native import lib
from ..errors import ConnectFailed, ConnectionLost, ConnectTimeout, InvalidArgument
from ..transports.base import AgentView
from .peer_core import PeerCore, PeersOwner


class Connector(PeersOwner, AgentView, Protocol):
    """What connecting needs of the agent (``core.AgentCore``)."""

    engine: Engine
    transports: dict[str, tr.Transport]

    @property
    def unavailable(self) -> dict[str, str]: ...

    def open_transports(self) -> None: ...

    def identity(self) -> c.Identity: ...


async def connect(
    agent: Connector, host: str, port: int, key: bytes, timeout: float | None, wanted: tuple[str, ...], what: str
) -> PeerCore:
    """A connected peer's plumbing, its session started; whatever was half made is let go on failure."""
    agent.engine.attach(what)
    agent.open_transports()
    me = agent.identity()
    links: list[tr.Link] = []
    ch: c.Channel | None = None
    try:
        with anyio.fail_after(timeout):
            ch = c.Channel(await c.connect_tcp(host, port, what))
            info = await c.client_handshake(ch, key, w.ROLE_CONTROL, bytes(16), me, what)
            assert info is not None
            dial = tr.Dial(agent, me, info, host, port, key, ch, what)
            usable = []
            for n, t in agent.transports.items():
                why_not = t.why_not(info) if n in wanted else "not allowed"
                if why_not is None:
                    usable.append(t)
                else:
                    dial.refused[n] = why_not
            if not usable:
                why = "".join(f" ({n} here: {why})" for n, why in agent.unavailable.items() if n in wanted)
                raise InvalidArgument(
                    f"{what}: no transport in common: we allow {wanted}{why}, the peer offers {info.transports}"
                )
            for transport in usable:
                link = await transport.dial(dial)
                if link is not None:
                    links.append(link)
            if links and not any(link.is_channel for link in links):
                # Heartbeats and notifications need a native channel of their own.
                maker = next(t for t in agent.transports.values() if t.makes_channels)
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
        lost = ConnectionLost(f"{what}: the connection broke during the handshake ({exc or type(exc).__name__})")
        lost.errno = getattr(exc, "errno", None)  # e.g. the native side's refusal of a connection
        raise lost from None
    except BaseException:
        await _abandon(ch, links)
        raise
    if not links:
        await _abandon(ch, links)
        raise InvalidArgument(f"{what}: no usable transport (allowed {wanted}, peer offers {info.transports})")
    channel = next(link for link in links if link.is_channel)
    if channel is links[-1] and len(links) > 1 and channel.name not in wanted:
        links.pop()  # a channel only, not a path for data
    for link in links:
        if link is not channel and link.handle is not None and channel.handle is not None:
            # A successful RC completion proves the peer alive: it counts as heard on the
            # channel, so RDMA that fills the link leaves no live peer looking silent.
            lib.hx_peer_heard_with(link.handle, channel.handle)
    reason = transport_reason(links[0].name, dial.refused)
    peer = PeerCore(agent, links, info.agent_id, info.name, info=info, channel=channel, transport_reason=reason)
    agent.peers.add(peer)
    peer.start_session(ch)
    return peer


def transport_reason(chosen: str, refused: dict[str, str]) -> str:
    """Why ``chosen`` carries a peer's ops: what each transport preferred to it could not do."""
    passed = [f"{n}: {refused[n]}" for n in tr.NAMES[: tr.NAMES.index(chosen)] if n in refused and n != "loopback"]
    return f"{chosen} ({'; '.join(passed) if passed else 'the first choice'})"


def transport_names(transports: str | tuple[str, ...], what: str) -> tuple[str, ...]:
    if transports == "auto":
        return tr.NAMES
    if not isinstance(transports, (tuple, list)) or any(t not in tr.NAMES for t in transports):
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
