"""Hosts as Linux network namespaces on one kernel (root only): veth pairs into a bridge.

Each ``Hosts`` is a throwaway network: a "switch" namespace holding a bridge, and one namespace
per host with an ``eth0`` into it and its own address. This process reaches every host
through one more veth (``Hosts.gateway``), so a test's client can talk to servers in them.
Everything is named ``hx<pid>x<n>...``: a set left behind by a killed run never clashes with the
next, and ``sweep()`` removes those whose process is gone. Removing the namespaces removes
their veths (a pair dies with either end), so ``close()`` is all the cleaning there is.

Used by tests/hosts (``make test-hosts``) and examples/hosts/capped_link.py.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"^hx(\d+)x\d+")
_count = itertools.count()


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def sweep() -> None:
    """Remove the namespaces of earlier runs whose process is gone (a killed test run)."""
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            ip("netns", "del", name, check=False)
    for line in ip("-o", "link", "show").stdout.splitlines():
        parts = line.split(":")
        dev = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = _NAME.match(dev)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            ip("link", "del", dev, check=False)


def _free_subnet() -> str:
    """A 10.213.N.0/24 no route of this namespace uses (another run's network, say)."""
    routes = ip("route", "show").stdout
    start = os.getpid() % 250
    for i in range(250):
        net = f"10.213.{(start + i) % 250}"
        if f"{net}." not in routes:
            return net
    raise RuntimeError("no free 10.213.N.0/24 subnet")


@dataclass
class Host:
    """One namespace: ``name`` for ``ip netns exec``, ``address`` on its eth0."""

    name: str
    address: str

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: Sequence[str], check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), check=check, capture_output=True, text=True, **kwargs)

    def python(self, *args: str, **kwargs: Any) -> subprocess.Popen:
        """This interpreter (the venv's) in the namespace."""
        return self.popen([sys.executable, *args], **kwargs)

    def nft(self, script: str) -> None:
        subprocess.run(self.argv(["nft", "-f", "-"]), input=script, check=True, capture_output=True, text=True)


class Hosts:
    """``n`` hosts on one bridge; ``partition``/``heal`` cut links (nftables), ``cap`` slows them (tbf)."""

    def __init__(self, n: int) -> None:
        self.tag = f"hx{os.getpid()}x{next(_count)}"
        self.net = _free_subnet()
        self.switch = f"{self.tag}sw"
        self.gateway = f"{self.net}.254"  # this process's address on the bridge
        self.hosts = [Host(f"{self.tag}h{i}", f"{self.net}.{i + 1}") for i in range(n)]
        self._made: list[str] = []
        self._gw_dev = f"{self.tag}gw"

    def __enter__(self) -> Hosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def _ns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)

    def _build(self) -> None:
        self._ns(self.switch)
        sw = ("-n", self.switch)
        ip(*sw, "link", "add", "br0", "type", "bridge")
        ip(*sw, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts):
            self._ns(h.name)
            ip(*sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", h.name)
            ip(*sw, "link", "set", f"p{i}", "master", "br0", "up")
            ip("-n", h.name, "addr", "add", f"{h.address}/24", "dev", "eth0")
            ip("-n", h.name, "link", "set", "eth0", "up")
            ip("-n", h.name, "link", "set", "lo", "up")
        # The gateway veth: made in the switch namespace, its far end moved here.
        ip(*sw, "link", "add", "gw", "type", "veth", "peer", "name", self._gw_dev)
        ip(*sw, "link", "set", self._gw_dev, "netns", "1")
        ip(*sw, "link", "set", "gw", "master", "br0", "up")
        ip("addr", "add", f"{self.gateway}/24", "dev", self._gw_dev)
        ip("link", "set", self._gw_dev, "up")

    def close(self) -> None:
        for name in reversed(self._made):
            ip("netns", "del", name, check=False)
        self._made.clear()
        ip("link", "del", self._gw_dev, check=False)  # gone with the switch, unless the build broke half-way

    # ---- faults ----

    def partition(self, host: Host, other: str, both_ways: bool = True, inbound: bool = False) -> None:
        """Drop, in ``host``'s namespace, what it sends to the address ``other`` (``inbound``: what
        it receives from it instead; ``both_ways``: both). Silently: no reset, no error."""
        rules = []
        if both_ways or not inbound:
            rules.append(f"add rule inet hxpart out ip daddr {other} drop")
        if both_ways or inbound:
            rules.append(f"add rule inet hxpart in ip saddr {other} drop")
        host.nft(
            "add table inet hxpart\n"
            "add chain inet hxpart in { type filter hook input priority 0; }\n"
            "add chain inet hxpart out { type filter hook output priority 0; }\n" + "\n".join(rules) + "\n"
        )

    def heal(self, host: Host) -> None:
        host.run(["nft", "delete", "table", "inet", "hxpart"], check=False)

    @contextlib.contextmanager
    def partitioned(self, host: Host, other: str, both_ways: bool = True, inbound: bool = False) -> Iterator[None]:
        self.partition(host, other, both_ways, inbound)
        try:
            yield
        finally:
            self.heal(host)

    def cap(self, rate: str | None) -> None:
        """What reaches each host (and this process) arrives at most at ``rate`` (tc's spelling:
        "1gbit", "200mbit"); None: uncapped. A tbf on each port of the bridge, towards its host."""
        ports = [f"p{i}" for i in range(len(self.hosts))] + ["gw"]
        for port in ports:
            ip("netns", "exec", self.switch, "tc", "qdisc", "del", "dev", port, "root", check=False)
            if rate is not None:
                # A burst of 1 ms at the rate (at least 64 KiB), so it holds whatever the kernel's HZ.
                tbf = ["tbf", "rate", rate, "burst", _burst(rate), "latency", "50ms"]
                ip("netns", "exec", self.switch, "tc", "qdisc", "add", "dev", port, "root", *tbf)


def _burst(rate: str) -> str:
    m = re.fullmatch(r"(\d+)([kmg]?)bit", rate)
    if m is None:
        raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 200mbit")
    bits = int(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)]
    return str(max(64 << 10, bits // 8 // 1000))
