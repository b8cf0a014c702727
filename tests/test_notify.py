"""Notifications: after the data, on every path; ordered; held back, never lost;
and connections (with their heartbeats) that survive a blocked event loop.

The target is a real process: it checks its own bytes the moment a message
arrives (tests/target.py ``take_note``), not when the sender says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import aiohixl
from aiohixl import _testing as hooks
from aiohixl._loop.native import lib

from .harness import TOKEN, Target, pattern, sha
from .test_contract import IN_VM, PATHS, RUN
from .waiting import all_end, wait_until

# Sizes up to 64 MiB; in the Soft-RoCE VM (emulated, ~100x slower) up to 8 MiB: its 1000 ops take ~1 min.
SPACE = (8 << 20) if IN_VM else (64 << 20)
OPS = 1000
# Path-independent tests run on the host; the VM runs the verbs path only.
not_in_vm = pytest.mark.skipif(IN_VM, reason="not path-specific: runs outside the Soft-RoCE VM")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=RUN)
async def path(request):
    """(initiator agent, peer, the target's region, source) over one path; target None: loopback."""
    name = request.param
    transports, kind = PATHS[name]
    target = None if name == "loopback" else await Target.start()
    async with aiohixl.Agent(f"sender-{name}", token=TOKEN, transports=transports) as agent:
        if target is None:
            arr = np.frombuffer(agent.allocate(SPACE, name="kv").memory, dtype=np.uint8)
            peer = agent.loopback()
        else:
            await target.alloc("kv", SPACE, kind=kind)
            peer = await agent.connect(target.address)
            arr = None
        kv = await peer.region("kv")
        assert await peer.path(kv) == name
        src_arr = pattern(SPACE, 5)
        yield {
            "name": name,
            "agent": agent,
            "peer": peer,
            "kv": kv,
            "arr": arr,
            "target": target,
            "src_arr": src_arr,
            "src": agent.register(src_arr),
        }
    if target is not None:
        await target.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_the_data_is_in_place_when_its_notification_arrives(path):
    rng = np.random.default_rng(9)
    peer, kv, src, src_arr = path["peer"], path["kv"], path["src"], path["src_arr"]
    for i in range(OPS):
        n = int(math.exp(rng.uniform(0, math.log(SPACE))))  # 1 B to SPACE, log-uniform
        off, a = int(rng.integers(0, SPACE - n + 1)), int(rng.integers(0, SPACE - n + 1))
        message = f"kv:{off}:{n}:{sha(src_arr[a : a + n])}".encode()
        if path["target"] is None:
            await peer.put(kv[off : off + n], src[a : a + n], notify=message)
            note = await path["agent"].notification(timeout=60)
            assert note.data == message and note.peer == path["agent"].name
            assert hashlib.sha256(path["arr"][off : off + n]).hexdigest() == sha(src_arr[a : a + n]), i
        else:
            # The target takes the message and hashes its bytes while we are still awaiting.
            check = asyncio.create_task(path["target"].cmd(op="take_note"))
            if i % 2:
                await peer.put(kv[off : off + n], src[a : a + n], notify=message)
            else:
                await peer.put_many([(kv[off : off + n], src[a : a + n])], notify=message)
            reply = await check
            assert reply["in_place"], (i, n)
            assert reply["peer"] == path["agent"].name


@pytest.mark.asyncio(loop_scope="module")
async def test_a_put_with_its_message_is_posted_at_the_call(path):
    """Under asyncio a put(notify=) on a path in use goes out at the call, message and all,
    as a plain put does: shm rings the doorbell once its inline copy is done; tcp and verbs
    send the message behind the data (tcp: the two as one op). The target finds the bytes in
    place."""
    if path["target"] is None:
        pytest.skip("loopback: the target is this agent")
    agent, peer, kv, src, src_arr = path["agent"], path["peer"], path["kv"], path["src"], path["src_arr"]
    await peer.put(kv[:4096], src[:4096])  # the path is set up
    sent, outstanding = agent.stats()["notifications"]["sent"], agent.outstanding
    op = peer.put(kv[4096:8192], src[8192:12288], notify=f"kv:4096:4096:{sha(src_arr[8192:12288])}".encode())
    assert agent.stats()["notifications"]["sent"] == sent + 1, "the message goes at the call, not at the await"
    if path["name"] == "tcp":  # one native op, answered once both are: no Task, nothing held
        assert agent.outstanding == outstanding + 1
    assert (await path["target"].cmd(op="take_note"))["in_place"]
    await op


@pytest.mark.asyncio(loop_scope="module")
async def test_a_put_never_awaited_moves_its_bytes_and_then_its_message(path):
    """An op never awaited still moves its bytes (docs/api.md); with notify= its message goes
    too, after them, also where the copy outlasts the call (shm: over 1 MiB)."""
    if path["target"] is None:
        pytest.skip("loopback: the target is this agent")
    peer, kv, src, src_arr = path["peer"], path["kv"], path["src"], path["src_arr"]
    n = SPACE // 4
    await peer.put(kv[:4096], src[:4096])  # the path is set up
    check = asyncio.create_task(path["target"].cmd(op="take_note", timeout=30))
    peer.put(kv[:n], src[n : 2 * n], notify=f"kv:0:{n}:{sha(src_arr[n : 2 * n])}".encode())  # dropped
    assert (await check)["in_place"]


async def _messages(path: dict, n: int, timeout: float = 60) -> list[str]:
    """The next ``n`` messages the target takes, in the order it takes them."""
    if path["target"] is None:
        return [(await path["agent"].notification(timeout=timeout)).data.decode() for _ in range(n)]
    return [data for _, data in (await path["target"].cmd(op="collect", n=n, timeout=timeout))["notes"]]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("awaited", ["in turn", "together", "never"])
async def test_messages_arrive_in_call_order_however_their_puts_are_awaited(path, awaited):
    """A message still waiting for its put's copy holds the peer's later messages back: a
    later put that ends at once (shm's and loopback's inline copy) cannot send its message
    ahead of it, whether the puts are awaited one after the other, together, or not at all."""
    peer, kv, src = path["peer"], path["kv"], path["src"]
    big = SPACE // 4
    collect = asyncio.create_task(_messages(path, 3))
    ops = [
        peer.put(kv[:big], src[:big], notify=b"first"),
        peer.put(kv[big : big + 4096], src[big : big + 4096], notify=b"second"),
        peer.put_many([(kv[big + 4096 : big + 8192], src[:4096])], notify=b"third"),
    ]
    if awaited == "in turn":
        for op in ops:
            await op
    elif awaited == "together":
        await asyncio.gather(*ops)
    else:
        asyncio.ensure_future(ops[2])  # a coroutine: it goes once a task runs it
    assert await collect == ["first", "second", "third"]


@pytest.mark.asyncio(loop_scope="module")
async def test_a_message_goes_once_its_data_lands_though_its_caller_timed_out_or_was_cancelled(path):
    """The data of a put that timed out, or whose awaiting task was cancelled, still lands
    (docs/api.md): so does its message, after it, on every path, and the messages of the
    puts after it come after it."""
    peer, kv, src, src_arr = path["peer"], path["kv"], path["src"], path["src_arr"]
    n = SPACE // 4

    def message(a: int) -> bytes:
        return f"kv:0:{n}:{sha(src_arr[a : a + n])}".encode()

    for how in ("timeout", "cancel-posted", "cancel-coroutine"):
        if path["target"] is not None:
            check = asyncio.create_task(path["target"].cmd(op="take_note", timeout=60))
        if how == "timeout":
            try:
                await peer.put(kv[:n], src[n : 2 * n], timeout=1e-6, notify=message(n))
            except aiohixl.TransferTimeout:
                pass  # the usual end: the op goes on
            expected = n
        elif how == "cancel-posted":
            task = asyncio.ensure_future(peer.put(kv[:n], src[2 * n : 3 * n], notify=message(2 * n)))
            await asyncio.sleep(0)  # it awaits the op posted at the call
            task.cancel()
            expected = 2 * n
        else:
            task = asyncio.create_task(peer.put_many([(kv[:n], src[:n])], notify=message(0)))
            await wait_until(lambda t=task: path["agent"].outstanding > 0 or t.done())  # posted
            task.cancel()
            expected = 0
        if path["target"] is None:
            note = await path["agent"].notification(timeout=60)
            assert note.data == message(expected), how
            assert hashlib.sha256(path["arr"][:n]).hexdigest() == sha(src_arr[expected : expected + n]), how
        else:
            assert (await check)["in_place"], how


@not_in_vm
async def test_a_put_with_its_message_through_a_ring_of_one():
    """max_inflight=1: a put and the message behind it are two ops, more than the completion
    ring holds; the message waits for the put instead (posting both deadlocked the loop in
    tcp's flush, which waited for room in the ring that only that loop drains)."""
    target = await Target.start()
    try:
        await target.alloc("kv", 1 << 20)
        async with aiohixl.Agent("ring-of-one", token=TOKEN, transports=("tcp",), max_inflight=1) as agent:
            src_arr = pattern(4096, 3)
            src = agent.register(src_arr)
            peer = await agent.connect(target.address)
            kv = await peer.region("kv")
            for _ in range(20):
                check = asyncio.create_task(target.cmd(op="take_note", timeout=30))
                await peer.put(kv[:4096], src[:4096], notify=f"kv:0:4096:{sha(src_arr)}".encode())
                assert (await check)["in_place"]
    finally:
        await target.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_refused_op_sends_no_notification(path):
    peer, kv, src = path["peer"], path["kv"], path["src"]
    import dataclasses

    from aiohixl.remote import RemoteRegion

    longer = RemoteRegion(dataclasses.replace(kv.info, nbytes=2 * SPACE))
    with pytest.raises((aiohixl.OutOfBounds, aiohixl.AccessDenied, aiohixl.ConnectionLost)):
        await peer.put(longer[SPACE - 8 : SPACE + 8], src[:16], notify=b"never")
    if peer.broken:  # verbs: a remote access error ends the queue pair
        return
    await peer.notify(b"kv:0:0:" + hashlib.sha256(b"").hexdigest().encode())
    if path["target"] is None:
        assert (await path["agent"].notification(timeout=10)).data.startswith(b"kv:0:0")
    else:
        assert (await path["target"].cmd(op="take_note"))["in_place"]


@not_in_vm
async def test_ordered_per_sender_none_lost_from_four_senders():
    senders, each = 4, 2500
    target = await Target.start()
    try:
        agents = [aiohixl.Agent(f"s{k}", token=TOKEN) for k in range(senders)]
        for a in agents:
            await a.start()
        peers = [await a.connect(target.address) for a in agents]
        collect = asyncio.create_task(target.cmd(op="collect", n=senders * each))

        async def send(k: int) -> None:
            for i in range(each):
                await peers[k].notify(f"{k}:{i}".encode())

        await asyncio.gather(*(send(k) for k in range(senders)))
        reply = await collect
        seen: dict[str, list[int]] = {}
        for peer_name, data in reply["notes"]:
            k, i = data.split(":")
            assert peer_name == f"s{k}"
            seen.setdefault(k, []).append(int(i))
        assert seen == {str(k): list(range(each)) for k in range(senders)}
        assert reply["dropped"] == 0
        for a in agents:
            await a.aclose()
    finally:
        await target.aclose()


async def _received_at_least(target: Target, n: int) -> bool:
    return (await target.state())["received"] >= n


@not_in_vm
async def test_a_full_queue_holds_senders_back_and_loses_nothing():
    # The native channel's hold-back; shm's doorbell ring in front of it: the test below.
    target = await Target.start(max_notes=8)
    try:
        async with aiohixl.Agent("sender", token=TOKEN, transports=("tcp",)) as agent:
            peer = await agent.connect(target.address)
            sends = [asyncio.create_task(peer.notify(f"m{i}".encode())) for i in range(100)]
            # Nobody takes any: the queue fills. All 100 went out at once, in order on one
            # connection; the state query after it has filled is a round trip through the
            # target's loop, long after the rest would have been queued had nothing held them.
            await wait_until(lambda: _received_at_least(target, 8), what="the target's queue full")
            received = (await target.state())["received"]
            assert received < 100, "a full queue must hold senders back"
            assert sum(t.done() for t in sends) <= received  # a notify returns once queued there
            collect = asyncio.create_task(target.cmd(op="collect", n=100))
            await all_end(sends, 120, lambda: f"peer.broken={peer.broken!r}", collect)
            reply = await collect
            assert [d for _, d in reply["notes"]] == [f"m{i}" for i in range(100)]
            assert reply["dropped"] == 0
    finally:
        await target.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_shm_notifications_ring_the_doorbell(path):
    if path["name"].startswith("shm"):
        link = hooks.notes_link(path["peer"])
        assert link.name == "shm" and link.bell, "shm notes ring the target's doorbell, not the channel"


@not_in_vm
async def test_a_full_doorbell_ring_holds_the_sender_back_in_order():
    """The target's loop is blocked: the ring fills, the rest go the channel's way and wait
    there (its queue is full too); nothing is lost and the order holds across both ways."""
    target = await Target.start(max_notes=8)
    n = 3 * lib.HX_BELL_SLOTS
    try:
        async with aiohixl.Agent("sender", token=TOKEN) as agent:
            peer = await agent.connect(target.address)
            assert hooks.notes_link(peer).bell
            await target.block(30.0)
            blocked = asyncio.create_task(target.unblocked())
            sends = [asyncio.create_task(peer.notify(f"m{i}".encode())) for i in range(n)]
            # A note in the ring is queued there; the next waits for the target's native
            # thread, which queues the ring's first and then has no room.
            await wait_until(lambda: sum(t.done() for t in sends) >= lib.HX_BELL_SLOTS, what="the ring full")
            assert sum(t.done() for t in sends) == lib.HX_BELL_SLOTS
            assert not blocked.done(), "the target's loop ran: the test proves nothing"
            await blocked
            collect = asyncio.create_task(target.cmd(op="collect", n=n))
            await all_end(sends, 120, lambda: f"peer.broken={peer.broken!r}", collect)
            reply = await collect
            assert [d for _, d in reply["notes"]] == [f"m{i}" for i in range(n)]
            assert reply["dropped"] == 0
            await peer.notify(b"after")  # the ring again, behind all of them
            assert (await target.cmd(op="collect", n=1))["notes"] == [["sender", "after"]]
    finally:
        await target.aclose()


async def _dropped_at_least(target: Target, n: int) -> bool:
    return (await target.state())["dropped"] >= n


@not_in_vm
@pytest.mark.parametrize(
    "forged",
    [
        {"seq_skew": 5, "length": 3, "tail_step": 1},  # a record not numbered as its slot
        {"seq_skew": 0, "length": 5000, "tail_step": 1},  # longer than a notification
        {"seq_skew": 0, "length": 3, "tail_step": 1000},  # a tail past a full ring
        {"seq_skew": 0, "length": 3, "tail_step": -1},  # a tail behind the target's head
    ],
)
async def test_a_malformed_ring_record_is_dropped_and_the_target_carries_on(forged):
    target = await Target.start()
    try:
        async with aiohixl.Agent("hostile", token=TOKEN) as agent:
            peer = await agent.connect(target.address)
            await peer.notify(b"before")
            assert (await target.cmd(op="collect", n=1))["notes"] == [["hostile", "before"]]
            hooks.forge_bell_record(peer, **forged)
            await wait_until(lambda: _dropped_at_least(target, 1), what="the forged record dropped")
            # The ring is read no more; the sender is told why its next note cannot go.
            with pytest.raises(aiohixl.ProtocolError):
                await peer.notify(b"after")
        state = await target.state()
        assert state["dropped"] == 1 and state["received"] == 1
        async with aiohixl.Agent("honest", token=TOKEN) as agent:
            peer = await agent.connect(target.address)
            await peer.notify(b"fine")
            assert (await target.cmd(op="collect", n=1))["notes"] == [["honest", "fine"]]
    finally:
        await target.aclose()


@not_in_vm
async def test_notes_to_a_closed_target_fail():
    target = await Target.start()
    async with aiohixl.Agent("sender", token=TOKEN) as agent:
        peer = await agent.connect(target.address)
        await peer.notify(b"one")
        await target.aclose()  # its agent closed its rings on the way out, then the process ended
        with pytest.raises(aiohixl.ConnectionLost):
            await peer.notify(b"too late")


@contextlib.asynccontextmanager
async def _heartbeat_sender(**target_knobs: int) -> AsyncIterator[tuple[Target, Any, Any, Any]]:
    """A target process with a 1 MiB region "kv" and a tcp sender to it, heartbeat 0.5 s /
    timeout 1.5 s on both sides: (target, peer, kv, src), src the sender's 1 MiB of pattern(seed 3)."""
    target = await Target.start(heartbeat=0.5, **target_knobs)
    try:
        await target.alloc("kv", 1 << 20)
        async with aiohixl.Agent(
            "sender", token=TOKEN, transports=("tcp",), heartbeat_interval=0.5, heartbeat_timeout=1.5
        ) as agent:
            peer = await agent.connect(target.address)
            yield target, peer, await peer.region("kv"), agent.register(pattern(1 << 20, 3))
    finally:
        await target.aclose()


@not_in_vm
async def test_a_target_whose_loop_is_blocked_keeps_its_connections():
    # heartbeat 0.5 s / timeout 1.5 s on both sides: far shorter than the block.
    block = 30.0
    async with _heartbeat_sender() as (target, peer, kv, src):
        await target.block(block)  # the target's loop is in time.sleep now
        blocked = asyncio.create_task(target.unblocked())
        start = time.monotonic()
        for i in range(1000):
            await peer.put(kv[(i % 256) * 4096 : (i % 256 + 1) * 4096], src[:4096], notify=f"n{i}".encode())
        during = time.monotonic() - start
        assert not blocked.done() and during < block, "the puts landed while the target's loop slept"
        await asyncio.sleep(3.0)  # idle, past the heartbeat timeout: still connected
        assert peer.broken is None
        await blocked
        reply = await target.cmd(op="collect", n=1000)
        assert [d for _, d in reply["notes"]] == [f"n{i}" for i in range(1000)]
        assert await target.hash("kv", 0, 4096) == sha(pattern(1 << 20, 3)[:4096])
        await peer.put(kv[:4096], src[:4096])  # and the connection works on
        assert peer.broken is None


@not_in_vm
async def test_typed_errors(agent):
    agent.allocate(16, name="x")
    peer = agent.loopback()
    x = await peer.region("x")
    src = agent.register(bytearray(16))
    with pytest.raises(aiohixl.InvalidArgument, match="at most 4096 bytes"):
        await peer.put(x, src, notify=bytes(4097))
    with pytest.raises(aiohixl.InvalidArgument, match="notify= takes bytes, not str"):
        await peer.put(x, src, notify="text")
    with pytest.raises(aiohixl.InvalidArgument, match="at most 4096"):
        await peer.notify(bytes(5000))
    await peer.notify(bytes(4096))  # the limit itself is fine
    assert len((await agent.notification(timeout=5)).data) == 4096
    with pytest.raises(aiohixl.NotificationTimeout):
        await agent.notification(timeout=0.05)


@not_in_vm
async def test_notification_on_a_closed_agent_and_iteration_ends():
    agent = aiohixl.Agent("closing")
    await agent.start()
    peer = agent.loopback()
    await peer.notify(b"one")
    got = []

    async def consume():
        async for note in agent.notifications():
            got.append(note.data)

    task = asyncio.create_task(consume())
    waiting = asyncio.create_task(agent.notification())
    # consume() waits for its second message from the moment it has the first; the loop
    # turns meanwhile, so the other task waits too.
    await wait_until(lambda: got == [b"one"], what="the first message consumed")
    assert not waiting.done() and not task.done()
    await agent.aclose()
    await asyncio.wait_for(task, 5)  # the iteration ends with the agent
    assert got == [b"one"]
    with pytest.raises(aiohixl.ClosedError):
        await waiting
    with pytest.raises(aiohixl.ClosedError, match="Agent.notification"):
        await agent.notification()


@not_in_vm
async def test_two_senders_of_one_name_are_told_apart_by_their_id():
    """``Notification.peer`` is the sender's name; ``peer_id`` its ``Agent.id``, unique."""
    async with aiohixl.Agent("target", listen="127.0.0.1:0", token=TOKEN) as target:
        async with aiohixl.Agent("twin", token=TOKEN) as one, aiohixl.Agent("twin", token=TOKEN) as two:
            for sender in (one, two):
                peer = await sender.connect(target.address)
                await peer.notify(sender.id)
                note = await target.notification(timeout=30)
                assert (note.data, note.peer, note.peer_id) == (sender.id, "twin", sender.id)
                assert sender.id[:4].hex() in repr(note)
            await target.loopback().notify(b"self")
            note = await target.notification(timeout=30)
            assert (note.peer, note.peer_id) == ("target", target.id)


async def test_waits_of_different_timeouts_each_end_at_their_own(agent):
    """Waits with timeouts share one loop timer, set for the earliest deadline: a shorter wait
    that comes later still ends on time, a longer one waits on once a shorter one ended, and
    none ends before its deadline."""
    peer = agent.loopback()
    loop = asyncio.get_running_loop()
    inbox = agent._core.inbox

    async def timed_out(timeout: float, match: bytes) -> float:
        start = loop.time()
        with pytest.raises(aiohixl.NotificationTimeout, match=f"within {timeout} s"):
            await agent.notification(timeout=timeout, match=match)
        return loop.time() - start

    long = asyncio.ensure_future(agent.notification(timeout=60, match=b"long"))
    await wait_until(lambda: len(inbox._waiters) == 1, what="the long wait waits")
    # Shorter than the timer set for the long wait: the timer is set earlier (not the long
    # wait's deadline, a minute away: 30 s is no bound on speed, only on which timer fired).
    assert 0.05 <= await timed_out(0.05, b"short") < 30
    # Two more, the later one longer: the first ends, the timer is set for the second.
    first = asyncio.ensure_future(timed_out(0.05, b"first"))
    second = asyncio.ensure_future(timed_out(0.2, b"second"))
    assert 0.05 <= await first < 30
    assert 0.2 <= await second < 30
    assert not long.done()
    await peer.notify(b"long")
    assert (await long).data == b"long"
    assert inbox._waiters == []


async def test_a_wait_that_times_out_or_is_cancelled_takes_nothing(agent):
    """notification(timeout=) under asyncio is a loop timer on the waiter: a wait that ends by
    it, or by its task's cancellation, leaves the waiter list empty and takes no message."""
    peer = agent.loopback()
    inbox = agent._core.inbox
    with pytest.raises(aiohixl.NotificationTimeout, match="within 0 s"):
        await agent.notification(timeout=0)
    waiting = asyncio.ensure_future(agent.notification(timeout=60))
    await wait_until(lambda: len(inbox._waiters) == 1, what="the task waits")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert inbox._waiters == []
    await peer.notify(b"a")
    await peer.notify(b"b")
    with pytest.raises(aiohixl.NotificationTimeout):
        await agent.notification(timeout=0.01, match=b"neither")
    assert inbox._waiters == []
    assert [(await agent.notification(timeout=5)).data for _ in range(2)] == [b"a", b"b"]
    # A message that arrives while the timer is armed is the one returned.
    waiting = asyncio.ensure_future(agent.notification(timeout=60))
    await wait_until(lambda: len(inbox._waiters) == 1, what="the task waits")
    await peer.notify(b"c")
    assert (await waiting).data == b"c"


@not_in_vm
@pytest.mark.parametrize("bad", [-1, 1.5, True, "50", None, 1_000_001])
def test_notify_poll_us_is_validated(bad):
    with pytest.raises(aiohixl.InvalidArgument, match=r"^Agent: notify_poll_us"):
        aiohixl.Agent(notify_poll_us=bad)


async def _loop_turns(seconds: float) -> tuple[int, float]:
    """While this task sleeps ``seconds``: how many times the event loop polled its selector
    without blocking (a turning loop does so on every turn, however little CPU a busy machine
    gives it), and the CPU its thread used."""
    loop = asyncio.get_running_loop()
    selector = loop._selector  # type: ignore[attr-defined]
    select, polls = selector.select, [0]

    def counted(timeout=None):
        polls[0] += timeout == 0
        return select(timeout)

    selector.select = counted
    gc.disable()  # a full collection of the suite's heap is tens of ms of this thread's CPU
    start = time.thread_time()
    try:
        await asyncio.sleep(seconds)
    finally:
        selector.select = select
        gc.enable()
    return polls[0], time.thread_time() - start


@not_in_vm
@pytest.mark.parametrize(
    "transports, window_us",
    [(("shm",), 0), (("shm",), 50), (("shm",), 300_000), (("tcp",), 300_000)],
    ids=["shm-0", "shm-50us", "shm-300ms", "tcp-300ms"],
)
async def test_the_loop_turns_for_the_next_notification_only_while_they_come(transports, window_us):
    """notify_poll_us: once doorbell (shm) notifications come within two windows of each other,
    the receiving loop keeps turning for the next for a window (a long one here, so that a busy
    machine cannot hide it); a lone one, and an idle agent, cost nothing. 0: it never turns.
    Over tcp the same: the turning loop reads the connection itself."""
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN, notify_poll_us=window_us) as t:
        t.allocate(4096, name="kv")
        async with aiohixl.Agent("i", token=TOKEN, transports=transports) as agent:
            peer = await agent.connect(t.address)
            kv, src = await peer.region("kv"), agent.allocate(4096)
            assert await peer.path(kv) == ("tcp" if transports == ("tcp",) else "shm-memfd")
            await peer.put(kv, src, notify=b"first")
            assert (await t.notification(timeout=60)).data == b"first"
            polls, cpu = await _loop_turns(0.2)
            assert polls < 10 and cpu < 0.02, f"after a lone notification: {polls} polls, {cpu:.3f} s of CPU"
            for i in range(5):
                await peer.put(kv, src, notify=b"%d" % i)
                assert (await t.notification(timeout=60)).data == b"%d" % i
            polls, cpu = await _loop_turns(0.2)
            if window_us == 300_000:
                assert polls > 50, f"the loop polled its selector {polls} times in 0.2 s of turning"
            else:
                assert polls < 10 and cpu < 0.02, f"without turning: {polls} polls, {cpu:.3f} s of CPU in 0.2 s"
            await asyncio.sleep(window_us / 1e6)
            polls, cpu = await _loop_turns(1.0)
            assert polls < 10 and cpu < 0.02, f"an idle loop: {polls} polls, {cpu:.3f} s of CPU in 1 s"


@not_in_vm
async def test_the_loop_turns_longer_while_messages_come_just_after_it_stopped():
    """The window adapts as a halt-polling one does: a message that finds the loop blocked
    within 4 windows of the last doubles it (from notify_poll_us up to 4x that) and turns; a
    longer gap sets it back and turns nothing. Long windows: a busy machine cannot blur them."""
    window = 0.3
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN, notify_poll_us=int(window * 1e6)) as t:
        t.allocate(4096, name="kv")
        async with aiohixl.Agent("i", token=TOKEN, transports=("shm",)) as agent:
            peer = await agent.connect(t.address)
            kv, src = await peer.region("kv"), agent.allocate(4096)
            inbox, backend = t._core.inbox, t._core.engine.backend

            async def one(data: bytes) -> None:
                await peer.put(kv, src, notify=data)
                assert (await t.notification(timeout=60)).data == data

            await one(b"lone")
            assert not backend._turn_until
            for grown in (1, 2, 4, 4):  # each found the loop blocked just after it stopped
                await one(b"next")
                assert backend._turn_until and inbox._window_ns == grown * window * 1e9
                if grown < 4:
                    await wait_until(lambda: not backend._turn_until)
            await wait_until(lambda: not backend._turn_until)
            await one(b"after a gap of more than 4 windows")  # the whole widest one went by
            assert not backend._turn_until and inbox._window_ns == window * 1e9 / 2


@not_in_vm
async def test_a_message_that_waited_for_a_held_up_loop_widens_the_window():
    """The gap a blocked loop judges the window by runs to the message's arrival, not to the
    loop's late take of it: a tcp message that came within the window's reach while the loop
    was held up (synchronous work, or its own wake-up) still widens it, and the loop turns."""
    window = 0.3  # the widest: 1.2 s
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN, notify_poll_us=int(window * 1e6)) as t:
        t.allocate(4096, name="kv")
        inbox, backend = t._core.inbox, t._core.engine.backend
        go, sent, failed = threading.Event(), threading.Event(), []

        def sender() -> None:  # its own thread and loop: it sends while the target's loop is held
            async def run() -> None:
                async with aiohixl.Agent("i", token=TOKEN, transports=("tcp",)) as agent:
                    peer = await agent.connect(t.address)
                    kv, src = await peer.region("kv"), agent.allocate(4096)
                    for data in (b"lone", b"next"):
                        await asyncio.get_running_loop().run_in_executor(None, go.wait, 60)
                        go.clear()
                        await peer.put(kv, src, notify=data)
                        sent.set()

            try:
                asyncio.run(run())
            except BaseException as exc:  # said by the test
                failed.append(exc)
                sent.set()

        thread = threading.Thread(target=sender)
        thread.start()
        try:
            go.set()
            assert (await t.notification(timeout=60)).data == b"lone"
            assert not backend._turn_until and inbox._window_ns == window * 1e9 / 2
            sent.clear()
            go.set()
            assert sent.wait(60) and not failed, failed  # the I/O thread took it: queued natively
            time.sleep(4 * window + 0.1)  # the loop held up past the widest window
            assert (await t.notification(timeout=60)).data == b"next"
            assert backend._turn_until and inbox._window_ns == window * 1e9
        finally:
            go.set()
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 60)
        assert not failed, failed


@not_in_vm
async def test_a_turning_loop_answers_a_put_with_a_message_once_the_messages_task_has_run():
    """The turning loop that reads a tcp put(notify=) sends the put's answer on its next
    turn, after the task the message woke has run: that send (7-12 us of loopback tcp here)
    no longer comes between the message's arrival and its task. So such a put returns once
    the target's task has taken the message and done its (short) synchronous work."""
    n, work = 100, 0.0003  # under the 1 ms after which a silent loop's answers go anyway
    seen: list[bool] = []  # at each put's return: whether its message's task had run
    # Up to 3 rounds of 100, until one shows it: a round on a loaded machine may find the loop
    # held up past 1 ms often (the answers then go from the I/O thread, before the task).
    for _ in range(3):
        seen.clear()
        await _one_round_of_answered_notes(n, work, seen)
        if sum(seen) >= n // 2:
            break
    # All but the first (the loop turns from the second on), less any read after a stall of
    # the loop past 1 ms. Before, the answer went first: none of them.
    assert sum(seen) >= n // 2, f"{sum(seen)} of {n} puts returned after their message's task ran"


async def _one_round_of_answered_notes(n: int, work: float, seen: list[bool]) -> None:
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN, notify_poll_us=300_000) as t:
        t.allocate(4096, name="kv")
        handled: list[bytes] = []
        failed: list[BaseException] = []

        def sender() -> None:  # its own thread and loop: the target's work lets go of the GIL
            async def run() -> None:
                async with aiohixl.Agent("i", token=TOKEN, transports=("tcp",)) as agent:
                    peer = await agent.connect(t.address)
                    kv, src = await peer.region("kv"), agent.allocate(4096)
                    for i in range(n):
                        data = b"%d" % i
                        await peer.put(kv, src, notify=data)
                        seen.append(data in handled)
                        while data not in handled:  # one at a time: the loop keeps turning
                            await asyncio.sleep(0)

            try:
                asyncio.run(run())
            except BaseException as exc:  # said by the test
                failed.append(exc)

        thread = threading.Thread(target=sender)
        thread.start()
        try:
            for _ in range(n):
                note = await t.notification(timeout=60)
                time.sleep(work)  # a handler's synchronous work
                handled.append(note.data)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 60)
        assert not failed, failed


