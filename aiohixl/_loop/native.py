"""The cffi module and the translation of native status codes into exceptions."""

from __future__ import annotations

import os

from .. import errors
from .._hixl import ffi, lib

__all__ = ["ffi", "lib", "check", "status_error"]

_STATUS = {
    lib.HX_E_BOUNDS: (errors.OutOfBounds, "range outside the region"),
    lib.HX_E_ACCESS: (errors.AccessDenied, "region not registered with the right this op needs"),
    lib.HX_E_NOREGION: (errors.RegionUnavailable, "no such region (closed or never registered)"),
    lib.HX_E_CLOSED: (errors.ClosedError, "closed while the op was in flight"),
    lib.HX_E_CONNLOST: (errors.ConnectionLost, "connection to the peer lost"),
    lib.HX_E_PROTO: (errors.ProtocolError, "malformed message from the peer"),
    lib.HX_E_NOMEM: (MemoryError, "out of memory"),
    lib.HX_E_BUSY: (errors.HixlError, "region busy"),
    lib.HX_E_INVAL: (
        errors.InvalidArgument,
        "invalid argument (e.g. destinations overlapping sources of one submission)",
    ),
    lib.HX_E_SYS: (OSError, "system call failed"),
    lib.HX_E_REMOTE: (errors.TransferError, "the target refused the op"),
    lib.HX_E_SILENT: (errors.ConnectionLost, "the peer went silent (no heartbeat within the heartbeat timeout)"),
}


def status_error(status: int, what: str, sys_errno: int | None = None) -> BaseException:
    """The exception for a native status, its message naming the call ``what``.

    An ``HX_E_SYS`` carries the errno of the failure: ``sys_errno`` for a completion (taken
    on the native thread that saw it fail), else the errno of the call just made.
    """
    cls, text = _STATUS.get(status, (errors.TransferError, f"native status {status}"))
    if cls is OSError:
        err = ffi.errno if sys_errno is None else sys_errno
        return OSError(err, f"{what}: {os.strerror(err)}") if err else OSError(f"{what}: {text}")
    return cls(f"{what}: {text}")


def check(status: int, what: str) -> int:
    if status < 0:
        raise status_error(status, what)
    return status
