"""Two real processes over real tcp sockets: correctness, concurrency,
failure of the peer, authentication, and hostile input to the listener."""

import asyncio
import os
import resource
import signal
import socket
import struct
import time
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import numpy as np
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiohixl
from aiohixl import _testing as hooks
from aiohixl._control import handshake as c
from aiohixl._control import wire as w
from aiohixl._control.listener import Served
from aiohixl._control.session import Session
from aiohixl._loop.native import lib

from . import threads
from .harness import TOKEN, Target, pattern, sha, tcp_queues
from .waiting import wait_until, wait_until_sync

TCP = ("tcp",)  # these tests are about tcp: shared memory would take over on one host
SPACE = 256 << 20
SEED = 21


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair():
    # Its loop never turns for notifications, so its I/O thread reads every request: these tests
    # are of the initiator's side (its polls); a loop reading tcp itself is test_notify.py's.
    target = await Target.start(notify_poll_us=0)
    await target.alloc("kv", SPACE + 4096)  # memfd region
    await target.alloc("src", SPACE, seed=SEED, kind="register")  # user memory with a known pattern
    async with aiohixl.Agent("initiator", token=TOKEN, transports=TCP) as agent:
        peer = await agent.connect(target.address)
        assert peer.transport == "tcp"
        src_arr = pattern(SPACE, 7)
        src = agent.register(src_arr)
        dst_arr = np.zeros(SPACE, dtype=np.uint8)
        dst = agent.register(dst_arr)
        yield dict(
            target=target,
            agent=agent,
            peer=peer,
            src=src,
            src_arr=src_arr,
            dst=dst,
            dst_arr=dst_arr,
            kv=await peer.region("kv"),
            rsrc=await peer.region("src"),
            tsrc=pattern(SPACE, SEED),
        )
    await target.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_both_directions_at_once(pair):
    peer, kv, src, src_arr = pair["peer"], pair["kv"], pair["src"], pair["src_arr"]
    size, count = 1 << 20, 64
    async with aiohixl.Agent("back", listen="127.0.0.1:0", token=TOKEN, transports=TCP) as me:
        inbox_arr = np.zeros(size * count, dtype=np.uint8)
        me.register(inbox_arr, name="inbox", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
        pump = asyncio.create_task(
            pair["target"].cmd(
                op="pump", address=me.address, name="inbox", size=size, count=count, seed=99, transports=["tcp"]
            )
        )
        for _ in range(4):
            await asyncio.gather(
                *(peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(count))
            )
        await pump
        assert np.array_equal(inbox_arr, pattern(size * count, 99))
    assert await pair["target"].hash("kv", 0, size * count) == sha(src_arr[: size * count])


def pipes() -> int:
    """Pipes this process holds open."""
    fds, n = f"/proc/{os.getpid()}/fd", 0
    for fd in os.listdir(fds):
        try:
            n += os.readlink(f"{fds}/{fd}").startswith("pipe:")
        except FileNotFoundError:  # the listing's own fd, closed since
            pass
    return n


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("way", ["copy", "splice"])
async def test_a_large_puts_memory_is_free_to_change_once_it_completes(pair, way):
    """Large puts are copied into the socket (the default) or, with tcp_send="splice", hand the
    kernel their pages through a pipe the connection makes for it: either way one that completed
    has been read by the target, so the source may be rewritten at once. One buffer, rewritten
    after each put, lands as it was at each put (odd sizes and offsets too: pieces that do not
    fill a page), and stats() counts the bytes under the way they went."""
    kv, target = pair["kv"], pair["target"]

    buf = np.zeros(3 << 20, dtype=np.uint8)
    async with aiohixl.Agent("sender", token=TOKEN, transports=TCP, tcp_send=way) as agent:
        peer = await agent.connect(target.address)
        src = agent.register(buf)
        before = pipes()
        cases = [(0, 1 << 20), (5, (1 << 20) + 4093), (4096, (3 << 20) - 4096), (1, 64 << 10)]
        for i, (at, size) in enumerate(cases):
            buf[:] = pattern(len(buf), 40 + i)
            await peer.put(kv[i * (4 << 20) : i * (4 << 20) + size], src[at : at + size])
            buf[:] = 0xEE  # what the target must never see
        assert pipes() == before + (2 if way == "splice" else 0)
        for i, (at, size) in enumerate(cases):
            assert await target.hash("kv", i * (4 << 20), size) == sha(pattern(len(buf), 40 + i)[at : at + size])
        sent = agent.stats()["tcp_send"]
        # Counted: the frames (1 MiB chunks of a put) with 64 KiB or more, and their headers.
        chunks = [min(size - o, 1 << 20) for _, size in cases for o in range(0, size, 1 << 20)]
        payloads = sum(n for n in chunks if n >= 64 << 10)
        assert payloads < sent["spliced"] + sent["copied"] < payloads + 4096
        if way == "copy":
            assert sent["spliced"] == 0
        else:  # a tail under 64 KiB left by a short splice is copied
            assert sent["copied"] < len(cases) * (64 << 10)


async def test_an_agent_holds_at_most_16_splice_pipes_and_sends_the_rest_by_copy():
    """Each splice pipe counts against the user's pipe quota on the host: an agent makes at most
    16. Its 17th and 18th connections send their large puts by sendmsg, and they land as well."""
    size = 1 << 20
    async with AsyncExitStack() as stack:
        targets = [
            await stack.enter_async_context(aiohixl.Agent(f"t{i}", listen="127.0.0.1:0", token=TOKEN, transports=TCP))
            for i in range(18)
        ]
        kvs = [t.allocate(size, name="kv") for t in targets]
        agent = await stack.enter_async_context(aiohixl.Agent("many", token=TOKEN, transports=TCP, tcp_send="splice"))
        src = agent.register(pattern(size, 5))
        peers = [await agent.connect(t.address) for t in targets]
        before = pipes()
        for peer in peers:
            await peer.put(await peer.region("kv"), src)
        assert pipes() == before + 2 * 16
        for kv in kvs:
            assert sha(kv.memory) == sha(pattern(size, 5))


@pytest.mark.asyncio(loop_scope="module")
async def test_medium_puts_held_for_the_burst_land_in_order(pair):
    """Puts of 32 KiB or more posted at the call wait for the end of the loop's current callbacks
    and go out as one burst: they land, and what is posted after them (a small put sent at once,
    a notification) still comes after them on the wire."""
    peer, kv, src, src_arr, target = pair["peer"], pair["kv"], pair["src"], pair["src_arr"], pair["target"]
    size, count = 64 << 10, 16
    # The same range, written in turn: the last put posted is what stays there.
    await asyncio.gather(*(peer.put(kv[:size], src[i * size : (i + 1) * size]) for i in range(count)))
    assert await target.hash("kv", 0, size) == sha(src_arr[(count - 1) * size : count * size])
    # A small put (not held) posted after held ones overwrites them, not the other way round.
    await asyncio.gather(
        *(peer.put(kv[:size], src[i * size : (i + 1) * size]) for i in range(count)), peer.put(kv[:4096], src[:4096])
    )
    assert await target.hash("kv", 0, 4096) == sha(src_arr[:4096])
    assert await target.hash("kv", 4096, size - 4096) == sha(src_arr[(count - 1) * size + 4096 : count * size])
    # A notification posted behind held puts arrives once their bytes are in place.
    off = 8 * size
    held = [peer.put(kv[off + i * size : off + (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(count)]
    message = f"kv:{off}:{size * count}:{sha(src_arr[: size * count])}".encode()
    check = asyncio.create_task(target.cmd(op="take_note"))
    await peer.put(kv[:4096], src[:4096], notify=message)
    await asyncio.gather(*held)
    assert (await check)["in_place"]


@pytest.mark.asyncio(loop_scope="module")
async def test_bursts_announced_frame_by_frame_are_all_answered(pair):
    """A frame sent with others queued behind it says so (REQ_MORE) and the target keeps its
    answers for theirs: a burst larger than it keeps answers for (1 MiB), an op of many
    frames, gets answered with data, and a lone put after them all end and land."""
    peer, kv, rsrc, src, src_arr, target = (pair[k] for k in ("peer", "kv", "rsrc", "src", "src_arr", "target"))
    size, count = 256 << 10, 16  # 4 MiB of held puts, flushed together
    await asyncio.gather(
        *(peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(count))
    )
    assert await target.hash("kv", 0, size * count) == sha(src_arr[: size * count])
    piece = 4096
    pairs = [(kv[i * 2 * piece : i * 2 * piece + piece], src[i * piece : (i + 1) * piece]) for i in range(300)]
    await peer.put_many(pairs)
    for i in (0, 150, 299):
        assert await target.hash("kv", i * 2 * piece, piece) == sha(src_arr[i * piece : (i + 1) * piece])
    got = np.zeros(8 * piece, dtype=np.uint8)
    dst = pair["agent"].register(got)
    await peer.get_many([(dst[i * piece : (i + 1) * piece], rsrc[i * piece : (i + 1) * piece]) for i in range(8)])
    assert np.array_equal(got, pair["tsrc"][: 8 * piece])
    await peer.put(kv[:4096], src[:4096])
    assert await target.hash("kv", 0, 4096) == sha(src_arr[:4096])


@pytest.mark.asyncio(loop_scope="module")
async def test_a_held_burst_goes_out_when_its_first_op_gets_a_waiter(pair):
    """A task awaiting the burst's first put sends the burst then, not a loop iteration
    later; a burst gathered, or that nobody waits on yet, goes out with the loop's next turn."""
    peer, kv, src, src_arr, target = pair["peer"], pair["kv"], pair["src"], pair["src_arr"], pair["target"]
    agent = pair["agent"]
    size, count = 64 << 10, 8
    for _ in range(2):  # the first burst of a run is not held whole: its first put goes alone
        held = [peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(count)]
        assert hooks.held_ops(agent)  # held for a flush
        await held[0]  # this task waits on the first: the burst goes out now
        assert not hooks.held_ops(agent)
        await asyncio.gather(*held[1:])
    held = [peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(count)]
    assert hooks.held_ops(agent)
    gathered = asyncio.gather(*held)  # a Task per op: they step on the loop's turn
    await asyncio.sleep(0)  # the loop's turn flushes them
    assert not hooks.held_ops(agent)
    await gathered
    assert await target.hash("kv", 0, size * count) == sha(src_arr[: size * count])


@pytest.mark.asyncio(loop_scope="module")
async def test_a_waiter_per_op_as_posted_does_not_split_the_burst(pair):
    """A task per put, made as it is posted (with eager tasks each awaits its op at once),
    leaves the burst whole for the loop's turn; the finished burst's first op flushes
    nothing later on."""
    peer, kv, src, src_arr, target = pair["peer"], pair["kv"], pair["src"], pair["src_arr"], pair["target"]
    agent = pair["agent"]
    size, count = 64 << 10, 8
    await asyncio.gather(*(peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(2)))
    ended: list[int] = []
    first = []
    loop = asyncio.get_running_loop()
    factory = loop.get_task_factory()
    if hasattr(asyncio, "eager_task_factory"):  # 3.12+: each task awaits its op as it is made
        loop.set_task_factory(asyncio.eager_task_factory)
    try:
        for i in range(count):
            task = asyncio.ensure_future(peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]))
            task.add_done_callback(lambda f, i=i: ended.append(i))
            first.append(task)
    finally:
        loop.set_task_factory(factory)
    assert hooks.held_ops(agent) == count  # all held: one burst
    await asyncio.sleep(0)  # the loop's turn sends it
    assert not hooks.held_ops(agent)
    await asyncio.gather(*first)
    held = [peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(count)]
    await first[0]  # the old burst's first op: not this burst's
    assert hooks.held_ops(agent) == count
    await asyncio.gather(*held)
    assert sorted(ended) == list(range(count))
    assert await target.hash("kv", 0, size * count) == sha(src_arr[: size * count])


@pytest.mark.asyncio(loop_scope="module")
async def test_held_puts_go_out_while_the_event_loop_is_blocked(pair):
    """The flush of held puts is a loop callback; a loop blocked right after posting (a
    synchronous forward pass) does not keep them back: the I/O thread sends them."""
    peer, kv, src, src_arr, target = pair["peer"], pair["kv"], pair["src"], pair["src_arr"], pair["target"]
    size, count = 64 << 10, 8
    engine = hooks.engine(pair["agent"])
    # A burst flushed as usual leaves the hold timer set (a flush does not disarm it): it fires
    # while the puts below are held for less than their limit and must set itself again.
    await asyncio.gather(
        *(peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(count))
    )
    held = [peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(count)]

    def sent() -> bool:
        engine.drain()  # what the loop would do with the completions, done here to see them
        return all(f.done() for f in held)

    # The loop is blocked (a synchronous wait): no callback runs, the flush included. Well
    # within a heartbeat interval (1 s), whose frames would wake the I/O thread too.
    wait_until_sync(sent, timeout=0.5, what="held puts sent by the I/O thread")
    await asyncio.gather(*held)
    assert await target.hash("kv", 0, size * count) == sha(src_arr[: size * count])


@pytest.mark.asyncio(loop_scope="module")
async def test_a_lone_put_whose_answer_nobody_reads_still_ends(pair):
    """A lone small put's answer is left for the task that awaits it to read (the I/O
    thread does not watch for it); with nobody awaiting it and the loop blocked, the I/O
    thread reads it after all, and what comes after it is answered as usual."""
    peer, kv, src, src_arr, target = pair["peer"], pair["kv"], pair["src"], pair["src_arr"], pair["target"]
    engine = hooks.engine(pair["agent"])
    size = 4096
    for _ in range(32):  # after a poll that missed its answer, a few lone puts are not polled
        op = peer.put(kv[:size], src[:size])
        if hooks.polled(op):
            break
        await op
    assert hooks.polled(op)

    def ended() -> bool:
        engine.drain()  # what the loop would do with the completion, done here to see it
        return op.done()

    wait_until_sync(ended, timeout=5, what="the unread answer read by the I/O thread")
    await op
    await asyncio.gather(*(peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(4)))
    assert await target.hash("kv", 0, 4 * size) == sha(src_arr[: 4 * size])


@pytest.mark.asyncio(loop_scope="module")
async def test_lone_puts_end_where_their_answers_are_read_each_once(pair):
    """An awaited lone put whose answer its task reads ends right there, with no Future made
    and nothing through the completion ring. When that read also answers a put posted after
    it, both go through the ring: none ends twice, none is lost."""
    peer, kv, src, src_arr, target = pair["peer"], pair["kv"], pair["src"], pair["src_arr"], pair["target"]
    engine = hooks.engine(pair["agent"])
    size, rounds = 4096, 0
    unknown, completed = engine.unknown_completions, engine.completed
    without_future = 0
    # 100 rounds, and on until one poll caught its answer (bounded): a slow minute of the
    # host's tcp (round trips past the 50 us poll) can make the polls of 100 rounds all miss.
    while rounds < 100 or (not without_future and rounds < 3000):
        i, rounds = rounds, rounds + 1
        a, b = (2 * i % 16) * size, (2 * i % 16 + 1) * size
        first = peer.put(kv[a : a + size], src[a : a + size])
        await first
        without_future += hooks.ended_without_future(first)
        # Two posted before either is awaited: the first one's read may answer both, and
        # what it leaves in the ring is drained before the await returns.
        first, second = peer.put(kv[a : a + size], src[b : b + size]), peer.put(kv[b : b + size], src[a : a + size])
        await first
        assert not hooks.completions_unseen(pair["agent"])
        await second
    assert engine.unknown_completions == unknown
    assert engine.completed - completed == 3 * rounds
    assert pair["agent"].outstanding == 0
    assert without_future, f"no poll of {rounds} rounds caught its answer"
    assert await target.hash("kv", 0, 16 * size) == sha(
        np.concatenate([src_arr[(i ^ 1) * size : ((i ^ 1) + 1) * size] for i in range(16)])
    )


@pytest.mark.asyncio(loop_scope="module")
async def test_a_lone_put_with_a_notification_leaves_both_answers_to_its_task(pair):
    """A lone put(notify=) goes out in one send with its message, and both answers are left
    for the task that awaits it to read, as a lone put's is: neither wakes the I/O thread,
    then the loop. The messages arrive in order, each once its data is in place."""
    peer, kv, src, src_arr, target = pair["peer"], pair["kv"], pair["src"], pair["src_arr"], pair["target"]
    size, count = 4096, 32
    left = rounds = 0
    # Rounds of 32 until a put's answers were left to its task (bounded): after a poll that
    # missed, the next 15 are not polled, and in a slow minute of the host's tcp most miss.
    while not left and rounds < 30:
        rounds += 1
        collect = asyncio.create_task(target.cmd(op="collect", n=count))
        for i in range(count):
            op = peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size], notify=f"n{i}".encode())
            left += hooks.answers_left_to_poster(peer)
            await op
        assert [data for _, data in (await collect)["notes"]] == [f"n{i}" for i in range(count)]
    assert left, f"no put of {rounds * count} left its answers to its task"
    assert await target.hash("kv", 0, size * count) == sha(src_arr[: size * count])
    assert pair["agent"].outstanding == 0


