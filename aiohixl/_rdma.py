"""Choosing an RDMA device, port and GID.

Defaults: the first device with an ACTIVE port, its first active port, and a
RoCE v2 GID holding an IPv4-mapped address when there is one (it routes over
IP), else GID index 0 (InfiniBand). Each can be fixed by an Agent argument or
by AIOHIXL_RDMA_DEVICE, AIOHIXL_RDMA_PORT, AIOHIXL_RDMA_GID_INDEX.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._files import read_text

SYSFS = "/sys/class/infiniband"


@dataclass(frozen=True)
class RdmaChoice:
    device: str
    port: int
    gid_index: int
    gid: str
    gid_type: str




def _active(device: str, port: int) -> bool:
    return "ACTIVE" in read_text(f"{SYSFS}/{device}/ports/{port}/state")


def _gids(device: str, port: int) -> list[tuple[int, str, str]]:
    out = []
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
        ports = sorted(int(p) for p in os.listdir(f"{SYSFS}/{dev}/ports")) if os.path.isdir(f"{SYSFS}/{dev}/ports") else []
        for p in [port] if port is not None else ports:
            if not _active(dev, p):
                continue
            gids = _gids(dev, p)
            if gid_index is not None:
                match = [g for g in gids if g[0] == gid_index]
                gid, gtype = (match[0][1], match[0][2]) if match else ("", "")
                return RdmaChoice(dev, p, gid_index, gid, gtype)
            best = sorted(
                gids, key=lambda g: (not ("v2" in g[2] and _ipv4_mapped(g[1])), "v2" not in g[2], g[0])
            )
            if best:
                return RdmaChoice(dev, p, best[0][0], best[0][1], best[0][2])
            return RdmaChoice(dev, p, 0, "", "")
    where = f"device {device!r}" if device else "any device"
    raise ValueError(f"no ACTIVE port on {where}" + (f" (port {port})" if port is not None else ""))
