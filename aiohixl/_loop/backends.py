"""Event-loop glue: watching the agent's wake fd and the waiters ops resolve.

One thin class per async library, chosen with sniffio. asyncio gets plain
futures and ``add_reader``; trio gets one system task blocked on the fd. Each
can keep its loop turning for a while (``keep_turning``: the notifications'
poll), asyncio with a callback that puts itself back, trio with a task.
"""

from __future__ import annotations

import asyncio
import collections.abc
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

import sniffio

__all__ = ["Backend", "current_backend"]

# Each turn yields the CPU to any thread waiting for it: on a small host the sender (or this
# process's native threads) may share this loop's CPU, and would else wait out the window
# (4 KiB shm notifications, one at a time: 18-20 us in every round with it; without it, rounds
# of 31 us where the scheduler had put both processes on one CPU).
_yield = os.sched_yield


def _nothing(last: bool) -> None:
    pass


class Backend:
    name: str
    _turn_until = 0  # keep_turning's deadline (monotonic ns); 0: not turning
    _turned: Callable[[bool], None] = staticmethod(_nothing)

    def watch(self, fd: int, on_readable: Callable[[], None]) -> None: ...
    def unwatch(self, fd: int) -> None: ...
    def new_waiter(self) -> Any: ...
    def resolve(self, waiter: Any, exc: BaseException | None) -> None: ...
    async def wait(self, waiter: Any) -> None: ...
    def forget(self, waiter: Any) -> None:
        """Nobody will wait for ``waiter`` (its task stopped waiting): what it is given is dropped."""

    def spawn(self, fn: Callable[[], Any], name: str) -> None:
        """Run ``fn()`` in the background; it must catch its own exceptions."""

    async def run_to_end(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker thread (its result), waited for to its end even through a
        cancellation, which is raised once it is done: what it releases is released
        when the caller goes on."""

    async def wait_to_end(self, waiter: Any) -> None:
        """``wait(waiter)``, to its end even through a cancellation, which is raised once it
        has resolved: the native side is done with what the op touches when this returns."""

    async def run_steps_to_end(self, steps: Coroutine[Any, Any, None]) -> None:
        """Await ``steps`` to its end even through a cancellation, which is raised once it has
        ended: a close that a cancellation cut short would leave memory half released."""

    def is_current(self) -> bool:
        """Whether the caller runs in the event loop (trio run) this backend was made in."""
        return True

    def keep_turning(self, until_ns: int, turned: Callable[[bool], None]) -> None:
        """Keep the loop turning without blocking in its wait until ``time.monotonic_ns()``
        reaches ``until_ns``: what becomes ready (the wake fd) is seen on the next turn,
        and the other tasks run as they would. Its CPU is the cost. ``turned(False)`` is
        called on each turn, ``turned(True)`` once after the last."""
        idle = self._turn_until == 0
        self._turn_until = max(self._turn_until, until_ns)
        self._turned = turned
        if idle:
            self._start_turning()

    def _start_turning(self) -> None:
        """Start the turns (a chain that checks ``_turn_until`` each time, and sets it back to
        0 after its last)."""


class Op:
    """What a plain ``put``/``get`` returns under asyncio: that op's own awaitable, which
    asyncio takes as a coroutine (it has ``send``/``throw``/``close``), so every combinator
    treats it as it treats any coroutine: ``create_task``, ``TaskGroup`` and anyio take it,
    ``gather``/``wait_for``/``shield``/``as_completed``/``ensure_future`` wrap it in a Task,
    and ``asyncio.wait`` takes those Tasks. ``await op`` itself makes no Task: it awaits
    the op's Future (an op that ended as it was posted is a ``DoneOp``; a lone tcp op whose
    answer the awaiting task reads, a ``PolledOp``, makes one only if it must wait).

    Unlike a coroutine it may be awaited again (it returns at once), and one that is never
    awaited still moves its bytes: the op was posted when it was made."""

    __slots__ = ("_waiter", "_steps")

    def __init__(self, waiter: asyncio.Future) -> None:
        self._waiter = waiter
        self._steps: Any = None

    def __await__(self) -> Any:
        return self._waiter.__await__()

    def done(self) -> bool:
        """Whether awaiting it returns at once: the op ended (or the Task awaiting it was
        cancelled; the op itself then still finishes in the background)."""
        return self._waiter.done()

    def send(self, value: Any) -> Any:
        steps = self._steps
        if steps is None:
            steps = self._steps = self._waiter.__await__()
        return steps.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        steps = self._steps
        if steps is None:  # not started: it ends with that exception, as a coroutine does
            exc = typ if val is None else val
            raise exc() if isinstance(exc, type) else exc
        return steps.throw(typ) if val is None else steps.throw(typ, val, tb)

    def close(self) -> None:
        steps = self._steps
        if steps is not None:
            steps.close()


collections.abc.Coroutine.register(Op)


class DoneOp(tuple):
    """``Op`` of an op that ended as it was posted (most same-host ops): made and awaited
    with no Python frame, since that is all such an op costs beyond its copy. An empty
    tuple's iterator is the awaiting (it ends at once, with None); identity is its own, so
    ops stay apart as dict keys and in sets."""

    __slots__ = ()
    __await__ = tuple.__iter__
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return "<aiohixl op: done>"

    def done(self) -> bool:
        return True

    def send(self, value: Any) -> Any:
        raise StopIteration

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        exc = typ if val is None else val
        raise exc() if isinstance(exc, type) else exc

    def close(self) -> None:
        pass


collections.abc.Coroutine.register(DoneOp)


class HeldOpFuture(asyncio.Future):
    """The Future of the first op of a burst that its transport holds until the loop's
    current callbacks have run (tcp). The first callback attached to it (the Task's that
    awaits it) sends the burst at once: by then every op of it is posted, and
    the loop need not turn once more first."""

    flush: Any = None  # the engine's early flush of this burst; None once the burst is out

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        flush = self.flush
        if flush is not None:
            try:
                flush(self)
            except Exception as exc:  # the callback is attached all the same: nobody waits forever
                self.get_loop().call_exception_handler(
                    {"message": "aiohixl: flushing a held burst failed", "exception": exc, "future": self}
                )
        super().add_done_callback(fn, context=context)


FRESH, WAIT, OK = 0, 1, 2  # PolledOp.state


class PolledOp(Op):
    """``Op`` of a lone op whose answer the awaiting task reads itself (tcp's
    HX_POSTED_POLL). Awaiting it first reads the answer (``Engine.poll_lone``); when
    that ends the op, awaiting returns with no Future made and no turn of the loop.
    A Future is made only for a task that must wait, or to carry a failure.

    It is also the op's waiter in the engine's records: ``done``, ``set_result`` and
    ``set_exception`` are what ``AsyncioBackend.resolve`` calls."""

    __slots__ = ("_engine", "handle", "op_id", "state")

    def __init__(self, engine: Any, handle: Any, op_id: int) -> None:
        self._waiter: asyncio.Future | None = None  # type: ignore[assignment]
        self._steps = None
        self._engine = engine
        self.handle = handle  # the native peer that reads the answer
        self.op_id = op_id
        self.state = FRESH  # FRESH: nobody read for it; WAIT: read, or a Future has it; OK: it succeeded

    def _read(self) -> None:
        self.state = WAIT
        self._engine.poll_lone(self)  # may end it: OK, or a Future holding its failure

    def __await__(self) -> Any:
        if self.state == FRESH:
            self._read()
        if self.state == OK:
            return iter(())  # ends at once, with None
        return self._future().__await__()

    def send(self, value: Any) -> Any:
        steps = self._steps
        if steps is None:
            if self.state == FRESH:
                self._read()
            if self.state == OK:
                raise StopIteration
            steps = self._steps = self._future().__await__()
        return steps.send(value)

    def _future(self) -> asyncio.Future:
        waiter = self._waiter
        if waiter is None:
            # The backend's, not engine.loop: a closing agent drops that before its ops fail.
            waiter = self._waiter = self._engine.backend.new_waiter()
        return waiter

    def done(self) -> bool:
        waiter = self._waiter
        return self.state == OK or (waiter is not None and waiter.done())

    def set_result(self, result: None) -> None:
        waiter = self._waiter
        if waiter is None:
            self.state = OK
        else:
            waiter.set_result(result)
        self._engine = None  # ended: an op kept by its caller keeps no agent alive

    def set_exception(self, exc: BaseException) -> None:
        self.state = WAIT  # nothing left to read for
        self._future().set_exception(exc)  # a failure never awaited is logged, as a Future's is
        self._engine = None


class AsyncioBackend(Backend):
    name = "asyncio"

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task] = set()

    def _start_turning(self) -> None:
        # A callback that puts itself back each turn: asyncio then selects with timeout 0.
        # Cheaper than a task (no coroutine step), and it holds no one up.
        self.loop.call_soon(self._turn)

    def _turn(self) -> None:
        if time.monotonic_ns() < self._turn_until:
            _yield()
            try:
                self._turned(False)
            finally:  # after what turned() woke: their tasks run before the next turn
                self.loop.call_soon(self._turn)
        else:
            self._turn_until = 0
            self._turned(True)

    def is_current(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:  # no loop running in this thread
            return False

    def watch(self, fd: int, on_readable: Callable[[], None]) -> None:
        self.loop.add_reader(fd, on_readable)

    def unwatch(self, fd: int) -> None:
        if not self.loop.is_closed():
            self.loop.remove_reader(fd)

    def new_waiter(self) -> asyncio.Future:
        return self.loop.create_future()

    def resolve(self, waiter: asyncio.Future, exc: BaseException | None) -> None:
        if waiter.done():  # the awaiting task was cancelled
            return
        if exc is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(exc)

    async def wait(self, waiter: asyncio.Future) -> None:
        await waiter

    def forget(self, waiter: asyncio.Future | PolledOp) -> None:
        # Else an error it is given later is logged as "exception was never retrieved".
        if isinstance(waiter, PolledOp):
            if waiter.state == OK:
                return
            waiter = waiter._future()  # where its end would go; cancelled, it takes none
        if not waiter.done():
            waiter.cancel()
        elif not waiter.cancelled():
            waiter.exception()  # marks it retrieved

    async def run_to_end(self, fn: Callable[..., Any], *args: Any) -> Any:
        # The loop's executor, not anyio's threads: their first use imports anyio's asyncio
        # backend on the loop (25-50 ms here), which the first region.close() would stall for.
        future = self.loop.run_in_executor(None, fn, *args)
        await self.wait_to_end(future)
        return future.result()

    async def wait_to_end(self, waiter: asyncio.Future) -> None:
        # A shielded anyio scope does not hold off a native Task.cancel(): asyncio.shield does.
        cancelled: asyncio.CancelledError | None = None
        while True:
            try:
                await asyncio.shield(waiter)
                break
            except asyncio.CancelledError as exc:
                if waiter.done():
                    raise
                cancelled = exc
        if cancelled is not None:
            raise cancelled

    async def run_steps_to_end(self, steps: Coroutine[Any, Any, None]) -> None:
        task = self.loop.create_task(steps)
        try:
            await self.wait_to_end(task)
        except BaseException:
            if not task.cancelled():
                task.exception()  # retrieved: the cancellation is what the caller gets
            raise
        task.result()

    def spawn(self, fn: Callable[[], Any], name: str) -> None:
        task = self.loop.create_task(fn(), name=name)
        self._tasks.add(task)  # the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)


class _TrioWaiter:
    """A trio task's waiter. ``done()`` and ``set_result()`` are an asyncio Future's, so a hot
    path (Inbox._serve) calls the waiter itself, with no backend call in between."""

    __slots__ = ("event", "exc", "abandoned")

    def __init__(self, event: Any) -> None:
        self.event = event
        self.exc: BaseException | None = None
        self.abandoned = False

    def done(self) -> bool:
        """Resolved, or its task stopped waiting (cancelled): nobody waits on it."""
        return self.event.is_set() or self.abandoned

    def set_result(self, _: None) -> None:
        self.event.set()


class TrioBackend(Backend):
    name = "trio"

    def __init__(self) -> None:
        import trio

        self.trio = trio
        self._scope: Any = None
        self._token = trio.lowlevel.current_trio_token()

    def _start_turning(self) -> None:
        # A runnable task makes trio's scheduler poll its fds with timeout 0.
        self.trio.lowlevel.spawn_system_task(self._turn, name="aiohixl-keep-turning")

    async def _turn(self) -> None:
        checkpoint = self.trio.lowlevel.checkpoint
        try:
            while time.monotonic_ns() < self._turn_until:
                _yield()
                self._turned(False)
                await checkpoint()
        finally:
            self._turn_until = 0
            self._turned(True)

    def is_current(self) -> bool:
        try:
            return self.trio.lowlevel.current_trio_token() is self._token
        except RuntimeError:  # not inside trio.run
            return False

    def watch(self, fd: int, on_readable: Callable[[], None]) -> None:
        trio = self.trio
        self._scope = trio.CancelScope()

        async def pump() -> None:
            with self._scope:
                while True:
                    try:
                        await trio.lowlevel.wait_readable(fd)
                    except trio.ClosedResourceError:
                        return
                    on_readable()

        # A system task needs no nursery from the user and lives with the run.
        trio.lowlevel.spawn_system_task(pump, name="aiohixl-completions")

    def unwatch(self, fd: int) -> None:
        if self._scope is not None:
            self._scope.cancel()
            try:
                self.trio.lowlevel.notify_closing(fd)
            except RuntimeError:
                pass  # not inside trio any more

    def new_waiter(self) -> _TrioWaiter:
        return _TrioWaiter(self.trio.Event())

    def resolve(self, waiter: _TrioWaiter, exc: BaseException | None) -> None:
        if not waiter.event.is_set():
            waiter.exc = exc
            waiter.event.set()

    async def wait(self, waiter: _TrioWaiter) -> None:
        try:
            await waiter.event.wait()
        except BaseException:
            waiter.abandoned = True  # cancelled: nobody will read what it is given
            raise
        if waiter.exc is not None:
            raise waiter.exc

    def forget(self, waiter: _TrioWaiter) -> None:
        waiter.abandoned = True

    async def run_to_end(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self.trio.CancelScope(shield=True):  # trio waits for the thread, even cancelled
            result = await self.trio.to_thread.run_sync(fn, *args)
        await self.trio.lowlevel.checkpoint_if_cancelled()
        return result

    async def wait_to_end(self, waiter: _TrioWaiter) -> None:
        with self.trio.CancelScope(shield=True):
            await self.wait(waiter)
        await self.trio.lowlevel.checkpoint_if_cancelled()

    async def run_steps_to_end(self, steps: Coroutine[Any, Any, None]) -> None:
        with self.trio.CancelScope(shield=True):
            await steps
        await self.trio.lowlevel.checkpoint_if_cancelled()

    def spawn(self, fn: Callable[[], Any], name: str) -> None:
        self.trio.lowlevel.spawn_system_task(fn, name=name)


def current_backend() -> Backend:
    library = sniffio.current_async_library()
    if library == "asyncio":
        return AsyncioBackend()
    if library == "trio":
        return TrioBackend()
    raise RuntimeError(f"aiohixl runs on asyncio or trio, not {library}")
