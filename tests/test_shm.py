"""Same-host transport between two real processes: memfd mappings and
cross-memory attach, fallbacks, revocation and the target's death."""

import asyncio
import logging
import shutil
import time

import numpy as np
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiohixl
from aiohixl import Access

from .harness import TOKEN, Target, pattern, sha

SPACE = 256 << 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair():
    target = await Target.start()
    await target.alloc("memfd", SPACE)
    await target.alloc("user", SPACE, kind="register")
    await target.alloc("tsrc", SPACE, seed=41)  # for gets: memfd holding a known pattern
    await target.alloc("usrc", SPACE, seed=42, kind="register")
    async with aiohixl.Agent("initiator", token=TOKEN) as agent:
        peer = await agent.connect(target.address)
        regions = {n: await peer.region(n) for n in ("memfd", "user", "tsrc", "usrc")}
        src_arr = pattern(SPACE, 43)
        dst_arr = np.zeros(SPACE, dtype=np.uint8)
        yield dict(target=target, agent=agent, peer=peer, r=regions, src=agent.register(src_arr),
                   src_arr=src_arr, dst=agent.register(dst_arr), dst_arr=dst_arr)
    await target.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_paths_are_chosen_and_reported(pair):
    peer, r = pair["peer"], pair["r"]
    assert peer.transport == "shm"
    assert await peer.path(r["memfd"]) == "shm-memfd"
    assert await peer.path(r["user"]) == "shm-cma"


sizes = st.one_of(
    st.integers(1, 4096), st.integers(4097, 2 << 20), st.integers(2 << 20, SPACE),
    st.sampled_from([1, 64 << 10, (1 << 20) + 1, 16 << 20, 64 << 20, SPACE]),
)
hyp = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.asyncio(loop_scope="module")
@hyp
@given(data=st.data(), name=st.sampled_from(["memfd", "user"]))
async def test_put_byte_exact(pair, data, name):
    n = data.draw(sizes)
    a, b = data.draw(st.integers(0, SPACE - n)), data.draw(st.integers(0, SPACE - n))
    await pair["peer"].put(pair["r"][name][b : b + n], pair["src"][a : a + n])
    assert await pair["target"].hash(name, b, n) == sha(pair["src_arr"][a : a + n])


@pytest.mark.asyncio(loop_scope="module")
@hyp
@given(data=st.data(), name=st.sampled_from(["tsrc", "usrc"]))
async def test_get_byte_exact(pair, data, name):
    n = data.draw(sizes)
    a, b = data.draw(st.integers(0, SPACE - n)), data.draw(st.integers(0, SPACE - n))
    dst_arr = pair["dst_arr"]
    dst_arr[b : b + n] = 0xEE
    await pair["peer"].get(pair["dst"][b : b + n], pair["r"][name][a : a + n])
    expected = pattern(SPACE, 41 if name == "tsrc" else 42)
    assert np.array_equal(dst_arr[b : b + n], expected[a : a + n])


@pytest.mark.asyncio(loop_scope="module")
async def test_put_many_across_both_paths(pair):
    peer, r, src, src_arr = pair["peer"], pair["r"], pair["src"], pair["src_arr"]
    pairs = [(r["memfd"][i << 20 : (i + 1) << 20], src[i << 20 : (i + 1) << 20]) for i in range(8)]
    pairs += [(r["user"][i << 20 : (i + 1) << 20], src[i << 20 : (i + 1) << 20]) for i in range(8, 16)]
    pairs += [(r["memfd"][(100 << 20) : (100 << 20) + 1], src[5:6])]
    await peer.put_many(pairs)
    assert await pair["target"].hash("memfd", 0, 8 << 20) == sha(src_arr[: 8 << 20])
    assert await pair["target"].hash("user", 8 << 20, 8 << 20) == sha(src_arr[8 << 20 : 16 << 20])
    assert await pair["target"].hash("memfd", 100 << 20, 1) == sha(src_arr[5:6])


@pytest.mark.asyncio(loop_scope="module")
async def test_ten_thousand_concurrent_small_puts(pair):
    peer, agent, src, src_arr = pair["peer"], pair["agent"], pair["src"], pair["src_arr"]
    before = agent.engine.completed
    n, size = 10_000, 1024
    await asyncio.gather(*(peer.put(pair["r"]["memfd"][i * size : (i + 1) * size], src[i * size : (i + 1) * size])
                           for i in range(n)))
    assert agent.outstanding == 0 and agent.engine.unknown_completions == 0
    assert agent.engine.completed - before == n
    assert await pair["target"].hash("memfd", 0, n * size) == sha(src_arr[: n * size])


@pytest.mark.asyncio(loop_scope="module")
async def test_rights_are_enforced_on_both_paths(pair):
    target, peer, src = pair["target"], pair["peer"], pair["src"]
    await target.alloc("ro-memfd", 4096, access=int(Access.REMOTE_READ), seed=7)
    await target.alloc("ro-user", 4096, access=int(Access.REMOTE_READ), seed=8, kind="register")
    for name, seed in (("ro-memfd", 7), ("ro-user", 8)):
        ro = await peer.region(name)
        with pytest.raises(aiohixl.AccessDenied):
            await peer.put(ro, src[:4096])
        import dataclasses

        from aiohixl.remote import RemoteRegion

        lying = RemoteRegion(dataclasses.replace(ro.info, access=Access.REMOTE_READ | Access.REMOTE_WRITE,
                                                 nbytes=1 << 20))
        # the path is built from the target's own description, not the lie
        with pytest.raises((aiohixl.AccessDenied, aiohixl.OutOfBounds)):
            await peer.put(lying[:4096], src[:4096])
        with pytest.raises(aiohixl.OutOfBounds):
            await peer.get(pair["dst"][: 1 << 20], lying)
        assert await target.hash(name, 0, 4096) == sha(pattern(4096, seed))
        back = pair["dst"]
        await peer.get(back[:4096], ro)
        assert np.array_equal(pair["dst_arr"][:4096], pattern(4096, seed))


