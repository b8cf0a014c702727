"""Two real processes over real tcp sockets: correctness, concurrency,
failure of the peer, authentication, and hostile input to the listener."""

import asyncio
import dataclasses
import os
import signal
import socket
import time

import anyio
import numpy as np
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiohixl
from aiohixl import Access
from aiohixl import _control as c
from aiohixl import _wire as w
from aiohixl.remote import RemoteRegion

from .harness import TOKEN, Target, pattern, sha

TCP = ("tcp",)  # these tests are about tcp: shared memory would take over on one host
SPACE = 256 << 20
SEED = 21


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair():
    target = await Target.start()
    await target.alloc("kv", SPACE + 4096)  # memfd region
    await target.alloc("src", SPACE, seed=SEED, kind="register")  # user memory with a known pattern
    async with aiohixl.Agent("initiator", token=TOKEN, transports=TCP) as agent:
        peer = await agent.connect(target.address)
        assert peer.transport == "tcp"
        src_arr = pattern(SPACE, 7)
        src = agent.register(src_arr)
        dst_arr = np.zeros(SPACE, dtype=np.uint8)
        dst = agent.register(dst_arr)
        yield dict(target=target, agent=agent, peer=peer, src=src, src_arr=src_arr, dst=dst, dst_arr=dst_arr,
                   kv=await peer.region("kv"), rsrc=await peer.region("src"), tsrc=pattern(SPACE, SEED))
    await target.aclose()


sizes = st.one_of(
    st.integers(1, 4096), st.integers(4097, 4 << 20), st.integers(4 << 20, SPACE),
    st.sampled_from([1, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 64 << 20, SPACE]),
)
hyp = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.asyncio(loop_scope="module")
@hyp
@given(data=st.data())
async def test_put_byte_exact(pair, data):
    n = data.draw(sizes)
    a = data.draw(st.integers(0, SPACE - n))
    b = data.draw(st.integers(0, SPACE + 4096 - n))
    await pair["peer"].put(pair["kv"][b : b + n], pair["src"][a : a + n])
    assert await pair["target"].hash("kv", b, n) == sha(pair["src_arr"][a : a + n])


@pytest.mark.asyncio(loop_scope="module")
@hyp
@given(data=st.data())
async def test_get_byte_exact(pair, data):
    n = data.draw(sizes)
    a = data.draw(st.integers(0, SPACE - n))
    b = data.draw(st.integers(0, SPACE - n))
    dst_arr = pair["dst_arr"]
    dst_arr[b : b + n] = 0xEE
    guard = dst_arr[b + n] if b + n < SPACE else None
    await pair["peer"].get(pair["dst"][b : b + n], pair["rsrc"][a : a + n])
    assert np.array_equal(dst_arr[b : b + n], pair["tsrc"][a : a + n])
    if guard is not None:
        assert dst_arr[b + n] == guard


@pytest.mark.asyncio(loop_scope="module")
async def test_put_many_get_many(pair):
    peer, kv, src, src_arr = pair["peer"], pair["kv"], pair["src"], pair["src_arr"]
    rng = np.random.default_rng(3)
    pairs, checks = [], []
    for i in range(20):
        n = int(rng.integers(1, 3 << 20))
        a = int(rng.integers(0, SPACE - n))
        b = i * (4 << 20)
        pairs.append((kv[b : b + n], src[a : a + n]))
        checks.append((a, b, n))
    await peer.put_many(pairs)
    for a, b, n in checks:
        assert await pair["target"].hash("kv", b, n) == sha(src_arr[a : a + n])
    dst, dst_arr = pair["dst"], pair["dst_arr"]
    gets = [(dst[b : b + n], kv[b : b + n]) for a, b, n in checks]
    await peer.get_many(gets)
    for a, b, n in checks:
        assert np.array_equal(dst_arr[b : b + n], src_arr[a : a + n])


@pytest.mark.asyncio(loop_scope="module")
async def test_thousand_concurrent_ops(pair):
    peer, kv, src, src_arr, agent = pair["peer"], pair["kv"], pair["src"], pair["src_arr"], pair["agent"]
    size = 8192
    before = agent.engine.completed
    puts = [peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(1000)]
    gets = [peer.get(pair["dst"][i * size : (i + 1) * size], pair["rsrc"][i * size : (i + 1) * size])
            for i in range(1000)]
    assert await asyncio.gather(*puts, *gets) == [None] * 2000
    assert agent.engine.completed - before == 2000 and agent.outstanding == 0
    assert agent.engine.unknown_completions == 0
    assert await pair["target"].hash("kv", 0, 1000 * size) == sha(src_arr[: 1000 * size])
    assert np.array_equal(pair["dst_arr"][: 1000 * size], pair["tsrc"][: 1000 * size])


