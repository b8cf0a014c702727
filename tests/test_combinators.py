"""Ops under asyncio's combinators and trio/anyio task groups: each op its own awaitable.

Over loopback (one agent) and between two agents of this process: the path the agents
choose (shared memory where the machine has it), and tcp. Every batch mixes small ops, which end as they are
posted, with a large one that runs on the copy threads and completes
through the event loop, and checks the bytes of each op.
"""

import asyncio
import sys
from contextlib import asynccontextmanager

import anyio
import numpy as np
import pytest
import trio

import aiohixl

from .conftest import random_bytes

SMALL, LARGE = 4096, 32 << 20
COUNT = 4  # small ops per batch, then one large
SPAN = COUNT * SMALL + LARGE
TOKEN = "combinators"


@asynccontextmanager
async def two_ends(kind: str):
    """(peer, remote destination, source region, destination array) for ``kind``."""
    async with aiohixl.Agent("initiator") as agent:
        src = agent.register(random_bytes(SPAN, seed=41))
        if kind == "loopback":
            dst = np.zeros(SPAN, dtype=np.uint8)
            agent.register(dst, name="d", access=aiohixl.Access.REMOTE_WRITE)
            peer = agent.loopback()
            yield peer, await peer.region("d"), src, dst
            return
        async with aiohixl.Agent("target", listen="127.0.0.1:0", token=TOKEN) as target:
            dst = np.zeros(SPAN, dtype=np.uint8)
            target.register(dst, name="d", access=aiohixl.Access.REMOTE_WRITE)
            peer = await agent.connect(target.address, token=TOKEN, transports=("tcp",) if kind == "tcp" else None)
            yield peer, await peer.region("d"), src, dst


@pytest.fixture(params=["loopback", "two agents", "tcp"])
async def ends(request):
    async with two_ends(request.param) as e:
        yield e


def ranges(remote, src):
    """(remote, local) of each op of a batch: COUNT small ones, then the large one."""
    out = [(remote[i * SMALL : (i + 1) * SMALL], src[i * SMALL : (i + 1) * SMALL]) for i in range(COUNT)]
    return [*out, (remote[COUNT * SMALL :], src[COUNT * SMALL :])]


async def post(peer, remote, src):
    ops = [peer.put(r, l) for r, l in ranges(remote, src)]
    assert len({id(op) for op in ops}) == len(ops)  # each op its own awaitable
    return ops


def landed(dst, src) -> bool:
    return np.array_equal(dst, np.frombuffer(src.memory, dtype=np.uint8))


async def test_gather(ends):
    peer, remote, src, dst = ends
    assert await asyncio.gather(*await post(peer, remote, src)) == [None] * (COUNT + 1)
    assert landed(dst, src)


async def test_wait_sees_each_op(ends):
    """As over any coroutines: asyncio.wait takes them through ensure_future (or
    create_task), one Task per op, and refuses them bare."""
    peer, remote, src, dst = ends
    done, pending = await asyncio.wait([asyncio.ensure_future(op) for op in await post(peer, remote, src)])
    assert len(done) == COUNT + 1 and not pending
    assert all(f.result() is None for f in done) and landed(dst, src)
    ops = await post(peer, remote, src)
    with pytest.raises(TypeError, match="coroutines"):
        await asyncio.wait(ops)
    assert await asyncio.gather(*ops) == [None] * (COUNT + 1)


async def test_wait_first_completed_returns_the_small_ops(ends):
    peer, remote, src, dst = ends
    tasks = [asyncio.create_task(op) for op in await post(peer, remote, src)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    assert done and done | pending == set(tasks) and all(t.result() is None for t in done)
    assert await asyncio.gather(*tasks) == [None] * (COUNT + 1) and landed(dst, src)


async def test_as_completed_yields_each_op(ends):
    peer, remote, src, dst = ends
    results = [await f for f in asyncio.as_completed(await post(peer, remote, src))]
    assert results == [None] * (COUNT + 1) and landed(dst, src)


async def test_a_dict_keyed_by_op_keeps_each(ends):
    peer, remote, src, dst = ends
    ops = {op: i for i, op in enumerate(await post(peer, remote, src))}
    assert sorted(ops.values()) == list(range(COUNT + 1))
    for op in ops:
        await op
    assert landed(dst, src)


async def test_wait_for(ends):
    peer, remote, src, dst = ends
    for op in await post(peer, remote, src):
        assert await asyncio.wait_for(op, timeout=60) is None
    assert landed(dst, src)


async def test_wait_for_timing_out_keeps_the_memory_in_flight(ends):
    """wait_for cancels the op's Future when its time is up; the copy goes on, its memory
    kept alive, and closing the source waits for it."""
    peer, remote, src, dst = ends
    large_remote, large_src = ranges(remote, src)[-1]
    op = peer.put(large_remote, large_src)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(op, timeout=0)
    await src.close()
    assert np.array_equal(dst[COUNT * SMALL :], random_bytes(SPAN, seed=41)[COUNT * SMALL :])


async def test_shield_lets_the_op_finish_when_its_waiter_is_cancelled(ends):
    peer, remote, src, dst = ends
    tasks = [asyncio.ensure_future(op) for op in await post(peer, remote, src)]
    waiter = asyncio.ensure_future(asyncio.gather(*(asyncio.shield(t) for t in tasks)))
    await asyncio.sleep(0)  # the gather waits on the shields now
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await asyncio.gather(*tasks) == [None] * (COUNT + 1) and landed(dst, src)


async def test_ensure_future_and_create_task(ends):
    peer, remote, src, dst = ends
    ops = await post(peer, remote, src)
    futures = [asyncio.ensure_future(op) for op in ops]
    assert all(isinstance(f, asyncio.Task) for f in futures)  # as for any coroutine
    assert await asyncio.gather(*futures) == [None] * (COUNT + 1)
    tasks = [asyncio.create_task(op) for op in await post(peer, remote, src)]
    assert [await t for t in tasks] == [None] * (COUNT + 1) and landed(dst, src)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is 3.11+")
async def test_task_group(ends):
    peer, remote, src, dst = ends
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(op) for op in await post(peer, remote, src)]
    assert [t.result() for t in tasks] == [None] * (COUNT + 1) and landed(dst, src)


async def test_anyio_task_group(ends):
    peer, remote, src, dst = ends
    async with anyio.create_task_group() as tg:
        for r, l in ranges(remote, src):
            tg.start_soon(peer.put, r, l)
    assert landed(dst, src)


@pytest.mark.parametrize("kind", ["loopback", "two agents"])
def test_trio_nursery_and_anyio_task_group_on_trio(kind):
    async def main():
        async with two_ends(kind) as (peer, remote, src, dst):
            async with trio.open_nursery() as nursery:
                for r, l in ranges(remote, src):
                    nursery.start_soon(peer.put, r, l)
            assert landed(dst, src)
            dst[:] = 0
            async with anyio.create_task_group() as tg:
                for r, l in ranges(remote, src):
                    tg.start_soon(peer.put, r, l)
            assert landed(dst, src)

    trio.run(main)
