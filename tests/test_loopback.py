"""put/get/put_many/get_many through the loopback transport: correctness,
refusals, concurrency, cancellation and closing."""

import asyncio
import dataclasses
import time

import numpy as np
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiohixl
from aiohixl import Access
from aiohixl.remote import RemoteRegion

from .conftest import random_bytes

SPACE = 72 << 20  # room for 64 MiB ops at random offsets
MARK = 0xEE


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def big():
    async with aiohixl.Agent("big") as agent:
        src_arr = random_bytes(SPACE, seed=1)
        dst_arr = np.zeros(SPACE, dtype=np.uint8)
        src = agent.register(src_arr, name="src")
        dst = agent.register(dst_arr, name="dst")
        peer = agent.loopback()
        yield agent, peer, src, src_arr, dst, dst_arr, await peer.region("dst"), await peer.region("src")


sizes = st.one_of(
    st.integers(1, 4096),
    st.integers(4097, 1 << 20),
    st.integers((1 << 20) + 1, 64 << 20),
    st.sampled_from([1, 64 << 10, (64 << 10) + 1, 4 << 20, 64 << 20]),
)


def offsets(size):
    return st.tuples(st.integers(0, SPACE - size), st.integers(0, SPACE - size))


hyp = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.asyncio(loop_scope="module")
@hyp
@given(data=st.data())
async def test_put_random_ranges(big, data):
    agent, peer, src, src_arr, dst, dst_arr, rdst, _ = big
    n = data.draw(sizes)
    a, b = data.draw(offsets(n))
    dst_arr[b : b + n] = MARK
    await peer.put(rdst[b : b + n], src[a : a + n])
    assert np.array_equal(dst_arr[b : b + n], src_arr[a : a + n])
    # the bytes either side of the range are never written
    if b > 0:
        before = dst_arr[b - 1]
        await peer.put(rdst[b : b + n], src[a : a + n])
        assert dst_arr[b - 1] == before


@pytest.mark.asyncio(loop_scope="module")
@hyp
@given(data=st.data())
async def test_get_random_ranges(big, data):
    agent, peer, src, src_arr, dst, dst_arr, _, rsrc = big
    n = data.draw(sizes)
    a, b = data.draw(offsets(n))
    dst_arr[b : b + n] = MARK
    guard = dst_arr[b + n] if b + n < SPACE else None
    await peer.get(dst[b : b + n], rsrc[a : a + n])
    assert np.array_equal(dst_arr[b : b + n], src_arr[a : a + n])
    if guard is not None:
        assert dst_arr[b + n] == guard


@pytest.mark.asyncio(loop_scope="module")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_put_many_get_many(big, data):
    agent, peer, src, src_arr, dst, dst_arr, rdst, rsrc = big
    count = data.draw(st.integers(1, 16))
    # disjoint destination ranges in blocks of 4 MiB
    lens = [data.draw(st.integers(1, 4 << 20)) for _ in range(count)]
    pairs, checks = [], []
    for i, n in enumerate(lens):
        b = i * (4 << 20)
        a = data.draw(st.integers(0, SPACE - n))
        dst_arr[b : b + n] = MARK
        pairs.append((rdst[b : b + n], src[a : a + n]))
        checks.append((a, b, n))
    await peer.put_many(pairs)
    for a, b, n in checks:
        assert np.array_equal(dst_arr[b : b + n], src_arr[a : a + n])
    # and back: read the written ranges of dst into the tail of dst with get_many
    base = 64 << 20
    gets, checks2 = [], []
    off = base
    for a, b, n in checks[:2]:
        n = min(n, (4 << 20) - 1)
        gets.append((dst[off : off + n], rdst[b : b + n]))
        checks2.append((a, off, n))
        off += n
    await peer.get_many(gets)
    for a, o, n in checks2:
        assert np.array_equal(dst_arr[o : o + n], src_arr[a : a + n])


