"""Notifications that arrived for an agent, and those who wait for them.

Messages are received by the native side (a transport's thread) into a
bounded native queue, whatever the event loop is doing. The inbox moves them
into a bounded queue of its own when the loop runs, and hands them out in
arrival order, or the first one with given data (``match``). When both
queues are full the transports hold the senders back (their ops wait) rather
than drop. A message is dropped, and counted (``dropped``), only when the native
side has no memory to queue it, or when a verbs session ends with messages it
was holding back.
"""

from __future__ import annotations

import collections
import math
import threading
import time
import types
import weakref
from collections.abc import Mapping
from typing import Any

import anyio

from . import _args
from ._loop.engine import Engine
from ._loop.native import ffi, lib
from .errors import ClosedError, InvalidArgument, NotificationTimeout

__all__ = ["Notification", "Inbox", "MAX_NOTIFICATION", "note_bytes"]

MAX_NOTIFICATION = int(lib.HX_NOTE_MAX)
_BATCH = 64
_IMM = int(lib.HX_NOTE_IMM)
_RUNG = int(lib.HX_NOTE_RUNG)
_TURNS = _RUNG | int(lib.HX_NOTE_SERVED)  # notifications that keep the loop turning (_poll)
_drain_notes = lib.hx_agent_drain_notes  # one lookup, not one per pull
_notes_ready = lib.hx_agent_notes_ready
_notes_arrived = lib.hx_agent_notes_arrived
_UNKNOWN = (None, None)  # a sender whose session is no longer known
_get_ident = threading.get_ident  # asyncio.get_running_loop() makes a getpid() system call (3.11)
_now_ns = time.monotonic_ns
_WIDEST = 4  # the loop's window grows up to this many times Agent(notify_poll_us=...)


@types.coroutine
def _one_turn() -> Any:
    """Let the loop turn once (a bare yield: the task's next step is its next callback)."""
    yield


class Notification:
    """A message a peer sent with ``put(notify=)`` or ``notify()``, or a verbs WRITE WITH IMM.

    ``data``: the message (``b""`` for an immediate); ``imm``: the verbs immediate, else
    None; ``nbytes``: bytes the WRITE WITH IMM wrote (0 for messages).

    Who sent it: ``peer``, the sending agent's name (``Agent.name``), and ``peer_id``, its
    id (``Agent.id``, the sender's ``Peer.remote_id`` is the same 16 bytes), which tells
    apart two agents of one name. Both None if the sender is no longer known (its session
    ended long before the message was read: the names of the last 4096 sessions are kept).
    """

    __slots__ = ("data", "imm", "peer", "peer_id", "nbytes")

    def __init__(
        self, data: bytes, imm: int | None, peer: str | None, nbytes: int = 0, peer_id: bytes | None = None
    ) -> None:
        self.data = data
        self.imm = imm
        self.peer = peer
        self.peer_id = peer_id
        self.nbytes = nbytes

    def __repr__(self) -> str:
        what = f"imm={self.imm:#x} nbytes={self.nbytes}" if self.imm is not None else f"data={self.data[:32]!r}"
        who = f"{self.peer!r} (id {self.peer_id[:4].hex()})" if self.peer_id is not None else repr(self.peer)
        return f"<Notification from {who} {what}>"


def _expire(inbox: weakref.ref[Inbox], loop: Any) -> None:
    alive = inbox()
    if alive is not None:
        alive._expire(loop)


