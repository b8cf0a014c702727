"""The verbs transport between two real processes over a real RDMA device.

Runs where an RDMA device is present: `make test-rdma` boots a VM with the
Soft-RoCE device rxe0 (tests/softroce) and runs this file there. Elsewhere
every test here is skipped. Python runs 20-35x slower in that VM: sizes are
small and few processes are started.
"""

import asyncio
import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import pytest_asyncio

import aiohixl
from aiohixl import Access
from aiohixl import _testing as hooks
from aiohixl.remote import RemoteRegion
from aiohixl.transports import verbs as _rdma

from ..harness import BRIDGE, TOKEN, Target, pattern, sha
from ..waiting import all_end, wait_until

try:
    CHOICE = _rdma.choose()
except ValueError as exc:  # no device: the whole tier skips
    pytest.skip(f"no RDMA device here ({exc}); run `make test-rdma`", allow_module_level=True)

VERBS = ("verbs", "tcp")  # both processes share a host: keep shared memory out of the way
SPACE = 8 << 20
QP_TIMEOUT = 12  # 4.096 us * 2**12 = 16.8 ms per try, one retry: a dead peer shows in ~50 ms
QP_RETRIES = 1
if BRIDGE:  # the target in the other guest: an emulated link and guest stall longer than that
    QP_TIMEOUT, QP_RETRIES = 14, 7


def agent(**kw) -> aiohixl.Agent:
    kw = {"rdma_timeout": QP_TIMEOUT, "rdma_retry_count": QP_RETRIES, **kw}
    return aiohixl.Agent(token=TOKEN, transports=VERBS, **kw)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair():
    target = await Target.start(rdma_timeout=QP_TIMEOUT)
    info = await target.cmd(op="info")
    assert info["verbs"] == "ready" and "verbs" in info["transports"], info
    await target.alloc("kv", SPACE)
    await target.alloc("src", SPACE, seed=5, kind="register")
    await target.alloc("ro", 64 << 10, access=int(Access.REMOTE_READ), seed=6)
    async with agent(name="initiator") as a:
        peer = await a.connect(target.address)
        src_arr = pattern(SPACE, 9)
        dst_arr = np.zeros(SPACE, dtype=np.uint8)
        yield dict(
            target=target,
            agent=a,
            peer=peer,
            src=a.register(src_arr),
            src_arr=src_arr,
            dst=a.register(dst_arr),
            dst_arr=dst_arr,
            kv=await peer.region("kv"),
            rsrc=await peer.region("src"),
        )
    await target.aclose()


def test_info_reports_the_device():
    from aiohixl.tools.info import transports

    verbs = next(t for t in transports() if t.name == "verbs")
    assert verbs.available and CHOICE.device in verbs.detail, verbs


@pytest.mark.asyncio(loop_scope="module")
async def test_verbs_is_the_path(pair):
    assert pair["peer"].transport == "verbs"
    assert await pair["peer"].path(pair["kv"]) == "verbs"
    assert len(pair["kv"].info.keys.get(1, b"")) == 4  # the rkey travels in the descriptor


@pytest.mark.asyncio(loop_scope="module")
async def test_write_with_imm_reaches_the_target(pair):
    peer, kv, src = pair["peer"], pair["kv"], pair["src"]
    waiting = asyncio.create_task(pair["target"].cmd(op="notify", timeout=120))  # queued there if it is first
    await peer.put(kv[100 : 100 + 5000], src[:5000], imm=0xC0FFEE)
    note = await waiting
    assert note["imm"] == 0xC0FFEE and note["nbytes"] == 5000
    assert await pair["target"].hash("kv", 100, 5000) == sha(pair["src_arr"][:5000])
    with pytest.raises(aiohixl.InvalidArgument, match="imm"):
        await peer.put(kv[:10], src[:10], imm=1 << 40)


