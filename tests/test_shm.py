"""Same-host transport between two real processes: memfd mappings and
cross-memory attach, fallbacks, revocation and the target's death."""

import asyncio
import logging
import shutil

import numpy as np
import pytest
import pytest_asyncio

import aiohixl
from aiohixl import _testing as hooks

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
        yield dict(
            target=target,
            agent=agent,
            peer=peer,
            r=regions,
            src=agent.register(src_arr),
            src_arr=src_arr,
            dst=agent.register(dst_arr),
            dst_arr=dst_arr,
        )
    await target.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_paths_are_chosen_and_reported(pair):
    peer, r = pair["peer"], pair["r"]
    assert peer.transport == "shm" and peer.transport_reason == "shm (the first choice)"
    assert await peer.path(r["memfd"]) == "shm-memfd"
    assert await peer.path(r["user"]) == "shm-cma"


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


class _MostHeld(dict):
    """An engine's record of ops outstanding that remembers how many it ever held."""

    most = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.most = max(self.most, len(self))


@pytest.mark.parametrize(
    "prefix, user_path",
    [((), "shm-cma"), (("unshare", "--user", "--map-root-user"), "tcp")],
    ids=["memfd+cma", "memfd+tcp"],
)
async def test_put_many_across_both_paths_never_holds_more_ops_than_the_ring(prefix, user_path):
    """Each path's group is an op of its own (put_many, get_many): a ring of one takes them
    in turn (posted together they overfilled it, and a completion pushed into a full ring
    waits: on the loop's own thread, in tcp's flush, for ever). In another user namespace
    the user memory goes over tcp (no cross-memory attach), the message after the data."""
    if prefix and not shutil.which("unshare"):
        pytest.skip("needs unshare(1)")
    try:
        target = await Target.start(prefix=prefix)
    except Exception as exc:
        if not prefix:
            raise
        pytest.skip(f"cannot start a target in a user namespace: {exc}")
    try:
        await target.alloc("memfd", 8 << 20)
        await target.alloc("user", 8 << 20, kind="register")
        async with aiohixl.Agent("ring-of-one", token=TOKEN, max_inflight=1) as agent:
            engine = hooks.engine(agent)
            engine._ops = held = _MostHeld(engine._ops)
            src_arr = pattern(8 << 20, 5)
            src = agent.register(src_arr)
            half = 3 << 19  # 1.5 MiB each way: on the pool too
            dst_arr = np.zeros(2 * half, dtype=np.uint8)
            dst = agent.register(dst_arr)
            peer = await agent.connect(target.address)
            r = {n: await peer.region(n) for n in ("memfd", "user")}
            assert [await peer.path(r[n]) for n in ("memfd", "user")] == ["shm-memfd", user_path]
            for i in range(4):
                lo, hi = i << 21, (i + 1) << 21  # 2 MiB each way: copied on the pool, not inline
                check = asyncio.create_task(target.cmd(op="take_note", timeout=30))
                pairs = [(r["memfd"][lo:hi], src[lo:hi]), (r["user"][lo:hi], src[lo:hi])]
                await peer.put_many(pairs, notify=f"memfd:{lo}:{hi - lo}:{sha(src_arr[lo:hi])}".encode())
                assert (await check)["in_place"]
                assert await target.hash("user", lo, hi - lo) == sha(src_arr[lo:hi])
                await peer.get_many([(dst[:half], r["memfd"][lo : lo + half]), (dst[half:], r["user"][hi - half : hi])])
                assert sha(dst_arr) == sha(np.concatenate([src_arr[lo : lo + half], src_arr[hi - half : hi]]))
            assert held.most == 1
    finally:
        await target.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_cross_memory_attach_at_every_alignment(pair):
    # Ends 1-63 bytes apart modulo a page go through a bounce buffer in 128 KiB
    # pieces (copy.c): every distance, lengths across pieces, both directions.
    peer, r, src, src_arr = pair["peer"], pair["r"], pair["src"], pair["src_arr"]
    dst, dst_arr, target = pair["dst"], pair["dst_arr"], pair["target"]
    usrc = pattern(SPACE, 42)  # what the target's "usrc" holds
    base = 200 << 20
    for delta in (1, 8, 16, 31, 32, 63, 64, 2048, 4095):
        for n in (255, 256, 4096 + 3, (300 << 10) + 5):
            far = base + delta
            await peer.put(r["user"][far : far + n], src[base : base + n])
            assert await target.hash("user", far, n) == sha(src_arr[base : base + n]), (delta, n)
            await peer.get(dst[far : far + n], r["usrc"][base : base + n])
            assert sha(dst_arr[far : far + n]) == sha(usrc[base : base + n]), (delta, n)


@pytest.mark.asyncio(loop_scope="module")
async def test_region_closed_by_target_fails_later_ops(pair):
    target, peer, src = pair["target"], pair["peer"], pair["src"]
    for kind in ("alloc", "register"):
        await target.alloc("gone", 8 << 20, kind=kind)
        gone = await peer.region("gone")
        await peer.put(gone, src[: 8 << 20])
        # ops in flight while the target closes: each completes or fails cleanly
        tasks = [asyncio.create_task(peer.put(gone, src[: 8 << 20])) for _ in range(20)]
        await target.cmd(op="close", name="gone")  # answered: the close did not wait on them forever
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
            assert peer.transport == "tcp" and "shm: not allowed" in peer.transport_reason, peer.transport_reason
            assert agent.loopback().transport_reason == "loopback (the agent itself)"
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
            assert not hooks.tracked_peers(agent), "closed peers are freed once their ops are back"
            last = await agent.connect(target.address, transports=transports)
            await last.put(await last.region("kv"), src)
        assert await target.hash("kv", 0, 8 << 20) == sha(pattern(8 << 20, 4))
    finally:
        await target.aclose()


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(f"memfd:aiohixl:{name} " in line for line in maps)


async def test_closing_a_peer_or_agent_unmaps_the_targets_memfds():
    # Unmapped off the loop, and gone when aclose() returns: with ops in flight on the mapping too.
    target = await Target.start()
    try:
        await target.alloc("mapped", 8 << 20)
        agent = aiohixl.Agent(token=TOKEN)
        src = agent.register(pattern(8 << 20, 5))
        for close_agent in (False, True):
            peer = await agent.connect(target.address)
            kv = await peer.region("mapped")
            assert await peer.path(kv) == "shm-memfd" and _mapped("mapped")
            pending = [asyncio.create_task(peer.put(kv, src)) for _ in range(3)]
            await asyncio.sleep(0)
            await (agent.aclose() if close_agent else peer.aclose())
            assert not _mapped("mapped")
            results = await asyncio.gather(*pending, return_exceptions=True)
            assert all(r is None or isinstance(r, aiohixl.ClosedError) for r in results), results
    finally:
        await target.aclose()
