"""Agent.stats(): the native counters move by exactly what the ops did."""

import dataclasses

import pytest

import aiohixl
from aiohixl.descriptor import encode_info

TOKEN = "stats-secret"
TCP = ("tcp",)


def delta(after: dict, before: dict, transport: str) -> dict:
    a, b = after["transports"][transport], before["transports"][transport]
    return {k: a[k] - b[k] for k in a}


async def test_loopback_ops_bytes_and_notifications(agent):
    kv = agent.allocate(1 << 20, name="kv")
    local = agent.register(bytearray(1 << 20))
    peer = agent.loopback()
    remote = await peer.region("kv")
    before = agent.stats()
    assert set(before["transports"]) == {"loopback", "shm", "tcp", "verbs"}
    await peer.put(remote[0:4096], local[0:4096], notify=b"one")
    await peer.put_many([(remote[0:100], local[0:100]), (remote[200:300], local[200:300])])
    await peer.get(local[0 : 1 << 20], remote)  # a large op: on the copy pool
    after = agent.stats()
    assert delta(after, before, "loopback") == {"ops": 3, "bytes": 4096 + 200 + (1 << 20), "errors": 0}
    assert after["notifications"]["sent"] - before["notifications"]["sent"] == 1
    assert after["notifications"]["received"] - before["notifications"]["received"] == 1
    assert after["notifications"]["dropped"] == 0
    assert after["outstanding"] == 0
    assert (await agent.notification(timeout=5)).data == b"one"
    await kv.close()


async def test_tcp_counts_both_sides_and_errors():
    async with (
        aiohixl.Agent("target", listen="127.0.0.1:0", token=TOKEN, transports=TCP) as target,
        aiohixl.Agent("initiator", token=TOKEN, transports=TCP) as initiator,
    ):
        target.allocate(2 << 20, name="kv")
        src = initiator.register(bytearray(b"x" * (2 << 20)))
        peer = await initiator.connect(target.address)
        kv = await peer.region("kv")
        before, tbefore = initiator.stats(), target.stats()
        await peer.put(kv[0 : 1 << 20], src[0 : 1 << 20], notify=b"req-1")
        await peer.get(src[0:512], kv[0:512])
        await target.notification(match=b"req-1", timeout=5)
        after, tafter = initiator.stats(), target.stats()
        assert delta(after, before, "tcp") == {"ops": 2, "bytes": (1 << 20) + 512, "errors": 0}
        assert after["notifications"]["sent"] - before["notifications"]["sent"] == 1
        assert tafter["notifications"]["received"] - tbefore["notifications"]["received"] == 1
        # The target serves ops; it posts none of its own.
        assert delta(tafter, tbefore, "tcp") == {"ops": 0, "bytes": 0, "errors": 0}

        # A descriptor with a wrong key passes the initiator's checks; the target refuses it.
        forged = peer.remote_region(encode_info(dataclasses.replace(kv.info, key=kv.key ^ 1)))
        with pytest.raises(aiohixl.HixlError):
            await peer.put(forged[0:64], src[0:64])
        final = initiator.stats()
        assert delta(final, after, "tcp") == {"ops": 1, "bytes": 64, "errors": 1}
        assert final["outstanding"] == 0


async def test_stats_of_a_closed_agent_raise():
    agent = aiohixl.Agent()
    await agent.start()
    await agent.aclose()
    with pytest.raises(aiohixl.ClosedError, match="Agent.stats"):
        agent.stats()


async def test_prometheus_collector(agent):
    prometheus_client = pytest.importorskip("prometheus_client")
    from aiohixl.metrics import AgentCollector

    registry = prometheus_client.CollectorRegistry()
    collector = AgentCollector(agent).register(registry)
    agent.allocate(8192, name="kv")
    local = agent.register(bytearray(8192))
    peer = agent.loopback()
    await peer.put(await peer.region("kv"), local, notify=b"m")
    labels = {"agent": agent.name, "transport": "loopback"}
    assert registry.get_sample_value("aiohixl_ops_total", labels) == 1
    assert registry.get_sample_value("aiohixl_bytes_total", labels) == 8192
    assert registry.get_sample_value("aiohixl_errors_total", labels) == 0
    assert registry.get_sample_value("aiohixl_notifications_received_total", {"agent": agent.name}) == 1
    assert registry.get_sample_value("aiohixl_outstanding_ops", {"agent": agent.name}) == 0
    text = prometheus_client.generate_latest(registry).decode()
    assert 'aiohixl_bytes_total{agent="test",transport="loopback"} 8192.0' in text
    collector.unregister()
