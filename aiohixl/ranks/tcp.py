"""The embedded rendezvous store: ``tcp://HOST:PORT``, no extra software.

The server runs inside rank 0's process (``aiohixl.init`` starts it) or alone
(``python -m aiohixl store --listen HOST:PORT``). Connections start with the
agents' handshake (HMAC-SHA256 challenge-response over the shared token, role
STORE), then carry the frames of docs/ranks.md, bounded and checked by the
control plane's Reader. A rank's entry lives as long as its connection: when
the connection drops (process death; TCP keepalive for a host that vanished)
the entry is removed and every client is told.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._control import handshake as c
from .._control import wire as w
from ..errors import AuthenticationError, ConnectionLost, ConnectTimeout, HixlError, ProtocolError
from .record import RankRecord, StoreURL
from .store import Store, barrier_complete

__all__ = ["StoreServer", "TcpStore"]

HANDSHAKE_TIMEOUT = 5.0
QUEUE = 65536  # frames queued for one client; a client that lets more pile up is dropped
REPLY_OK, REPLY_CONFLICT, REPLY_REFUSED = 0, 1, 2
SERVES = "an aiohixl rendezvous store"


def keepalive(stream: Any) -> None:
    """Let the kernel find a peer whose host vanished: probes after 10 s idle, 3 every 5 s."""
    try:
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except (OSError, anyio.TypedAttributeLookupError):
        pass


# ---------- server ----------


@dataclass(eq=False)
class _Client:
    ch: c.Channel
    scope: anyio.CancelScope
    space: _Space | None = None
    rank: int | None = None
    watching: set[int] = field(default_factory=set)
    # STORE_MEMBERS: hear of every join and leave once the namespace holds this many ranks (a
    # client that never says: at once). init(world_size=N) waits for N, so a join storm of N
    # ranks is not N x N frames and wake-ups: each rank gets the N records once, in one write.
    members_at: int = 0
    member: bool = False
    # Frames wait here for the writer, which sends all that piled up in one write: at hundreds of
    # ranks a join is a frame to every client, and a queue operation and a syscall per frame was
    # where the time went.
    outbox: list[bytes] = field(default_factory=list)
    queued: anyio.Event = field(default_factory=anyio.Event)
    closed: bool = False

    def push(self, frame: bytes) -> None:
        if self.closed:
            return
        if len(self.outbox) >= QUEUE:
            c.log.warning("aiohixl store: a client fell %d frames behind; dropping it", QUEUE)
            self.closed = True
            self.scope.cancel()
            return
        self.outbox.append(frame)
        self.queued.set()


@dataclass(eq=False)
class _Space:
    """One job namespace: its ranks (each owned by a connection) and open barriers."""

    records: dict[int, tuple[RankRecord, _Client]] = field(default_factory=dict)
    # (key, gen) -> group ("" all), ranks expected at least, who entered
    barriers: dict[tuple[str, int], tuple[str, int, dict[int, _Client]]] = field(default_factory=dict)
    clients: set[_Client] = field(default_factory=set)
    # n -> the clients waiting (STORE_MEMBERS n) for the namespace to hold n ranks
    pending: dict[int, list[_Client]] = field(default_factory=dict)
    # rank -> the clients that asked for its changes (STORE_WATCH): a publish goes only to them
    watchers: dict[int, set[_Client]] = field(default_factory=dict)

    def broadcast(self, frame: bytes, skip: _Client | None = None, also: set[_Client] | None = None) -> None:
        """``frame`` to every member (the clients that hear of joins and leaves), and to ``also``."""
        for client in list(self.clients):
            if client is not skip and (client.member or (also is not None and client in also)):
                client.push(frame)

    def admit(self, clients: list[_Client]) -> None:
        """Make ``clients`` members: every record now (encoded once for all), then STORE_MEMBERS."""
        if not clients:
            return
        frames = [w.Writer().blob(rec.encode()).frame(w.STORE_RECORD) for rec, _ in self.records.values()]
        frames.append(w.Writer().u32(len(self.records)).frame(w.STORE_MEMBERS))
        snapshot = b"".join(frames)
        for client in clients:
            if not client.member and not client.closed:
                client.member = True
                client.push(snapshot)

    def admit_waiting(self) -> None:
        """Admit the clients whose count the namespace reached."""
        count = len(self.records)
        ready = [n for n in self.pending if n <= count]
        self.admit([client for n in ready for client in self.pending.pop(n)])

    def check_barriers(self) -> None:
        records = {r: rec for r, (rec, _) in self.records.items()}
        for key, (group, expected, arrived) in list(self.barriers.items()):
            if barrier_complete(records, group, expected, set(arrived)):
                del self.barriers[key]
                frame = w.Writer().str(key[0]).u32(key[1]).frame(w.STORE_RELEASE)
                for client in arrived.values():
                    client.push(frame)


class StoreServer:
    """The tcp store's server: ``await start()`` binds and serves in the background."""

    def __init__(self, host: str, port: int, token: bytes) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.spaces: dict[str, _Space] = {}
        self.address: str | None = None
        self._listener: Any = None
        self._scope: anyio.CancelScope | None = None
        self._stopped = anyio.Event()
        self._backend: Any = None
        self._serving = False  # a task runs (or is about to run) _serve, which sets _stopped at its end
        self._closing = False

    async def start(self) -> None:
        """Bind (OSError if the port is taken) and serve in the background until aclose()."""
        from .._loop.backends import current_backend

        await self._bind()
        self._backend = current_backend()
        self._backend.spawn(self._serve, f"aiohixl-store-{self.address}")
        self._serving = True

    async def serve_forever(self) -> None:
        """Bind and serve in this task (``python -m aiohixl store``)."""
        await self._bind()
        self._serving = True
        await self._serve()

    async def _bind(self) -> None:
        self._listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        port = self._listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
        self.address = f"{self.host}:{port}"

    async def _serve(self) -> None:
        try:
            with anyio.CancelScope() as self._scope:
                # aclose() may come before this task first runs (init failing right after
                # start()): there is no scope to cancel then, and it must not serve after all
                if not self._closing:
                    await self._listener.serve(self._handle)
        except Exception:
            c.log.exception("aiohixl store %s stopped", self.address)
        finally:
            with anyio.CancelScope(shield=True):
                await self._listener.aclose()
            self._stopped.set()

    async def aclose(self) -> None:
        """Stop serving and close the socket, at any point of the server's life: once this
        returns, nothing listens on its port and its task has ended."""
        self._closing = True
        if self._scope is not None:
            self._scope.cancel()
        if self._serving:
            await self._stopped.wait()
        elif self._listener is not None:  # bound, never served
            await self._listener.aclose()

    async def _handle(self, stream: Any) -> None:
        keepalive(stream)
        ch = c.Channel(stream)
        client: _Client | None = None
        try:
            with anyio.fail_after(HANDSHAKE_TIMEOUT):
                await c.server_handshake(ch, self.token, (w.ROLE_STORE,), SERVES)
                await ch.send(w.DATA_OK_FRAME)
            async with anyio.create_task_group() as tg:
                client = _Client(ch, tg.cancel_scope)
                tg.start_soon(self._writer, client)
                await self._reader(client)
                tg.cancel_scope.cancel()
        except (HixlError, TimeoutError, *c.STREAM_ERRORS) as exc:
            c.log.info("aiohixl store %s: closed a connection: %s", self.address, exc)
        except Exception:
            c.log.exception("aiohixl store %s: connection handler failed", self.address)
        finally:
            if client is not None:
                self._drop(client)
            await ch.aclose()

    async def _writer(self, client: _Client) -> None:
        try:
            while not client.closed:
                await client.queued.wait()
                client.queued = anyio.Event()
                frames, client.outbox = client.outbox, []
                await client.ch.send(b"".join(frames))
        except c.STREAM_ERRORS:
            client.scope.cancel()

    async def _reader(self, client: _Client) -> None:
        while True:
            try:
                ftype, r = await client.ch.recv(w.MAX_FRAME)
            except c.STREAM_ERRORS:
                return
            if ftype == w.BYE:
                return
            if ftype == w.PING:
                r.end()
            elif ftype == w.STORE_JOIN:
                req, namespace, blob = r.u32(), r.str(), r.blob()
                r.end()
                self._join(client, req, namespace, RankRecord.decode(blob, "STORE_JOIN"))
            elif ftype == w.STORE_PUBLISH:
                record = RankRecord.decode(r.blob(), "STORE_PUBLISH")
                r.end()
                self._publish(client, record)
            elif ftype == w.STORE_WATCH:
                rank = r.u32()
                r.end()
                self._watch(client, rank)
            elif ftype == w.STORE_ARRIVE:
                key, gen, group, expected = r.str(), r.u32(), r.str(), r.u32()
                r.end()
                self._arrive(client, key, gen, group, expected)
            elif ftype == w.STORE_MEMBERS:
                n = r.u32()
                r.end()
                self._members(client, n)
            else:
                raise ProtocolError(f"unexpected {w.NAMES[ftype]} frame on a store connection")

    def _join(self, client: _Client, req: int, namespace: str, record: RankRecord) -> None:
        def reply(status: int, blob: bytes) -> None:
            client.push(w.Writer().u32(req).u8(status).blob(blob).frame(w.STORE_REPLY))

        if client.space is not None:
            reply(REPLY_REFUSED, b"this connection has joined already")
            return
        space = self.spaces.setdefault(namespace, _Space())
        held = space.records.get(record.rank)
        if held is not None:
            reply(REPLY_CONFLICT, held[0].encode())
            return
        client.space, client.rank = space, record.rank
        frame = w.Writer().blob(record.encode()).frame(w.STORE_RECORD)
        space.broadcast(frame, also=space.watchers.get(record.rank))  # to the members so far
        space.records[record.rank] = (record, client)
        space.clients.add(client)
        if client.members_at <= len(space.records):  # the joiner's mirror, before it hears "ok"
            space.admit([client])
        else:
            space.pending.setdefault(client.members_at, []).append(client)
        reply(REPLY_OK, b"")
        space.admit_waiting()
        space.check_barriers()

    def _publish(self, client: _Client, record: RankRecord) -> None:
        space = client.space
        if space is None or record.rank != client.rank:
            raise ProtocolError(f"STORE_PUBLISH for rank {record.rank} from a connection holding {client.rank}")
        old = space.records[record.rank][0]
        if record.agent_id != old.agent_id:
            raise ProtocolError(f"STORE_PUBLISH for rank {record.rank} from another agent")
        space.records[record.rank] = (record, client)
        frame = w.Writer().blob(record.encode()).frame(w.STORE_RECORD)
        for watcher in list(space.watchers.get(record.rank, ())):
            if watcher is not client:
                watcher.push(frame)

    def _watch(self, client: _Client, rank: int) -> None:
        space = client.space
        if space is None:
            raise ProtocolError("STORE_WATCH before STORE_JOIN")
        space.watchers.setdefault(rank, set()).add(client)
        client.watching.add(rank)
        held = space.records.get(rank)
        if held is not None:  # the record as it is now; its changes follow
            client.push(w.Writer().blob(held[0].encode()).frame(w.STORE_RECORD))

    def _members(self, client: _Client, n: int) -> None:
        space = client.space
        if space is None:  # before the join: the join admits it (or not yet)
            client.members_at = n
            return
        if client.member:
            return
        for waiting in space.pending.values():
            if client in waiting:
                waiting.remove(client)
        space.pending = {k: v for k, v in space.pending.items() if v}
        if n <= len(space.records):
            space.admit([client])
        else:
            space.pending.setdefault(n, []).append(client)

    def _arrive(self, client: _Client, key: str, gen: int, group: str, expected: int) -> None:
        space = client.space
        if space is None or client.rank is None:
            raise ProtocolError("STORE_ARRIVE before STORE_JOIN")
        entry = space.barriers.setdefault((key, gen), (group, expected, {}))
        entry[2][client.rank] = client
        space.check_barriers()

    def _drop(self, client: _Client) -> None:
        space, rank = client.space, client.rank
        client.closed = True
        if space is None or rank is None:
            return
        space.clients.discard(client)
        for n, waiting in list(space.pending.items()):
            if client in waiting:
                waiting.remove(client)
                if not waiting:
                    del space.pending[n]
        for watched in client.watching:
            watchers = space.watchers.get(watched)
            if watchers is not None:
                watchers.discard(client)
                if not watchers:
                    del space.watchers[watched]
        held = space.records.get(rank)
        if held is not None and held[1] is client:
            del space.records[rank]
            gone = w.Writer().u32(rank).raw(held[0].agent_id).frame(w.STORE_GONE)
            space.broadcast(gone, also=space.watchers.get(rank))
        for _, _, arrived in space.barriers.values():
            if arrived.get(rank) is client:
                del arrived[rank]
        if not space.clients:
            self.spaces = {k: v for k, v in self.spaces.items() if v is not space}
        else:
            space.check_barriers()