def _rung(agent: aiohixl.Agent) -> bool:
    """Whether the agent's wake fd says something came (a doorbell's wake-up among it)."""
    import select

    return bool(select.select([agent._core.engine.fd], [], [], 0)[0])


@contextlib.asynccontextmanager
async def _a_turning_shm_target(window: float) -> AsyncIterator[tuple[aiohixl.Agent, Any, Any, Any]]:
    """(target, peer, its region, source) over shm, the target's loop turning for messages
    (``window``: its notify_poll_us, in seconds) after 5 put(notify=) close together."""
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN, notify_poll_us=int(window * 1e6)) as t:
        t.allocate(4096, name="kv")
        async with aiohixl.Agent("i", token=TOKEN, transports=("shm",)) as agent:
            peer = await agent.connect(t.address)
            kv, src = await peer.region("kv"), agent.allocate(4096)
            for i in range(5):
                await peer.put(kv, src, notify=b"%d" % i)
                assert (await t.notification(timeout=60)).data == b"%d" % i
            yield t, peer, kv, src


@not_in_vm
async def test_a_task_waiting_in_a_turning_loop_goes_on_in_the_step_that_takes_its_message():
    """While the loop turns for messages, a task waiting in notification() looks for its
    message on each of its own steps: the step that takes it returns it, with no turn of the
    loop in between (a callback that counts the loop's turns has not run again)."""
    window = 0.3  # long: a busy machine cannot end it between two steps
    async with _a_turning_shm_target(window) as (t, peer, kv, src):
        inbox, backend = t._core.inbox, t._core.engine.backend
        assert backend._turn_until
        loop, turns, handed, counting = asyncio.get_running_loop(), [0], [], [True]

        def count() -> None:
            turns[0] += 1
            if counting[0]:
                loop.call_soon(count)

        serve = inbox._serve

        def counted_serve() -> None:
            if inbox._waiters and inbox._queue:
                handed.append(turns[0])
            serve()

        async def wait() -> tuple[bytes, int]:
            note = await t.notification(timeout=60)
            return note.data, turns[0]

        loop.call_soon(count)
        inbox._serve = counted_serve
        try:
            waiter = asyncio.create_task(wait())
            await asyncio.sleep(0)  # it waits
            assert not waiter.done()
            await peer.put(kv, src, notify=b"looked for")
            data, returned_at = await asyncio.wait_for(waiter, 10)
        finally:
            del inbox._serve
            counting[0] = False
        assert data == b"looked for"
        assert backend._turn_until, "the window ended before the message came: a run too slow to tell"
        assert handed == [returned_at], f"handed over at turn {handed}, returned at turn {returned_at}"


