"""Raw RC peers: RDMA between an agent and a program that is not aiohixl (pyverbs, a NIC library).

Both ends trade connection facts as JSON (never pickle) by whatever means
they like; nothing else travels between them. ``Agent.export_rc`` gives a
raw peer one range of a region: a queue pair and a memory registration in a
protection domain of their own, so the peer's NIC requests reach exactly
that range with exactly the granted rights. ``Agent.rc_peer`` is the other
way: an agent's queue pair that puts into and gets from memory a raw
program registered, which grants that program no access to the agent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Union

from ._loop.native import ffi, lib, status_error
from .descriptor import RegionInfo
from .errors import AccessDenied, ClosedError, ConnectionLost, HixlError, InvalidArgument, LengthMismatch
from .memory import Access, Region, RegionSlice, parse_access
from .remote import RemoteRegion, RemoteSlice
from .transports.verbs import VerbsLink, VerbsTransport

# ``core`` below is the agent's AgentCore, typed Any: importing it would close a cycle
# (the core imports the transports, whose verbs module this one uses).
AgentCore = Any

__all__ = ["RcEndpoint", "RcExport", "RcPeer"]

_MTUS = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}  # bytes -> enum ibv_mtu


def _gid_text(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def _gid_raw(text: Any, what: str) -> bytes:
    digits = text.replace(":", "") if isinstance(text, str) else ""
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise InvalidArgument(f"{what}: gid {text!r} is not 16 bytes of hex (e.g. 0000:...:ffff:c000:0201)")
    return raw


def _facts(data: Mapping[str, Any] | str | bytes, what: str) -> Mapping[str, Any]:
    if isinstance(data, (str, bytes)):
        if len(data) > 4096:  # an endpoint is ~150 bytes; deep nesting would exhaust the parser's stack
            raise InvalidArgument(f"{what}: {len(data)} characters is no endpoint")
        try:
            data = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise InvalidArgument(f"{what}: not JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _uint(data: Mapping[str, Any], key: str, bits: int, what: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise InvalidArgument(f"{what}: {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << bits:
        raise InvalidArgument(f"{what}: {key}={value!r} is not a {bits}-bit unsigned integer")
    return value


@dataclass(frozen=True)
class RcEndpoint:
    """One end of an RC connection, as the other end needs it to move its QP to RTR.

    ``gid`` as 8 colon-separated groups of 4 hex digits (as sysfs and
    ``ibv_devinfo -v`` print it), ``mtu`` in bytes (256-4096; the path uses
    the smaller of the two ends'), ``lid`` 0 on RoCE.
    """

    gid: str
    qpn: int
    psn: int
    lid: int = 0
    mtu: int = 1024

    @classmethod
    def parse(cls, data: RcEndpoint | Mapping[str, Any] | str | bytes, what: str = "RcEndpoint") -> RcEndpoint:
        """From a JSON object (text or already decoded); extra keys are ignored."""
        if isinstance(data, RcEndpoint):
            return data
        d = _facts(data, what)
        mtu = _uint(d, "mtu", 16, what, 1024)
        if mtu not in _MTUS:
            raise InvalidArgument(f"{what}: mtu={mtu} is not one of {sorted(_MTUS)}")
        gid = _gid_text(_gid_raw(d.get("gid"), what))
        return cls(gid, _uint(d, "qpn", 24, what), _uint(d, "psn", 24, what), _uint(d, "lid", 16, what, 0), mtu)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def _native(self) -> tuple[int, int, bytes, int, int]:
        return self.qpn, self.psn, _gid_raw(self.gid, "RcEndpoint"), self.lid, _MTUS[self.mtu]


def _local_end(verbs: VerbsTransport, qpn: int, psn: int) -> RcEndpoint:
    gid, lid, mtu = verbs._local()
    return RcEndpoint(_gid_text(gid), qpn, psn, lid, 128 << mtu)


def _verbs(core: AgentCore, what: str) -> VerbsTransport:
    core.check_open(what)
    verbs = core.transports.get("verbs")
    if not isinstance(verbs, VerbsTransport) or verbs.device is None:
        why = "not among this agent's transports" if verbs is None else verbs.unavailable
        raise InvalidArgument(f"{what}: needs the verbs transport, which is unavailable: {why}")
    return verbs


class RcExport:
    """A range of a region exported to one raw RC peer (``Agent.export_rc``).

    ``info()`` is what that peer needs: this end's {gid, qpn, psn, lid, mtu}
    and the range's {addr, rkey, length} (and ``access``). ``connect()`` takes
    the peer's {gid, qpn, psn[, lid, mtu]}. WRITE WITH IMM from the peer
    reaches ``agent.notification()`` (``.imm`` set, ``peer`` the label). The
    export ends with ``close()``, or with its region or agent: then its rkey
    and queue pair are gone and the peer's next access fails on its side.
    """

    def __init__(self, core: AgentCore, target: Region | RegionSlice, access: Access, label: str) -> None:
        what = "Agent.export_rc"
        verbs = _verbs(core, what)
        ls = target.as_slice() if isinstance(target, Region) else target
        region = ls.region
        region.check_open(what)
        if region.agent is not core.agent:
            raise InvalidArgument(f"{what}: region {region.label()} belongs to another agent")
        if not access or int(access) & ~int(region.access):
            raise AccessDenied(
                f"{what}: access {access!r} is not a non-empty part of region {region.label()}'s {region.access!r}"
            )
        if not ls.nbytes:
            raise InvalidArgument(f"{what}: an empty range cannot be exported")
        sid = os.urandom(16)
        self._session = int.from_bytes(sid[:8], "little")
        qpn, psn = ffi.new("uint32_t *"), ffi.new("uint32_t *")
        addr, rkey = ffi.new("uint64_t *"), ffi.new("uint32_t *")
        native = core.engine.native
        rc = lib.hx_verbs_export_new(
            native, self._session, region.id, ls.offset, ls.nbytes, int(access), qpn, psn, addr, rkey
        )
        if rc != 0:
            raise _failed(rc, what)
        core._on_session(sid, label, bytes(16))  # names WRITE WITH IMM's notifications
        self._core, self._verbs, self.region, self.access, self.label = core, verbs, region, access, label
        self.endpoint = _local_end(verbs, qpn[0], psn[0])
        self.addr, self.rkey, self.length = int(addr[0]), int(rkey[0]), ls.nbytes
        self.peer: RcEndpoint | None = None
        self.closed = False
        verbs.exports.setdefault(region.id, set()).add(self)

    def info(self) -> dict[str, Any]:
        """What the raw peer needs: {gid, qpn, psn, lid, mtu, addr, rkey, length, access ("rw", "r", "w")}."""
        return {
            **asdict(self.endpoint),
            "addr": self.addr,
            "rkey": self.rkey,
            "length": self.length,
            "access": ("r" if self.access & Access.REMOTE_READ else "")
            + ("w" if self.access & Access.REMOTE_WRITE else ""),
        }

    def to_json(self) -> str:
        return json.dumps(self.info())

    def connect(self, peer: RcEndpoint | Mapping[str, Any] | str | bytes) -> None:
        """Move this end's queue pair to RTS toward the raw peer's QP (once)."""
        what = "RcExport.connect"
        end = RcEndpoint.parse(peer, what)
        if self.closed:
            raise ClosedError(f"{what}: the export of {self.region.label()} is closed")
        if self.peer is not None:
            raise InvalidArgument(f"{what}: already connected (an RC queue pair has one peer)")
        rc = lib.hx_verbs_export_connect(self._core.engine.native, self._session, *end._native())
        if rc != 0:
            raise _failed(rc, what)
        self.peer = end

    def close(self) -> None:
        """Drop the queue pair and the registration: the rkey no longer works."""
        if self.closed:
            return
        self.closed = True
        self._verbs.exports.get(self.region.id, set()).discard(self)
        if not self._core.closed:  # else the agent's device went, and this with it
            lib.hx_verbs_drop_session(self._core.engine.native, self._session)

    def __enter__(self) -> RcExport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "connected" if self.peer else "waiting"
        return f"<RcExport {self.region.label()} {self.length} bytes {self.info()['access']} {state}>"


RemoteRef = Union[RemoteRegion, RemoteSlice]
LocalRef = Union[Region, RegionSlice]


class RcPeer:
    """An agent's queue pair toward a raw RC program (``Agent.rc_peer``).

    ``endpoint`` goes to that program; ``connect()`` takes its
    {gid, qpn, psn[, lid, mtu]}, ``region()`` a range it registered,
    {addr, rkey, length[, access]}; then ``put``/``get`` are RDMA WRITE/READ,
    checked here for lengths and the claimed rights and by the remote NIC
    for the rest. Any op error breaks the queue pair (``broken``); make a
    new RcPeer. The remote end gets no access to this agent's memory.
    """

    def __init__(self, core: AgentCore) -> None:
        what = "Agent.rc_peer"
        verbs = _verbs(core, what)
        qpn, psn, status = ffi.new("uint32_t *"), ffi.new("uint32_t *"), ffi.new("int *")
        handle = lib.hx_verbs_raw_peer_new(core.engine.native, qpn, psn, status)
        if handle == ffi.NULL:
            raise _failed(status[0], what)
        self._core, self._engine = core, core.engine
        self._link: VerbsLink = VerbsLink(handle)
        self._id = os.urandom(16)  # what its RemoteRegions name as their agent
        self._next_region = 1
        self.endpoint = _local_end(verbs, qpn[0], psn[0])
        self.peer: RcEndpoint | None = None
        self.broken: HixlError | None = None
        self.closed = False

    def connect(self, peer: RcEndpoint | Mapping[str, Any] | str | bytes) -> None:
        what = "RcPeer.connect"
        end = RcEndpoint.parse(peer, what)
        self._check_open(what)
        if self.peer is not None:
            raise InvalidArgument(f"{what}: already connected (an RC queue pair has one peer)")
        if lib.hx_verbs_peer_connect(self._link.handle, *end._native()) != 0:
            raise _failed(lib.HX_E_SYS, what)
        self.peer = end

    def region(self, data: Mapping[str, Any] | str | bytes) -> RemoteRegion:
        """A range the raw program registered: {addr, rkey, length} and optionally
        ``access`` ("rw", "r", "w": what it granted; default "rw", its NIC decides)."""
        what = "RcPeer.region"
        d = _facts(data, what)
        addr, rkey, length = _uint(d, "addr", 64, what), _uint(d, "rkey", 32, what), _uint(d, "length", 64, what)
        access = parse_access(d.get("access", "rw"), what) or Access.NONE
        if addr + length > 1 << 64:
            raise InvalidArgument(f"{what}: addr + length wraps past 2**64")
        rid, self._next_region = self._next_region, self._next_region + 1
        self._link._rkeys[rid] = rkey
        return RemoteRegion(RegionInfo(self._id, rid, length, addr, access, "cpu", None))

    async def put(self, remote: RemoteRef, local: LocalRef, *, imm: int | None = None) -> None:
        """RDMA WRITE of ``local`` into ``remote`` (WRITE WITH IMM when ``imm`` is given)."""
        if imm is not None and not 0 <= imm <= 0xFFFFFFFF:
            raise InvalidArgument(f"RcPeer.put: imm={imm} is not a 32-bit unsigned value")
        await self._op(int(lib.HX_OP_PUT), remote, local, imm, "RcPeer.put")

    async def get(self, local: LocalRef, remote: RemoteRef) -> None:
        """RDMA READ of ``remote`` into ``local``."""
        await self._op(int(lib.HX_OP_GET), remote, local, None, "RcPeer.get")

    async def _op(self, opcode: int, remote: Any, local: Any, imm: int | None, what: str) -> None:
        self._check_open(what)
        if self.peer is None:
            raise InvalidArgument(f"{what}: connect() first")
        rs = remote.as_slice() if isinstance(remote, RemoteRegion) else remote
        if not isinstance(rs, RemoteSlice) or rs.region.agent_id != self._id:
            raise InvalidArgument(f"{what}: remote must be a region from this RcPeer's region(), or a slice of one")
        ls = local.as_slice() if isinstance(local, Region) else local
        if not isinstance(ls, RegionSlice) or ls.region.agent is not self._core.agent:
            raise InvalidArgument(f"{what}: local must be a Region of this agent, or a slice of one")
        ls.region.check_open(what)
        if rs.nbytes != ls.nbytes:
            raise LengthMismatch(f"{what}: remote range is {rs.nbytes} bytes, local range is {ls.nbytes} bytes")
        put = opcode == lib.HX_OP_PUT
        need = Access.REMOTE_WRITE if put else Access.REMOTE_READ
        if not rs.region.rights & need:
            raise AccessDenied(f"{what}: the raw peer granted this range no {need.name}")
        if not put and ls.region.readonly:
            raise AccessDenied(f"{what}: local region {ls.region.label()} is read-only")
        if not rs.nbytes:
            return
        engine = self._engine
        engine.attach(what)
        if engine.full:
            await engine.admit(what)
            self._check_open(what)
        waiters = self._link.post(engine, opcode, [(rs, ls)], what, self, imm)
        await engine.wait_all(waiters, None, what)

    def op_failed(self, exc: BaseException) -> None:
        """The engine's word that an op failed: an RC queue pair in error stays so."""
        if self.broken is None:
            self.broken = ConnectionLost(f"RcPeer: the queue pair broke: {exc}")

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ClosedError(f"{what}: this RcPeer is closed")
        self._core.check_open(what)
        if self.broken is not None:
            raise ConnectionLost(f"{what}: {self.broken}")

    async def aclose(self) -> None:
        """Close the queue pair: ops still queued fail with ClosedError, those moving bytes end first."""
        if self.closed:
            return
        self.closed = True
        core = self._core
        if core.closed:
            return  # the agent freed its queue pairs, this one too
        self._link.close()
        engine = self._engine
        backend = engine.attach("RcPeer.aclose")
        waiter = backend.new_waiter()
        engine.when_none(lambda op: op[3] is self, partial(backend.resolve, waiter, None))
        await backend.wait(waiter)
        if not core.closed:
            self._link.free()

    async def __aenter__(self) -> RcPeer:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<RcPeer qpn {self.endpoint.qpn} {'connected' if self.peer else 'waiting'}>"


def _failed(status: int, what: str) -> BaseException:
    if status == lib.HX_E_SYS:  # the verbs call says why
        return OSError(f"{what}: {ffi.string(lib.hx_verbs_error()).decode(errors='replace')}")
    return status_error(status, what)
