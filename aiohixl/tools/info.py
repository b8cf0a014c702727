"""What this machine offers aiohixl: ``python -m aiohixl info``."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass

from .. import __version__
from .._control.handshake import HostIdentity
from .._files import read_text

_IB_SYSFS = "/sys/class/infiniband"


@dataclass
class TransportStatus:
    name: str
    available: bool
    detail: str


def rdma_devices() -> list[tuple[str, list[str]]]:
    """``(device, ["port 1: ACTIVE (RoCE)", ...])`` for each RDMA device the kernel shows."""
    out: list[tuple[str, list[str]]] = []
    try:
        names = sorted(os.listdir(_IB_SYSFS))
    except OSError:
        return out
    for dev in names:
        ports = []
        pdir = os.path.join(_IB_SYSFS, dev, "ports")
        for port in sorted(os.listdir(pdir), key=int) if os.path.isdir(pdir) else []:
            state = read_text(os.path.join(pdir, port, "state")).partition(":")[2].strip() or "?"
            layer = read_text(os.path.join(pdir, port, "link_layer")) or "?"
            ports.append(f"port {port}: {state} ({layer})")
        out.append((dev, ports))
    return out


def _shm_status() -> TransportStatus:
    if not hasattr(os, "memfd_create"):
        return TransportStatus("shm", False, "no memfd_create on this system")
    scope = read_text("/proc/sys/kernel/yama/ptrace_scope")
    cma = {
        "": "cross-memory attach allowed (no Yama)",
        "0": "cross-memory attach allowed (ptrace_scope 0)",
        "1": "cross-memory attach only to descendants (ptrace_scope 1): user memory goes over tcp",
    }.get(scope, f"cross-memory attach restricted (ptrace_scope {scope}): user memory goes over tcp")
    return TransportStatus("shm", True, f"same host and network namespace: memfd regions mapped; {cma}")


def _verbs_status() -> TransportStatus:
    from .._loop.native import lib as native

    if not native.hx_verbs_built():
        return TransportStatus("verbs", False, "built without rdma-core headers (install libibverbs-dev, reinstall)")
    if ctypes.util.find_library("ibverbs") is None:
        return TransportStatus("verbs", False, "libibverbs not installed (apt install libibverbs1 ibverbs-providers)")
    from ..transports import verbs

    try:
        choice = verbs.choose()
    except ValueError as exc:
        return TransportStatus("verbs", False, str(exc))
    return TransportStatus(
        "verbs",
        True,
        f"{choice.device} port {choice.port} GID[{choice.gid_index}] {choice.gid} {choice.gid_type}".strip(),
    )


def transports() -> list[TransportStatus]:
    result = [
        TransportStatus("loopback", True, "ops between regions of one agent"),
        TransportStatus("tcp", True, "any two hosts; native epoll I/O thread"),
        _shm_status(),
    ]
    result.append(_verbs_status())
    return result


def render() -> str:
    lines = [f"aiohixl {__version__}", "", "transports:"]
    for t in transports():
        mark = "yes" if t.available else "no "
        lines.append(f"  {t.name:<9} {mark}  {t.detail}")
    me = HostIdentity.local()
    lines += [
        "",
        "this host (agents share memory only with the same host, boot and network namespace; else tcp):",
        f"  host       {me.host}",
        f"  boot       {me.boot or '?'}",
        f"  namespaces {me.ns}",
    ]
    lines += ["", "RDMA devices:"]
    devices = rdma_devices()
    if not devices:
        lines.append("  none")
    for dev, ports in devices:
        lines.append(f"  {dev}: " + ("; ".join(ports) or "no ports"))
    return "\n".join(lines)
