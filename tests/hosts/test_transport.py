"""Agents in different network namespaces of one kernel talk tcp, and say why not shm."""

from __future__ import annotations

import subprocess
import sys

import aiohixl
from tests.harness import Target, pattern, sha

TOKEN = "hosts-tier-token"
SIZE = 1 << 20


async def start(host) -> Target:
    return await Target.start(listen=f"{host.address}:0", token=TOKEN, prefix=tuple(host.argv([])))


async def test_another_namespace_is_reached_over_tcp_and_says_why(hosts):
    a = await start(hosts[0])
    try:
        await a.alloc("dst", SIZE, seed=1)
        async with aiohixl.Agent("gw", token=TOKEN) as me:
            peer = await me.connect(a.address)
            assert peer.transport == "tcp", peer.transport_reason
            assert "another network namespace" in peer.transport_reason, peer.transport_reason
            src = me.register(pattern(SIZE, 2))
            await peer.put(await peer.region("dst"), src)
            assert await peer.path(await peer.region("dst")) == "tcp"
        assert await a.hash("dst", 0, SIZE) == sha(pattern(SIZE, 2))
    finally:
        await a.aclose()


async def test_namespace_decides_shm_or_tcp_between_two_targets(hosts):
    """The same pair of processes' kind: tcp across namespaces, shm within one."""
    a = await start(hosts[0])
    across = await start(hosts[1])
    beside = await start(hosts[0])
    try:
        await a.alloc("inbox", SIZE * 2, seed=3)
        got = await across.cmd(op="pump", address=a.address, name="inbox", size=SIZE, count=1, seed=4)
        assert got["transport"] == "tcp" and "another network namespace" in got["reason"], got
        assert await a.hash("inbox", 0, SIZE) == sha(pattern(SIZE, 4))
        got = await beside.cmd(op="pump", address=a.address, name="inbox", size=SIZE, count=1, seed=5)
        assert got["transport"] == "shm", got
        assert await a.hash("inbox", 0, SIZE) == sha(pattern(SIZE, 5))
    finally:
        for t in (a, across, beside):
            await t.aclose()


def test_info_names_the_network_namespace(hosts):
    here = subprocess.run([sys.executable, "-m", "aiohixl", "info"], capture_output=True, text=True, check=True)
    there = hosts[0].run([sys.executable, "-m", "aiohixl", "info"])
    ns = [next(line for line in out.stdout.splitlines() if "namespaces" in line) for out in (here, there)]
    assert "net:[" in ns[0] and ns[0] != ns[1], ns
    assert "same host and network namespace" in there.stdout
