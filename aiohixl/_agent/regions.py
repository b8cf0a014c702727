"""An agent's registered memory: pinning, the native registry, and finding a region for a peer."""

from __future__ import annotations

import hmac
import os
import secrets
from functools import partial
from typing import Any, Protocol

from .. import _args
from .._control.listener import Listener
from .._loop.backends import Backend
from .._loop.engine import Engine
from .._loop.native import check, ffi, lib
from ..descriptor import RegionInfo, encode_info
from ..errors import InvalidArgument, RegionUnavailable
from ..memkinds import Pinned, pin
from ..memkinds import memfd as memfd_kind
from ..memory import Access, Region, parse_access
from ..remote import RemoteRegion
from ..transports import Transport


class RegistryOwner(Protocol):
    """What the registry needs of its agent (``core.AgentCore``)."""

    agent: Any  # the public Agent: what a region names as its own
    id: bytes
    engine: Engine
    transports: dict[str, Transport]
    threads: int
    closed: bool
    listener: Listener | None

    def check_open(self, what: str) -> None: ...


class Regions:
    """The regions of one agent, by id and by published name. Regions point here (``close``, ``describe``)."""

    def __init__(self, core: RegistryOwner) -> None:
        self._core = core
        self.by_id: dict[int, Region] = {}
        self.named: dict[str, Region] = {}
        self._next = 1

    # ---- registering ----

    def pin(self, obj: Any, access: Access | str | None, name: str | None, what: str) -> tuple[Pinned, Access]:
        self._core.check_open(what)
        self._core.engine.check_loop(what)
        access = check_region_args(access, name, what)
        pinned = pin(obj, what)
        if access is None:
            access = Access.NONE  # nothing a peer can do unless asked for
        if pinned.readonly and access & Access.REMOTE_WRITE:
            pinned.release()
            raise InvalidArgument(f"{what}: {type(obj).__name__} is read-only but access asks for REMOTE_WRITE")
        return pinned, Access(access)

    def memfd(
        self, nbytes: int, access: Access | str | None, name: str | None, call: str
    ) -> tuple[Pinned, Access, str]:
        self._core.check_open(call)
        self._core.engine.check_loop(call)
        what = f"{call}({nbytes!r})"
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise InvalidArgument(f"{what}: size must be an int, not {type(nbytes).__name__}")
        if nbytes < 0:
            raise InvalidArgument(f"{what}: size must be >= 0")
        access = check_region_args(access, name, what)
        available = memfd_kind.room()
        if available is not None and nbytes > available:
            raise MemoryError(f"{what}: cannot allocate {nbytes} bytes: the host has {available} available")
        try:
            pinned = memfd_kind.allocate(nbytes, name)
        except OSError as exc:
            raise MemoryError(f"{what}: cannot allocate {nbytes} bytes: {exc.strerror or exc}") from exc
        if access is None:
            access = Access.REMOTE_READ | Access.REMOTE_WRITE
        return pinned, Access(access), what

    def prefault(self, pinned: Pinned, threads: int | None = None) -> None:
        # A first copy into cold memory runs at a fraction of the speed of one into warm memory.
        write = 0 if pinned.readonly else 1
        lib.hx_prefault(ffi.cast("void *", pinned.address), pinned.nbytes, write, threads or self._core.threads)

    async def prefault_off_loop(self, pinned: Pinned, what: str) -> None:
        """``prefault`` on a copy thread, completed through the ring: no Python thread to
        start (which stalled the loop), and the memory held until the native side is done."""
        # One core is left to the event loop, which must not stall meanwhile.
        threads = max(1, min(self._core.threads, (os.cpu_count() or 1) - 1))
        engine = self._core.engine
        write = 0 if pinned.readonly else 1
        address = ffi.cast("void *", pinned.address)
        try:
            await engine.admit(what)
            self._core.check_open(what)
            waiter = engine.post_with(
                lambda op_id: lib.hx_prefault_post(engine.native, op_id, address, pinned.nbytes, write, threads),
                (pinned,),
                what,
            )
            # Cancelled or not, the thread touches the pages until its completion: released after it.
            await engine.attach(what).wait_to_end(waiter)
            self._core.check_open(what)
        except BaseException:
            pinned.release()
            raise

    def add(self, pinned: Pinned, access: Access, name: str | None, what: str) -> Region:
        core = self._core
        if name is not None and name in self.named:
            pinned.release()
            raise InvalidArgument(f"{what}: a region named {name!r} is already registered")
        region_id = self._next
        self._next += 1
        # Ids count up and are easy to guess; the key is not. Every access a
        # peer makes carries it, and the native registry checks it.
        key = secrets.randbits(64)
        rc = lib.hx_region_add(core.engine.native, region_id, pinned.address, pinned.nbytes, int(access), key)
        if rc < 0:
            pinned.release()
            check(rc, what)
        region = Region.construct(self, core.agent, region_id, pinned, access, name, key)
        self.by_id[region_id] = region
        for transport in core.transports.values():
            transport.region_added(region)
        if name is not None:
            self.named[name] = region
        return region

    # ---- finding ----

    def live(self, region_id: int) -> Region | None:
        region = self.by_id.get(region_id)
        return None if region is None or region.closed else region

    def live_all(self) -> list[Region]:
        return [r for r in self.by_id.values() if not r.closed]

    def info(self, region: Region) -> RegionInfo:
        """What a peer needs to reach ``region`` (its descriptor, decoded)."""
        keys: dict[int, bytes] = {}
        for transport in self._core.transports.values():
            keys.update(transport.descriptor_keys(region))
        return RegionInfo(
            agent_id=self._core.id,
            region_id=region.id,
            nbytes=region.nbytes,
            address=region.address,
            access=region.access,
            kind=region.kind,
            name=region.name,
            key=region.key,
            keys=keys,
        )

    def describe(self, region: Region) -> bytes:
        return encode_info(self.info(region))

    def lookup(self, by_name: bool, name: str, region_id: int, key: int) -> bytes | None:
        """A published region by name, or any region by id and key (from its descriptor): never by id alone."""
        if by_name:
            region = self.named.get(name)
        else:
            region = self.live(region_id)
            if region is not None and not hmac.compare_digest(
                region.key.to_bytes(8, "little"), key.to_bytes(8, "little")
            ):
                region = None
        return None if region is None else self.describe(region)

    def published(self) -> list[bytes]:
        return [self.describe(r) for r in self.named.values()]

    def published_remote(self, name: str, what: str) -> RemoteRegion:
        """A region of this agent published as ``name``, as a loopback peer sees it."""
        region = self.named.get(name)
        if region is None:
            raise RegionUnavailable(f"{what}({name!r}): no region of that name is published")
        return RemoteRegion(self.info(region))

    # ---- closing ----

    async def close(self, region: Region) -> None:
        """Region.close(): withdrawn from peers, then removed once no op in flight uses it."""
        core = self._core
        core.engine.check_loop("Region.close")  # before anything changes
        region.closed = True
        if region.name is not None:
            self.named.pop(region.name, None)
        if core.closed:
            return
        engine = core.engine
        backend = engine.attach("Region.close")
        if core.listener is not None:
            await core.listener.withdraw(region.id)

        def uses(op: tuple[Any, ...]) -> bool:
            return any(r is region for r in op[1])

        # Again once woken: a pair checked before close() was called may have been posted meanwhile.
        while engine.oldest_op(uses) is not None:
            waiter = backend.new_waiter()
            engine.when_none(uses, partial(backend.resolve, waiter, None))
            await backend.wait(waiter)
        if core.closed:
            return
        rc = lib.hx_region_remove(engine.native, region.id, 0)
        if rc == lib.HX_E_BUSY:
            # A remote access is still running on a native thread.
            rc = await backend.run_to_end(lib.hx_region_remove, engine.native, region.id, 1)
        for transport in core.transports.values():
            transport.region_removed(region)
        self.by_id.pop(region.id, None)
        # Unmapping a pool of GiBs takes a second: off the loop, and gone when close() returns.
        await backend.run_to_end(region.pinned.release)

    def release_all(self) -> None:
        """The agent is gone (its native side freed): every region closed, its memory unpinned."""
        for region in self.by_id.values():
            region.closed = True
            region.pinned.release()
        self.by_id.clear()
        self.named.clear()

    async def release_all_off_loop(self, backend: Backend) -> None:
        """release_all(), the unmapping on a worker thread (GiBs take a second), awaited to its end."""
        regions = list(self.by_id.values())
        self.by_id.clear()
        self.named.clear()
        for region in regions:
            region.closed = True
        await backend.run_to_end(_release, [region.pinned for region in regions])

    def __len__(self) -> int:
        return len(self.by_id)


def _release(pinned: list[Pinned]) -> None:
    for p in pinned:
        p.release()


def check_region_args(access: Any, name: Any, what: str) -> Access | None:
    """``access`` (flags or words, as parse_access takes) and ``name`` of register()/allocate(),
    checked before anything is pinned; the access as flags."""
    access = parse_access(access, what)
    if name is not None:
        _args.text(name, what, "name", 255)
        if not name:
            raise InvalidArgument(f"{what}: name must be 1 to 255 bytes of UTF-8")
    return access