async def test_held_puts_of_a_peer_closed_at_once_end_and_nothing_hangs():
    target = await Target.start()
    try:
        await target.alloc("kv", 4 << 20)
        async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
            src = agent.allocate(1 << 20)
            for _ in range(5):
                peer = await agent.connect(target.address)
                kv = await peer.region("kv")
                held = [peer.put(kv[i << 16 : (i + 1) << 16], src[i << 16 : (i + 1) << 16]) for i in range(16)]
                await peer.aclose()  # before the loop flushed them, or while they go out
                results = await asyncio.wait_for(asyncio.gather(*held, return_exceptions=True), 10)
                assert all(r is None or isinstance(r, aiohixl.ClosedError) for r in results), results
    finally:
        await target.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_regions_published_after_connect_and_withdrawn(pair):
    target, peer, src = pair["target"], pair["peer"], pair["src"]
    with pytest.raises(aiohixl.RegionUnavailable, match="late"):
        await peer.region("late")
    await target.alloc("late", 4096)
    late = await peer.region("late")
    await peer.put(late, src[:4096])
    await target.cmd(op="close", name="late")

    async def refused() -> bool:  # by the withdrawal notice, or else by the target itself
        try:
            await peer.put(late, src[:4096])
        except aiohixl.RegionUnavailable:
            return True
        return False

    await wait_until(refused, timeout=10, what="a put into the withdrawn region refused")
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
        await ch.send(w.Writer().u16(w.VERSION_MAX).raw(os.urandom(32)).raw(os.urandom(32)).frame(w.CHALLENGE))
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
    """A target under fuzzing, and a peer connected to it before any of it."""
    target = await Target.start()
    await target.alloc("kv", 1 << 20, seed=4)
    async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
        peer = await agent.connect(target.address)
        target.peer, target.kv = peer, await peer.region("kv")
        target.probe = agent.register(bytearray(8))
        target.count = 0
        yield target
    await target.aclose()


