"""One control connection after its handshake, on either side: frames to handlers, liveness, its end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from ..errors import ConnectionLost, HixlError, ProtocolError
from . import wire as w
from .handshake import STREAM_ERRORS, Channel, log


class Session:
    """One control connection after its handshake, on either side.

    ``handlers`` maps frame types to callables taking a Reader (they may be
    coroutines). ``on_end`` runs once, with the reason, when the session ends.

    Liveness is not judged here: the peer's native channel carries heartbeats
    that its native thread answers, so a peer whose event loop is blocked
    stays connected. Every ``interval`` seconds ``silent()`` is asked; a
    reason it gives ends the session.
    """

    def __init__(
        self,
        ch: Channel,
        interval: float,
        handlers: dict[int, Callable[..., Any]],
        on_end: Callable[[HixlError], None],
        label: str,
        silent: Callable[[], str | None],
    ) -> None:
        self.ch = ch
        self.interval = interval
        self.handlers = handlers
        self.on_end = on_end
        self.label = label
        self.silent = silent
        self.scope: anyio.CancelScope | None = None
        self.ended: HixlError | None = None
        self._reason: HixlError | None = None

    async def run(self) -> None:
        reason: HixlError = ConnectionLost(f"{self.label}: control connection closed")
        try:
            with anyio.CancelScope() as self.scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._watch)
                    reason = await self._reader()
                    tg.cancel_scope.cancel()
        except anyio.get_cancelled_exc_class():
            pass
        except Exception as exc:
            exc = _unwrapped(exc)
            reason = exc if isinstance(exc, HixlError) else self._internal_error(exc)
        finally:
            if self._reason is not None:
                reason = self._reason
            if self.ended is None:
                self.ended = reason
                self.on_end(reason)
            await self.ch.aclose()

    def _internal_error(self, exc: Exception) -> HixlError:
        """A handler raised what the library never raises on purpose: a bug, so logged, never a quiet close."""
        log.error("aiohixl %s: internal error in a control frame handler; the session ends", self.label, exc_info=exc)
        return ConnectionLost(
            f"{self.label}: internal error in aiohixl ({type(exc).__name__}: {exc}); the session ended (see the log)"
        )

    async def _reader(self) -> HixlError:
        while True:
            try:
                ftype, r = await self.ch.recv(w.MAX_FRAME)
            except STREAM_ERRORS:
                return ConnectionLost(f"{self.label}: control connection lost")
            except ProtocolError as exc:
                return ProtocolError(f"{self.label}: {exc}")
            if ftype == w.BYE:
                return ConnectionLost(f"{self.label}: the peer closed the connection")
            if ftype == w.PING:
                r.end()
                continue
            handler = self.handlers.get(ftype)
            if handler is None:
                return ProtocolError(f"{self.label}: unexpected {w.NAMES[ftype]} frame")
            try:
                result = handler(r)
                if result is not None:
                    await result
            except ProtocolError as exc:
                return ProtocolError(f"{self.label}: {exc}")

    async def _watch(self) -> None:
        while True:
            await anyio.sleep(self.interval)
            why = self.silent()
            if why is not None:
                self._reason = ConnectionLost(f"{self.label}: {why}")
                if self.scope is not None:
                    self.scope.cancel()
                return

    async def send(self, frame: bytes) -> None:
        try:
            await self.ch.send(frame)
        except STREAM_ERRORS:
            raise ConnectionLost(f"{self.label}: control connection lost") from None

    def cancel(self) -> None:
        if self.scope is not None:
            self.scope.cancel()


def _unwrapped(exc: Exception) -> Exception:
    """What the task group's body raised: anyio wraps it in an ExceptionGroup (of one)."""
    inner = getattr(exc, "exceptions", None)
    while inner and len(inner) == 1 and isinstance(inner[0], Exception):
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc
