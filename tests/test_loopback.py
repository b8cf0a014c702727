"""put/get/put_many/get_many through the loopback transport: correctness,
refusals, concurrency, cancellation and closing."""

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import aiohixl
from aiohixl import Access
from aiohixl import _testing as hooks
from aiohixl.remote import RemoteRegion

from . import threads
from .conftest import random_bytes
from .waiting import wait_until

SPACE = 72 << 20  # room for 64 MiB ops at random offsets
MARK = 0xEE


async def test_refusals_leave_memory_untouched(agent):
    target = agent.register(bytearray(b"T" * 4096), name="t", access=Access.REMOTE_READ)
    writable = agent.register(
        bytearray(b"W" * 4096), name="w", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE
    )
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
    agent.allocate(10, name="x")
    async with aiohixl.Agent() as other:
        with pytest.raises(aiohixl.InvalidArgument, match="another agent"):
            await peer.put(await peer.region("x"), other.allocate(10))


async def test_zero_length_is_a_no_op(agent):
    src = agent.register(bytearray(b"s" * 10))
    dst = agent.register(
        bytearray(b"d" * 10), name="x", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE
    )
    peer = agent.loopback()
    x = await peer.region("x")
    before = hooks.engine(agent).completed
    await peer.put(x[5:5], src[0:0])
    await peer.get(src[3:3], x[10:10])
    await peer.put_many([])
    await peer.get_many([(src[0:0], x[0:0])])
    assert bytes(dst.memory) == b"d" * 10 and bytes(src.memory) == b"s" * 10
    assert hooks.engine(agent).completed == before and agent.outstanding == 0  # nothing was posted
    with pytest.raises(aiohixl.OutOfBounds):
        x[11:11]  # an empty slice past the end is still out of bounds


@pytest.mark.parametrize("shift", [1, 4096, -1, -(1 << 20) - 7, (3 << 20) - 1])
async def test_overlapping_put_and_get_behave_like_memmove(agent, shift):
    """Source and destination overlap in one region: the pool's pieces must not read bytes already written."""
    size = 3 << 20  # several copy-pool pieces
    base = 4 << 20
    arr = random_bytes(12 << 20, seed=abs(shift))
    region = agent.register(arr, name="buf", access=Access.REMOTE_READ | Access.REMOTE_WRITE)
    peer = agent.loopback()
    remote = await peer.region("buf")
    expect = arr.copy()
    expect[base + shift : base + shift + size] = expect[base : base + size].copy()
    await peer.put(remote[base + shift : base + shift + size], region[base : base + size])
    assert np.array_equal(arr, expect)
    expect[base : base + size] = expect[base + shift : base + shift + size].copy()
    await peer.get(region[base : base + size], remote[base + shift : base + shift + size])
    assert np.array_equal(arr, expect)


async def test_overlapping_pairs_of_one_submission_are_refused(agent):
    arr = random_bytes(4 << 20, seed=3)
    region = agent.register(arr, name="buf", access=Access.REMOTE_READ | Access.REMOTE_WRITE)
    before = arr.copy()
    peer = agent.loopback()
    remote = await peer.region("buf")
    # the second pair writes where the first reads: no order makes that well defined
    pairs = [(remote[0 : 2 << 20], region[1 << 20 : 3 << 20]), (remote[2 << 20 : 4 << 20], region[0 : 2 << 20])]
    with pytest.raises(aiohixl.InvalidArgument, match="overlapping"):
        await peer.put_many(pairs)
    assert np.array_equal(arr, before)
    # disjoint pairs in one region are fine
    await peer.put_many([(remote[0:1024], region[4096:5120]), (remote[8192:9216], region[1024:2048])])
    assert bytes(arr[0:1024]) == bytes(before[4096:5120]) and bytes(arr[8192:9216]) == bytes(before[1024:2048])


async def test_use_from_another_loop_or_thread_is_refused_at_the_call(agent):
    """The agent belongs to the loop that started it: small and large ops alike are refused, none stays outstanding."""
    src = agent.register(random_bytes(8 << 20))
    dst = agent.register(bytearray(8 << 20), name="x", access=Access.REMOTE_WRITE)
    peer = agent.loopback()
    x = await peer.region("x")
    await peer.put(x[0:16], src[0:16])  # the agent is bound to this loop now

    def elsewhere(size: int) -> BaseException | None:
        async def op() -> None:
            await peer.put(x[0:size], src[0:size])

        try:
            asyncio.run(op())
        except BaseException as exc:
            return exc
        return None

    for size in (16, 8 << 20):
        exc = await asyncio.to_thread(elsewhere, size)
        assert isinstance(exc, aiohixl.WrongEventLoop), exc
        assert isinstance(exc, RuntimeError) and "Peer.put" in str(exc) and "event loop" in str(exc)
        assert agent.outstanding == 0
    assert bytes(dst.memory[16:32]) == bytes(16)  # nothing was written from the other loop
    await peer.put(x, src)  # and the agent still works on its own loop
    assert bytes(dst.memory) == bytes(src.memory)