async def _still_serving(victim) -> None:
    """The fuzzed listener still answers lookups and places puts of a connection made before."""
    victim.count += 1
    victim.probe.memory[:] = victim.count.to_bytes(8, "little")
    assert (await victim.peer.region("kv")).nbytes == 1 << 20
    await victim.peer.put(victim.kv[:8], victim.probe)
    assert await victim.hash("kv", 0, 8) == sha(np.frombuffer(victim.probe.memory, dtype=np.uint8))


hello = w.Writer().raw(w.MAGIC).u16(w.VERSION_MIN).u16(w.VERSION_MAX).u8(0).raw(bytes(32)).frame(w.HELLO)
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
    await _still_serving(victim)


@pytest.mark.asyncio(loop_scope="module")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=400))
async def test_fuzzed_frames_on_an_authenticated_data_connection(victim, data):
    # Get through the handshake as a real client, then send garbage where
    # native data frames belong: only that connection may close.
    async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
        ch = c.Channel(await anyio.connect_tcp("127.0.0.1", victim.port))
        info = await c.client_handshake(ch, TOKEN.encode(), w.ROLE_CONTROL, bytes(16), hooks.identity(agent), "fuzz")
        data_ch = c.Channel(await anyio.connect_tcp("127.0.0.1", victim.port))
        await c.client_handshake(data_ch, TOKEN.encode(), w.ROLE_DATA, info.session, hooks.identity(agent), "fuzz")
        await data_ch.stream.send(data)
        with anyio.move_on_after(0.05):
            try:
                await data_ch.stream.receive()  # a refusal, or the close of a bad frame
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
        await data_ch.aclose()
        await ch.aclose()
    await _still_serving(victim)


