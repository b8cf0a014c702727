"""Waiting on a state, never on a guess of how long something takes."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Union

import anyio

Predicate = Callable[[], Union[object, Awaitable[object]]]


async def wait_until(predicate: Predicate, timeout: float = 30.0, what: str | None = None) -> object:
    """Return ``predicate()``'s first true value, asking again as the event loop turns (it may
    be a coroutine function: a state query on another process); fail naming ``what`` (or the
    predicate) after ``timeout`` seconds, on asyncio or trio."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        got = predicate()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or getattr(predicate, '__qualname__', predicate)}")
        await anyio.sleep(pause)
        pause = min(pause * 2, 0.05)  # quick for what is nearly there, cheap for what takes long


def wait_until_sync(predicate: Callable[[], object], timeout: float = 30.0, what: str | None = None) -> object:
    """wait_until for code outside an event loop (a fixture starting a server)."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or getattr(predicate, '__qualname__', predicate)}")
        time.sleep(0.02)


async def all_end(
    tasks: list[asyncio.Task[object]], timeout: float, state: Callable[[], str], beside: asyncio.Task[object]
) -> None:
    """Wait for ``tasks`` (asyncio) while ``beside`` (a collect of what they send) runs. The
    first that fails is raised at once; any still running after ``timeout`` seconds fail the
    test with ``state()`` (the sender's side of it): else ``beside`` would wait out its own
    timeout and say neither. Either way ``beside`` is cancelled then."""
    done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
    failed = [t.exception() for t in done if t.exception() is not None]
    if failed or pending:
        beside.cancel()
    if failed:
        raise failed[0]
    if pending:
        raise AssertionError(f"{len(pending)} of {len(tasks)} still wait after {timeout} s: {state()}")
