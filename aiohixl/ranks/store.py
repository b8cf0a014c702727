"""The rendezvous store's client side: what both stores (tcp, redis) share.

A client joins one rank into one job namespace and keeps a mirror of the
namespace's records: the tcp store pushes every join and leave to every rank,
but a rank's later records (its regions) only to the ranks that watch it
(``_watch``: a lookup of a region asks); the redis store is read again while
someone waits and every lease/3 seconds. Waiting (for a
rank, for n ranks, for a barrier) is a predicate on the mirror, checked
whenever it changes, with a deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import anyio
import sniffio

from .._loop.backends import Backend, current_backend
from ..errors import HixlError, InvalidArgument, RankConflict, RendezvousTimeout, StoreLost, UnknownRank
from .record import RankRecord, StoreURL

__all__ = ["Store", "summary", "barrier_complete", "client_library"]

T = TypeVar("T")


@contextmanager
def client_library(what: str, extra: str, package: str) -> Iterator[None]:
    """Around the imports of a store's client library (redis, etcd: named as their pip extra),
    which runs on asyncio only: InvalidArgument under another event loop, or when ``package``
    is not installed."""
    if sniffio.current_async_library() != "asyncio":
        raise InvalidArgument(f"{what}: the {extra} store runs on asyncio only (use a tcp:// store under trio)")
    try:
        yield
    except ImportError as exc:
        raise InvalidArgument(f"{what}: needs {package} (pip install 'aiohixl[{extra}]'): {exc}") from None


def summary(records: dict[int, RankRecord], limit: int = 16) -> str:
    """What a store holds, in a line: ``ranks 0-3 (prefill), 4-7 (decode)``."""
    if not records:
        return "no ranks"
    by_group: dict[str, list[int]] = {}
    for rank in sorted(records):
        by_group.setdefault(records[rank].group, []).append(rank)
    parts = [f"{_spans(ranks, limit)} ({group})" for group, ranks in by_group.items()]
    return "ranks " + ", ".join(parts)


def _spans(ranks: list[int], limit: int) -> str:
    spans: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(spans[:limit]) + (",..." if len(spans) > limit else "")


class Store:
    """One rank's connection to a rendezvous store."""

    #: how long a join waits for a conflicting entry to go away (a dead holder's) before RankConflict
    conflict_grace = 2.0

    def __init__(self, url: StoreURL, namespace: str) -> None:
        self.url = url
        self.namespace = namespace
        self.records: dict[int, RankRecord] = {}
        self.own: RankRecord | None = None
        self.broken: HixlError | None = None
        self.closed = False
        self._changed = anyio.Event()
        self._backend: Backend = current_backend()
        # publishing: the latest own record is sent by one background task at a time
        self._wanted = 0
        self._sent = 0
        self._publishing = False
        self._published = anyio.Event()
        self._publish_error: HixlError | None = None
        self._barrier_gen: dict[str, int] = {}
        self._watched: set[int] = set()
        # join(members_at=n): the mirror need not list the other ranks before the store holds n
        # (init(world_size=n) waits for that anyway): a store may then skip telling this rank of
        # each join in the storm of n joins (the tcp store does), so it is not n x n messages
        self.members_at = 0

    @property
    def label(self) -> str:
        return f"store {self.url} (job {self.namespace!r})"

    # ---- what a store implements ----

    async def _join(self, record: RankRecord) -> RankRecord | None:
        """Claim the rank; the record of the live holder when another one holds it."""
        raise NotImplementedError

    async def _put_record(self, record: RankRecord) -> None:
        """Replace our own record (same rank, same agent)."""
        raise NotImplementedError

    async def _watch(self, rank: int) -> None:
        """Keep ``records[rank]``'s regions current from now on (``lookup`` of a region asks).

        The mirror always holds every rank's record as it joined (membership: group, address,
        agent id); what a rank publishes later reaches only the ranks that watch it, so that N
        ranks publishing is not N x N messages. A store whose mirror is read whole (redis) need
        not do anything."""

    async def _next_change(self, waited: int) -> None:
        """Return once the mirror may have changed (``waited``: how many times this wait looped)."""
        raise NotImplementedError

    async def _arrive(self, key: str, gen: int, group: str, expected: int) -> None:
        """Enter barrier ``key``/``gen``; return when every rank it covers has entered."""
        raise NotImplementedError

    async def _leave(self) -> None:
        raise NotImplementedError

    async def sync(self) -> None:
        """Bring the mirror up to date now (the tcp store's always is)."""

    def _complete(self) -> bool:
        """Whether the mirror lists every rank (not, over tcp, before the count of ``members_at``)."""
        return True

    async def _until_count(self, n: int, what: str) -> None:
        """Return once the store may hold ``n`` ranks: a cheap wait before the mirror's (Redis: a count)."""

    async def _whole_mirror(self) -> None:
        """Fill the mirror now, however many ranks joined (for a timeout's message)."""

    # ---- the mirror ----

    def _changed_now(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def check(self, what: str) -> None:
        if self.closed:
            raise StoreLost(f"{what}: {self.label} is closed")
        if self.broken is not None:
            raise StoreLost(f"{what}: {self.broken}")

    def fail(self, reason: str) -> None:
        """The connection to the store is gone: every waiter raises StoreLost."""
        if self.broken is None and not self.closed:
            self.broken = StoreLost(f"{self.label}: {reason}")
        self._changed_now()

    async def wait_for(self, what: str, predicate: Callable[[], T | None], timeout: float | None) -> T | None:
        """The first non-None value of ``predicate()`` (re-checked at each change), or None at the deadline."""
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        waited = 0
        while True:
            self.check(what)
            value = predicate()
            if value is not None:
                return value
            left = deadline - anyio.current_time()
            if left <= 0:
                return None
            with anyio.move_on_after(left):
                await self._next_change(waited)
            waited += 1

    # ---- joining and publishing ----

    async def join(self, record: RankRecord, timeout: float, members_at: int = 0) -> None:
        """Claim ``record.rank``; RankConflict when a live process keeps it past ``conflict_grace``.

        ``members_at``: the caller waits for that many ranks next (``wait_ranks``), so the mirror
        need not follow the joins before."""
        self.members_at = members_at
        deadline = anyio.current_time() + min(timeout, self.conflict_grace)
        pause = 0.05
        while True:
            holder = await self._join(record)
            if holder is None:
                self.own = record
                self.records[record.rank] = record
                self._changed_now()
                return
            if anyio.current_time() >= deadline:
                raise RankConflict(
                    f"rank {record.rank} in {self.label} is held by a live process: {holder.describe()}"
                    f" (agent {holder.name!r}); this process ({record.describe()}) is refused"
                )
            await anyio.sleep(pause)
            pause = min(pause * 2, 0.5)

    def publish(self, record: RankRecord) -> None:
        """Make ``record`` our entry from now on (sent in the background; ``flush()`` waits for it)."""
        if self.own is not None and record.rank != self.own.rank:
            raise InvalidArgument(f"{self.label}: publishing rank {record.rank} on rank {self.own.rank}'s entry")
        self.own = record
        self.records[record.rank] = record
        self._wanted += 1
        if not self._publishing:
            self._publishing = True
            self._backend.spawn(self._publisher, "aiohixl-store-publish")

    async def _publisher(self) -> None:
        try:
            while self._sent < self._wanted and self.broken is None and not self.closed:
                wanted, record = self._wanted, self.own
                assert record is not None
                await self._put_record(record)
                self._sent = wanted
        except HixlError as exc:
            self._publish_error = exc
        except Exception as exc:  # a background task must not raise
            self._publish_error = StoreLost(f"{self.label}: publishing failed: {exc!r}")
        finally:
            self._publishing = False
            self._published.set()
            self._published = anyio.Event()

    async def flush(self, what: str) -> None:
        """Return once the store holds the last record given to ``publish()``."""
        while self._sent < self._wanted:
            self.check(what)
            if self._publish_error is not None:
                raise self._publish_error
            if not self._publishing:  # the publisher stopped (store broken or closed)
                self.check(what)
                break
            await self._published.wait()

    # ---- lookups and waits ----

    async def lookup(self, rank: int, region: str | None, timeout: float | None, what: str) -> RankRecord:
        """The record of ``rank`` (with ``region`` published, when given), waiting up to ``timeout``."""

        def found() -> RankRecord | None:
            rec = self.records.get(rank)
            return rec if rec is not None and (region is None or region in rec.regions) else None

        if region is not None and rank not in self._watched and found() is None:
            self._watched.add(rank)
            await self._watch(rank)

        rec = await self.wait_for(what, found, timeout)
        if rec is not None:
            return rec
        held = self.records.get(rank)
        if held is not None:
            raise UnknownRank(
                f"{what}: {held.describe()} published no region {region!r} within {_secs(timeout)};"
                f" it publishes {sorted(held.regions) or 'none'}"
            )
        raise UnknownRank(
            f"{what}: no rank {rank} in {self.label} within {_secs(timeout)}; it holds {summary(self.records)}"
        )

    def ranks(self, group: str | None = None) -> list[int]:
        return sorted(r for r, rec in self.records.items() if group is None or rec.group == group)

    async def wait_ranks(self, n: int, group: str | None, timeout: float | None, what: str) -> list[int]:
        def enough() -> list[int] | None:
            if len(self.records) < n or not self._complete():  # checked at every change: no sorting
                return None
            ranks = self.ranks(group)
            return ranks if len(ranks) >= n else None

        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        with anyio.move_on_after(deadline - anyio.current_time()):
            await self._until_count(n, what)
        got = await self.wait_for(what, enough, max(0.0, deadline - anyio.current_time()))
        if got is None:
            self.check(what)
            await self._whole_mirror()
            among = "" if group is None else f" of group {group!r}"
            raise RendezvousTimeout(
                f"{what}: {len(self.ranks(group))} of {n} ranks{among} joined {self.label} within {_secs(timeout)};"
                f" it holds {summary(self.records)}"
            )
        return got

    async def barrier(self, group: str | None, expected: int, timeout: float | None, what: str) -> None:
        """Wait until every rank of ``group`` (all ranks when None; at least ``expected``) has entered."""
        await self.flush(what)
        key = group if group is not None else "*"
        gen = self._barrier_gen.get(key, 0) + 1
        self._barrier_gen[key] = gen
        with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
            await self._arrive(key, gen, group or "", expected)
        if scope.cancelled_caught:
            self.check(what)
            among = "all ranks" if group is None else f"group {group!r}"
            raise RendezvousTimeout(
                f"{what}: barrier {gen} of {among} did not complete within {_secs(timeout)}"
                f" ({self.label} holds {summary(self.records)}{self._barrier_detail(key, gen)})"
            )

    def _barrier_detail(self, key: str, gen: int) -> str:
        return ""

    async def aclose(self) -> None:
        """Leave: our entry goes away now."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.broken is None:
                with anyio.move_on_after(2.0, shield=True):
                    await self._leave()
        except HixlError:
            pass
        finally:
            self._changed_now()


def barrier_complete(records: dict[int, RankRecord], group: str, expected: int, arrived: set[int]) -> bool:
    """Whether every rank a barrier covers (the group's, or all when ``group`` is "") has entered it."""
    if len(arrived) < expected:
        return False
    if not group:  # counts first: this is checked at every arrival, and at hundreds of ranks
        return len(arrived) >= len(records) >= expected and records.keys() <= arrived
    members = {r for r, rec in records.items() if rec.group == group}
    return len(members) >= expected and members <= arrived


def _secs(timeout: float | None) -> str:
    return "no time limit" if timeout is None else f"{timeout:.3g} s"
