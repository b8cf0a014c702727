"""The transports, behind one interface (``base``): one module each.

Adding one: a module with a ``Transport`` and a ``Link`` subclass, listed in
``ALL``; a folder under ``_native/`` with its C side; its name in the
transport parametrization of ``tests/test_contract.py``.
"""

from __future__ import annotations

from .base import AgentView, Dial, Link, Options, Transport
from .loopback import LoopbackTransport
from .shm import ShmTransport
from .tcp import TcpTransport
from .verbs import VerbsTransport

__all__ = ["ALL", "NAMES", "Dial", "Link", "Options", "Transport", "make"]

ALL: dict[str, type[Transport]] = {
    t.name: t for t in sorted((LoopbackTransport, TcpTransport, ShmTransport, VerbsTransport), key=lambda t: t.rank)
}
NAMES = tuple(ALL)


def make(agent: AgentView, names: tuple[str, ...], options: Options) -> dict[str, Transport]:
    """The transports an agent allows, by name, in order of preference.

    Some are always made (loopback never leaves the agent; tcp carries every
    peer's native channel): ``names`` says what peers' data may use.
    """
    return {name: cls(agent, options) for name, cls in ALL.items() if name in names or cls.always}


def self_link(transports: dict[str, Transport]) -> Link | None:
    """A link from an agent to itself, when one of its transports makes such links."""
    for transport in transports.values():
        link = transport.self_link()
        if link is not None:
            return link
    return None