@pytest.mark.asyncio(loop_scope="module")
async def test_reconnecting_frees_queue_pairs(pair):
    # Each closed peer's QP is destroyed here, its twin on the target when the
    # session ends; a long-lived server does not accumulate them.
    a, src = pair["agent"], pair["src"]
    for i in range(4):
        peer = await a.connect(pair["target"].address)
        assert peer.transport == "verbs"
        kv = await peer.region("kv")
        await peer.put(kv[i * 4096 : (i + 1) * 4096], src[:4096], imm=i)
        await pair["target"].cmd(op="notify", timeout=120)
        await peer.aclose()
        assert not hooks.peer_tracked(a, peer)
    assert await pair["target"].hash("kv", 3 * 4096, 4096) == sha(pair["src_arr"][:4096])


@pytest.mark.asyncio(loop_scope="module")
async def test_notifications_are_sends_on_the_queue_pair_behind_the_data(pair):
    peer, kv, src, src_arr, target = pair["peer"], pair["kv"], pair["src"], pair["src_arr"], pair["target"]
    assert (
        hooks.notes_link(peer) is hooks.links(peer)[0] and hooks.notes_link(peer).name == "verbs"
    )  # not the tcp channel
    sent = pair["agent"].stats()["transports"]["verbs"]["ops"]
    for i, n in enumerate((1, 4096, 3 << 20)):
        off = i * 4096
        message = f"kv:{off}:{n}:{sha(src_arr[i : i + n])}".encode()
        check = asyncio.create_task(target.cmd(op="take_note", timeout=120))
        await peer.put(kv[off : off + n], src[i : i + n], notify=message)
        reply = await check
        assert reply["in_place"] and reply["peer"] == "initiator", reply
    # A message alone, 4 KiB of it, after a get: fenced behind the READ.
    dst = pair["dst"]
    check = asyncio.create_task(target.cmd(op="collect", n=1, timeout=120))
    await peer.get(dst[:4096], pair["rsrc"][:4096])
    await peer.notify(b"x" * 4096)
    assert (await check)["notes"] == [["initiator", "x" * 4096]]
    assert pair["agent"].stats()["transports"]["verbs"]["ops"] == sent + 4  # 3 puts and the get


async def _received_at_least(target: Target, n: int) -> bool:
    return (await target.state())["received"] >= n


@pytest.mark.asyncio(loop_scope="module")
async def test_a_full_queue_holds_verbs_senders_back_and_loses_nothing():
    # 8 slots in the target's queue, 256 receive buffers per queue pair: past
    # both the sender's NIC waits (RNR) for the target to take messages.
    # The library's default ACK timeout and retries (67 ms, 7), not the tier's 17 ms and 1:
    # this is about back-pressure, not how soon a dead peer shows, and an emulated guest on a
    # busy host may stall longer than 34 ms while the sender's NIC waits on the target.
    target = await Target.start(rdma_timeout=14, max_notes=8)
    try:
        await target.alloc("kv", 1 << 20)
        async with agent(name="sender", rdma_timeout=14, rdma_retry_count=7) as a:
            peer = await a.connect(target.address)
            kv = await peer.region("kv")
            src = a.register(pattern(4096, 1))
            total = 400
            sends = []
            for i in range(total):
                # odd: a WRITE WITH IMM, held too, never dropped
                op = peer.put(kv[:64], src[:64], imm=i) if i % 2 else peer.notify(f"m{i}".encode())
                sends.append(asyncio.create_task(op))
            # As in test_notify: asked once the queue has filled, and again after a round trip
            # through the target's loop, by when the rest would have landed had nothing held them.
            await wait_until(lambda: _received_at_least(target, 8), timeout=120, what="the target's queue full")
            received = (await target.state())["received"]
            assert received < total and sum(t.done() for t in sends) < total, "a full queue must hold the sender back"
            collect = asyncio.create_task(target.cmd(op="collect", n=total, timeout=300))
            # The sends end as the target takes the messages (one that failed: the queue pair broke).
            await all_end(sends, 240, lambda: f"peer.broken={peer.broken!r}, {a.stats()}", collect)
            reply = await collect
            # Each kind in its order (the tasks race one another, so not interleaved).
            assert [d for _, d in reply["notes"] if d] == [f"m{i}" for i in range(0, total, 2)]
            assert [i for i in reply["imms"] if i is not None] == list(range(1, total, 2))
            assert reply["dropped"] == 0
            assert peer.broken is None
    finally:
        await target.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_notifications_from_two_verbs_senders_arrive_in_order():
    target = await Target.start(rdma_timeout=QP_TIMEOUT)
    try:
        each = 300
        async with agent(name="s0") as a0, agent(name="s1") as a1:
            peers = [await a.connect(target.address) for a in (a0, a1)]
            collect = asyncio.create_task(target.cmd(op="collect", n=2 * each, timeout=300))

            async def send(k: int) -> None:
                await asyncio.gather(*(peers[k].notify(f"{k}:{i}".encode()) for i in range(each)))

            await asyncio.gather(send(0), send(1))
            reply = await collect
        seen: dict[str, list[int]] = {}
        for name, data in reply["notes"]:
            k, i = data.split(":")
            assert name == f"s{k}"
            seen.setdefault(k, []).append(int(i))
        assert seen == {"0": list(range(each)), "1": list(range(each))}
        assert reply["dropped"] == 0
    finally:
        await target.aclose()