@pytest.mark.asyncio(loop_scope="module")
async def test_region_closed_by_target_fails_later_ops(pair):
    target, peer, src = pair["target"], pair["peer"], pair["src"]
    for kind in ("alloc", "register"):
        await target.alloc("gone", 8 << 20, kind=kind)
        gone = await peer.region("gone")
        await peer.put(gone, src[: 8 << 20])
        # ops in flight while the target closes: each completes or fails cleanly
        tasks = [asyncio.create_task(peer.put(gone, src[: 8 << 20])) for _ in range(20)]
        start = time.monotonic()
        await target.cmd(op="close", name="gone")
        assert time.monotonic() - start < 3.0  # acknowledged, not timed out
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(r is None or isinstance(r, aiohixl.RegionUnavailable) for r in results), results
        with pytest.raises(aiohixl.RegionUnavailable):
            await peer.put(gone, src[: 8 << 20])
    # the peer still works
    await peer.put(pair["r"]["memfd"][:4096], src[:4096])


async def test_forced_tcp_per_agent_and_per_connection():
    target = await Target.start()
    try:
        await target.alloc("kv", 1 << 20)
        async with aiohixl.Agent(token=TOKEN, transports=("tcp",)) as agent:
            peer = await agent.connect(target.address)
            assert peer.transport == "tcp"
            kv = await peer.region("kv")
            assert await peer.path(kv) == "tcp"
            await peer.put(kv, agent.register(pattern(1 << 20, 1)))
        async with aiohixl.Agent(token=TOKEN) as agent:
            peer = await agent.connect(target.address, transports=("tcp",))
            assert peer.transport == "tcp"
            await peer.put(await peer.region("kv"), agent.register(pattern(1 << 20, 2)))
        assert await target.hash("kv", 0, 1 << 20) == sha(pattern(1 << 20, 2))
    finally:
        await target.aclose()


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare(1)")
async def test_no_cross_memory_attach_falls_back_to_tcp(caplog):
    # In another user namespace the kernel's permission for process_vm_writev
    # cannot be assumed: memfd regions still map, user memory goes over tcp.
    try:
        target = await Target.start(prefix=("unshare", "--user", "--map-root-user"))
    except Exception as exc:
        pytest.skip(f"cannot start a target in a user namespace: {exc}")
    try:
        await target.alloc("memfd", 1 << 20)
        await target.alloc("user", 1 << 20, kind="register")
        caplog.set_level(logging.INFO, logger="aiohixl")
        async with aiohixl.Agent(token=TOKEN) as agent:
            peer = await agent.connect(target.address)
            assert "cross-memory attach" in caplog.text or "namespaces" in caplog.text
            memfd, user = await peer.region("memfd"), await peer.region("user")
            assert await peer.path(memfd) == "shm-memfd"
            assert await peer.path(user) == "tcp"
            src = agent.register(pattern(1 << 20, 3))
            await peer.put_many([(memfd, src), (user, src)])
        assert await target.hash("memfd", 0, 1 << 20) == sha(pattern(1 << 20, 3))
        assert await target.hash("user", 0, 1 << 20) == sha(pattern(1 << 20, 3))
    finally:
        await target.aclose()


@pytest.mark.parametrize("kind", ["alloc", "register"])
async def test_kill_target_mid_transfer(kind):
    target = await Target.start()
    await target.alloc("kv", 64 << 20, kind=kind)
    async with aiohixl.Agent(token=TOKEN) as agent:
        peer = await agent.connect(target.address)
        kv = await peer.region("kv")
        assert await peer.path(kv) in ("shm-memfd", "shm-cma")
        src = agent.register(pattern(64 << 20, 2))
        done = 0

        async def pump():
            nonlocal done
            while True:
                await peer.put(kv, src)
                done += 1

        tasks = [asyncio.create_task(pump()) for _ in range(4)]
        await asyncio.sleep(0.3)
        target.kill()
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - killed
        assert all(isinstance(r, aiohixl.ConnectionLost) for r in results), results
        assert elapsed < 1.0, f"ops took {elapsed:.2f} s to fail"
        assert done > 0
        with pytest.raises(aiohixl.ConnectionLost):
            await peer.put(kv, src)
    await target.proc.wait()


@pytest.mark.parametrize("transports", [None, ("tcp",)], ids=["shm", "tcp"])
async def test_closed_peers_release_their_native_resources(transports):
    target = await Target.start()
    try:
        await target.alloc("kv", 8 << 20)
        async with aiohixl.Agent(token=TOKEN) as agent:
            src = agent.register(pattern(8 << 20, 4))
            for _ in range(15):
                peer = await agent.connect(target.address, transports=transports)
                kv = await peer.region("kv")
                pending = [asyncio.create_task(peer.put(kv, src)) for _ in range(3)]
                await asyncio.sleep(0)
                await peer.aclose()  # with ops possibly in flight
                results = await asyncio.gather(*pending, return_exceptions=True)
                assert all(r is None or isinstance(r, aiohixl.ClosedError) for r in results), results
            assert agent.outstanding == 0
            assert not agent._peers, "closed peers are freed once their ops are back"
            last = await agent.connect(target.address, transports=transports)
            await last.put(await last.region("kv"), src)
        assert await target.hash("kv", 0, 8 << 20) == sha(pattern(8 << 20, 4))
    finally:
        await target.aclose()