@not_in_vm
async def test_a_turning_loop_is_not_rung_and_takes_what_came_as_it_stopped():
    """While the loop turns for shm notifications it looks at the doorbells itself: a
    put(notify=) then rings nothing. After the window they are rung again; a message that
    came during the last turn, which no wake-up announces, is taken then."""
    window = 0.3  # long: a busy machine cannot end it between two steps
    async with _a_turning_shm_target(window) as (t, peer, kv, src):
        backend = t._core.engine.backend
        assert backend._turn_until
        await peer.put(kv, src, notify=b"quiet")  # ends here: no turn of the loop since
        assert not _rung(t)
        assert (await t.notification(timeout=60)).data == b"quiet"

        waiter = asyncio.create_task(t.notification(timeout=60))
        await asyncio.sleep(0)  # it waits
        await peer.put(kv, src, notify=b"last")
        time.sleep(2 * window)  # the loop's next turn is its last: past the window
        assert (await asyncio.wait_for(waiter, 10)).data == b"last"
        await wait_until(lambda: not backend._turn_until)

        await peer.put(kv, src, notify=b"rung")
        assert _rung(t)
        assert (await t.notification(timeout=60)).data == b"rung"


async def _served_by_the_loop(t: aiohixl.Agent, peer, kv, src, tag: bytes) -> None:
    """put(notify=) to ``t`` until its loop turns and reads the connection itself. It hands the
    connection back whenever it went 1 ms without a turn (a slow machine, the GC): try again."""
    for i in range(200):
        await peer.put(kv, src, notify=tag + b"%d" % i)
        assert (await t.notification(timeout=60)).data == tag + b"%d" % i
        if i >= 4 and t._core.engine.backend._turn_until and hooks.tcp_served(t) == (1, 1):
            return
    raise AssertionError(f"the loop never read the connection itself: {hooks.tcp_served(t)}")


