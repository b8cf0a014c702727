"""Failures the system rarely gives, injected natively at a named site (``hx_test_fail_next``):
an op that meets one fails with a typed error, and nothing waits on it forever.

The sites are process-wide, so each test here is the only user of its site while it runs: the
agents are made in the test, a tcp target is another process.
"""

import asyncio

import numpy as np
import pytest

import aiohixl
from aiohixl import Access
from aiohixl._native import lib

from .conftest import random_bytes

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