@pytest.mark.asyncio(loop_scope="module")
async def test_listener_takes_new_connections_after_the_fuzzing(victim):
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


@asynccontextmanager
async def _heartbeating_pair():
    """A target and a peer of it that both beat every 0.2 s (0.6 s of silence breaks the
    connection), a 4 KiB region there and a source here: (target, peer, kv, src)."""
    target = await Target.start(heartbeat=0.2)
    try:
        await target.alloc("kv", 4096)
        async with aiohixl.Agent(token=TOKEN, transports=TCP, heartbeat_interval=0.2, heartbeat_timeout=0.6) as agent:
            peer = await agent.connect(target.address)
            yield target, peer, await peer.region("kv"), agent.register(bytearray(4096))
    finally:
        await target.aclose()


async def test_heartbeat_detects_a_silent_peer():
    async with _heartbeating_pair() as (target, peer, kv, src):
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


async def test_reading_a_poll_kept_goes_back_to_the_io_thread():
    """An awaited lone put's poll that read every answer keeps the reading (the next lone
    op needs no epoll_ctl); once no op comes, the hold timer hands it back to the I/O
    thread, which reads the target's heartbeats: the idle connection is not judged silent."""
    async with _heartbeating_pair() as (_, peer, kv, src):
        for _ in range(200):
            await peer.put(kv, src)
        await asyncio.sleep(1.5)  # idle, over twice the heartbeat timeout
        assert peer.broken is None
        await peer.put(kv, src)


