"""aiohixl's exceptions: one hierarchy, each class with one exact meaning.

- ``ClosedError``: *you* closed the agent, region or peer this call used.
- ``ConnectionLost``: the *other side* went away (process died, link broke).
- ``ConnectFailed`` (a ``ConnectionLost`` and an ``OSError``): no connection
  was made at all (refused, the name does not resolve, unreachable).
- ``RegionUnavailable``: the target withdrew (closed) the region an op named.
- ``OutOfBounds`` / ``AccessDenied``: the op was refused before any byte moved.
- ``TransferTimeout``: the caller stopped waiting; the op itself may still
  complete (bytes may land later).
- ``NotificationTimeout``: ``Agent.notification(timeout=)`` saw none in time.
- ``WrongEventLoop``: a call that changes an agent came from another thread or
  event loop than the one that started it (the contract: ``Agent``'s docstring).
- Ranks (``aiohixl.init``): ``RankConflict`` (another live process holds the
  rank), ``UnknownRank`` (no such rank in the store within the timeout),
  ``StoreLost`` (the connection to the rendezvous store broke),
  ``RendezvousTimeout`` (a barrier or wait_ranks did not complete in time).
"""

from __future__ import annotations

__all__ = [
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
    "WrongEventLoop",
    "RankConflict",
    "UnknownRank",
    "StoreLost",
    "RendezvousTimeout",
]


class HixlError(Exception):
    """Base of every error aiohixl raises on purpose."""


class InvalidArgument(HixlError, ValueError):
    """An argument can never work, whatever the state of the system."""


class UnsupportedMemory(InvalidArgument, TypeError):
    """The object cannot be registered (not a buffer, not contiguous, wrong device...)."""


class LengthMismatch(InvalidArgument):
    """The two sides of a put/get have different lengths."""


class OutOfBounds(InvalidArgument, IndexError):
    """A range reaches outside its region."""


class InvalidDescriptor(InvalidArgument):
    """A region descriptor is malformed, of an unknown version, or from another agent."""


class AccessDenied(HixlError):
    """The region was not registered with the right this op needs."""


class ClosedError(HixlError):
    """The agent, region or peer was closed by this process."""


class RegionUnavailable(HixlError):
    """The target has no such region any more (it was closed or never published)."""


class ConnectionLost(HixlError):
    """The peer went away; ops outstanding on it failed.

    ``errno`` is the system's error number when one said why (e.g. ECONNREFUSED
    from Agent.connect()), else None.
    """

    errno: int | None = None


class ConnectFailed(ConnectionLost, OSError):
    """No connection could be made: nothing listens there, the host name does not
    resolve, the host or network is unreachable.

    An ``OSError`` too, with the system's ``errno`` kept (``ECONNREFUSED``...; for a
    name that does not resolve, the resolver's ``socket.EAI_*`` code, as in
    ``socket.gaierror``), and a ``ConnectionLost``: code that handles "cannot reach
    the peer" with ``except ConnectionLost`` keeps working.
    """

    errno = OSError.errno  # ConnectionLost's class-level None would hide OSError's


class ConnectTimeout(HixlError, TimeoutError):
    """Agent.connect() got no complete answer in time."""


class AuthenticationError(HixlError):
    """The peer could not prove it holds the shared token (or we could not)."""


class ProtocolError(HixlError):
    """The peer sent something this version of the protocol does not allow."""


class TransferError(HixlError):
    """A transfer failed for a reason not covered by a more precise class."""


class TransferTimeout(TransferError, TimeoutError):
    """The caller stopped waiting. The op may still complete in the background."""


class NotificationTimeout(HixlError, TimeoutError):
    """Agent.notification(timeout=...) saw no (matching) notification in time."""


class WrongEventLoop(HixlError, RuntimeError):
    """The agent was used from an event loop or thread other than the one that started it."""


class RankConflict(HixlError):
    """Another live process holds the rank this one claims in the rendezvous store."""


class UnknownRank(HixlError, LookupError):
    """The rendezvous store had no such rank (or the rank no such region) within the timeout."""


class StoreLost(ConnectionLost):
    """The connection to the rendezvous store broke (its host died, or the network)."""


class RendezvousTimeout(HixlError, TimeoutError):
    """A barrier or wait_ranks did not complete in time; the message names who is missing."""