def note_bytes(data: Any, what: str, arg: str = "notify=") -> bytes:
    """``data`` as the bytes of a notification, or InvalidArgument naming ``arg``, the argument."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"{what}: {arg} takes bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_NOTIFICATION:
        raise InvalidArgument(f"{what}: a notification holds at most {MAX_NOTIFICATION} bytes, not {len(data)}")
    return data


class Inbox:
    """The agent's notifications: pulled from the native queue, handed to waiters in order."""

    def __init__(
        self,
        engine: Engine,
        capacity: int,
        names: Mapping[int, tuple[str, bytes]],
        own: tuple[str, bytes],
        poll_us: int,
    ) -> None:
        self.engine = engine
        self.capacity = capacity
        self._poll_ns = poll_us * 1000  # Agent(notify_poll_us=...)
        self._window_ns = self._poll_ns // 2  # how long the loop turns after a message (_poll)
        self._arrived_at = 0  # when doorbell messages were last taken from the native queue
        self._quiet = False  # the loop turns and looks itself: doorbells are not rung, tcp is read by it
        # The sender's (name, agent id): by session key, or ``own`` for source 0 (this agent).
        self.names, self.own = names, own
        self._queue: collections.deque[Notification] = collections.deque()
        # [waiter, match, notification, deadline (asyncio: loop time, or None), timeout, what]
        self._waiters: list[list[Any]] = []
        self._timer: Any = None  # asyncio: fires at the earliest deadline of a waiter, or before it
        self._timer_at = math.inf
        self._space: list[Any] = []  # senders on this agent (loopback) waiting for room
        self._buf = ffi.new("hx_note[]", _BATCH)
        self._short = False  # the last pull stopped for want of room: more may wait natively
        self._looking = 0  # tasks that look for their message each turn themselves (get)
        self.closed = False
        lib.hx_agent_set_notes(engine.native, capacity)

    @property
    def dropped(self) -> int:
        return int(lib.hx_agent_notes_dropped(self.engine.native)) if self.engine.native is not None else 0

    def pull(self, woken: bool = True) -> None:
        """Move what arrived natively into the queue (as far as it has room), then serve waiters.

        Not ``woken`` (a drain of what a flush read, not of the wake fd): only if something
        may wait natively, a check with no system call."""
        native = self.engine.native
        if native is None or not (woken or self._short or _notes_ready(native)):
            return
        moved = turns = 0
        queue, buf, names = self._queue, self._buf, self.names
        while True:
            room = self.capacity - len(queue)
            # With no room it takes nothing but still reads the doorbells' wake-ups (shm):
            # else their fd would keep waking the loop until someone takes a notification.
            n = _drain_notes(native, buf, min(_BATCH, room))
            for i in range(n):
                e = buf[i]
                source = e.source
                name, agent_id = names.get(source) or (self.own if source == 0 else _UNKNOWN)
                flags = e.flags
                turns |= flags & _TURNS
                imm = int(e.imm) if flags & _IMM else None
                queue.append(Notification(ffi.buffer(e.data, e.len)[:], imm, name, e.nbytes, agent_id))
            moved += n
            if n < _BATCH or n == room:
                # Short of room: what waits natively is taken once a waiter made some (_serve).
                self._short = n == room
                break
        if moved and self._space:
            self._wake_space()
        if turns and self._poll_ns:
            self._poll()
        if self._waiters and self._queue:
            self._serve()

    def _poll(self) -> None:
        """Messages arrived by shm's doorbell or over tcp: keep the loop turning for the next
        while they come that often. The next is then seen on the loop's next turn rather than
        by waking a blocked loop, which costs its thread 20-40 us here and the sender's wake
        of it 15 more (docs/api.md, "Notifications"). Meanwhile the loop reads tcp's target
        connections itself (hx_agent_notes_quiet), so the I/O thread is not woken either.

        How long it turns adapts as a halt-polling vCPU's window does (Linux's KVM): a message
        taken while the loop turned keeps the window; one that found it blocked, within
        ``_WIDEST`` windows of the last, doubles it, from ``poll_ns`` up to ``_WIDEST`` times
        that, and turns; a longer gap sets it back and turns nothing. A blocked loop's gap
        ends when the message arrived natively (``hx_agent_notes_arrived``), not when the
        loop took it: its own wake-up (40-80 us here) is not the sender's pace. Counted to
        the take, a tcp ping-pong of 4 KiB messages whose steps were slow (a blocked loop:
        222-245 us a message, medians) measured past the widest window (200 us) and stayed
        slow: in 6 of 14 runs of 1000 messages, 50-94% of them found the loop blocked.

        Not for verbs: its completion thread is woken first whatever the loop does. Nor for
        sparser streams: the window would seldom catch the next."""
        now = _now_ns()
        arrived = now if self._quiet else _notes_arrived(self.engine.native) or now
        gap, self._arrived_at = arrived - self._arrived_at, now
        widest = _WIDEST * self._poll_ns
        if not self._quiet:  # it found the loop blocked
            if gap > widest:
                self._window_ns = self._poll_ns // 2
                return
            self._window_ns = min(2 * self._window_ns, widest)
        backend, native = self.engine.backend, self.engine.native
        if backend is not None and native is not None and not self.closed:
            if not self._quiet:
                # The loop looks each turn (_turned): the senders need not ring, which
                # saves each put(notify=) a system call and the loop a read; and it reads
                # tcp's target connections, so their requests wake no I/O thread.
                self._quiet = True
                lib.hx_agent_notes_quiet(native, 1)
            backend.keep_turning(now + self._window_ns, self._turned)

    def _turned(self, last: bool) -> None:
        """A turn of the loop keep_turning keeps going: what the doorbells and tcp's target
        connections hold is taken. After the ``last`` one the doorbells are rung again (and
        the I/O thread reads tcp), and what came before that is taken now: nothing would
        announce it."""
        native = self.engine.native
        if native is None:
            return
        if not last:
            if not self._looking:  # else those tasks look, each on its own step
                self.pull(woken=False)
        elif self._quiet:
            self._quiet = False
            if lib.hx_agent_notes_quiet(native, 0):
                self.pull()

    def _take(self, match: bytes | None) -> Notification | None:
        if match is None:
            return self._queue.popleft() if self._queue else None
        for i, note in enumerate(self._queue):
            if note.data == match:
                del self._queue[i]
                return note
        return None

    def _serve(self) -> None:
        # Run by the loop (a drain, or get()/room() checked already). A waiter is an asyncio
        # Future or a trio one that answers the same two calls (backends._TrioWaiter).
        waiters, queue, i = self._waiters, self._queue, 0
        while i < len(waiters) and queue:
            entry = waiters[i]
            waiter = entry[0]
            if waiter.done():  # its task was cancelled, or its wait timed out: it takes nothing
                del waiters[i]
                continue
            note = queue.popleft() if entry[1] is None else self._take(entry[1])
            if note is None:
                i += 1
                continue
            entry[2] = note
            del waiters[i]
            waiter.set_result(None)
        if self._short and len(self._queue) < self.capacity and lib.hx_agent_notes_pending(self.engine.native):
            self.pull()  # room made: more may wait natively

    async def get(self, timeout: float | None, match: Any, what: str) -> Notification:
        if self.closed:
            raise ClosedError(f"{what}: agent {self.own[0]!r} is closed")
        timeout = _args.timeout(timeout, what)
        if match is not None:
            match = note_bytes(match, what, "match=")
        engine = self.engine
        loop = engine.loop
        # Attached, and this thread runs its loop (as Peer's fast path asks); else attach() says.
        mine = loop is not None and engine.loop_is_base and loop._thread_id == _get_ident()
        backend = engine.backend if mine else None
        if backend is None:
            backend = engine.attach(what)  # the loop that started the agent, or WrongEventLoop
            loop = engine.loop  # set by the first attach (asyncio), else None
        # Take what arrived natively, if anything did (a check with no system call): else the
        # wake fd announces it and the loop's drain serves this waiter. Short of room, the fd
        # may not: what waits natively is taken here.
        native = engine.native
        if native is not None and (self._short or _notes_ready(native)):
            self.pull()
        note = (self._queue.popleft() if self._queue else None) if match is None else self._take(match)
        if note is not None:
            if self._short:
                self.pull()  # room made: more may wait natively
            return note
        waiter = loop.create_future() if loop is not None else backend.new_waiter()
        entry: list[Any] = [waiter, match, None, None, timeout, what]
        self._waiters.append(entry)
        try:
            if loop is not None:
                if timeout is not None:
                    # Not a cancel scope (anyio's costs tens of microseconds of the loop's CPU
                    # per wait, more than the wake-up itself), nor a timer per wait (a
                    # call_later and its cancel are a dozen calls into asyncio per
                    # notification): one timer, at the earliest deadline, which sets itself
                    # again when it fires.
                    deadline = entry[3] = loop.time() + timeout
                    if deadline < self._timer_at:
                        self._arm(loop, deadline)
                if backend._turn_until:
                    await self._look(waiter, backend)
                await waiter
            elif timeout is None:
                await backend.wait(waiter)
            else:
                try:
                    with anyio.fail_after(timeout):
                        await backend.wait(waiter)
                except TimeoutError:
                    raise NotificationTimeout(f"{what}: no notification within {timeout} s") from None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
        if entry[2] is None:
            raise ClosedError(f"{what}: agent closed while waiting")
        return entry[2]

    async def _look(self, waiter: Any, backend: Any) -> None:
        """While the loop turns for messages (asyncio), the waiting task looks for its own on
        each of its steps, in place of the turn's look: found, it goes on in that step. Woken
        by a Future instead, it would run one turn of the loop later (its selector's poll and
        the loop's own steps: 3-5 us here, per message)."""
        self._looking += 1
        try:
            while True:  # get() looked already
                await _one_turn()
                self.pull(woken=False)
                if waiter.done() or not backend._turn_until:
                    return
        finally:
            self._looking -= 1

    def _arm(self, loop: Any, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        # Left set when its waiter is served (one wake-up at most, per deadline), so it holds
        # the inbox weakly: an abandoned agent is not kept until then.
        self._timer, self._timer_at = loop.call_at(at, _expire, weakref.ref(self), loop), at

    def _expire(self, loop: Any) -> None:
        """The timer (asyncio): waiters past their deadline fail, unless served first; it is
        set again for the earliest deadline still ahead."""
        self._timer, self._timer_at = None, math.inf
        now, soonest = loop.time(), math.inf
        for waiter, _, _, deadline, timeout, what in self._waiters:
            if deadline is None or waiter.done():
                continue
            if deadline <= now:
                waiter.set_exception(NotificationTimeout(f"{what}: no notification within {timeout} s"))
            elif deadline < soonest:
                soonest = deadline
        if soonest < math.inf:
            self._arm(loop, soonest)

    async def room(self) -> None:
        """Wait until the native queue took some messages off (a loopback sender held back)."""
        backend = self.engine.attach()
        waiter = backend.new_waiter()
        self._space.append(waiter)
        self.pull()
        await backend.wait(waiter)

    def _wake_space(self) -> None:
        backend = self.engine.attach()
        waiters, self._space = self._space, []
        for w in waiters:
            backend.resolve(w, None)

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        if self.engine.backend is None:
            return
        for entry in self._waiters:
            self.engine.backend.resolve(entry[0], ClosedError("Agent.notification: agent closed"))
        self._waiters.clear()
        for w in self._space:
            self.engine.backend.resolve(w, ClosedError("notify: agent closed"))
        self._space.clear()