@pytest.mark.asyncio(loop_scope="module")
async def test_both_directions_at_once(pair):
    peer, kv, src, src_arr = pair["peer"], pair["kv"], pair["src"], pair["src_arr"]
    size, count = 1 << 20, 64
    async with aiohixl.Agent("back", listen="127.0.0.1:0", token=TOKEN, transports=TCP) as me:
        inbox_arr = np.zeros(size * count, dtype=np.uint8)
        me.register(inbox_arr, name="inbox")
        pump = asyncio.create_task(
            pair["target"].cmd(op="pump", address=me.address, name="inbox", size=size, count=count, seed=99,
                                 transports=["tcp"])
        )
        for _ in range(4):
            await asyncio.gather(*(peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size])
                                   for i in range(count)))
        await pump
        assert np.array_equal(inbox_arr, pattern(size * count, 99))
    assert await pair["target"].hash("kv", 0, size * count) == sha(src_arr[: size * count])


@pytest.mark.asyncio(loop_scope="module")
async def test_refusals_by_the_target_leave_memory_untouched(pair):
    target, peer, src = pair["target"], pair["peer"], pair["src"]
    await target.alloc("ro", 1 << 20, access=int(Access.REMOTE_READ), seed=5)
    await target.alloc("small", 4096, seed=6)
    ro = await peer.region("ro")
    small = await peer.region("small")
    before = (await target.hash("ro", 0, 1 << 20), await target.hash("small", 0, 4096))
    with pytest.raises(aiohixl.AccessDenied, match="REMOTE_WRITE"):
        await peer.put(ro[:10], src[:10])  # refused by the initiator, from the descriptor
    lying = RemoteRegion(dataclasses.replace(ro.info, access=Access.REMOTE_READ | Access.REMOTE_WRITE))
    with pytest.raises(aiohixl.AccessDenied, match="Peer.put"):
        await peer.put(lying, src[: 1 << 20])  # refused by the target's registry
    longer = RemoteRegion(dataclasses.replace(small.info, nbytes=8 << 20))
    with pytest.raises(aiohixl.OutOfBounds, match="Peer.put"):
        await peer.put(longer, src[: 8 << 20])
    with pytest.raises(aiohixl.OutOfBounds):
        await peer.get(pair["dst"][: 8192], longer[:8192])
    ghost = RemoteRegion(dataclasses.replace(small.info, region_id=99999))
    with pytest.raises(aiohixl.RegionUnavailable):
        await peer.put(ghost, src[:4096])
    # a refused piece fails the op; the target's memory is checked unchanged
    with pytest.raises(aiohixl.OutOfBounds):
        await peer.put_many([(longer[4096 : 8 << 20], src[: (8 << 20) - 4096])])
    assert (await target.hash("ro", 0, 1 << 20), await target.hash("small", 0, 4096)) == before
    # and the connection still works
    await peer.put(small, src[:4096])
    assert await target.hash("small", 0, 4096) == sha(pair["src_arr"][:4096])


@pytest.mark.asyncio(loop_scope="module")
async def test_regions_published_after_connect_and_withdrawn(pair):
    target, peer, src = pair["target"], pair["peer"], pair["src"]
    with pytest.raises(aiohixl.RegionUnavailable, match="late"):
        await peer.region("late")
    await target.alloc("late", 4096)
    late = await peer.region("late")
    await peer.put(late, src[:4096])
    await target.cmd(op="close", name="late")
    with pytest.raises(aiohixl.RegionUnavailable):
        for _ in range(50):  # the withdrawal notice races this loop; the target refuses anyway
            await peer.put(late, src[:4096])
            await asyncio.sleep(0.01)
    with pytest.raises(aiohixl.RegionUnavailable):
        await peer.region("late")


async def test_wrong_token_is_refused_and_listener_keeps_serving():
    target = await Target.start()
    try:
        await target.alloc("kv", 4096)
        async with aiohixl.Agent(token="wrong", transports=TCP) as agent:
            with pytest.raises(aiohixl.AuthenticationError):
                await agent.connect(target.address)
            with pytest.raises(aiohixl.InvalidArgument, match="token"):
                os.environ.pop("AIOHIXL_TOKEN", None)
                await aiohixl.Agent(transports=TCP).connect(target.address)
            peer = await agent.connect(target.address, token=TOKEN)
            src = agent.register(pattern(4096, 1))
            await peer.put(await peer.region("kv"), src)
        assert await target.hash("kv", 0, 4096) == sha(pattern(4096, 1))
    finally:
        await target.aclose()