async def _stopped(pid: int) -> None:
    def stopped() -> bool:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "T"

    await wait_until(stopped, timeout=5, what="the target stopped")


@asynccontextmanager
async def _pair_to_stop():
    """(target, agent, peer, kv, src): a tcp pair whose silence is judged only after 15 s
    (heartbeats every 5 s), for tests that stop the target for a while; it runs again at the end."""
    target = await Target.start(heartbeat=5.0)
    try:
        await target.alloc("kv", 1 << 20)
        async with aiohixl.Agent(token=TOKEN, transports=TCP, heartbeat_interval=5.0, heartbeat_timeout=15.0) as agent:
            peer = await agent.connect(target.address)
            yield target, agent, peer, await peer.region("kv"), agent.register(pattern(1 << 20, 6))
    finally:
        target.proc.send_signal(signal.SIGCONT)
        await target.aclose()


async def test_a_lone_put_failing_as_its_agent_closes_raises_that():
    """A lone put whose answer its awaiting task would read, still unawaited when its agent
    closes (the target stopped: no answer comes), fails with the close; awaiting it raises
    that, and the drain that failed it goes on with the rest."""
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        async with _pair_to_stop() as (target, agent, peer, kv, src):
            # Until a poll reads its answer (the next is then polled too): bounded, and long,
            # since in a slow minute of the host's tcp most polls miss (each miss skips 15).
            for _ in range(3000):
                op = peer.put(kv[:4096], src[:4096])
                polled = hooks.polled(op)
                await op
                if polled and hooks.ended_without_future(op):
                    break
            assert polled and hooks.ended_without_future(op), "no poll of 3000 puts read its answer"
            target.proc.send_signal(signal.SIGSTOP)
            await _stopped(target.proc.pid)
            op = peer.put(kv[:4096], src[:4096])
            assert hooks.polled(op)
            engine = hooks.engine(agent)
            await agent.aclose()
            with pytest.raises(aiohixl.ClosedError):
                await op
            assert op.done() and engine.unknown_completions == 0
    finally:
        loop.set_exception_handler(None)
    assert errors == []


