"""The engine and the native bridge: how completions become results and errors."""

from __future__ import annotations

import asyncio
import errno
import gc

import pytest

import aiohixl
from aiohixl import _testing as hooks
from aiohixl._loop.native import ffi, lib

from .waiting import wait_until


async def test_a_system_error_completed_on_a_native_thread_carries_that_threads_errno():
    """An HX_E_SYS completion's OSError has the errno of the failure, not whatever the event loop's thread saw last."""
    async with aiohixl.Agent(transports=("loopback",)) as agent:
        engine = hooks.engine(agent)
        posted: list[int] = []
        waiter = engine.post_with(lambda op_id: posted.append(op_id) or lib.HX_POSTED, (), "Peer.put")
        assert lib.hx_test_complete_on_thread(engine.native, posted[0], lib.HX_E_SYS, errno.ENETDOWN) == 0
        ffi.errno = errno.EBADF  # the loop's thread: another errno entirely
        with pytest.raises(OSError) as raised:
            await engine.wait(waiter, 10.0, "Peer.put")
        assert raised.value.errno == errno.ENETDOWN, raised.value
        assert str(raised.value).startswith(f"[Errno {errno.ENETDOWN}] Peer.put: ")


async def test_an_op_posted_through_a_transports_own_call_is_the_one_a_notification_follows():
    """post_with (verbs imm, notifications) moves last_op_id as post and post1 do: a notify's dep is that op."""
    async with aiohixl.Agent(transports=("loopback",)) as agent:
        engine = hooks.engine(agent)
        posted: list[int] = []
        engine.post_with(lambda op_id: posted.append(op_id) or lib.HX_DONE_INLINE, (), "Peer.put")
        assert engine.last_op_id == posted[0]


@pytest.mark.parametrize("stop", ["cancel", "timeout"])
async def test_ops_left_behind_by_a_cancelled_or_timed_out_wait_log_nothing_when_they_fail(stop):
    """put_many's ops fail after its task stopped waiting for them: nobody reads those errors,
    and asyncio must not report them as 'exception was never retrieved' (each a logged error)."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        await _fail_ops_left_behind(stop)
        gc.collect()  # an unretrieved error is reported as its Future is freed
    finally:
        loop.set_exception_handler(None)
    assert reported == []


async def _fail_ops_left_behind(stop: str) -> None:
    async with aiohixl.Agent(transports=("loopback",)) as agent:
        engine = hooks.engine(agent)
        posted: list[int] = []
        waiters = [
            engine.post_with(lambda op_id: posted.append(op_id) or lib.HX_POSTED, (), "Peer.put_many") for _ in range(3)
        ]
        waiting = asyncio.create_task(engine.wait_all(waiters, 0.01 if stop == "timeout" else None, "Peer.put_many"))
        await asyncio.sleep(0)  # it waits on the first
        if stop == "cancel":
            waiting.cancel()
        with pytest.raises(asyncio.CancelledError if stop == "cancel" else aiohixl.TransferTimeout):
            await waiting
        for op_id in posted:
            assert lib.hx_test_complete_on_thread(engine.native, op_id, lib.HX_E_CONNLOST, 0) == 0
        await wait_until(lambda: not engine._ops, what="the three completions drained")