async def test_client_refuses_listener_without_the_token():
    # A fake listener that answers HELLO with a CHALLENGE it cannot sign.
    async def fake(stream):
        ch = c.Channel(stream)
        await ch.expect(w.HELLO, w.MAX_UNAUTH_FRAME)
        await ch.send(w.Writer().u16(1).raw(os.urandom(32)).raw(os.urandom(32)).frame(w.CHALLENGE))
        await anyio.sleep(1)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, fake)
        async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
            with pytest.raises(aiohixl.AuthenticationError, match="does not hold the same token"):
                await agent.connect(f"127.0.0.1:{port}")
        tg.cancel_scope.cancel()


async def _raw_send(port: int, data: bytes) -> None:
    try:
        async with await anyio.connect_tcp("127.0.0.1", port) as s:
            await s.send(data)
            with anyio.move_on_after(0.2):
                await s.receive()
    except (OSError, anyio.EndOfStream, anyio.BrokenResourceError):
        pass


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def victim():
    target = await Target.start()
    await target.alloc("kv", 1 << 20, seed=4)
    yield target
    await target.aclose()


hello = w.Writer().raw(w.MAGIC).u16(1).u16(1).u8(0).raw(bytes(32)).frame(w.HELLO)
frames = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda t, b: w.Writer().raw(b).frame(t), st.integers(0, 255), st.binary(max_size=200)),
    st.builds(lambda b: hello + b, st.binary(max_size=200)),
    st.builds(lambda n, t: n.to_bytes(4, "little") + bytes([t]), st.integers(0, 2**32 - 1), st.integers(0, 12)),
)


@pytest.mark.asyncio(loop_scope="module")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=frames)
async def test_fuzzed_unauthenticated_bytes(victim, data):
    await _raw_send(victim.port, data)


@pytest.mark.asyncio(loop_scope="module")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=400))
async def test_fuzzed_frames_on_an_authenticated_data_connection(victim, data):
    # Get through the handshake as a real client, then send garbage where
    # native data frames belong: only that connection may close.
    async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
        ch = c.Channel(await anyio.connect_tcp("127.0.0.1", victim.port))
        info = await c.client_handshake(ch, TOKEN.encode(), w.ROLE_CONTROL, bytes(16), agent._identity(), "fuzz")
        data_ch = c.Channel(await anyio.connect_tcp("127.0.0.1", victim.port))
        await c.client_handshake(data_ch, TOKEN.encode(), w.ROLE_DATA, info.session, agent._identity(), "fuzz")
        await data_ch.stream.send(data)
        with anyio.move_on_after(0.05):
            try:
                await data_ch.stream.receive()  # a refusal, or the close of a bad frame
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
        await data_ch.aclose()
        await ch.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_listener_survived_the_fuzzing(victim):
    assert await victim.hash("kv", 0, 1 << 20) == sha(pattern(1 << 20, 4))
    async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
        peer = await agent.connect(victim.address)
        src = agent.register(pattern(1 << 20, 8))
        await peer.put(await peer.region("kv"), src)
    assert await victim.hash("kv", 0, 1 << 20) == sha(pattern(1 << 20, 8))


async def test_handshake_that_stalls_is_dropped(victim=None):
    target = await Target.start()
    try:
        s = socket.create_connection(("127.0.0.1", target.port))
        s.sendall(hello[:10])  # and then nothing
        await target.alloc("kv", 4096)
        async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:  # others are served meanwhile
            peer = await agent.connect(target.address)
            await peer.put(await peer.region("kv"), agent.register(bytearray(4096)))
        s.settimeout(10)
        assert s.recv(100) == b""  # closed by the listener's handshake timeout
        s.close()
    finally:
        await target.aclose()