EXIT_WITH_AGENTS_OPEN = """
import asyncio, gc, sys
import numpy as np
import aiohixl
from aiohixl import Access

async def main():
    target = aiohixl.Agent("t", listen="127.0.0.1:0", token="x")
    await target.start()
    target.allocate(1 << 20, name="kv")
    target.register(np.zeros(1 << 20, dtype=np.uint8), name="arr", access=Access.REMOTE_READ)
    me = aiohixl.Agent("me", token="x")
    await me.start()
    src = me.register(bytearray(64 << 20), name="src", access=Access.REMOTE_READ | Access.REMOTE_WRITE)
    for transports in (("shm",), ("tcp",)):
        peer = await me.connect(target.address, transports=transports)
        await peer.put(await peer.region("kv"), src[0 : 1 << 20])
    lb = me.loopback()
    remote = await lb.region("src")
    asyncio.ensure_future(lb.put(remote[0 : 32 << 20], src[32 << 20 :]))  # in flight at exit
    dropped = aiohixl.Agent("dropped")
    dropped.register(bytearray(4096))
    del dropped
    gc.collect()  # collected while the loop runs: warned and freed, no crash
    await asyncio.sleep(0)
    if sys.argv[1] == "raise":
        raise RuntimeError("escaped main() before aclose()")
    raise SystemExit(0)

asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_agents_left_open_at_exit_warn_and_do_not_crash(tmp_path, how):
    """A program that ends with agents open (peers, regions, an op in flight) exits cleanly, with ResourceWarnings."""
    script = tmp_path / "leave_open.py"
    script.write_text(EXIT_WITH_AGENTS_OPEN)
    proc = subprocess.run(
        [sys.executable, "-W", "always", str(script), how],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert proc.returncode == (0 if how == "exit" else 1), proc.stderr[-3000:]
    assert proc.stderr.count("ResourceWarning: unclosed <Agent") == 3, proc.stderr[-3000:]
    assert "'dropped'" in proc.stderr and "'me'" in proc.stderr and "'t'" in proc.stderr
    if how == "raise":
        assert "escaped main() before aclose()" in proc.stderr


async def test_ten_thousand_concurrent_ops(agent):
    n, size = 10_000, 512
    src_arr = random_bytes(n * size, seed=7)
    src = agent.register(src_arr)
    dst_arr = np.zeros(n * size, dtype=np.uint8)
    agent.register(dst_arr, name="dst", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
    big_src = agent.register(random_bytes(1 << 20, seed=8))
    agent.register(
        np.zeros(100 << 20, dtype=np.uint8),
        name="bigdst",
        access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE,
    )
    peer = agent.loopback()
    dst = await peer.region("dst")
    bigdst = await peer.region("bigdst")
    # mix inline ops with ops on the copy pool so both completion paths are counted
    before = hooks.engine(agent).completed  # (under asyncio a put is posted at the call)
    ops = [peer.put(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(n)]
    ops += [peer.put(bigdst[i << 20 : (i + 1) << 20], big_src) for i in range(100)]
    results = await asyncio.gather(*ops)
    assert results == [None] * len(ops)
    assert np.array_equal(dst_arr, src_arr)
    assert agent.outstanding == 0
    assert hooks.engine(agent).completed - before == len(ops)  # each op accounted for once
    assert hooks.engine(agent).unknown_completions == 0  # and none completed twice


async def test_max_inflight_waits_for_room():
    async with aiohixl.Agent(max_inflight=4) as agent:
        src = agent.register(random_bytes(8 << 20, seed=3))
        dst_arr = np.zeros(32 * (8 << 20), dtype=np.uint8)
        agent.register(dst_arr, name="d", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
        peer = agent.loopback()
        d = await peer.region("d")
        await asyncio.gather(*(peer.put(d[i * (8 << 20) : (i + 1) * (8 << 20)], src) for i in range(32)))
        assert np.array_equal(dst_arr.reshape(32, -1), np.tile(src.memory, (32, 1)))


async def test_close_agent_with_ops_in_flight():
    agent = aiohixl.Agent("closing", copy_threads=1)
    await agent.__aenter__()
    piece, pieces, ops = 2 << 20, 32, 16
    src = agent.register(random_bytes(piece, seed=2))
    dst_arr = np.zeros(ops * pieces * piece, dtype=np.uint8)
    agent.register(dst_arr, name="d", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
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
        _ = region.memory
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
        with pytest.raises(aiohixl.ClosedError, match="Peer.path: peer"):
            await peer.path(remote)


async def test_idle_agent_does_not_spin():
    async with aiohixl.Agent(copy_threads=4) as agent:
        agent.allocate(1 << 20, name="kv")
        peer = agent.loopback()
        await peer.put(await peer.region("kv"), agent.allocate(1 << 20))
        start = time.process_time()
        await asyncio.sleep(2.0)
        used = time.process_time() - start
    assert used < 0.02 * 2.0, f"idle agent used {used:.3f} s of CPU in 2 s"


def _copy_threads() -> dict[str, set[int]]:
    """This process's copy threads and the CPUs each may run on."""
    found = {}
    for tid in threads.named("hixl-copy"):
        try:
            found[tid] = os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to spread over")
