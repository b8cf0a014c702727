"""The verbs transport between two real processes over a real RDMA device.

Runs where an RDMA device is present: `make test-rdma` boots a VM with the
Soft-RoCE device rxe0 (tests/softroce) and runs this file there. Elsewhere
every test here is skipped. Python runs 20-35x slower in that VM: sizes are
small and few processes are started.
"""

import asyncio
import dataclasses
import random
import time

import numpy as np
import pytest
import pytest_asyncio

import aiohixl
from aiohixl import Access
from aiohixl.remote import RemoteRegion
from aiohixl.transports import verbs as _rdma

from ..harness import TOKEN, Target, pattern, sha

try:
    CHOICE = _rdma.choose()
except ValueError as exc:  # no device: the whole tier skips
    pytest.skip(f"no RDMA device here ({exc}); run `make test-rdma`", allow_module_level=True)

VERBS = ("verbs", "tcp")  # both processes share a host: keep shared memory out of the way
SPACE = 8 << 20
QP_TIMEOUT = 12  # 4.096 us * 2**12 = 16.8 ms per try, one retry: a dead peer shows in ~50 ms


def agent(**kw) -> aiohixl.Agent:
    return aiohixl.Agent(token=TOKEN, transports=VERBS, rdma_timeout=QP_TIMEOUT, rdma_retry_count=1, **kw)


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
    assert pair["kv"]._rkey is not None


def cases(seed: int, count: int):
    rng = random.Random(seed)
    sizes = [1, 7, 4096, 4097, 65536 + 3, 1 << 20, 4 << 20] + [rng.randint(1, 4 << 20) for _ in range(count)]
    for n in sizes:
        yield n, rng.randint(0, SPACE - n), rng.randint(0, SPACE - n)


@pytest.mark.asyncio(loop_scope="module")
async def test_put_byte_exact(pair):
    for n, a, b in cases(1, 5):
        await pair["peer"].put(pair["kv"][b : b + n], pair["src"][a : a + n])
        assert await pair["target"].hash("kv", b, n) == sha(pair["src_arr"][a : a + n]), (n, a, b)


@pytest.mark.asyncio(loop_scope="module")
async def test_get_byte_exact(pair):
    expected = pattern(SPACE, 5)
    for n, a, b in cases(2, 5):
        pair["dst_arr"][b : b + n] = 0xEE
        await pair["peer"].get(pair["dst"][b : b + n], pair["rsrc"][a : a + n])
        assert np.array_equal(pair["dst_arr"][b : b + n], expected[a : a + n]), (n, a, b)


@pytest.mark.asyncio(loop_scope="module")
async def test_put_many_get_many(pair):
    peer, kv, src, src_arr = pair["peer"], pair["kv"], pair["src"], pair["src_arr"]
    pairs = [(kv[i * 65536 : i * 65536 + 1000 + i], src[i * 7 : i * 7 + 1000 + i]) for i in range(40)]
    await peer.put_many(pairs)
    for i in (0, 17, 39):
        assert await pair["target"].hash("kv", i * 65536, 1000 + i) == sha(src_arr[i * 7 : i * 7 + 1000 + i])
    dst, dst_arr = pair["dst"], pair["dst_arr"]
    gets = [(dst[i * 4096 : (i + 1) * 4096], pair["rsrc"][i * 8192 : i * 8192 + 4096]) for i in range(300)]
    await peer.get_many(gets)  # more pairs than one work-request chain holds
    expected = pattern(SPACE, 5)
    for i in (0, 150, 299):
        assert np.array_equal(dst_arr[i * 4096 : (i + 1) * 4096], expected[i * 8192 : i * 8192 + 4096])


@pytest.mark.asyncio(loop_scope="module")
async def test_write_with_imm_reaches_the_target(pair):
    peer, kv, src = pair["peer"], pair["kv"], pair["src"]
    waiting = asyncio.create_task(pair["target"].cmd(op="notify", timeout=120))
    await asyncio.sleep(0.5)
    await peer.put(kv[100 : 100 + 5000], src[:5000], imm=0xC0FFEE)
    note = await waiting
    assert note["imm"] == 0xC0FFEE and note["nbytes"] == 5000
    assert await pair["target"].hash("kv", 100, 5000) == sha(pair["src_arr"][:5000])
    with pytest.raises(aiohixl.InvalidArgument, match="imm"):
        await peer.put(kv[:10], src[:10], imm=1 << 40)


@pytest.mark.asyncio(loop_scope="module")
async def test_thousand_concurrent_ops(pair):
    peer, a = pair["peer"], pair["agent"]
    size = 2048
    before = a.engine.completed
    puts = [peer.put(pair["kv"][i * size : (i + 1) * size], pair["src"][i * size : (i + 1) * size]) for i in range(500)]
    gets = [
        peer.get(pair["dst"][i * size : (i + 1) * size], pair["rsrc"][i * size : (i + 1) * size]) for i in range(500)
    ]
    assert await asyncio.gather(*puts, *gets) == [None] * 1000
    assert a.engine.completed - before == 1000 and a.outstanding == 0 and a.engine.unknown_completions == 0
    assert await pair["target"].hash("kv", 0, 500 * size) == sha(pair["src_arr"][: 500 * size])
    assert np.array_equal(pair["dst_arr"][: 500 * size], pattern(SPACE, 5)[: 500 * size])


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
        assert peer not in a._peers
    assert await pair["target"].hash("kv", 3 * 4096, 4096) == sha(pair["src_arr"][:4096])


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


async def test_kill_target_fails_outstanding_ops_then_reconnect():
    target = await Target.start(rdma_timeout=QP_TIMEOUT)
    port = target.port
    await target.alloc("kv", 4 << 20)
    async with agent() as a:
        peer = await a.connect(target.address)
        kv = await peer.region("kv")
        src = a.register(pattern(4 << 20, 3))
        tasks = [asyncio.create_task(peer.put(kv, src)) for _ in range(30)]
        await asyncio.sleep(0.2)
        target.kill()
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - killed
        assert all(r is None or isinstance(r, aiohixl.ConnectionLost) for r in results), results
        assert any(r is not None for r in results), "30 puts of 4 MiB over rxe cannot finish in 0.2 s"
        assert elapsed < 5.0, f"outstanding ops took {elapsed:.2f} s to fail"
        assert a.outstanding == 0
        await target.proc.wait()
        target2 = await Target.start(listen=f"127.0.0.1:{port}", rdma_timeout=QP_TIMEOUT)
        try:
            await target2.alloc("kv", 4 << 20)
            peer2 = await a.connect(target2.address)
            assert peer2.transport == "verbs"
            await peer2.put(await peer2.region("kv"), src)
            assert await target2.hash("kv", 0, 4 << 20) == sha(pattern(4 << 20, 3))
        finally:
            await target2.aclose()