@not_in_vm
async def test_a_turning_loop_reads_tcp_itself_and_gives_reading_back_as_it_stops():
    """While the loop turns for tcp notifications it reads the connection itself (the I/O
    thread no longer watches it, so no thread is woken for a message). After the window the
    I/O thread reads it again: a message that came during the last turn is taken then, and
    later ones as before."""
    window = 0.3  # long: a busy machine cannot end it between two steps
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN, notify_poll_us=int(window * 1e6)) as t:
        t.allocate(4096, name="kv")
        async with aiohixl.Agent("i", token=TOKEN, transports=("tcp",)) as agent:
            peer = await agent.connect(t.address)
            kv, src = await peer.region("kv"), agent.allocate(4096)
            await _served_by_the_loop(t, peer, kv, src, b"")  # close together: the loop turns
            backend = t._core.engine.backend
            await peer.put(kv, src, notify=b"served")  # read, and answered, by the target's loop
            assert (await t.notification(timeout=60)).data == b"served"

            waiter = asyncio.create_task(t.notification(timeout=60))
            await asyncio.sleep(0)  # it waits
            posted = peer.put(kv, src, notify=b"last")
            time.sleep(2 * window)  # the loop's next turn is its last: past the window
            assert (await asyncio.wait_for(waiter, 10)).data == b"last"
            await posted
            await wait_until(lambda: not backend._turn_until)
            assert hooks.tcp_served(t) == (0, 1)

            await peer.put(kv, src, notify=b"read by the I/O thread")
            assert (await t.notification(timeout=60)).data == b"read by the I/O thread"


