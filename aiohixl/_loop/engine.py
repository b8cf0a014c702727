"""The completion engine: posts native ops and resolves their waiters.

Native threads push completions into the agent's ring and write its wake fd
once per batch; the event loop reads the fd and drains the ring here. Every
posted op stays in ``_ops`` with the objects it touches until its completion
arrives, whatever happened to the task that awaited it: that is what keeps
memory in flight alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Protocol

import anyio

from ..errors import ClosedError, HixlError, TransferTimeout, WrongEventLoop
from ..memory import Region, RegionSlice
from ..remote import RemoteSlice
from .backends import Backend, HeldOpFuture, PolledOp, current_backend
from .native import check, ffi, lib, status_error

_post1 = lib.hx_peer_post1  # one lookup, not one per op
_flush = lib.hx_peer_flush
_await = lib.hx_peer_await
_HOLD = lib.HX_OP_HOLD
_POLL = lib.HX_OP_POLL
_post_note = lib.hx_peer_note
_put_note = lib.hx_peer_put_note
_BUSY = lib.HX_E_BUSY

__all__ = ["Engine"]

_DRAIN_BATCH = 4096


class OpOwner(Protocol):
    """Who posted an op (a peer). Whether it still has ops in flight is asked of the
    engine (``when_none``), not counted per op: the hot path keeps no books."""

    def op_failed(self, exc: BaseException) -> None:
        """Told before the op's waiter gets ``exc`` (a peer learns its path broke)."""


# An op in flight, as a tuple (the cheapest record Python makes, once per op): its waiter;
# the local regions (and their buffers) the native side touches, kept alive until it ends;
# what to name in an error; who posted it (OpOwner or None). ``Engine._ops`` holds them in
# the order they were posted (op ids increase), which is what lets a fence stop early.
_Op = tuple  # (waiter, keep, what, owner)