# ---------- client ----------


class TcpStore(Store):
    """A rank's connection to a tcp store; the server pushes every change into the mirror."""

    def __init__(self, url: StoreURL, namespace: str, ch: c.Channel) -> None:
        super().__init__(url, namespace)
        self.ch = ch
        self._next_req = 1
        self._replies: dict[int, list[Any]] = {}
        self._released: set[tuple[str, int]] = set()
        self._member = False  # STORE_MEMBERS came: the mirror holds every rank, joins and leaves follow
        self._asked_members = False
        self._backend.spawn(self._read, f"aiohixl-store-client-{url}")

    @classmethod
    async def connect(cls, url: StoreURL, namespace: str, token: bytes, me: c.Identity, timeout: float) -> TcpStore:
        """Connect and authenticate, retrying a refused connection (the host may start later) until ``timeout``."""
        what = f"store {url}"
        deadline = anyio.current_time() + timeout
        last = "no attempt"
        pause = 0.05
        while True:
            left = deadline - anyio.current_time()
            if left <= 0:
                raise ConnectTimeout(f"{what}: unreachable for {timeout} s (last: {last})")
            ch: c.Channel | None = None
            try:
                with anyio.fail_after(left):
                    stream = await anyio.connect_tcp(url.host, url.port)
                    keepalive(stream)
                    ch = c.Channel(stream)
                    await c.client_handshake(ch, token, w.ROLE_STORE, bytes(16), me, what)
                return cls(url, namespace, ch)
            except TimeoutError:
                if ch is not None:
                    await ch.aclose()
                raise ConnectTimeout(f"{what}: no answer within {timeout} s (last: {last})") from None
            except AuthenticationError as exc:
                if ch is not None:
                    await ch.aclose()
                raise AuthenticationError(f"{exc} (is AIOHIXL_TOKEN the agents' token?)") from None
            except ProtocolError:  # it names the store already
                if ch is not None:
                    await ch.aclose()
                raise
            except c.STREAM_ERRORS as exc:
                if ch is not None:
                    await ch.aclose()
                last = str(exc) or type(exc).__name__
            await anyio.sleep(min(pause, max(0.0, deadline - anyio.current_time())))
            pause = min(pause * 2, 0.5)

    async def _send(self, frame: bytes) -> None:
        try:
            await self.ch.send(frame)
        except c.STREAM_ERRORS:
            self.fail("connection to the store lost")
            self.check("store")

    async def _read(self) -> None:
        reason = "connection to the store lost (its host ended?)"
        buf = b""
        try:
            while True:
                # Every frame that arrived is handled before waiters look again: the store sends
                # what piled up in one write, and at hundreds of ranks that is many frames.
                buf += await self.ch.reader.receive()
                at = 0
                while len(buf) - at >= w.HEAD_SIZE:
                    n, ftype = w.split_head(buf[at : at + w.HEAD_SIZE], w.MAX_FRAME)
                    end = at + w.HEAD_SIZE + n  # n: the body's length
                    if len(buf) < end:
                        break
                    self._on_frame(ftype, w.Reader(buf[at + w.HEAD_SIZE : end], w.NAMES[ftype]))
                    at = end
                buf = buf[at:]
                self._changed_now()
        except c.STREAM_ERRORS:
            pass
        except HixlError as exc:
            reason = f"the store sent something wrong: {exc}"
        except Exception as exc:  # a background task must not raise
            reason = f"reading from the store failed: {exc!r}"
        finally:
            self.fail(reason)
            for event, _ in self._replies.values():
                event.set()
            await self.ch.aclose()

    def _on_frame(self, ftype: int, r: w.Reader) -> None:
        if ftype == w.STORE_RECORD:
            record = RankRecord.decode_shared(r.blob(), "STORE_RECORD")
            r.end()
            self.records[record.rank] = record
        elif ftype == w.STORE_GONE:
            rank, agent_id = r.u32(), r.raw(16)
            r.end()
            held = self.records.get(rank)
            if held is not None and held.agent_id == agent_id:
                del self.records[rank]
        elif ftype == w.STORE_RELEASE:
            key, gen = r.str(), r.u32()
            r.end()
            self._released.add((key, gen))
        elif ftype == w.STORE_REPLY:
            req, status, blob = r.u32(), r.u8(), r.blob()
            r.end()
            slot = self._replies.pop(req, None)
            if slot is None:
                raise ProtocolError(f"reply to request {req} that was never made")
            slot[1] = (status, blob)
            slot[0].set()
        elif ftype == w.STORE_MEMBERS:
            r.u32()
            r.end()
            self._member = True
        elif ftype == w.PING:
            r.end()
        else:
            raise ProtocolError(f"unexpected {w.NAMES[ftype]} frame from the store")

    async def _join(self, record: RankRecord) -> RankRecord | None:
        what = f"join rank {record.rank}"
        req = self._next_req
        self._next_req += 1
        slot: list[Any] = [anyio.Event(), None]
        self._replies[req] = slot
        if self.members_at > 1 and not self._asked_members:  # the join storm: the mirror once all joined
            self._asked_members = True
            await self._send(w.Writer().u32(self.members_at).frame(w.STORE_MEMBERS))
        await self._send(w.Writer().u32(req).str(self.namespace).blob(record.encode()).frame(w.STORE_JOIN))
        await slot[0].wait()
        if slot[1] is None:
            self.check(what)
            raise ConnectionLost(f"{what}: {self.label} did not answer")
        status, blob = slot[1]
        if status == REPLY_OK:
            return None
        if status == REPLY_CONFLICT:
            return RankRecord.decode(blob, "STORE_REPLY")
        raise ProtocolError(f"{what}: {self.label} refused: {blob.decode(errors='replace')}")

    async def _put_record(self, record: RankRecord) -> None:
        await self._send(w.Writer().blob(record.encode()).frame(w.STORE_PUBLISH))

    def _complete(self) -> bool:
        return self._member

    async def _whole_mirror(self) -> None:
        if not self._member:
            try:
                await self._send(w.Writer().u32(0).frame(w.STORE_MEMBERS))
            except HixlError:
                return
            with anyio.move_on_after(2.0):
                await self.wait_for("store", lambda: True if self._member else None, math.inf)

    async def _watch(self, rank: int) -> None:
        await self._send(w.Writer().u32(rank).frame(w.STORE_WATCH))

    async def _next_change(self, waited: int) -> None:
        await self._changed.wait()

    async def _arrive(self, key: str, gen: int, group: str, expected: int) -> None:
        await self._send(w.Writer().str(key).u32(gen).str(group).u32(expected).frame(w.STORE_ARRIVE))
        done = await self.wait_for(f"barrier {key}", lambda: True if (key, gen) in self._released else None, math.inf)
        assert done
        self._released.discard((key, gen))

    async def _leave(self) -> None:
        try:
            await self.ch.send(w.Writer().frame(w.BYE))
        except c.STREAM_ERRORS:
            pass
        await self.ch.aclose()
