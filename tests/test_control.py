"""The control plane in-process: a real socket between two Channels, no agent, no subprocess."""

from __future__ import annotations

import logging

import anyio

from aiohixl._control import handshake as c
from aiohixl._control import wire as w
from aiohixl._control.session import Session
from aiohixl.errors import ConnectionLost, HixlError


async def test_a_handler_bug_is_logged_and_ends_the_session_as_an_internal_error(caplog):
    """A non-library exception from a frame handler is a bug: logged with its traceback, never a quiet 'closed'."""
    ended: list[HixlError] = []
    done = anyio.Event()

    def buggy(r: w.Reader) -> None:
        raise KeyError("a bug in a handler")

    def on_end(reason: HixlError) -> None:
        ended.append(reason)
        done.set()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    caplog.set_level(logging.ERROR, logger="aiohixl")
    async with anyio.create_task_group() as tg:

        async def serve(stream) -> None:
            await Session(c.Channel(stream), 60.0, {w.LOOKUP: buggy}, on_end, "peer 'x'", lambda: None).run()

        tg.start_soon(listener.serve, serve)
        client = c.Channel(await anyio.connect_tcp("127.0.0.1", port))
        await client.send(w.Writer().u32(1).frame(w.LOOKUP))
        with anyio.fail_after(10):
            await done.wait()
        await client.aclose()
        tg.cancel_scope.cancel()
    await listener.aclose()
    (reason,) = ended
    assert isinstance(reason, ConnectionLost)
    assert "internal error" in str(reason) and "KeyError" in str(reason), reason
    logged = [rec for rec in caplog.records if rec.exc_info and rec.exc_info[0] is KeyError]
    assert logged, [rec.getMessage() for rec in caplog.records]
    assert "peer 'x'" in logged[0].getMessage()


async def test_a_library_error_from_a_handler_still_ends_the_session_with_it():
    ended: list[HixlError] = []
    done = anyio.Event()

    def refuses(r: w.Reader) -> None:
        raise ConnectionLost("peer 'x': gone while answering")

    def on_end(reason: HixlError) -> None:
        ended.append(reason)
        done.set()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as tg:

        async def serve(stream) -> None:
            await Session(c.Channel(stream), 60.0, {w.LOOKUP: refuses}, on_end, "peer 'x'", lambda: None).run()

        tg.start_soon(listener.serve, serve)
        client = c.Channel(await anyio.connect_tcp("127.0.0.1", port))
        await client.send(w.Writer().u32(1).frame(w.LOOKUP))
        with anyio.fail_after(10):
            await done.wait()
        await client.aclose()
        tg.cancel_scope.cancel()
    await listener.aclose()
    assert [str(e) for e in ended] == ["peer 'x': gone while answering"]