async def test_copy_threads_as_many_as_the_cpus_own_one_each_and_follow_the_posting_threads_cpus():
    """Woken together, two copy threads could be queued on one CPU while another idled, and
    copy a large put one after the other (docs/shm.md): when the threads and the posting
    thread are at least as many as its CPUs, each thread owns one, and a change of the posting
    thread's CPUs moves them at its next large op."""
    cpus = os.sched_getaffinity(0)
    before = set(_copy_threads())
    size = 16 << 20  # shared by the pool: its threads take tasks
    try:
        async with aiohixl.Agent(copy_threads=min(len(cpus), 64)) as agent:
            mine = set(_copy_threads()) - before

            def placed() -> list[set[int]]:
                now = _copy_threads()
                return [now[tid] for tid in mine if tid in now]

            def one_each(among: set[int]) -> bool:
                got = placed()
                return all(len(c) == 1 for c in got) and set().union(*got) == among

            await wait_until(lambda: one_each(cpus), what=f"one CPU each of {sorted(cpus)}: {placed()}")
            dst = agent.allocate(size, name="dst")
            peer = agent.loopback()
            remote, local = await peer.region("dst"), agent.allocate(size)
            local.memory[:] = b"\x5a" * size
            last = max(cpus)
            os.sched_setaffinity(0, {last})  # this thread's CPUs: the one posting
            await peer.put(remote, local)
            await wait_until(lambda: one_each({last}), what=f"all on CPU {last}: {placed()}")
            os.sched_setaffinity(0, cpus)
            await peer.put(remote, local)
            await wait_until(lambda: one_each(cpus), what=f"one CPU each of {sorted(cpus)} again: {placed()}")
            assert bytes(dst.memory[-4:]) == b"\x5a" * 4
    finally:
        os.sched_setaffinity(0, cpus)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 3, reason="fewer than 3 CPUs: one thread and the caller cover them")
async def test_copy_threads_fewer_than_the_cpus_may_run_on_any_of_them():
    cpus = os.sched_getaffinity(0)
    before = set(_copy_threads())
    async with aiohixl.Agent(copy_threads=1):
        mine = set(_copy_threads()) - before
        assert [c for tid, c in _copy_threads().items() if tid in mine] == [cpus]


async def test_calls_that_change_the_agent_are_refused_from_another_thread(agent):
    """The contract (Agent's docstring): what changes an agent raises WrongEventLoop off its
    loop, before anything is made; the read-only queries answer from any thread."""
    region = agent.allocate(4096, name="kv")
    peer = agent.loopback()  # bound to this loop (the fixture started it)
    remote = await peer.region("kv")
    calls = {
        "Peer.region": lambda: asyncio.run(peer.region("kv")),
        "Peer.path": lambda: asyncio.run(peer.path(remote)),
        "Peer.aclose": lambda: asyncio.run(peer.aclose()),
        "Agent.allocate": lambda: agent.allocate(64),
        "Agent.register": lambda: agent.register(bytearray(64)),
        "Agent.allocate_async": lambda: asyncio.run(agent.allocate_async(64)),
        "Agent.register_async": lambda: asyncio.run(agent.register_async(bytearray(64))),
        "Agent.loopback": agent.loopback,
        "Agent.notification": lambda: asyncio.run(agent.notification(timeout=0)),
        "Region.close": lambda: asyncio.run(region.close()),
        "Agent.aclose": lambda: asyncio.run(agent.aclose()),
    }

    def elsewhere() -> dict:
        refused = {}
        for name, call in calls.items():
            try:
                call()
            except aiohixl.WrongEventLoop as exc:
                refused[name] = name in str(exc)
        return refused

    before = len(hooks.live_regions(agent))
    assert await asyncio.to_thread(elsewhere) == dict.fromkeys(calls, True)
    assert len(hooks.live_regions(agent)) == before and not agent.closed and not region.closed and not peer.closed
    stats, outstanding, view = await asyncio.to_thread(lambda: (agent.stats(), agent.outstanding, region.memory))
    assert stats["outstanding"] == outstanding == 0 and len(view) == 4096