@pytest.mark.skipif(bool(BRIDGE), reason="stops the target's process: it must be in this guest")
@pytest.mark.asyncio
async def test_completed_ops_keep_a_silent_peer_alive_and_only_them():
    # The target's process stopped: its control connection sends nothing (no heartbeat), while
    # its RC queue pair, which the kernel's rxe serves, still completes our WRITEs. A completed
    # RC op proves the peer there, so it counts as heard; once no op completes, the heartbeat
    # ends the session as for any silent peer (docs/rdma.md, "Two guests").
    timeout = 3.0
    target = await Target.start()
    pid = target.proc.pid
    try:
        await target.alloc("kv", 64 << 10)
        async with agent(heartbeat_interval=0.5, heartbeat_timeout=timeout) as a:
            peer = await a.connect(target.address)
            kv = await peer.region("kv")
            src_arr = pattern(64 << 10, 11)
            src = a.register(src_arr)
            os.kill(pid, signal.SIGSTOP)
            try:
                stopped = time.monotonic()
                puts = 0
                while time.monotonic() - stopped < 2 * timeout:  # twice the timeout of silence
                    await peer.put(kv, src)
                    puts += 1
                assert peer.broken is None, (puts, peer.broken)
                await wait_until(lambda: peer.broken is not None, timeout=60, what="the heartbeat, no op completing")
                assert isinstance(peer.broken, aiohixl.ConnectionLost) and "heartbeat" in str(peer.broken)
                with pytest.raises(aiohixl.ConnectionLost):
                    await peer.put(kv, src)
            finally:
                os.kill(pid, signal.SIGCONT)
        assert await target.hash("kv", 0, 64 << 10) == sha(src_arr)  # the puts while it was stopped landed
    finally:
        await target.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_remote_nic_refuses_a_write_without_rights(pair):
    # Last in the module: an RC error puts the queue pair in error.
    target, peer, src = pair["target"], pair["peer"], pair["src"]
    ro = await peer.region("ro")
    before = await target.hash("ro", 0, 64 << 10)
    with pytest.raises(aiohixl.AccessDenied, match="REMOTE_WRITE"):
        await peer.put(ro, src[: 64 << 10])  # the initiator's own check, from the descriptor
    lying = RemoteRegion(dataclasses.replace(ro.info, access=Access.REMOTE_READ | Access.REMOTE_WRITE))
    with pytest.raises(aiohixl.AccessDenied):
        await peer.put(lying, src[: 64 << 10])  # the remote NIC's check, by the MR's rights
    assert await target.hash("ro", 0, 64 << 10) == before
    assert isinstance(peer.broken, aiohixl.ConnectionLost)
    with pytest.raises(aiohixl.ConnectionLost):
        await peer.put(pair["kv"][:10], src[:10])
    again = await pair["agent"].connect(target.address)  # new queue pairs
    await again.put((await again.region("kv"))[:4096], src[:4096])
    assert await target.hash("kv", 0, 4096) == sha(pair["src_arr"][:4096])
