"""The trio subset: the same agent, driven by trio (one system task on the wake fd)."""

import numpy as np
import pytest
import trio

import aiohixl
from aiohixl import Access

from .conftest import random_bytes
from .waiting import wait_until


def run(fn):
    return trio.run(fn)


def test_put_get_many_on_trio():
    async def main():
        async with aiohixl.Agent("trio") as agent:
            src_arr = random_bytes(8 << 20, seed=11)
            src = agent.register(src_arr)
            dst_arr = np.zeros(8 << 20, dtype=np.uint8)
            agent.register(dst_arr, name="d", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
            peer = agent.loopback()
            d = await peer.region("d")
            await peer.put(d[:4096], src[:4096])  # inline
            await peer.put(d, src)  # copy pool, completion through the wake fd
            assert np.array_equal(dst_arr, src_arr)
            dst_arr[:] = 0
            half = 4 << 20
            await peer.put_many([(d[:half], src[half:]), (d[half:], src[:half])])
            assert np.array_equal(dst_arr[:half], src_arr[half:])
            back = agent.register(np.zeros(8 << 20, dtype=np.uint8))
            await peer.get_many([(back[:half], d[half:]), (back[half:], d[:half])])
            assert np.array_equal(back.memory, src_arr)
            await peer.get(back, d)
            assert np.array_equal(np.frombuffer(back.memory, dtype=np.uint8), dst_arr)

    run(main)


def test_concurrent_ops_and_errors_on_trio():
    async def main():
        async with aiohixl.Agent() as agent:
            src = agent.register(random_bytes(1 << 20, seed=12))
            dst_arr = np.zeros(200 << 20, dtype=np.uint8)
            agent.register(dst_arr, name="d", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
            agent.register(bytearray(10), name="ro", access=Access.REMOTE_READ)
            peer = agent.loopback()
            d = await peer.region("d")
            async with trio.open_nursery() as nursery:
                for i in range(200):
                    nursery.start_soon(peer.put, d[i << 20 : (i + 1) << 20], src)
            assert np.array_equal(dst_arr.reshape(200, -1), np.tile(src.memory, (200, 1)))
            with pytest.raises(aiohixl.AccessDenied):
                await peer.put(await peer.region("ro"), src[:10])
            with pytest.raises(aiohixl.TransferTimeout):
                big = agent.register(np.ones(200 << 20, dtype=np.uint8))
                await peer.put(d, big, timeout=0.0001)
            # Timed out, and the copy goes on: its source stays registered until it ends
            # (closing the region waits for it; a loaded machine may have ended it already).
            assert agent.outstanding in (0, 1)
            await big.close()
            assert agent.outstanding == 0 and dst_arr.all()

    run(main)


def test_cancellation_on_trio():
    async def main():
        async with aiohixl.Agent() as agent:
            src = agent.register(np.ones(128 << 20, dtype=np.uint8))
            dst_arr = np.zeros(128 << 20, dtype=np.uint8)
            region = agent.register(dst_arr, name="d", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE)
            peer = agent.loopback()
            d = await peer.region("d")
            with trio.move_on_after(0.0001):
                await peer.put(d, src)
            await region.close()  # waits for the abandoned copy
            assert dst_arr.all()
            await wait_until(lambda: agent.outstanding == 0, what="the abandoned put's completion")

    run(main)


@pytest.mark.parametrize("transports", [("tcp",), None], ids=["tcp", "auto"])
def test_two_process_put_get_on_trio(transports):
    from .harness import TOKEN, Target, pattern, sha

    async def main():
        target = await Target.start()
        try:
            await target.alloc("kv", 8 << 20)
            async with aiohixl.Agent("trio-init", token=TOKEN) as agent:
                peer = await agent.connect(target.address, transports=transports)
                assert peer.transport == ("tcp" if transports else "shm")
                kv = await peer.region("kv")
                src = agent.register(pattern(8 << 20, 31))
                await peer.put(kv[:4096], src[:4096])
                await peer.put(kv, src)
                assert await target.hash("kv", 0, 8 << 20) == sha(pattern(8 << 20, 31))
                back = agent.register(np.zeros(8 << 20, dtype=np.uint8))
                await peer.get_many([(back[: 1 << 20], kv[: 1 << 20]), (back[1 << 20 :], kv[1 << 20 :])])
                assert np.array_equal(back.memory, pattern(8 << 20, 31))
                async with trio.open_nursery() as nursery:
                    for i in range(100):
                        nursery.start_soon(peer.put, kv[i * 4096 : (i + 1) * 4096], src[:4096])
                assert await target.hash("kv", 99 * 4096, 4096) == sha(pattern(4096, 31))
        finally:
            await target.aclose()

    run(main)


def test_allocate_async_on_trio_cancelled_while_populating():
    """Cancelled, allocate_async returns only once the copy thread's populate has completed."""
    from aiohixl import _testing as hooks

    async def main():
        async with aiohixl.Agent("trio") as agent:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(agent.allocate_async, 512 << 20)
                    await wait_until(lambda: hooks.engine(agent).outstanding > 0)
                    scope.cancel()
            assert hooks.engine(agent).outstanding == 0
            assert hooks.live_regions(agent) == []
            region = await agent.allocate_async(1 << 20)
            region.memory[:4] = b"abcd"
            assert bytes(region.memory[:4]) == b"abcd"

    run(main)


def test_notification_timeout_on_trio():
    """trio keeps anyio's deadline for notification(timeout=) (asyncio has a loop timer)."""

    async def main():
        async with aiohixl.Agent("trio") as agent:
            peer = agent.loopback()
            with pytest.raises(aiohixl.NotificationTimeout):
                await agent.notification(timeout=0.01)
            await peer.notify(b"after")
            assert (await agent.notification(timeout=5)).data == b"after"
            assert agent._core.inbox._waiters == []

    run(main)


def test_notifications_keep_a_trio_loop_turning_while_they_come():
    """notify_poll_us under trio: doorbell (shm) notifications close together keep the run turning
    for a window, through a task of its own that only checkpoints (so it is seen among the run's
    living tasks, however little CPU a busy machine gives it), and it ends once they stop."""
    import gc
    import time

    async def main():
        async with aiohixl.Agent("trio-t", listen="127.0.0.1:0", token="trio-notes", notify_poll_us=300_000) as t:
            dst = t.allocate(4096, name="d")
            async with aiohixl.Agent("trio-i", token="trio-notes") as agent:
                src = agent.allocate(4096)
                src.memory[:] = b"\x07" * 4096
                peer = await agent.connect(t.address)
                d = await peer.region("d")
                assert await peer.path(d) == "shm-memfd"
                living = trio.lowlevel.current_statistics().tasks_living
                for i in range(5):
                    await peer.put(d, src, notify=b"%d" % i)
                    assert (await t.notification(timeout=60)).data == b"%d" % i
                assert bytes(dst.memory) == b"\x07" * 4096
                assert trio.lowlevel.current_statistics().tasks_living == living + 1  # the turning task
                await wait_until(
                    lambda: trio.lowlevel.current_statistics().tasks_living == living,
                    timeout=30,
                    what="the turning task's end",
                )
                gc.disable()  # a full collection of the suite's heap is tens of ms of this thread's CPU
                try:
                    start = time.thread_time()
                    await trio.sleep(1.0)
                    idle = time.thread_time() - start
                finally:
                    gc.enable()
                assert idle < 0.02, f"an idle run used {idle:.3f} s of CPU in 1 s"

    run(main)