@not_in_vm
async def test_a_large_put_to_a_turning_loop_lands_whole_before_its_message():
    """A put far larger than what the turning loop reads in one turn (256 KiB) goes back to
    the I/O thread, which reads the rest; the loop then reads the connection again: every
    byte lands, each message after its data, in order."""
    big = 8 << 20
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN, notify_poll_us=300_000) as t:
        dst = t.allocate(big, name="kv")
        async with aiohixl.Agent("i", token=TOKEN, transports=("tcp",)) as agent:
            peer = await agent.connect(t.address)
            kv, src = await peer.region("kv"), agent.allocate(big)
            data = pattern(big, seed=7)
            src.memory[:] = data
            round_ = 0
            # At least 3 rounds, and until the loop read one of the big puts first and gave the
            # rest to the I/O thread: it reads none when it stalled for 1 ms just then (a busy
            # machine) and so gave every connection back.
            while round_ < 3 or (hooks.tcp_serving(t)[2] == 0 and round_ < 20):
                dst.memory[:] = bytes(big)  # 8 MiB: the loop may well stop serving meanwhile
                await _served_by_the_loop(t, peer, kv[:4096], src[:4096], b"%d." % round_)
                puts = [peer.put(kv, src, notify=b"big %d" % round_)]
                puts += [peer.put(kv[:4096], src[:4096], notify=b"small %d.%d" % (round_, i)) for i in range(3)]
                note = await t.notification(timeout=60)
                assert note.data == b"big %d" % round_ and sha(dst.memory) == sha(data)
                for i in range(3):
                    assert (await t.notification(timeout=60)).data == b"small %d.%d" % (round_, i)
                await asyncio.gather(*puts)
                round_ += 1
            assert hooks.tcp_serving(t)[2] >= 1


@not_in_vm
async def test_a_sender_that_goes_away_while_the_loop_reads_it_leaves_the_target_serving():
    """The initiator closes while the target's loop turns and reads its connection: the
    target drops that connection, keeps turning or stops as messages say, and serves a new
    sender; it then closes cleanly."""
    async with aiohixl.Agent("t", listen="127.0.0.1:0", token=TOKEN, notify_poll_us=300_000) as t:
        t.allocate(4096, name="kv")
        for sender in range(3):
            async with aiohixl.Agent("i", token=TOKEN, transports=("tcp",)) as agent:
                peer = await agent.connect(t.address)
                kv, src = await peer.region("kv"), agent.allocate(4096)
                await _served_by_the_loop(t, peer, kv, src, b"%d." % sender)
            await wait_until(lambda: hooks.tcp_served(t) == (0, 0))


@not_in_vm
async def test_a_turning_target_whose_loop_blocks_still_takes_puts():
    """The target's loop turns (and reads tcp itself) when its handler blocks it: the I/O
    thread takes the connection back, so puts land and the connection lives meanwhile, as
    for a loop that blocks while not turning (the test above)."""
    block = 8.0
    async with _heartbeat_sender(notify_poll_us=300_000) as (target, peer, kv, src):
        taking = asyncio.create_task(target.ask({"op": "take_block", "n": 5, "seconds": block}, 60))
        sent = 0
        while not taking.done():  # close together: the target's loop turns
            await peer.put(kv[:4096], src[:4096], notify=f"t{sent}".encode())
            sent += 1
            await asyncio.sleep(0)
        reply = await taking
        assert reply["served"] == [1, 1], reply  # it blocks while it reads the connection itself
        blocked = asyncio.create_task(target.unblocked())
        start = time.monotonic()
        for i in range(100):
            await asyncio.wait_for(
                peer.put(kv[(i % 256) * 4096 : (i % 256 + 1) * 4096], src[:4096], notify=f"n{i}".encode()),
                block / 2,
            )
        during = time.monotonic() - start
        assert not blocked.done() and during < block, "the puts landed while the target's loop slept"
        await asyncio.sleep(2.0)  # past the heartbeat timeout: still connected
        assert peer.broken is None
        await blocked
        left = sent - reply["taken"]  # sent as it began to block
        reply = await target.cmd(op="collect", n=left + 100)
        notes = [d for _, d in reply["notes"]]
        assert notes == [f"t{i}" for i in range(sent - left, sent)] + [f"n{i}" for i in range(100)]
        assert peer.broken is None