async def test_a_put_stalled_mid_payload_cannot_hold_a_region_forever():
    """stall_timeout cuts a connection that stops in the middle of a put's payload, so the
    region it writes can be closed. The client says it is on another host (so its frame
    carries the region's key): a same-host peer must also acknowledge the withdrawal, which
    a silent one never does, and close() then waited WITHDRAW_TIMEOUT (5 s) in more than half
    the runs on a slow host, whatever the stall cut did."""
    import struct

    target = await Target.start(stall=1.0)
    try:
        await target.alloc("kv", 1 << 20, seed=3)
        async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
            # A real client's handshake, then half a PUT frame and silence.
            me = c.Identity(agent.id, "stall", c.HostIdentity("elsewhere/1", "boot-1", "ns"), ["tcp"])
            ch = c.Channel(await anyio.connect_tcp("127.0.0.1", target.port))
            info = await c.client_handshake(ch, TOKEN.encode(), w.ROLE_CONTROL, bytes(16), me, "stall")
            kv = [aiohixl.RemoteRegion(__import__("aiohixl").descriptor.decode(d)) for d in info.regions][0]
            data_ch = c.Channel(await anyio.connect_tcp("127.0.0.1", target.port))
            await c.client_handshake(data_ch, TOKEN.encode(), w.ROLE_DATA, info.session, me, "stall")
            header = struct.pack("<IB3xI4xQQQQ", 0x50445848, 1, kv.id, 0, 1 << 20, 1, kv.key)  # off, len, op id, key
            await data_ch.stream.send(header + bytes(1000))
            sock = data_ch.stream.extra(anyio.abc.SocketAttribute.raw_socket)
            await wait_until(lambda: tcp_queues(sock)[0] == 0, what="the target read the half frame")
            reply = await target.cmd(op="close", name="kv")  # waits for the stalled writer
            assert 0.5 < reply["seconds"] < 5.0, reply
            await data_ch.aclose()
            await ch.aclose()
    finally:
        await target.aclose()


async def test_peer_that_never_reads_its_answers_is_cut_off_and_close_returns():
    """A token holder sends gets, never reads the answers, keeps heart-beating: close() waits stall_timeout at most."""
    stall = 1.0
    async with aiohixl.Agent(
        "t", listen="127.0.0.1:0", token=TOKEN, transports=TCP, stall_timeout=stall, heartbeat_timeout=600
    ) as target:
        region = target.allocate(8 << 20, name="kv")
        info = hooks.region_info(region)
        port = int(target.address.rpartition(":")[2])
        # Another host: the target waits for no withdrawal acknowledgement, only the data path can hold it.
        me = c.Identity(os.urandom(16), "hoarder", c.HostIdentity("elsewhere/1", "boot-1", "ns"), ["tcp"])
        ctl = c.Channel(await anyio.connect_tcp("127.0.0.1", port))
        served = await c.client_handshake(ctl, TOKEN.encode(), w.ROLE_CONTROL, bytes(16), me, "hoarder")
        handlers = {w.WITHDRAWN: lambda r: None}
        session = Session(ctl, 0.2, handlers, lambda reason: None, "hoarder", lambda: None)
        async with anyio.create_task_group() as tg:
            tg.start_soon(session.run)
            data = c.Channel(await anyio.connect_tcp("127.0.0.1", port))
            await c.client_handshake(data, TOKEN.encode(), w.ROLE_DATA, served.session, me, "hoarder")
            sock = data.stream.extra(anyio.abc.SocketAttribute.raw_socket)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            magic = int.from_bytes(b"HXDP", "little")
            gets = b"".join(
                struct.pack("<IB3xI4xQQQQ", magic, 2, info.region_id, 0, 1 << 20, i + 1, info.key) for i in range(64)
            )
            await data.stream.send(gets)  # 64 MiB of answers, never read

            def answering() -> bool:  # the target read the gets and answers into our full buffer
                unread_there, unread_here = tcp_queues(sock)
                return unread_there == 0 and unread_here > 0

            await wait_until(answering, what="the target answering gets nobody reads")
            start = time.monotonic()
            with anyio.fail_after(120):  # forever, before: the answers held the region
                await region.close()
            elapsed = time.monotonic() - start
            assert elapsed < 30, elapsed
            tg.cancel_scope.cancel()
        await data.aclose()
        # The hoarder is cut off (its channel, then its session); a well-behaved peer is served.
        target.allocate(4096, name="next")
        async with aiohixl.Agent("next", token=TOKEN, transports=TCP) as agent:
            peer = await agent.connect(target.address)
            await peer.put(await peer.region("next"), agent.register(bytearray(b"n" * 4096)))


def _accept_failed(target: Target):
    async def failed() -> bool:
        return any("cannot accept connections" in m for m in (await target.state())["warnings"])

    return failed


async def test_listener_survives_fd_exhaustion_with_its_live_connections():
    """Out of fds, accept() fails (EMFILE): the listener backs off and goes on; live connections are untouched."""
    target = await Target.start()
    try:
        await target.alloc("kv", 1 << 20)
        async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
            peer = await agent.connect(target.address)
            kv = await peer.region("kv")
            src = agent.register(pattern(1 << 20, 3))
            pid = target.proc.pid
            used = len(os.listdir(f"/proc/{pid}/fd"))
            # What `prlimit --pid PID --nofile=N:N` does: a few fds to spare, then none.
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (used + 6, used + 6))
            hogs = [socket.create_connection(("127.0.0.1", target.port)) for _ in range(24)]
            try:
                fds = f"/proc/{pid}/fd"
                await wait_until(lambda: len(os.listdir(fds)) >= used + 6, what="the target's fds used up")
                await wait_until(_accept_failed(target), what="the target's accept() failing (EMFILE)")
                await peer.put(kv, src)  # the live connection was not collateral
                assert await target.hash("kv", 0, 1 << 20) == sha(pattern(1 << 20, 3))
            finally:
                for s in hogs:
                    s.close()
            # fds come back: new connections are accepted again
            peer2 = await agent.connect(target.address, timeout=60)
            src2 = agent.register(pattern(1 << 20, 4))
            await peer2.put(await peer2.region("kv"), src2)
            assert await target.hash("kv", 0, 1 << 20) == sha(pattern(1 << 20, 4))
            await peer.put(kv, src)
            assert await target.hash("kv", 0, 1 << 20) == sha(pattern(1 << 20, 3))
    finally:
        await target.aclose()