async def test_kill_target_mid_transfer_then_reconnect():
    target = await Target.start()
    port = target.port
    await target.alloc("kv", 64 << 20)
    async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
        peer = await agent.connect(target.address)
        kv = await peer.region("kv")
        src = agent.register(pattern(64 << 20, 2))
        started = time.monotonic()
        tasks = [asyncio.create_task(peer.put(kv, src)) for _ in range(40)]
        await asyncio.sleep(0.05)
        target.kill()
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - killed
        lost = [r for r in results if isinstance(r, aiohixl.ConnectionLost)]
        assert all(r is None or isinstance(r, aiohixl.ConnectionLost) for r in results), results
        assert lost, f"40 puts of 64 MiB cannot all finish in 50 ms ({elapsed:.3f} s, {killed - started:.3f} s)"
        assert elapsed < 1.0, f"outstanding ops took {elapsed:.2f} s to fail"
        assert agent.outstanding == 0
        with pytest.raises(aiohixl.ConnectionLost, match="Peer.put"):
            await peer.put(kv, src)
        await target.proc.wait()

        # a new target on the same port: connecting again works
        target2 = await Target.start(listen=f"127.0.0.1:{port}")
        try:
            await target2.alloc("kv", 64 << 20)
            peer2 = await agent.connect(target2.address)
            await peer2.put(await peer2.region("kv"), src)
            assert await target2.hash("kv", 0, 64 << 20) == sha(pattern(64 << 20, 2))
        finally:
            await target2.aclose()


async def test_heartbeat_detects_a_silent_peer():
    target = await Target.start(heartbeat=0.2)
    try:
        await target.alloc("kv", 4096)
        async with aiohixl.Agent(token=TOKEN, transports=TCP, heartbeat_interval=0.2, heartbeat_timeout=0.6) as agent:
            peer = await agent.connect(target.address)
            kv = await peer.region("kv")
            src = agent.register(bytearray(4096))
            target.proc.send_signal(signal.SIGSTOP)  # alive but silent: a half-open connection
            await _stopped(target.proc.pid)
            try:
                start = time.monotonic()
                with pytest.raises(aiohixl.ConnectionLost, match="heartbeat"):
                    await peer.put(kv, src)
                assert time.monotonic() - start < 3.0
                assert isinstance(peer.broken, aiohixl.ConnectionLost)
            finally:
                target.proc.send_signal(signal.SIGCONT)
    finally:
        await target.aclose()


async def _stopped(pid: int) -> None:
    for _ in range(500):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "T":
                return
        await asyncio.sleep(0.01)
    raise AssertionError("the target did not stop")


async def test_closing_the_initiator_with_ops_in_flight():
    target = await Target.start()
    try:
        await target.alloc("kv", 64 << 20)
        agent = aiohixl.Agent(token=TOKEN, transports=TCP)
        await agent.start()
        peer = await agent.connect(target.address)
        kv = await peer.region("kv")
        src = agent.register(pattern(64 << 20, 2))
        tasks = [asyncio.create_task(peer.put(kv, src)) for _ in range(20)]
        await asyncio.sleep(0.02)
        await agent.aclose()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(r is None or isinstance(r, aiohixl.ClosedError) for r in results), results
        # the target is unharmed and serves a new peer
        async with aiohixl.Agent(token=TOKEN, transports=TCP) as again:
            p = await again.connect(target.address)
            await p.put((await p.region("kv"))[:4096], again.register(bytearray(4096)))
    finally:
        await target.aclose()


async def test_a_put_stalled_mid_payload_cannot_hold_a_region_forever():
    import struct

    target = await Target.start(stall=1.0)
    try:
        await target.alloc("kv", 1 << 20, seed=3)
        async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
            # A real client's handshake, then half a PUT frame and silence.
            ch = c.Channel(await anyio.connect_tcp("127.0.0.1", target.port))
            info = await c.client_handshake(ch, TOKEN.encode(), w.ROLE_CONTROL, bytes(16), agent._identity(), "stall")
            kv = [aiohixl.RemoteRegion(__import__("aiohixl").descriptor.decode(d)) for d in info.regions][0]
            data_ch = c.Channel(await anyio.connect_tcp("127.0.0.1", target.port))
            await c.client_handshake(data_ch, TOKEN.encode(), w.ROLE_DATA, info.session, agent._identity(), "stall")
            header = struct.pack("<IB3xI4xQQQ", 0x50445848, 1, kv.id, 0, 1 << 20, 1)
            await data_ch.stream.send(header + bytes(1000))
            await anyio.sleep(0.2)
            reply = await target.cmd(op="close", name="kv")  # waits for the stalled writer
            assert 0.5 < reply["seconds"] < 5.0, reply
            await data_ch.aclose()
            await ch.aclose()
    finally:
        await target.aclose()
