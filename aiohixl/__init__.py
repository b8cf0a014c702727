"""aiohixl: one-sided, zero-copy put/get between processes and hosts, for asyncio and trio."""

from .agent import Agent
from .errors import (
    AccessDenied,
    AuthenticationError,
    ClosedError,
    ConnectFailed,
    ConnectionLost,
    ConnectTimeout,
    HixlError,
    InvalidArgument,
    InvalidDescriptor,
    LengthMismatch,
    NotificationTimeout,
    OutOfBounds,
    ProtocolError,
    RankConflict,
    RegionUnavailable,
    RendezvousTimeout,
    StoreLost,
    TransferError,
    TransferTimeout,
    UnknownRank,
    UnsupportedMemory,
    WrongEventLoop,
)
from .memory import Access, Region, RegionSlice
from .notifications import Notification
from .peer import Peer
from .ranks import Context, get, get_remote_mem, init, put
from .rc import RcEndpoint, RcExport, RcPeer
from .remote import RemoteRegion, RemoteSlice

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "Access",
    "Region",
    "RegionSlice",
    "RemoteRegion",
    "RemoteSlice",
    "Peer",
    "RcEndpoint",
    "RcExport",
    "RcPeer",
    "HixlError",
    "InvalidArgument",
    "UnsupportedMemory",
    "LengthMismatch",
    "OutOfBounds",
    "InvalidDescriptor",
    "AccessDenied",
    "ClosedError",
    "RegionUnavailable",
    "ConnectionLost",
    "ConnectFailed",
    "ConnectTimeout",
    "AuthenticationError",
    "ProtocolError",
    "TransferError",
    "TransferTimeout",
    "NotificationTimeout",
    "Notification",
    "WrongEventLoop",
    "RankConflict",
    "UnknownRank",
    "StoreLost",
    "RendezvousTimeout",
    "init",
    "get_remote_mem",
    "put",
    "get",
    "Context",
    "__version__",
]
