"""verbs: RDMA over RC queue pairs (libibverbs), the hardware path.

Every region is registered with the device (its rkey travels in the
descriptor); each peer gets an RC queue pair, set up by trading QP facts over
the control connection before its session starts. A put is an RDMA WRITE (or
WRITE WITH IMM), a get an RDMA READ; the target's CPU does nothing.

Device choice: the first device with an ACTIVE port, its first active port,
and a RoCE v2 GID holding an IPv4-mapped address when there is one (it routes
over IP), else GID index 0 (InfiniBand). Each can be fixed by an Agent
argument or by AIOHIXL_RDMA_DEVICE, AIOHIXL_RDMA_PORT, AIOHIXL_RDMA_GID_INDEX.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from .._control import handshake as c
from .._control import wire as w
from .._files import read_text
from .._loop.native import ffi, lib
from ..descriptor import RegionInfo
from ..errors import ProtocolError
from ..memory import Region
from .base import AgentView, ControlView, Dial, Handler, Link, Options, Pair, SessionView, Transport
from .tcp import session_key

KEY_RKEY = 1  # descriptor key: the verbs rkey of the region (u32 little endian)
_CHAIN = 128  # pairs per work-request chain; the send queue holds 512 WRs


def qp_info(wr: w.Writer, qpn: int, psn: int, gid: bytes, lid: int, mtu: int) -> w.Writer:
    """The queue pair facts two sides trade to connect RC QPs (frames VERBS_QP, VERBS_QP_OK)."""
    return wr.u32(qpn).u32(psn).raw(gid).u16(lid).u8(mtu)


def read_qp_info(r: w.Reader) -> tuple[int, int, bytes, int, int]:
    return r.u32(), r.u32(), r.raw(16), r.u16(), r.u8()


class Export(Protocol):
    """A range exported to a raw RC peer (aiohixl.rc.RcExport)."""

    def close(self) -> None: ...


def _error() -> str:
    return str(ffi.string(lib.hx_verbs_error()).decode(errors="replace"))


class VerbsLink(Link):
    name = "verbs"
    carries_imm = True
    ordered_notes = True  # a SEND on the same queue pair, behind the writes
    plain_post = False  # its own post_one: rkeys and addresses, not regions and offsets

    def __init__(self, handle: Any) -> None:
        super().__init__(handle)
        self._rkeys: dict[int, int] = {}

    async def reach(self, info: RegionInfo, control: ControlView | None, what: str) -> str | None:
        key = info.keys.get(KEY_RKEY, b"")
        if len(key) != 4:
            return None  # the owner registered it with no device
        self._rkeys[info.region_id] = int.from_bytes(key, "little")
        return self.name

    def post_one(self, engine: Any, opcode: int, rs: Any, ls: Any, what: str, owner: Any) -> Any:
        waiters = self.post(engine, opcode, [(rs, ls)], what, owner, None)
        return waiters[0] if waiters else None

    def post(self, engine: Any, opcode: int, group: list[Pair], what: str, owner: Any, imm: int | None) -> list[Any]:
        """One WR chain per 128 pairs, in order; ``imm`` rides on the very last write."""
        waiters = []
        for start in range(0, len(group), _CHAIN):
            chunk = group[start : start + _CHAIN]
            sges = ffi.new("hx_sge[]", len(chunk))
            for sge, (rs, ls) in zip(sges, chunk, strict=True):
                sge.local_region = ls.region.id
                sge.local_off = ls.offset
                sge.len = rs.nbytes
                # The remote NIC checks the rkey and the virtual address itself.
                sge.rkey = self._rkeys[rs.region.id]
                sge.raddr = rs.region.info.address + rs.offset
            keep = tuple(ls.region for _, ls in chunk)
            n = len(chunk)
            if imm is not None and start + n >= len(group):
                waiter = engine.post_with(
                    lambda op_id, s=sges, k=n: lib.hx_verbs_post_imm(self.handle, op_id, s, k, imm), keep, what, owner
                )
            else:
                waiter = engine.post(self.handle, opcode, sges, n, keep, what, owner)
            if waiter is not None:
                waiters.append(waiter)
        return waiters


@dataclass(frozen=True)
class RdmaChoice:
    device: str
    port: int
    gid_index: int
    gid: str
    gid_type: str


class VerbsTransport(Transport):
    name = "verbs"
    rank = 2

    def __init__(self, agent: AgentView, options: Options) -> None:
        super().__init__(agent, options)
        o = options
        self._args = (o.rdma_device, o.rdma_port, o.rdma_gid_index, o.rdma_timeout, o.rdma_retry_count)
        self.device: RdmaChoice | None = None
        self._rkeys: dict[int, int] = {}
        self.exports: dict[int, set[Export]] = {}  # by region id: closed with their region
        self.unavailable = "not opened yet"

    def open(self) -> None:
        if self.device is not None or self.unavailable != "not opened yet":
            return
        device, port, gid_index, timeout, retries = self._args
        try:
            choice = choose(device, port, gid_index)
        except ValueError as exc:
            self.unavailable = str(exc)
            return
        native = self.agent.engine.native
        if lib.hx_verbs_open(native, choice.device.encode(), choice.port, choice.gid_index, timeout, retries) != 0:
            self.unavailable = _error()
            c.log.info("aiohixl %s: verbs unavailable: %s", self.agent.name, self.unavailable)
            return
        self.device = choice
        self.unavailable = None
        for region in self.agent.live_regions():
            self.region_added(region)

    def region_added(self, region: Region) -> None:
        if self.device is None:
            return
        rkey = ffi.new("uint32_t *")
        if lib.hx_verbs_reg(self.agent.engine.native, region.id, 1 if region.readonly else 0, rkey) == 0:
            self._rkeys[region.id] = rkey[0]
        else:
            c.log.warning(
                "aiohixl %s: region %s not registered with the RDMA device: %s",
                self.agent.name,
                region.label(),
                _error(),
            )

    def region_removed(self, region: Region) -> None:
        self._rkeys.pop(region.id, None)
        for export in list(self.exports.pop(region.id, ())):
            export.close()  # before its memory goes: the raw peer's NIC can reach it no more

    def descriptor_keys(self, region: Region) -> dict[int, bytes]:
        rkey = self._rkeys.get(region.id)
        return {} if rkey is None else {KEY_RKEY: rkey.to_bytes(4, "little")}

    # ---- the listener's side ----

    def session_handlers(self, session: SessionView) -> dict[int, Handler]:
        async def on_qp(r: w.Reader) -> None:
            qpn, psn, gid, lid, mtu = read_qp_info(r)
            r.end()
            reply = w.Writer()
            native = self.agent.engine.native
            if self.device is None:
                await session.send(reply.u8(1).frame(w.VERBS_QP_OK))
                return
            lqpn, lpsn = ffi.new("uint32_t *"), ffi.new("uint32_t *")
            rc = lib.hx_verbs_accept(native, session_key(session.sid), qpn, psn, gid, lid, mtu, lqpn, lpsn)
            if rc != 0:
                c.log.warning("aiohixl %s: no queue pair for %s: %s", self.agent.name, session.label, _error())
                await session.send(reply.u8(1).frame(w.VERBS_QP_OK))
                return
            qp_info(reply.u8(0), lqpn[0], lpsn[0], *self._local())
            await session.send(reply.frame(w.VERBS_QP_OK))

        return {w.VERBS_QP: on_qp}

    def session_ended(self, session: SessionView) -> None:
        native = self.agent.engine.native
        if native is not None:  # else the agent is gone, and its queue pairs with it
            lib.hx_verbs_drop_session(native, session_key(session.sid))

    def _local(self) -> tuple[bytes, int, int]:
        gid, lid, mtu = ffi.new("uint8_t[16]"), ffi.new("uint16_t *"), ffi.new("int *")
        lib.hx_verbs_local(self.agent.engine.native, gid, lid, mtu)
        return bytes(gid), lid[0], mtu[0]

    # ---- the initiator's side ----

    async def dial(self, dial: Dial) -> VerbsLink | None:
        """Create our RC QP, trade QP facts with the target over the control channel, connect."""
        what, ch = dial.what, dial.control
        qpn, psn, status = ffi.new("uint32_t *"), ffi.new("uint32_t *"), ffi.new("int *")
        handle = lib.hx_verbs_peer_new(self.agent.engine.native, qpn, psn, status)
        if handle == ffi.NULL:
            c.log.warning("aiohixl %s: no queue pair: %s", what, _error())
            return None
        link = VerbsLink(handle)
        try:
            await ch.send(qp_info(w.Writer(), qpn[0], psn[0], *self._local()).frame(w.VERBS_QP))
            while True:  # the target's session may ping meanwhile
                ftype, r = await ch.recv(w.MAX_FRAME)
                if ftype == w.PING:
                    continue
                if ftype != w.VERBS_QP_OK:
                    raise ProtocolError(f"{what}: expected VERBS_QP_OK, got {w.NAMES[ftype]}")
                break
            if r.u8() != 0:
                r.end()
                c.log.warning("aiohixl %s: the peer could not make a queue pair; not using verbs", what)
                link.free()
                return None
            rqpn, rpsn, rgid, rlid, rmtu = read_qp_info(r)
            r.end()
        except BaseException:
            link.free()
            raise
        if lib.hx_verbs_peer_connect(handle, rqpn, rpsn, rgid, rlid, rmtu) != 0:
            c.log.warning("aiohixl %s: connecting the queue pair failed: %s", what, _error())
            link.free()
            return None
        return link


SYSFS = "/sys/class/infiniband"


def _active(device: str, port: int) -> bool:
    return "ACTIVE" in read_text(f"{SYSFS}/{device}/ports/{port}/state")


def _gids(device: str, port: int) -> list[tuple[int, str, str]]:
    out: list[tuple[int, str, str]] = []
    base = f"{SYSFS}/{device}/ports/{port}"
    try:
        names = os.listdir(f"{base}/gids")
    except OSError:
        return out
    for name in sorted(names, key=int):
        gid = read_text(f"{base}/gids/{name}")
        if not gid or gid.replace("0", "").replace(":", "") == "":
            continue
        out.append((int(name), gid, read_text(f"{base}/gid_attrs/types/{name}")))
    return out


def _ipv4_mapped(gid: str) -> bool:
    return gid.lower().startswith("0000:0000:0000:0000:0000:ffff:")


def choose(device: str | None = None, port: int | None = None, gid_index: int | None = None) -> RdmaChoice:
    """The device/port/GID to use, or ValueError saying why there is none."""
    device = device or os.environ.get("AIOHIXL_RDMA_DEVICE") or None
    if port is None and os.environ.get("AIOHIXL_RDMA_PORT"):
        port = int(os.environ["AIOHIXL_RDMA_PORT"])
    if gid_index is None and os.environ.get("AIOHIXL_RDMA_GID_INDEX"):
        gid_index = int(os.environ["AIOHIXL_RDMA_GID_INDEX"])
    try:
        devices = sorted(os.listdir(SYSFS))
    except OSError:
        devices = []
    if not devices:
        raise ValueError("no RDMA device (/sys/class/infiniband is empty)")
    if device is not None and device not in devices:
        raise ValueError(f"no RDMA device named {device!r} (have {', '.join(devices)})")
    for dev in [device] if device else devices:
        ports = (
            sorted(int(p) for p in os.listdir(f"{SYSFS}/{dev}/ports")) if os.path.isdir(f"{SYSFS}/{dev}/ports") else []
        )
        for p in [port] if port is not None else ports:
            if not _active(dev, p):
                continue
            gids = _gids(dev, p)
            if gid_index is not None:
                match = [g for g in gids if g[0] == gid_index]
                gid, gtype = (match[0][1], match[0][2]) if match else ("", "")
                return RdmaChoice(dev, p, gid_index, gid, gtype)
            best = sorted(gids, key=lambda g: (not ("v2" in g[2] and _ipv4_mapped(g[1])), "v2" not in g[2], g[0]))
            if best:
                return RdmaChoice(dev, p, best[0][0], best[0][1], best[0][2])
            return RdmaChoice(dev, p, 0, "", "")
    where = f"device {device!r}" if device else "any device"
    raise ValueError(f"no ACTIVE port on {where}" + (f" (port {port})" if port is not None else ""))