class Engine:
    def __init__(self, ring_capacity: int, copy_threads: int) -> None:
        status = ffi.new("int *")
        native = lib.hx_agent_new(ring_capacity, copy_threads, status)
        if native == ffi.NULL:
            check(status[0], "Agent()")
        self.native = native
        self.capacity = ring_capacity
        self.fd = lib.hx_agent_wake_fd(native)
        self.backend: Backend | None = None
        self.loop: Any = None  # the asyncio loop attached to (the fast path posts at the call), else None
        self.loop_is_base = False  # it is asyncio's own loop: its _thread_id says which thread runs it
        self._hold = 0  # HX_OP_HOLD where the loop can run the flush (asyncio: call_soon)
        self._poll = 0  # HX_OP_POLL where a waiter can read its answer as it is awaited (asyncio)
        # Or'ed into a lone put that its notification follows at once (Peer): held to go out with it.
        self.note_next = 0
        self._burst = False  # the last flush sent more than one op
        self._ops: dict[int, _Op] = {}
        self._next_id = 1
        self._batch = ffi.new("hx_completion[]", _DRAIN_BATCH)
        # The batch read as plain integers: indexing a memoryview is cheaper than a cdata
        # struct per completion. hx_completion is {uint64 op_id; int32 status; int32 sys_errno}.
        assert ffi.sizeof("hx_completion") == 16
        raw = memoryview(ffi.buffer(self._batch)).cast("B")
        self._batch_ids = raw.cast("Q")  # op_id of completion i at [2 * i]
        self._batch_status = raw.cast("i")  # status of completion i at [4 * i + 2], its sys_errno at [4 * i + 3]
        self._slot_waiters: list[Any] = []
        self.completed = 0  # ops whose completion arrived, awaited or not
        self.unknown_completions = 0  # completions of no outstanding op: a bug if ever > 0
        self.last_op_id = 0  # the id of the op posted last (what a notification may follow)
        self.on_wake: Any = None  # called after each drain (was it woken?): notifications may have arrived
        self._held: list[tuple[Any, int]] = []  # (handle, op id) of ops held until _flush_held
        self._held_first: HeldOpFuture | None = None  # the Future of the held burst's first op
        # when_none's waits: [oldest op id found, match, up_to, then]
        self._waits: list[list[Any]] = []

    @property
    def outstanding(self) -> int:
        return len(self._ops)

    @property
    def held(self) -> int:
        """Ops the transports hold for the burst's flush (under asyncio)."""
        return len(self._held)

    def in_flight(self, op_id: int) -> bool:
        return op_id in self._ops

    @property
    def last_posted(self) -> int:
        """The id of the op posted last: every op posted so far has an id up to this."""
        return self._next_id - 1

    def oldest_op(self, match: Callable[[_Op], bool], up_to: int | None = None) -> int | None:
        """The id of the oldest op in flight that ``match``es (with an id up to ``up_to``), or None."""
        for op_id, op in self._ops.items():
            if up_to is not None and op_id > up_to:
                return None  # later ops only from here: ids increase in posting order
            if match(op):
                return op_id
        return None

    def when_none(self, match: Callable[[_Op], bool], then: Callable[[], None], up_to: int | None = None) -> None:
        """Run ``then`` once no op in flight ``match``es (up to ``up_to``): now, or after the
        drain that makes it so.

        For the rare waits (a fence, a region's close, a peer's free), so that posting and
        completing an op count nothing. A wait remembers the oldest op it found and looks
        again only once that one has ended."""
        found = self.oldest_op(match, up_to)
        if found is None:
            then()
        else:
            self._waits.append([found, match, up_to, then])

    def _recheck(self) -> None:
        waits, self._waits = self._waits, []
        ops = self._ops
        for wait in waits:
            found = wait[0] if wait[0] in ops else self.oldest_op(wait[1], wait[2])
            if found is None:
                wait[3]()
            else:
                wait[0] = found
                self._waits.append(wait)

    def closing(self) -> None:
        """The agent closes: nothing is posted at the call any more (Peer's checked path says why)."""
        self.loop = None
        self._hold = self._poll = self.note_next = 0

    @property
    def full(self) -> bool:
        """As many ops outstanding as the completion ring holds: the next must wait (admit)."""
        return len(self._ops) >= self.capacity

    def attach(self, what: str = "aiohixl") -> Backend:
        """Bind to the running event loop (once; later calls return the same backend).

        An agent belongs to the loop that first used it: a call from another
        loop or thread raises WrongEventLoop before anything is posted.
        """
        backend = self.backend
        if backend is None:
            backend = self.backend = current_backend()
            backend.watch(self.fd, self.drain)
            if backend.name == "asyncio":
                self.loop = backend.loop  # type: ignore[attr-defined]
                self._hold = _HOLD
                self._poll = _POLL
                self.note_next = _HOLD | lib.HX_OP_NOTE_NEXT
                self.loop_is_base = isinstance(self.loop, asyncio.BaseEventLoop) and hasattr(self.loop, "_thread_id")
        elif not backend.is_current():
            raise WrongEventLoop(
                f"{what}: this agent belongs to the event loop that started it; it cannot be used"
                " from another event loop or thread"
            )
        return backend

    def check_loop(self, what: str) -> None:
        """WrongEventLoop if the agent belongs to a loop and the caller runs outside it.

        Binds nothing: an agent not started yet may be set up (regions registered) from
        plain code, and belongs to the loop that starts it."""
        if self.backend is not None and not self.backend.is_current():
            self.attach(what)  # raises WrongEventLoop

    async def admit(self, what: str = "aiohixl", room: int = 1) -> None:
        """Wait for room for ``room`` ops in the completion ring (at most its capacity):
        completions are never dropped."""
        backend = self.attach(what)
        room = min(room, self.capacity)
        while len(self._ops) + room > self.capacity:
            waiter = backend.new_waiter()
            self._slot_waiters.append(waiter)
            await backend.wait(waiter)

    def post(
        self,
        handle: Any,
        opcode: int,
        sges: Any,
        n: int,
        keep: tuple[Region, ...],
        what: str,
        owner: OpOwner | None = None,
    ) -> Any:
        """Post an op; returns its waiter, or None when it finished inline.

        ``keep`` (the local regions) stays referenced until the completion
        arrives (Region.close() waits for it).
        """
        op_id = self.last_op_id = self._next_id
        self._next_id += 1
        rc = lib.hx_peer_post(handle, opcode | self._poll, op_id, sges, n)
        if rc == 1:  # HX_DONE_INLINE
            self.completed += 1
            return None
        return self._track(op_id, rc, keep, what, owner, handle)

    def post1(self, handle: Any, opcode: int, rs: RemoteSlice, ls: RegionSlice, what: str, owner: OpOwner) -> Any:
        """post() of one checked pair, with scalar arguments: the hot path of a single put/get.

        Under asyncio the transport may hold the op (HX_POSTED_HELD) until the
        burst's first op gets a waiter (HeldOpFuture), else until the loop's
        current callbacks have run, so the ops a gather posts go out together
        (tcp: large puts). Asked while ops come in bursts: others are
        outstanding, or the last flush sent several; a lone op awaited before
        the next goes out at once (holding it only adds to its latency)."""
        rr, region = rs.region, ls.region
        op_id = self.last_op_id = self._next_id
        self._next_id = op_id + 1
        ops = self._ops
        flags = self._hold | self._poll if self._burst or ops else self._poll
        rc = _post1(handle, opcode | flags, op_id, region.id, ls.offset, rr.id, rs.offset, rs.nbytes, rr.key)
        if rc == 1:  # HX_DONE_INLINE
            self.completed += 1
            return None
        if rc < 0:
            raise status_error(rc, what)
        waiter: Any
        if rc == 3:  # HX_POSTED_POLL: its answer is read when it is awaited (poll_lone)
            waiter = PolledOp(self, handle, op_id)
        elif rc == 2 and not self._held:  # HX_POSTED_HELD, the first of a burst
            self.loop.call_soon(self._flush_held)  # unless its first waiter flushes sooner
            waiter = self._held_first = HeldOpFuture(loop=self.loop)
            waiter.flush = self._flush_first
        else:
            waiter = self.backend.new_waiter()  # type: ignore[union-attr]  # attached: loop is set
        if rc == 2:
            self._held.append((handle, op_id))
        ops[op_id] = (waiter, (region,), what, owner)  # _track's record, written out: the hot path
        return waiter

    def put_note(self, handle: Any, rs: RemoteSlice, ls: RegionSlice, data: bytes, what: str, owner: OpOwner) -> Any:
        """post1() of a put and post_note() of its message behind it, as one op (a tcp
        link's): its waiter, or None when it ended inline. Nothing is held for a flush."""
        rr, region = rs.region, ls.region
        op_id = self.last_op_id = self._next_id
        self._next_id = op_id + 1
        rc = _put_note(
            handle, self._poll, op_id, region.id, ls.offset, rr.id, rs.offset, rs.nbytes, rr.key, data, len(data)
        )
        if rc == 1:  # HX_DONE_INLINE
            self.completed += 1
            return None
        return self._track(op_id, rc, (region,), what, owner, handle)

    def _flush_first(self, first: HeldOpFuture) -> None:
        """The burst's first op got a waiter (gather, a Task): send the burst now. Not while
        that op is all it holds: a waiter attached as each op is posted (eager tasks,
        add_done_callback per op) would send every op alone; the loop's turn sends them."""
        if first is self._held_first and len(self._held) > 1:
            self._flush_held()

    def poll_lone(self, op: PolledOp) -> None:
        """A task waits for an op the transport called worth polling for (tcp: sent whole,
        its answer the next to come): the loop would block in its selector now, then be
        woken by the native I/O thread, itself woken by the answer. Reading the answer
        here (the native side reads it for a few tens of microseconds at most) saves both
        wake-ups. A burst posted behind it goes out first (its flush reads the answers).
        Native holds the answer for this call for a millisecond at most, then reads it
        itself: an op never awaited still ends.

        When the answer read is this op's success and nothing else came with it, the op
        ends here, with no trip through the ring."""
        if self._held:
            self._flush_held()
        if op.done() or self.native is None:
            return
        if _await(op.handle, op.op_id) != 1:  # not HX_DONE_INLINE: the ring has it, or will
            self.drain(False)
            return
        del self._ops[op.op_id]
        self.completed += 1
        op.set_result(None)
        if self._slot_waiters or self._waits:
            self.drain(False)  # the slot it freed, the op it ended: what waits on those goes on

    def _flush_held(self) -> None:
        held, self._held = self._held, []
        first, self._held_first = self._held_first, None
        if first is not None:
            first.flush = None  # no stale flush (of a later burst), no engine kept alive by it
        if not held:
            return  # sent already, when the burst's first op got its first waiter
        self._burst = len(held) > 1
        if self.native is None:
            return  # freed (an abandoned agent): its connections with it
        flushed = set()
        ops = self._ops
        for handle, op_id in held:
            # An op still outstanding keeps its peer's handles alive; one that
            # ended already (its connection failed) has nothing left to send.
            if op_id in ops and handle not in flushed:
                flushed.add(handle)
                _flush(handle)
        if flushed:
            # tcp's flush reads the burst's answers for a while: take what it put in the
            # ring now, not a loop iteration later (the flush signalled none of it).
            self.drain(False)

    BUSY = object()  # post_note: the receiver has no room yet

    def post_with(self, submit: Any, keep: tuple[object, ...], what: str, owner: OpOwner | None = None) -> Any:
        """Like post(), through a transport's own native call ``submit(op_id) -> status``."""
        op_id = self.last_op_id = self._next_id
        self._next_id += 1
        rc = submit(op_id)
        if rc == 1:  # HX_DONE_INLINE
            self.completed += 1
            return None
        return self._track(op_id, rc, keep, what, owner)

    def post_note(self, handle: Any, dep: int, data: bytes, what: str, owner: OpOwner | None) -> Any:
        """A notification through peer ``handle`` (after op ``dep`` when not 0): its waiter,
        None when it went in at once, or ``BUSY`` when the receiving queue has no room."""
        op_id = self.last_op_id = self._next_id
        self._next_id += 1
        rc = _post_note(handle, op_id, dep, data, len(data), self._poll)
        if rc == 1:  # HX_DONE_INLINE
            self.completed += 1
            return None
        if rc == _BUSY:
            return self.BUSY
        return self._track(op_id, rc, (), what, owner, handle)

    def _track(
        self, op_id: int, rc: int, keep: tuple[object, ...], what: str, owner: OpOwner | None, handle: Any = None
    ) -> Any:
        """The waiter of a posted op, recorded. HX_POSTED_POLL (through peer ``handle``): one
        whose answer, and those of what it went out with, the awaiting task reads (``poll_lone``)."""
        if rc < 0:
            raise status_error(rc, what)
        if rc == 3:  # HX_POSTED_POLL
            waiter: Any = PolledOp(self, handle, op_id)
        else:
            backend = self.backend
            assert backend is not None
            waiter = backend.new_waiter()
        self._ops[op_id] = (waiter, keep, what, owner)
        return waiter

    async def wait(self, waiter: Any, timeout: float | None, what: str) -> None:
        backend = self.attach()
        if timeout is None:
            await backend.wait(waiter)
            return
        try:
            with anyio.fail_after(timeout):
                await backend.wait(waiter)
        except TimeoutError:
            raise TransferTimeout(f"{what}: no completion within {timeout} s; the op may still complete") from None

    async def wait_all(self, waiters: list[Any], timeout: float | None, what: str) -> None:
        """Wait for every waiter; the first failure is raised once all have ended."""
        if len(waiters) == 1:
            await self.wait(waiters[0], timeout, what)
            return
        backend = self.attach()
        first: BaseException | None = None
        try:
            with anyio.fail_after(timeout) if timeout is not None else nullcontext():
                for waiter in waiters:
                    try:
                        await backend.wait(waiter)
                    except HixlError as exc:
                        first = first or exc
        except BaseException as exc:
            # Cancelled or timed out: the ops not waited for yet end without anyone to see
            # how (their memory stays held until then, as the engine keeps it).
            for waiter in waiters:
                backend.forget(waiter)
            if isinstance(exc, TimeoutError):
                raise TransferTimeout(f"{what}: no completion within {timeout} s; the op may still complete") from None
            raise
        if first is not None:
            raise first

    def drain(self, woken: bool = True) -> None:
        """Resolve the waiters of what the ring holds. ``woken``: the wake fd woke the loop
        (else a flush drains the answers it read, which woke nobody)."""
        batch = self._batch
        backend = self.backend
        assert backend is not None  # drain is what the backend calls
        resolve = backend.resolve
        pop = self._ops.pop
        ids, statuses = self._batch_ids, self._batch_status
        while True:
            n = lib.hx_agent_drain(self.native, batch, _DRAIN_BATCH)
            for i in range(n):
                op = pop(ids[2 * i], None)
                if op is None:
                    self.unknown_completions += 1
                    continue
                self.completed += 1
                status = statuses[4 * i + 2]
                if status == 0:
                    resolve(op[0], None)
                    continue
                exc = status_error(status, op[2], statuses[4 * i + 3])
                if op[3] is not None:
                    op[3].op_failed(exc)
                resolve(op[0], exc)
            if n < _DRAIN_BATCH:
                break
        if self._slot_waiters and len(self._ops) < self.capacity:
            waiters, self._slot_waiters = self._slot_waiters, []
            for w in waiters:
                resolve(w, None)
        if self._waits:
            self._recheck()
        if self.on_wake is not None:
            self.on_wake(woken)

    async def shutdown(self) -> None:
        """Stop native work (queued ops fail as closed), then resolve every op."""
        backend = self.backend
        if backend is None:  # never attached: nothing was ever posted, nothing to wait for
            lib.hx_agent_shutdown(self.native)
            return
        await backend.run_to_end(lib.hx_agent_shutdown, self.native)
        self.drain()
        for op_id, op in list(self._ops.items()):
            # Native shutdown completed everything; this is a last guard.
            self._ops.pop(op_id)
            backend.resolve(op[0], ClosedError(f"{op[2]}: agent closed"))
        self._recheck()
        for w in self._slot_waiters:
            backend.resolve(w, ClosedError("agent closed while waiting to post"))
        self._slot_waiters = []

    def free(self) -> None:
        if self.native is None:
            return
        if self.backend is not None:
            try:
                self.backend.unwatch(self.fd)
            except RuntimeError:
                pass  # the loop is closed (an agent freed at exit): nothing watches any more
        lib.hx_agent_free(self.native)
        self.native = None

    def __del__(self) -> None:
        # Joins native threads before the buffers in _ops can be released.
        if getattr(self, "native", None) is not None:
            lib.hx_agent_free(self.native)
            self.native = None
