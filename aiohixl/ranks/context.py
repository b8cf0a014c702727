"""Ranks and groups over the object API: ``ctx = await aiohixl.init(rank=0, group="prefill")``.

A Context is one rank: an Agent listening for peers, an entry in the
rendezvous store (its group, its agent's address, its published regions), and
a cache of peers by rank. ``get_remote_mem(rank)`` finds the rank in the
store (waiting for it), connects on first use and returns a RemoteRegion;
``put``/``get`` route a RemoteRegion to its rank's peer, reconnecting a broken
one on the next op. See docs/ranks.md.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, Union

import anyio

from .. import _args
from .._control import handshake as c
from ..agent import Agent
from ..errors import (
    ClosedError,
    ConnectionLost,
    ConnectTimeout,
    InvalidArgument,
    OutOfBounds,
    UnsupportedMemory,
)
from ..memory import Access, Region, RegionSlice, parse_access
from ..notifications import note_bytes
from ..peer import Peer
from ..remote import RemoteRegion, RemoteSlice
from .record import MAX_RANK, RankRecord, StoreURL, parse_store_url
from .store import Store
from .tcp import StoreServer, TcpStore

__all__ = ["Context", "init", "get_remote_mem", "put", "get"]

log = logging.getLogger("aiohixl")

RemoteRef = Union[RemoteRegion, RemoteSlice]


def _env_int(name: str, what: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"{what}: {name}={text!r} is not an integer") from None


def _local_ip_towards(host: str, port: int) -> str:
    """The address of the interface this host uses to reach ``host`` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class Context:
    """One rank of a job: use ``await aiohixl.init(...)``, then ``async with ctx`` (or ``await ctx.aclose()``)."""

    def __init__(
        self,
        rank: int,
        group: str,
        world_size: int | None,
        store: Store,
        agent: Agent,
        address: str,
        server: StoreServer | None,
    ) -> None:
        self.rank = rank
        self.group = group
        self.world_size = world_size
        self.store = store
        self.agent = agent
        self.address = address
        self._server = server
        self._peers: dict[int, Peer] = {}
        self._ranks_of: dict[bytes, int] = {}  # agent id -> rank, for routing a RemoteRegion
        self._locks: dict[int, anyio.Lock] = {}
        self._published: dict[str, bytes] = {}
        self._locals: dict[int, Region] = {}  # id(obj) -> region, for ops given the registered object
        self._closed = False

    @property
    def hosts_store(self) -> bool:
        """Whether this rank's process serves the embedded tcp store (rank 0 does)."""
        return self._server is not None

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._peers)} peers"
        return f"<Context rank {self.rank} ({self.group}) {self.store.url} {state}>"

    # ---- lifetime ----

    async def __aenter__(self) -> Context:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Leave the store (our entry goes now), close the agent and its peers; the embedded store stops too."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.store.aclose()
        finally:
            await self.agent.aclose()
            if self._server is not None:
                await self._server.aclose()

    def _check(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: rank {self.rank}'s context is closed")

    # ---- memory ----

    def allocate_registered(
        self, nbytes: int, access: Access | str | None = "remote_write", name: str | None = "kv"
    ) -> Region:
        """``nbytes`` of zero-filled memory peers may reach, published to the store under ``name``."""
        what = "Context.allocate_registered"
        self._check(what)
        region = self.agent.allocate(nbytes, access=parse_access(access, what), name=name)
        self._publish(region)
        return region

    def register(self, obj: Any, *, access: Access | str | None = None, name: str | None = None) -> Region:
        """Register a buffer or tensor (``Agent.register``); with a ``name`` it is published to the store.

        The object itself may then be given to ``put``/``get`` as the local side.
        """
        what = "Context.register"
        self._check(what)
        region = self.agent.register(obj, access=parse_access(access, what), name=name)
        self._locals[id(obj)] = region
        self._publish(region)
        return region

    async def deregister(self, region: Region) -> None:
        """Withdraw ``region`` from the store, then close it."""
        if not isinstance(region, Region):
            raise InvalidArgument(f"Context.deregister: expected a Region, not {type(region).__name__}")
        if region.name is not None and region.name in self._published:
            del self._published[region.name]
            self._republish()
        self._locals = {k: r for k, r in self._locals.items() if r is not region}
        await region.close()

    def _publish(self, region: Region) -> None:
        if region.name is None:
            return
        self._published[region.name] = region.descriptor()
        self._republish()

    def _republish(self) -> None:
        own = self.store.own
        assert own is not None
        self.store.publish(own.with_regions(self._published))

    # ---- membership ----

    def ranks(self, group: str | None = None) -> list[int]:
        """The ranks (of ``group``) the store holds now, as this rank last heard."""
        return self.store.ranks(group)

    def group_of(self, rank: int) -> str | None:
        _args.integer(rank, "Context.group_of", "rank", 0, MAX_RANK)
        rec = self.store.records.get(rank)
        return None if rec is None else rec.group

    async def wait_ranks(self, n: int, group: str | None = None, timeout: float | None = 60.0) -> list[int]:
        """Wait until at least ``n`` ranks (of ``group``) have joined; RendezvousTimeout names who is there."""
        what = f"Context.wait_ranks({n!r}, group={group!r})"
        self._check(what)
        _args.integer(n, what, "n", 0, MAX_RANK + 1)
        if group is not None:
            _args.text(group, what, "group", 255)
        timeout = _args.timeout(timeout, what)
        return await self.store.wait_ranks(n, group, timeout, what)

    async def barrier(self, group: str | None = None, timeout: float | None = 60.0) -> None:
        """Wait until every rank of ``group`` (every rank when None: ``world_size`` of them if given)
        has entered this barrier. Regions published before it are visible to all after it."""
        what = f"Context.barrier(group={group!r})"
        self._check(what)
        if group is not None:
            _args.text(group, what, "group", 255)
        timeout = _args.timeout(timeout, what)
        expected = (self.world_size or 0) if group is None else 0
        await self.store.barrier(group, expected, timeout, what)

    # ---- peers ----

    async def get_remote_mem(
        self, rank: int, nbytes: int | None = None, name: str = "kv", timeout: float | None = 30.0
    ) -> RemoteRef:
        """The region ``rank`` published as ``name``: waits up to ``timeout`` for the rank (UnknownRank),
        connects to it on first use and caches the peer. ``nbytes``: a window of that many bytes
        at the region's start (a RemoteSlice; the RemoteRegion itself when it is the whole
        region); a smaller region raises OutOfBounds."""
        what = f"Context.get_remote_mem(rank={rank!r}, name={name!r})"
        self._check(what)
        _args.integer(rank, what, "rank", 0, MAX_RANK)
        _args.text(name, what, "name", 255)
        timeout = _args.timeout(timeout, what)
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
            raise InvalidArgument(f"{what}: nbytes must be an int >= 0 or None, not {nbytes!r}")
        deadline = anyio.current_time() + (timeout if timeout is not None else 1e9)
        while True:
            left = max(0.0, deadline - anyio.current_time())
            rec = await self.store.lookup(rank, name, left, what)
            try:
                peer = await self._peer_for(rec, max(0.1, deadline - anyio.current_time()), what)
                remote = peer.remote_region(rec.regions[name])
                break
            except (ConnectionLost, ConnectTimeout) as exc:
                # The store may still list a process that died (a Redis entry lives until its lease
                # ends) and a restarted one may not have replaced it yet: look again until the deadline.
                if anyio.current_time() >= deadline:
                    raise ConnectionLost(
                        f"{what}: cannot reach {rec.describe()} ({exc}); the store still lists it"
                    ) from None
                with anyio.move_on_after(min(0.5, deadline - anyio.current_time())):
                    await self.store.wait_for(what, _replaced(self.store, rec), None)
        if nbytes is None or nbytes == remote.nbytes:
            return remote
        if nbytes > remote.nbytes:
            raise OutOfBounds(f"{what}: asked for {nbytes} bytes, rank {rank}'s region has {remote.nbytes}")
        return remote[:nbytes]

    async def peer(self, rank: int, timeout: float | None = 30.0) -> Peer:
        """The (cached) peer of ``rank``, connected on first use."""
        what = f"Context.peer({rank!r})"
        self._check(what)
        _args.integer(rank, what, "rank", 0, MAX_RANK)
        timeout = _args.timeout(timeout, what)
        rec = await self.store.lookup(rank, None, timeout, what)
        return await self._peer_for(rec, timeout if timeout is not None else 30.0, what)

    async def _peer_for(self, rec: RankRecord, timeout: float, what: str) -> Peer:
        lock = self._locks.setdefault(rec.rank, anyio.Lock())
        async with lock:
            peer = self._peers.get(rec.rank)
            if peer is not None and peer.remote_id == rec.agent_id and _usable(peer):
                return peer
            if peer is not None:  # broken, or the rank restarted (a new agent): let the old one go
                del self._peers[rec.rank]
                await peer.aclose()
            if rec.rank == self.rank and rec.agent_id == self.agent.id:
                peer = self.agent.loopback()
            else:
                peer = await self.agent.connect(rec.address, timeout=timeout)
                if peer.remote_id != rec.agent_id:
                    await peer.aclose()
                    raise ConnectionLost(f"{what}: {rec.address} is another agent now, not {rec.describe()}")
            self._peers[rec.rank] = peer
            self._ranks_of[rec.agent_id] = rec.rank
            return peer

    async def _peer_of(self, remote: RemoteRef, what: str) -> Peer:
        """The peer a RemoteRegion belongs to; a broken one is reconnected (to the same agent)."""
        region = remote if isinstance(remote, RemoteRegion) else getattr(remote, "region", None)
        if not isinstance(region, RemoteRegion):
            raise InvalidArgument(f"{what}: expected a RemoteRegion from get_remote_mem(), got {type(remote).__name__}")
        rank = self._ranks_of.get(region.agent_id)
        if rank is None:
            raise InvalidArgument(f"{what}: remote region {region.label()} did not come from this context")
        peer = self._peers.get(rank)
        if peer is not None and peer.remote_id == region.agent_id and _usable(peer):
            return peer
        await self.store.sync()
        rec = self.store.records.get(rank)
        if rec is None or rec.agent_id != region.agent_id:
            why = "left the store" if rec is None else f"restarted ({rec.describe()})"
            raise ConnectionLost(
                f"{what}: rank {rank} {why}; its old regions are gone (call get_remote_mem({rank}) again)"
            )
        return await self._peer_for(rec, 10.0, what)

    # ---- ops ----

    async def put(
        self,
        remote: RemoteRef,
        local: Any,
        nbytes: int | None = None,
        *,
        notify: bytes | None = None,
        timeout: float | None = None,
    ) -> None:
        """Write ``local`` (a Region, a slice, or a registered object) into ``remote``.

        ``nbytes``: only the first ``nbytes`` of both. ``notify``: the target's
        ``agent.notification()`` yields it once the bytes are in place.
        """
        what = "Context.put"
        self._check(what)
        ls = self._local(local, what)
        peer = await self._peer_of(remote, what)
        if nbytes is not None:
            remote, ls = _first(remote, nbytes, what), _first(ls, nbytes, what)
        await peer.put(remote, ls, notify=notify, timeout=timeout)

    async def get(
        self, local: Any, remote: RemoteRef, nbytes: int | None = None, *, timeout: float | None = None
    ) -> None:
        """Read ``remote`` into ``local`` (a Region, a slice, or a registered object)."""
        what = "Context.get"
        self._check(what)
        ls = self._local(local, what)
        peer = await self._peer_of(remote, what)
        if nbytes is not None:
            remote, ls = _first(remote, nbytes, what), _first(ls, nbytes, what)
        await peer.get(ls, remote, timeout=timeout)

    async def notify(self, rank: int, data: bytes, *, timeout: float | None = None) -> None:
        """Send ``data`` to ``rank`` after every op issued to it earlier has landed. ``timeout``
        also bounds the wait for ``rank`` to be known (30 s without one)."""
        what = f"Context.notify({rank!r})"
        data = note_bytes(data, what, "data")
        timeout = _args.timeout(timeout, what)
        peer = await self.peer(rank, timeout if timeout is not None else 30.0)
        await peer.notify(data, timeout=timeout)

    def _local(self, local: Any, what: str) -> Region | RegionSlice:
        if isinstance(local, (Region, RegionSlice)):
            return local
        region = self._locals.get(id(local))
        if region is not None and not region.closed:
            return region
        address, size = _address_of(local)
        if address is not None:
            for region in self._locals.values():
                if not region.closed and region.address <= address and address + size <= region.address + region.nbytes:
                    off = address - region.address
                    return region[off : off + size]
        raise InvalidArgument(
            f"{what}: the local side must be a Region, a slice of one, or an object registered with"
            f" Context.register(), not an unregistered {type(local).__name__}"
        )


def _replaced(store: Store, rec: RankRecord) -> Callable[[], bool | None]:
    """A predicate: the store's entry for ``rec.rank`` is no longer ``rec``."""
    return lambda: None if store.records.get(rec.rank) is rec else True


def _usable(peer: Peer) -> bool:
    return not peer.closed and peer.broken is None


def _first(ref: Any, nbytes: int, what: str) -> Any:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise InvalidArgument(f"{what}: nbytes must be an int or None, not {type(nbytes).__name__}")
    if nbytes < 0 or nbytes > len(ref):
        raise OutOfBounds(f"{what}: nbytes={nbytes} but one side has {len(ref)} bytes")
    return ref[0:nbytes]


def _address_of(obj: Any) -> tuple[int | None, int]:
    """Where a tensor or array (a view of registered memory, perhaps) lives, without pinning it."""
    try:
        if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch
            if not obj.is_contiguous():
                raise UnsupportedMemory("a non-contiguous tensor")
            return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
        iface = getattr(obj, "__array_interface__", None)
        if iface is not None and iface.get("strides") is None:
            return int(iface["data"][0]), int(obj.nbytes)
    except (AttributeError, TypeError, KeyError):
        pass
    return None, 0


# ---------- init ----------


async def init(
    rank: int | None = None,
    group: str | None = None,
    store: str | None = None,
    world_size: int | None = None,
    token: str | bytes | None = None,
    listen: str | None = None,
    *,
    namespace: str | None = None,
    timeout: float = 60.0,
    **agent_options: Any,
) -> Context:
    """Join rank ``rank`` of group ``group`` to the job through the rendezvous store ``store``.

    Defaults: ``AIOHIXL_RANK``, ``AIOHIXL_GROUP`` (else "default"), ``AIOHIXL_STORE``,
    ``AIOHIXL_WORLD_SIZE``, ``AIOHIXL_TOKEN``, ``AIOHIXL_JOB`` (the namespace, else "default").
    ``store``: ``tcp://HOST:PORT`` (rank 0 serves it, unless a standalone store already
    listens there), ``redis://HOST:PORT/DB[?lease=SECONDS]`` or
    ``etcd://HOST:PORT[/PREFIX][?lease=SECONDS]``. ``listen``: where the agent
    listens (default: the interface that reaches the store, a free port). With ``world_size``,
    returns once that many ranks joined. ``agent_options`` go to ``Agent()``.

    Raises ConnectTimeout (store unreachable), AuthenticationError (wrong token), RankConflict
    (a live process holds the rank), RendezvousTimeout (world_size not reached in ``timeout``).
    """
    what = "aiohixl.init"
    if rank is None:
        rank = _env_int("AIOHIXL_RANK", what)
        if rank is None:
            raise InvalidArgument(f"{what}: give rank= or set AIOHIXL_RANK")
    if world_size is None:
        world_size = _env_int("AIOHIXL_WORLD_SIZE", what)
    for arg, given in (("group", group), ("namespace", namespace)):
        if given == "":  # not taken as "not given": a name that silently became "default"
            raise InvalidArgument(f"{what}: {arg}='' names nothing (None takes the default)")
    group = group or os.environ.get("AIOHIXL_GROUP") or "default"
    store = store or os.environ.get("AIOHIXL_STORE")
    namespace = namespace or os.environ.get("AIOHIXL_JOB") or "default"
    if not store:
        raise InvalidArgument(
            f"{what}: give store= (tcp://HOST:PORT, redis://HOST:PORT/DB or etcd://HOST:PORT) or set AIOHIXL_STORE"
        )
    _args.integer(rank, what, "rank", 0, MAX_RANK)
    if world_size is not None:
        _args.integer(world_size, what, "world_size", 1, MAX_RANK + 1)
        if not rank < world_size:
            raise InvalidArgument(f"{what}: rank {rank} is not below world_size {world_size}")
    _args.text(group, what, "group", 255)
    _args.text(namespace, what, "namespace", 255)
    if not isinstance(store, str):
        raise InvalidArgument(f"{what}: store must be a URL string, not {type(store).__name__}")
    timeout = _args.seconds(timeout, what, "timeout", _args.FOREVER)
    url = parse_store_url(store, what)
    key = c.resolve_token(token, what)

    server: StoreServer | None = None
    agent: Agent | None = None
    st: Store | None = None
    try:
        if url.scheme == "tcp" and rank == 0:
            server = await _host_store(url, key)
        if listen is None:
            listen = f"{_local_ip_towards(url.host, url.port)}:0"
        agent = Agent(f"rank{rank}-{group}", listen=listen, token=key, **agent_options)
        await agent.start()
        address = agent.address
        assert address is not None
        host, port = c.parse_address(address, what)
        if host in ("0.0.0.0", "::", ""):
            address = f"{_local_ip_towards(url.host, url.port)}:{port}"
        st = await _open_store(url, namespace, key, agent, timeout)
        record = RankRecord(
            rank, group, address, agent.id, agent.name, agent.host_identity.host, os.getpid(), world_size or 0
        )
        await st.join(record, timeout, members_at=world_size or 0)
        ctx = Context(rank, group, world_size, st, agent, address, server)
        if world_size is not None:
            await ctx.wait_ranks(world_size, timeout=timeout)
        return ctx
    except BaseException:
        with anyio.CancelScope(shield=True):
            if st is not None:
                await st.aclose()
            if agent is not None:
                await agent.aclose()
            if server is not None:
                await server.aclose()
        raise


async def _host_store(url: StoreURL, token: bytes) -> StoreServer | None:
    """Rank 0 serves the tcp store, unless the port is taken (a standalone store, we hope: the handshake tells)."""
    server = StoreServer(url.host, url.port, token)
    try:
        await server.start()
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            log.info("aiohixl: %s is not ours to serve (%s); connecting to it as a client", url, exc.strerror)
            return None
        raise OSError(exc.errno, f"aiohixl.init: cannot serve the store at {url}: {exc.strerror}") from None
    return server


async def _open_store(url: StoreURL, namespace: str, token: bytes, agent: Agent, timeout: float) -> Store:
    if url.scheme == "tcp":
        me = c.Identity(agent.id, agent.name, agent.host_identity, [])
        return await TcpStore.connect(url, namespace, token, me, timeout)
    if url.scheme == "etcd":
        from .etcd import EtcdStore

        return await EtcdStore.connect(url, namespace, token, timeout)
    from .redis import RedisStore

    return await RedisStore.connect(url, namespace, token, timeout)


# ---------- the functional spelling ----------


async def get_remote_mem(
    ctx: Context, rank: int, size: int | None = None, name: str = "kv", timeout: float | None = 30.0
) -> RemoteRef:
    """``aiohixl.get_remote_mem(ctx, rank, size)``: ``ctx.get_remote_mem``."""
    return await ctx.get_remote_mem(rank, size, name, timeout)


async def put(ctx: Context, remote: RemoteRef, local: Any, nbytes: int | None = None, **kw: Any) -> None:
    """``aiohixl.put(ctx, remote, local, nbytes)``: ``ctx.put``."""
    await ctx.put(remote, local, nbytes, **kw)


async def get(ctx: Context, local: Any, remote: RemoteRef, nbytes: int | None = None, **kw: Any) -> None:
    """``aiohixl.get(ctx, local, remote, nbytes)``: ``ctx.get``."""
    await ctx.get(local, remote, nbytes, **kw)
