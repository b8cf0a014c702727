"""loopback: ops between regions of one agent, copied by its own native threads."""

from __future__ import annotations

from .._control.handshake import PeerInfo
from .._loop.native import check, ffi, lib
from .base import Link, Transport


class LoopbackLink(Link):
    """Its notifications are queued in this very agent."""

    reaches_all = True
    is_channel = True
    name = "loopback"


class LoopbackTransport(Transport):
    name = "loopback"
    rank = 0
    always = True

    def why_not(self, info: PeerInfo) -> str | None:
        return "only within one agent"

    def self_link(self) -> LoopbackLink:
        status = ffi.new("int *")
        handle = lib.hx_loopback_new(self.agent.engine.native, status)
        if handle == ffi.NULL:
            check(status[0], "Agent.loopback")
        return LoopbackLink(handle)
