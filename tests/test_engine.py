"""The engine and the native bridge: how completions become results and errors."""

from __future__ import annotations

import errno

import pytest

import aiohixl
from aiohixl import _testing as hooks
from aiohixl._loop.native import ffi, lib


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