async def test_memfd_socket_checks_credentials_and_drops_idle_connections(monkeypatch):
    from aiohixl.transports import shm

    monkeypatch.setattr(shm, "HANDSHAKE_TIMEOUT", 0.5)
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN) as target:
        shm_transport = hooks.transport(target, "shm")
        # the listener starts its side servers in the background
        name = await wait_until(lambda: shm_transport.socket_name, what="the memfd socket listening")
        idle = [await anyio.connect_unix(name) for _ in range(shm.MAX_PER_PID + 2)]
        try:
            # more than MAX_PER_PID from one process: closed at once; the rest once the timeout passes
            with anyio.fail_after(30):
                for s in idle:
                    with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError)):
                        await s.receive()
        finally:
            for s in idle:
                await s.aclose()
        # the socket still serves: a same-host peer maps memfd regions through it
        target.allocate(4096, name="kv")
        async with aiohixl.Agent("me", token=TOKEN, transports=("shm",)) as me:
            peer = await me.connect(target.address)
            assert await peer.path(await peer.region("kv")) == "shm-memfd"


async def test_timeout_raises_and_the_op_still_completes():
    """A stopped target answers nothing: the caller's timeout fires; once it runs again the op lands."""
    async with _pair_to_stop() as (target, agent, peer, kv, src):
        target.proc.send_signal(signal.SIGSTOP)
        await _stopped(target.proc.pid)
        try:
            with pytest.raises(aiohixl.TransferTimeout, match="Peer.put.*may still complete"):
                await peer.put(kv, src, timeout=0.2)
            assert agent.outstanding == 1  # still accounted for
        finally:
            target.proc.send_signal(signal.SIGCONT)
        await wait_until(lambda: agent.outstanding == 0, timeout=60, what="the timed-out put's completion")
        assert await target.hash("kv", 0, 1 << 20) == sha(pattern(1 << 20, 6))


@pytest.mark.parametrize("knob", ["busy_poll_us", "serve_poll_us"])
@pytest.mark.parametrize("bad", [-1, 1.5, True, "50", None, 1_000_001])
async def test_poll_windows_are_validated(knob, bad):
    with pytest.raises(aiohixl.InvalidArgument, match=rf"^Agent: {knob}"):
        aiohixl.Agent(**{knob: bad})


def _io_threads() -> dict[str, tuple[float, int, str]]:
    """This process's tcp I/O threads: seconds each has spent on a CPU or runnable, waiting for
    one (Linux schedstat), how often it went to sleep (voluntary context switches), and its
    state now (R: on a CPU or runnable; S: asleep). A polling thread never sleeps and is always
    R, however little CPU a busy machine gives it: a virtual CPU the host takes away counts
    its thread's time as neither run nor waited."""
    found = {}
    for tid, (schedstat, status, stat) in threads.named("hixl-tcp-io", "schedstat", "status", "stat").items():
        ran, waited = schedstat.split()[:2]
        slept = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt_switches"))
        found[tid] = ((int(ran) + int(waited)) / 1e9, slept, stat.rpartition(")")[2].split()[0])
    return found


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux's schedstat")
@pytest.mark.parametrize("window_us", [0, 20, 300_000])
async def test_a_target_polls_for_requests_only_while_they_come(window_us):
    """serve_poll_us: after lone puts a target's I/O thread polls for the next request for the
    window (a long one here), never sleeping meanwhile, and not once they stop: an idle target
    costs nothing, whatever the window. 0: it never polls."""
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN, transports=TCP, serve_poll_us=window_us) as t:
        t.allocate(1 << 16, name="kv")
        async with aiohixl.Agent("i", token=TOKEN, transports=TCP, serve_poll_us=window_us) as agent:
            peer = await agent.connect(t.address)
            kv, src = await peer.region("kv"), agent.allocate(1 << 16)
            for _ in range(50):
                await peer.put(kv, src)
            start = _io_threads()
            await asyncio.sleep(0.2)
            end = _io_threads()
            polled = sum(end[tid][0] - start[tid][0] for tid in end if tid in start)
            if window_us == 300_000:
                # Runnable at both ends and asleep not once between. Its CPU time says nothing
                # here: with the host stealing the guest's CPU, a thread that never slept read
                # 0.06-0.19 s of 0.2, and once none at all.
                pollers = [
                    tid
                    for tid in end
                    if tid in start and end[tid][1] == start[tid][1] and start[tid][2] == end[tid][2] == "R"
                ]
                assert pollers, f"no I/O thread polled through the 0.2 s: {start} -> {end}"
            elif window_us == 0:
                assert polled < 0.02, f"the I/O threads were awake {polled:.3f} s of 0.2 s without polling"
            await asyncio.sleep(window_us / 1e6)
            start = time.process_time()
            await asyncio.sleep(1.0)
            used = time.process_time() - start
            assert used < 0.02, f"an idle target used {used:.3f} s of CPU in 1 s"