def test_an_agent_not_started_yet_is_set_up_from_plain_code_then_belongs_to_its_loop():
    agent = aiohixl.Agent("plain")
    data = random_bytes(4096)
    src = agent.register(data)  # no loop runs here
    dst = agent.allocate(4096, name="dst")

    async def main() -> bytes:
        async with agent:
            peer = agent.loopback()
            await peer.put(await peer.region("dst"), src)
            return bytes(dst.memory)

    assert asyncio.run(main()) == data.tobytes()


def test_use_from_a_later_loop_of_the_same_thread_is_refused():
    """The fast path knows its loop by the thread running it: a loop of the same thread
    run after the agent's own stopped is another loop, refused like one of another thread."""
    first = asyncio.new_event_loop()
    try:

        async def start() -> tuple:
            agent = aiohixl.Agent("loops")
            src = agent.register(random_bytes(4096))
            agent.register(bytearray(4096), name="x", access=Access.REMOTE_WRITE)
            peer = agent.loopback()
            x = await peer.region("x")
            await peer.put(x, src)  # bound to the first loop now
            return agent, peer, x, src

        agent, peer, x, src = first.run_until_complete(start())

        async def later() -> None:
            with pytest.raises(aiohixl.WrongEventLoop):
                await peer.put(x, src)
            with pytest.raises(aiohixl.WrongEventLoop):
                await peer.get(src, x)

        asyncio.run(later())
        first.run_until_complete(agent.aclose())
    finally:
        first.close()


async def test_closing_a_region_waits_for_its_ops_in_flight():
    """Region.close() returns only once no op of this agent touches the region: a 64 MiB put
    runs on the copy threads, so it is still in flight when close() is called."""
    size = 64 << 20
    async with aiohixl.Agent() as agent:
        src = agent.allocate(size)
        dst = agent.allocate(size, name="dst")
        np.frombuffer(src.memory, dtype=np.uint8)[:] = 7
        peer = agent.loopback()
        remote = await peer.region("dst")
        put = asyncio.ensure_future(peer.put(remote, src))
        await asyncio.sleep(0)  # posted
        assert hooks.in_flight_on(agent, src)
        await src.close()
        assert put.done() and put.exception() is None
        assert not hooks.in_flight_on(agent, src)
        assert np.all(np.frombuffer(dst.memory, dtype=np.uint8) == 7)


async def test_peers_and_regions_come_from_the_agent_never_from_their_constructors(agent):
    with pytest.raises(TypeError, match=r"aiohixl\.Peer objects are not made directly: Agent\.connect\(\)"):
        aiohixl.Peer(agent, [], b"", "x")
    with pytest.raises(TypeError, match=r"aiohixl\.Region objects are not made directly: Agent\.register\(\)"):
        aiohixl.Region(None, agent, 1, None, aiohixl.Access.NONE, None, 0)
    region = agent.allocate(64)
    assert type(region) is aiohixl.Region and type(agent.loopback()) is aiohixl.Peer


async def test_the_agent_and_the_peer_show_users_their_api_only(agent):
    """What transports, the listener and the engine use of them lives on internal objects."""
    internal = {
        agent: "close_region describe live_region live_regions published_remote forget_peer heartbeat"
        " notes_room check_open engine",
        agent.loopback(): "start_session end_session close_links release_links free op_failed region_info send label",
    }
    for obj, names in internal.items():
        shown = {n for n in dir(obj) if not n.startswith("_")}
        assert shown.isdisjoint(names.split()), (obj, shown & set(names.split()))


async def test_an_op_on_a_closed_agent_is_refused_at_the_call():
    agent = aiohixl.Agent(transports=("loopback",))
    await agent.start()
    src = agent.allocate(64)
    dst = agent.allocate(64, name="dst")
    peer = agent.loopback()
    remote = await peer.region("dst")
    await peer.put(remote[0:64], src[0:64])
    await agent.aclose()
    with pytest.raises(aiohixl.ClosedError, match=r"^Peer\.put: "):
        peer.put(remote[0:64], src[0:64])  # not awaited: raised by the call itself
    assert dst.closed
