"""Failures the system rarely gives, injected natively at a named site (``hx_test_fail_next``):
an op that meets one fails with a typed error, and nothing waits on it forever.

The sites are process-wide, so each test here is the only user of its site while it runs: the
agents are made in the test, a tcp target is another process.
"""

import asyncio
import errno
import os

import numpy as np
import pytest

import aiohixl
from aiohixl import Access
from aiohixl._loop.native import lib

from .conftest import random_bytes
from .harness import TOKEN, Target

DEADLINE = 20.0  # far past what any op here takes; reaching it means a hang


@pytest.fixture
def fail_next():
    """fail_next(site): the next pass through the native fault site fails; disarmed after the test."""
    armed = []

    def arm(site: int, count: int = 1) -> None:
        armed.append(site)
        lib.hx_test_fail_next(site, count)

    yield arm
    for site in armed:
        lib.hx_test_fail_next(site, 0)


async def test_out_of_memory_for_a_pooled_copy_fails_the_op(agent, fail_next):
    """A copy too big to run inline moves its on-stack bookkeeping to the heap for the pool;
    when that allocation fails the op fails (MemoryError) and its regions are released:
    closing them does not wait on an op that never ends."""
    size = 4 << 20
    src_arr = random_bytes(size, seed=3)
    dst_arr = np.zeros(size, dtype=np.uint8)
    src = agent.register(src_arr)
    dst = agent.register(dst_arr, name="dst", access=Access.REMOTE_WRITE)
    peer = agent.loopback()
    remote = await peer.region("dst")
    fail_next(lib.HX_FAULT_COPY_JOB)
    with pytest.raises(MemoryError, match="Peer.put"):
        await asyncio.wait_for(peer.put(remote, src), DEADLINE)
    await asyncio.wait_for(dst.close(), DEADLINE)
    await asyncio.wait_for(src.close(), DEADLINE)
    assert not dst_arr.any()  # refused before a byte moved


async def test_the_same_copy_without_the_fault_lands(agent):
    size = 4 << 20
    src_arr = random_bytes(size, seed=4)
    dst_arr = np.zeros(size, dtype=np.uint8)
    src = agent.register(src_arr)
    agent.register(dst_arr, name="dst", access=Access.REMOTE_WRITE)
    peer = agent.loopback()
    await asyncio.wait_for(peer.put(await peer.region("dst"), src), DEADLINE)
    assert np.array_equal(dst_arr, src_arr)


def _threads_named(name: str) -> int:
    """This process's threads called ``name`` (the native threads name themselves)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == name
        except FileNotFoundError:
            pass  # ended while we looked
    return count


async def test_a_failed_tcp_io_thread_fails_ops_and_refuses_new_connections(fail_next):
    """When the tcp I/O thread's epoll_wait fails it stops for good: the ops of its
    connections fail (ConnectionLost), and a new connection is refused with the system's error (OSError)
    instead of being handed to a thread that no longer runs (whose ops would never end)."""
    target = await Target.start()
    try:
        await target.alloc("kv", 1 << 20)
        async with aiohixl.Agent("initiator", token=TOKEN, transports=("tcp",)) as agent:
            src = agent.register(random_bytes(4096, seed=5))
            peer = await agent.connect(target.address)
            kv = await peer.region("kv")
            io_threads = _threads_named("hixl-tcp-io")
            fail_next(lib.HX_FAULT_EPOLL_WAIT)
            # A lone 4 KiB put's answer may be read by this thread (the lone-op poll) and
            # never wake the I/O thread; 1 MiB is over what a caller sends itself, so the
            # I/O thread wakes to send the rest and fails at its next wait.
            big = agent.register(random_bytes(1 << 20, seed=6))
            try:
                await asyncio.wait_for(peer.put(kv, big), DEADLINE)
            except aiohixl.ConnectionLost:
                pass  # the thread may fail before it reads the answer
            # The failed thread ends: a state to wait for, not a time.
            give_up = asyncio.get_running_loop().time() + DEADLINE
            while _threads_named("hixl-tcp-io") >= io_threads:
                assert asyncio.get_running_loop().time() < give_up, "the failed I/O thread never ended"
                await asyncio.sleep(0.01)
            # Past that nothing reads the connection: a put fails, none hangs.
            with pytest.raises(aiohixl.ConnectionLost):
                await asyncio.wait_for(peer.put(kv[:4096], src), DEADLINE)
            with pytest.raises((aiohixl.HixlError, OSError)) as refused:
                again = await asyncio.wait_for(agent.connect(target.address), DEADLINE)
                await asyncio.wait_for(again.put(kv[:4096], src), DEADLINE)
            assert not isinstance(refused.value, TimeoutError), "hung"
            assert refused.value.errno == errno.EBADF, refused.value  # the I/O thread's own error
    finally:
        await target.aclose()