async def test_latency_mode_ops_land_in_order_end_inline_and_fail_as_usual():
    """busy_poll_us on both sides: small ops end inline (their Future is done at the call), their
    bytes land and read back, a notification still follows its data, a refused op still fails
    (through the ring), and large ops still take the usual path."""
    target = await Target.start(busy_poll_us=50)
    size, count = 4096, 64
    try:
        await target.alloc("kv", 4 << 20)
        await target.alloc("ro", 4096, access=int(aiohixl.Access.REMOTE_READ), seed=5)
        # A window long enough that a loaded machine still answers within it: ops end inline.
        # Heartbeats checked every ms while this thread stamps what it reads: none may misfire.
        async with aiohixl.Agent(
            token=TOKEN, transports=TCP, busy_poll_us=200_000, heartbeat_interval=0.004, heartbeat_timeout=5.0
        ) as agent:
            peer = await agent.connect(target.address)
            kv, ro = await peer.region("kv"), await peer.region("ro")
            src_arr = pattern(size * count, 11)
            src = agent.register(src_arr)
            back_arr = np.zeros(size * count, dtype=np.uint8)
            back = agent.register(back_arr)
            inline = 0
            for i in range(count):
                fut = peer.put(kv[i * size : (i + 1) * size], src[i * size : (i + 1) * size])
                inline += fut.done()
                await fut
            assert inline > 0  # the mode did something: answers were read by the caller
            # Overwrites in order: the last put to a range is what stays there.
            for i in range(count):
                await peer.put(kv[:size], src[i * size : (i + 1) * size])
            assert await target.hash("kv", 0, size) == sha(src_arr[(count - 1) * size :])
            assert await target.hash("kv", size, size * (count - 1)) == sha(src_arr[size:])
            await peer.put(kv[:size], src[:size])
            for i in range(count):
                await peer.get(back[i * size : (i + 1) * size], kv[i * size : (i + 1) * size])
            assert np.array_equal(back_arr, src_arr)
            # Gathered: several in flight at once on the one connection (many times: the heartbeat
            # checks run meanwhile).
            for _ in range(20):
                await asyncio.gather(*(peer.put(kv[i * size : (i + 1) * size], src[:size]) for i in range(count)))
            assert peer.broken is None
            assert await target.hash("kv", 0, size * count) == sha(np.tile(src_arr[:size], count))
            # A refused op fails as it does without the mode, and the path stays usable.
            with pytest.raises(aiohixl.AccessDenied):
                await peer.put(ro[:size], src[:size])
            assert peer.broken is None
            # The data is in place when its notification arrives.
            message = f"kv:0:{size}:{sha(src_arr[size : 2 * size])}".encode()
            check = asyncio.create_task(target.cmd(op="take_note"))
            await peer.put(kv[:size], src[size : 2 * size], notify=message)
            assert (await check)["in_place"]
            # A large op (more than one frame, sent partly by the I/O thread) is unaffected.
            big = agent.allocate(3 << 20)
            np.frombuffer(big.memory, dtype=np.uint8)[:] = pattern(3 << 20, 12)
            fut = peer.put(kv[: 3 << 20], big)
            await fut
            assert await target.hash("kv", 0, 3 << 20) == sha(pattern(3 << 20, 12))
    finally:
        await target.aclose()


async def test_without_the_latency_mode_no_op_ends_inline():
    target = await Target.start()
    try:
        await target.alloc("kv", 1 << 20)
        async with aiohixl.Agent(token=TOKEN, transports=TCP) as agent:
            peer = await agent.connect(target.address)
            kv = await peer.region("kv")
            src = agent.allocate(4096)
            for _ in range(20):
                fut = peer.put(kv[:4096], src)
                assert not fut.done()  # its completion comes through the ring and the event loop
                await fut
    finally:
        await target.aclose()


async def test_a_data_connection_the_native_side_could_not_take_is_not_reported_taken():
    """take_data_connection says False when hx_tcp_serve_fd fails (here: the agent's native side has stopped)."""
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN, transports=TCP) as agent:
        tcp = hooks.transport(agent, "tcp")
        await agent.connect(agent.address)  # the native I/O thread runs
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        accepted = anyio.Event()
        results: list[bool] = []
        lib.hx_agent_shutdown(hooks.engine(agent).native)  # no I/O thread takes connections now

        async def serve(stream) -> None:
            results.append(await tcp.take_data_connection(c.Channel(stream), Served(os.urandom(16), None)))
            accepted.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, serve)
            client = await anyio.connect_tcp("127.0.0.1", port)
            with anyio.fail_after(10):
                await accepted.wait()
            tg.cancel_scope.cancel()
        await client.aclose()
        await listener.aclose()
        assert results == [False]