async def test_refusals_leave_memory_untouched(agent):
    target = agent.register(bytearray(b"T" * 4096), name="t", access=Access.REMOTE_READ)
    writable = agent.register(bytearray(b"W" * 4096), name="w")
    src = agent.register(bytearray(b"S" * 8192))
    peer = agent.loopback()
    t = await peer.region("t")
    w = await peer.region("w")

    with pytest.raises(aiohixl.AccessDenied, match="Peer.put.*REMOTE_WRITE"):
        await peer.put(t, src[:4096])
    with pytest.raises(aiohixl.LengthMismatch, match="4096 bytes.*8192 bytes"):
        await peer.put(w, src)

    # A forged descriptor that claims more length or more rights than were
    # registered gets past the initiator's checks; the target's registry refuses.
    longer = RemoteRegion(dataclasses.replace(w.info, nbytes=8192))
    with pytest.raises(aiohixl.OutOfBounds, match="Peer.put"):
        await peer.put(longer, src)
    with pytest.raises(aiohixl.OutOfBounds):
        await peer.put_many([(w[:100], src[:100]), (longer[4000:8000], src[:4000])])
    lying = RemoteRegion(dataclasses.replace(t.info, access=Access.REMOTE_WRITE | Access.REMOTE_READ))
    with pytest.raises(aiohixl.AccessDenied, match="Peer.put"):
        await peer.put(lying, src[:4096])
    assert bytes(target.memory) == b"T" * 4096
    assert bytes(writable.memory) == b"W" * 4096

    # refused after close, for a region withdrawn by its owner
    await writable.close()
    with pytest.raises(aiohixl.RegionUnavailable):
        await peer.put(w, src[:4096])
    with pytest.raises(aiohixl.RegionUnavailable, match="Peer.region"):
        await peer.region("w")


async def test_wrong_argument_types(agent):
    src = agent.allocate(10)
    peer = agent.loopback()
    with pytest.raises(aiohixl.InvalidArgument, match="Peer.put: expected a RemoteRegion"):
        await peer.put(src, src)
    r = agent.allocate(10, name="x")
    async with aiohixl.Agent() as other:
        with pytest.raises(aiohixl.InvalidArgument, match="another agent"):
            await peer.put(await peer.region("x"), other.allocate(10))


async def test_zero_length_is_a_no_op(agent):
    src = agent.allocate(10)
    agent.allocate(10, name="x")
    peer = agent.loopback()
    x = await peer.region("x")
    await peer.put(x[5:5], src[0:0])
    await peer.put_many([])


async def test_ten_thousand_concurrent_ops(agent):
    n, size = 10_000, 512
    src_arr = random_bytes(n * size, seed=7)
    src = agent.register(src_arr)
    dst_arr = np.zeros(n * size, dtype=np.uint8)
    agent.register(dst_arr, name="dst")
    big_src = agent.register(random_bytes(1 << 20, seed=8))
    agent.register(np.zeros(100 << 20, dtype=np.uint8), name="bigdst")
    peer = agent.loopback()
    dst = await peer.region("dst")
    bigdst = await peer.region("bigdst")
    # mix inline ops with ops on the copy pool so both completion paths are counted
    ops = [peer.put(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(n)]
    ops += [peer.put(bigdst[i << 20 : (i + 1) << 20], big_src) for i in range(100)]
    before = agent.engine.completed
    results = await asyncio.gather(*ops)
    assert results == [None] * len(ops)
    assert np.array_equal(dst_arr, src_arr)
    assert agent.outstanding == 0
    assert agent.engine.completed - before == len(ops)  # each op accounted for once
    assert agent.engine.unknown_completions == 0  # and none completed twice


async def test_max_inflight_waits_for_room():
    async with aiohixl.Agent(max_inflight=4) as agent:
        src = agent.register(random_bytes(8 << 20, seed=3))
        dst_arr = np.zeros(32 * (8 << 20), dtype=np.uint8)
        agent.register(dst_arr, name="d")
        peer = agent.loopback()
        d = await peer.region("d")
        await asyncio.gather(*(peer.put(d[i * (8 << 20) : (i + 1) * (8 << 20)], src) for i in range(32)))
        assert np.array_equal(dst_arr.reshape(32, -1), np.tile(src.memory, (32, 1)))


async def test_cancellation_keeps_memory_alive_and_op_completes(agent):
    n = 64 << 20
    src_arr = random_bytes(n, seed=5)
    src = agent.register(src_arr)
    dst_arr = np.zeros(n, dtype=np.uint8)
    dst_region = agent.register(dst_arr, name="d")
    peer = agent.loopback()
    d = await peer.region("d")
    task = asyncio.create_task(peer.put(d, src))
    await asyncio.sleep(0)  # posted, copying on the pool
    assert agent.outstanding == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the op is still accounted for, and its memory still registered
    assert agent.outstanding in (0, 1)
    del src_arr  # the user's reference is gone; the op keeps the buffer alive
    await dst_region.close()  # waits for the cancelled op's copy to finish
    assert np.array_equal(dst_arr, random_bytes(n, seed=5))
    for _ in range(100):  # its completion follows the copy closely
        if not agent.outstanding:
            break
        await asyncio.sleep(0.01)
    assert agent.outstanding == 0
    # later ops work
    agent.register(bytearray(8), name="e")
    small = agent.register(bytearray(b"12345678"))
    await peer.put(await peer.region("e"), small)


async def test_timeout_raises_and_op_still_completes(agent):
    n = 256 << 20
    src = agent.register(np.ones(n, dtype=np.uint8))
    dst_arr = np.zeros(n, dtype=np.uint8)
    agent.register(dst_arr, name="d")
    peer = agent.loopback()
    d = await peer.region("d")
    with pytest.raises(aiohixl.TransferTimeout, match="Peer.put.*may still complete"):
        await peer.put(d, src, timeout=0.0001)
    while agent.outstanding:
        await asyncio.sleep(0.01)
    assert dst_arr.all()


async def test_close_agent_with_ops_in_flight():
    agent = aiohixl.Agent("closing", copy_threads=1)
    await agent.__aenter__()
    piece, pieces, ops = 2 << 20, 32, 16
    src = agent.register(random_bytes(piece, seed=2))
    dst_arr = np.zeros(ops * pieces * piece, dtype=np.uint8)
    agent.register(dst_arr, name="d")
    peer = agent.loopback()
    d = await peer.region("d")
    step = pieces * piece
    # Each op is 32 pieces: the caller copies one, the single pool thread queues
    # the rest, ~1 GB in all, which cannot be done by the time aclose() runs.
    tasks = [
        asyncio.create_task(
            peer.put_many([(d[i * step + j * piece : i * step + (j + 1) * piece], src) for j in range(pieces)])
        )
        for i in range(ops)
    ]
    await asyncio.sleep(0)
    await agent.aclose()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [r for r in results if r is not None]
    assert all(isinstance(r, aiohixl.ClosedError) for r in failed), failed
    assert failed, "1 GB of queued copies cannot all finish before aclose"
    expected = np.tile(random_bytes(piece, seed=2), pieces)
    for i, r in enumerate(results):
        if r is None:
            assert np.array_equal(dst_arr[i * step : (i + 1) * step], expected)
    assert agent.outstanding == 0


async def test_use_after_close_names_the_method():
    agent = aiohixl.Agent()
    region = agent.allocate(10, name="r")
    peer = agent.loopback()
    remote = await peer.region("r")
    await agent.aclose()
    await agent.aclose()  # idempotent
    with pytest.raises(aiohixl.ClosedError, match="Agent.register"):
        agent.register(bytearray(1))
    with pytest.raises(aiohixl.ClosedError, match="Agent.allocate"):
        agent.allocate(1)
    with pytest.raises(aiohixl.ClosedError, match="Agent.loopback"):
        agent.loopback()
    with pytest.raises(aiohixl.ClosedError, match="Peer.put"):
        await peer.put(remote, region)
    with pytest.raises(aiohixl.ClosedError, match="Peer.get_many"):
        await peer.get_many([(region, remote)])
    with pytest.raises(aiohixl.ClosedError, match="Peer.region"):
        await peer.region("r")
    with pytest.raises(aiohixl.ClosedError, match="Region.memory"):
        region.memory
    with pytest.raises(aiohixl.ClosedError, match="Agent.start"):
        async with agent:
            pass


async def test_closed_peer_and_region():
    async with aiohixl.Agent() as agent:
        region = agent.allocate(10, name="r")
        peer = agent.loopback()
        remote = await peer.region("r")
        await region.close()
        with pytest.raises(aiohixl.ClosedError, match="Peer.put: region 'r'"):
            await peer.put(remote, region)
        await peer.aclose()
        with pytest.raises(aiohixl.ClosedError, match="Peer.put: peer"):
            await peer.put(remote, region)


async def test_idle_agent_does_not_spin():
    async with aiohixl.Agent(copy_threads=4) as agent:
        agent.allocate(1 << 20, name="kv")
        peer = agent.loopback()
        await peer.put(await peer.region("kv"), agent.allocate(1 << 20))
        start = time.process_time()
        await asyncio.sleep(2.0)
        used = time.process_time() - start
    assert used < 0.02 * 2.0, f"idle agent used {used:.3f} s of CPU in 2 s"
