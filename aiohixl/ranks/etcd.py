"""The etcd rendezvous store: ``etcd://[USER:PASSWORD@]HOST:PORT[/PREFIX][?lease=SECONDS]``.

For clusters that already run etcd v3 (the ``etcd`` extra: aetcd, an asyncio
gRPC client; asyncio only). Keys of a job namespace NS (``quote``d, so it holds
no ``/``), under PREFIX (default ``aiohixl``; docs/ranks.md)::

    PREFIX/NS/rank/R            fingerprint (32 bytes) + RankRecord bytes   the rank's lease
    PREFIX/NS/regions/R         fingerprint + the rank's latest record      the rank's lease
    PREFIX/NS/barrier/K/G/R     empty: rank R entered barrier K, generation G the rank's lease
    PREFIX/NS/done/K/G          empty: barrier K, generation G completed       its writer's lease

Each rank grants one lease and keeps it alive every lease/3 seconds; a dead
rank's keys go with its lease, within one lease. A watch on PREFIX/NS/done/ to
PREFIX/NS/rank/ (not the arrivals), from the revision the namespace was read
at, keeps the mirror current (no polling). A barrier is decided at one
revision by whoever finds it complete (its arrival transaction reads the
arrivals and the ranks), who writes done/K/G; its event releases the others.
Publishing writes regions/R, which only the ranks that looked R up watch.
The fingerprint is HMAC-SHA256(token, "aiohixl-store:" NS): a joiner that finds
another one in the namespace is refused. Values are never pickled.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import Any
from urllib.parse import quote, unquote

import anyio

from ..errors import AuthenticationError, ConnectTimeout, HixlError, ProtocolError, StoreLost
from .record import RankRecord, StoreURL
from .store import Store, barrier_complete, client_library

__all__ = ["EtcdStore"]

# grpc's reconnect backoff starts at 1 s and grows to 2 min: a restarted etcd would be found late
_CHANNEL = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    # finds a vanished host on a quiet connection; etcd refuses pings more often than every 5 s
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}
FINGERPRINT = 32


def _range_end(prefix: bytes) -> bytes:
    """The end of etcd's key range holding exactly the keys that start with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    end[-1] += 1
    return bytes(end)


class EtcdStore(Store):
    """A rank's keys in etcd under a lease kept alive in the background; a watch feeds the mirror."""

    def __init__(self, url: StoreURL, namespace: str, token: bytes, client: Any) -> None:
        super().__init__(url, namespace)
        self.client = client
        self.root = f"{url.prefix}/{quote(namespace, safe='')}/".encode()
        self.fingerprint = hmac.new(token, b"aiohixl-store:" + namespace.encode(), hashlib.sha256).digest()
        self.ttl = url.lease  # what etcd granted, once it did
        self.conflict_grace = url.lease + 1.0  # a dead holder's entry is gone within one lease
        self.lease: Any = None
        self._created = 0  # the create revision of our rank key: whether it is still ours
        self._revision = 0  # the mirror holds every change up to this revision
        self._arrived: dict[tuple[str, int], set[int]] = {}
        self._waiting: dict[tuple[str, int], tuple[str, int]] = {}  # barriers we entered: group, expected
        self._released: set[tuple[str, int]] = set()
        self._membership = 0  # raised by every rank that comes or goes in the mirror
        self._regions: dict[int, RankRecord] = {}  # the watched ranks' regions/R records
        self._last_ok = anyio.current_time()
        self._watching = False  # the mirror is read and watched (at the join, or once members_at joined)

    @classmethod
    async def connect(cls, url: StoreURL, namespace: str, token: bytes, timeout: float) -> EtcdStore:
        what = f"store {url}"
        with client_library(what, "etcd", "aetcd"):
            import aetcd
            from aetcd.exceptions import UnauthenticatedError
        call_timeout = max(2.0, url.lease / 3)
        client = aetcd.Client(
            url.host, url.port, username=url.username, password=url.password, timeout=call_timeout, options=_CHANNEL
        )
        store = cls(url, namespace, token, client)
        deadline = anyio.current_time() + timeout
        pause = 0.05
        while True:
            try:
                with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                    await client.connect()  # authenticates, when credentials are given
                    await client.get(store.root + b"rank/0")
                store._last_ok = anyio.current_time()
                return store
            except (aetcd.ClientError, TimeoutError) as exc:
                await client.close()
                text = str(exc) or type(exc).__name__
                if isinstance(exc, UnauthenticatedError) or _refusal(text):
                    raise AuthenticationError(f"{what}: etcd refused the credentials: {text}") from None
                if anyio.current_time() + pause >= deadline:
                    raise ConnectTimeout(f"{what}: unreachable for {timeout} s (last: {text})") from None
            await anyio.sleep(pause)
            pause = min(pause * 2, 0.5)

    # ---- keys ----

    def _rank_key(self, rank: int) -> bytes:
        return self.root + f"rank/{rank}".encode()

    def _regions_key(self, rank: int) -> bytes:
        return self.root + f"regions/{rank}".encode()

    def _apply_regions(self, rank: int, value: bytes) -> None:
        """A watched rank's record with its regions (``regions/R``): the mirror's, while that agent holds the rank."""
        rec = self._decode(value, "etcd regions entry")
        if rec is None or rec.rank != rank:
            return
        self._regions[rank] = rec
        held = self.records.get(rank)
        if held is not None and held.agent_id == rec.agent_id and (self.own is None or rank != self.own.rank):
            self.records[rank] = rec

    def _barrier_key(self, key: str, gen: int, rank: int) -> bytes:
        return self.root + f"barrier/{quote(key, safe='')}/{gen}/{rank}".encode()

    def _decode(self, value: bytes, what: str) -> RankRecord | None:
        """The record in a rank key's value; None for one written with another token."""
        if value[:FINGERPRINT] != self.fingerprint:
            return None
        return RankRecord.decode_shared(value[FINGERPRINT:], what)

    async def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """One etcd call; after a whole lease without an answer the store counts as lost."""
        import aetcd

        try:
            result = await fn(*args, **kw)
        except aetcd.ClientError as exc:
            self._no_answer(exc)
            raise StoreLost(f"{what}: {self.label}: {exc or type(exc).__name__}") from None
        self._last_ok = anyio.current_time()
        return result

    def _no_answer(self, exc: BaseException) -> None:
        if anyio.current_time() - self._last_ok > self.ttl:
            self.fail(f"no answer from etcd for {self.ttl:g} s (its lease): {exc or type(exc).__name__}")

    # ---- what a store implements ----

    async def _join(self, record: RankRecord) -> RankRecord | None:
        tx = self.client.transactions
        if self.lease is None:
            self.lease = await self._call("grant a lease", self.client.lease, int(self.url.lease))
            self.ttl = float(self.lease.ttl)
            self.conflict_grace = self.ttl + 1.0
        key = self._rank_key(record.rank)
        # In a join storm (init(world_size=N)) the namespace is read, and watched, once N ranks
        # joined (_until_count): N ranks reading it at each join, and each hearing every other
        # join, would be N x N records.
        later = self.members_at > 1
        success = [tx.put(key, self.fingerprint + record.encode(), lease=self.lease)]
        if not later:
            success.append(tx.get(self.root, _range_end(self.root)))
        ok, replies = await self._call(
            f"join rank {record.rank}",
            self.client.transaction,
            compare=[tx.create(key) == 0],
            success=success,
            failure=[tx.get(key)],
        )
        if not ok:
            value, _ = replies[0][0]
            holder = self._decode(value, "etcd rank entry")
            if holder is None:
                raise AuthenticationError(
                    f"{self.label}: rank {record.rank}'s entry was made with another token{_HINT}"
                )
            return holder
        self._created = self._revision = replies[0].response_put.header.revision
        self._backend.spawn(self._keep_lease, f"aiohixl-store-lease-{record.rank}")
        if not later:
            self._read_namespace(replies[1])
            self._start_watch()
        return None

    def _read_namespace(self, kvs: Any) -> None:
        """Fill the mirror from a read of the whole namespace."""
        records: dict[int, RankRecord] = {}
        foreign = 0
        for value, meta in kvs:
            parts = bytes(meta.key)[len(self.root) :].split(b"/")
            if parts[0] == b"rank":
                rec = self._decode(value, "etcd rank entry")
                if rec is None:
                    foreign += 1
                else:
                    records[rec.rank] = rec
        if foreign:
            raise AuthenticationError(
                f"{self.label}: {foreign} of the job's entries were made with another token{_HINT}"
            )
        if self.own is not None:
            records[self.own.rank] = self.own
        self.records = records

    def _start_watch(self) -> None:
        assert not self._watching
        self._watching = True
        # done/ and rank/ (in key order, nothing between them): not barrier/, whose arrivals
        # would be an event to every rank from every rank, nor regions/ (watched one by one)
        start, end = self.root + b"done/", _range_end(self.root + b"rank/")
        self._backend.spawn(lambda: self._watch_loop(start, end, None), f"aiohixl-store-watch-{self.namespace}")

    def _complete(self) -> bool:
        return self._watching

    async def _count(self) -> int:
        """How many rank keys the namespace holds (etcd counts; aetcd's API does not ask for that)."""
        import aetcd
        from aetcd import rpc

        prefix = self.root + b"rank/"
        request = rpc.RangeRequest(key=prefix, range_end=_range_end(prefix), count_only=True)
        try:
            reply = await self.client.kvstub.Range(request, timeout=self.client._timeout, metadata=self.client.metadata)
        except rpc.AioRpcError as exc:
            try:
                aetcd.exceptions._handle_exception(exc)
            except aetcd.ClientError as err:
                self._no_answer(err)
            raise StoreLost(f"count: {self.label}: {exc.details()}") from None
        self._last_ok = anyio.current_time()
        return int(reply.count)

    async def _until_count(self, n: int, what: str) -> None:
        """Poll the number of rank keys (one integer) until there are ``n``; then read the
        namespace once and watch it from that revision on."""
        if self._watching:
            return
        waited = 0
        while True:
            self.check(what)
            try:
                if await self._count() >= n:
                    break
            except StoreLost:
                pass  # tried again at the next poll; fail() says when it is over
            await anyio.sleep(min(0.02 * 2**waited, 0.25))
            waited += 1
        await self._whole_mirror()

    async def _whole_mirror(self) -> None:
        if self._watching:
            return
        reply = await self._call("read the job", self.client.get_prefix, self.root)
        if self._watching:
            return
        self._revision = max(self._revision, reply.header.revision)
        self._read_namespace([(kv.value, kv) for kv in reply.kvs])
        self._start_watch()
        self._changed_now()

    async def _put_record(self, record: RankRecord) -> None:
        tx = self.client.transactions
        key = self._rank_key(record.rank)
        ok, _ = await self._call(
            f"publish rank {record.rank}",
            self.client.transaction,
            compare=[tx.create(key) == self._created],
            # regions/R, not rank/R: the ranks' watch would carry each publish to every rank
            success=[tx.put(self._regions_key(record.rank), self.fingerprint + record.encode(), lease=self.lease)],
            failure=[],
        )
        if not ok:
            self.fail(f"rank {record.rank}'s entry is gone from etcd (did this process stall past its lease?)")

    async def _watch(self, rank: int) -> None:
        """Read ``regions/R`` now and watch it from that revision on (a lookup of a region asks)."""
        key = self._regions_key(rank)
        reply = await self._call(f"read rank {rank}'s regions", self.client.get_range, key, key + b"\0")
        revision = [reply.header.revision]  # watched from there on, even when there is nothing yet
        for kv in reply.kvs:
            self._apply_regions(rank, bytes(kv.value))
        self._changed_now()
        self._backend.spawn(lambda: self._watch_loop(key, None, revision), f"aiohixl-store-watch-regions-{rank}")

    async def _keep_lease(self) -> None:
        """Refresh our lease every lease/3 s until closed; a lease etcd no longer has loses the store."""
        try:
            while not self.closed and self.broken is None:
                await anyio.sleep(self.ttl / 3)
                if self.closed or self.own is None:
                    return
                try:
                    reply = await self._call("refresh the lease", self.client.refresh_lease, self.lease.id)
                except StoreLost:
                    continue  # said again by fail() once a whole lease passed without etcd
                if reply is not None and reply.TTL > 0 and self.url.username is not None:
                    # etcd's simple auth tokens lapse unused (--auth-token-ttl, 5 min) and neither the
                    # lease stream nor the watch uses ours: a read now and then keeps it
                    try:
                        await self._call("refresh the auth token", self.client.get, self._rank_key(self.own.rank))
                    except StoreLost:
                        continue
                if reply is None or reply.TTL <= 0:
                    self.fail(
                        f"rank {self.own.rank}'s lease ended in etcd (did this process stall past its lease,"
                        " or etcd restart without its data?)"
                    )
        except Exception as exc:  # a background task must not raise
            self.fail(f"refreshing the lease failed: {exc!r}")

    async def _watch_loop(self, start: bytes, end: bytes | None, revision: list[int] | None) -> None:
        """Apply every change of keys ``start`` to ``end`` (``start`` alone: None) to the mirror,
        resuming after the last revision seen (``revision[0]``; the mirror's when None)."""
        import aetcd

        pause = 0.05
        try:
            while not self.closed and self.broken is None:
                try:
                    since = self._revision if revision is None else revision[0]
                    watch = await self.client.watch(start, end, start_revision=since + 1)
                    async for event in watch:
                        self._last_ok = anyio.current_time()
                        if revision is not None:
                            revision[0] = max(revision[0], event.kv.mod_revision)
                        self._apply(event)
                        pause = 0.05
                except aetcd.RevisionCompactedError as exc:
                    # what happened in between is gone from etcd: nothing to resume from
                    self.fail(f"the watch fell behind etcd's compaction ({exc})")
                except aetcd.ClientError as exc:
                    self._no_answer(exc)
                if self.closed or self.broken is not None:
                    return
                await anyio.sleep(pause)
                pause = min(pause * 2, 1.0)
        except Exception as exc:  # a background task must not raise
            self.fail(f"watching etcd failed: {exc!r}")

    def _apply(self, event: Any) -> None:
        import aetcd

        kv = event.kv
        if not bytes(kv.key).startswith(self.root + b"regions/"):  # their watches keep their own
            self._revision = max(self._revision, kv.mod_revision)
        put = event.kind == aetcd.EventKind.PUT
        parts = bytes(kv.key)[len(self.root) :].split(b"/")
        try:
            if parts[0] == b"rank" and len(parts) == 2:
                self._apply_rank(int(parts[1]), bytes(kv.value) if put else None)
            elif parts[0] == b"regions" and len(parts) == 2:
                if put:
                    self._apply_regions(int(parts[1]), bytes(kv.value))
                else:
                    self._regions.pop(int(parts[1]), None)
            elif parts[0] == b"done" and len(parts) == 3 and put:
                bk = (unquote(parts[1].decode()), int(parts[2]))
                if bk in self._waiting:
                    self._released.add(bk)
        except (ValueError, ProtocolError) as exc:
            self.fail(f"etcd holds a malformed entry {bytes(kv.key)!r}: {exc}")
        self._changed_now()

    def _apply_rank(self, rank: int, value: bytes | None) -> None:
        own = self.own
        if value is None:
            if self.records.pop(rank, None) is not None:
                self._membership += 1
            if own is not None and rank == own.rank and not self.closed:
                self.fail(f"rank {rank}'s entry was removed from etcd (its lease ended?)")
            return
        rec = self._decode(value, "etcd rank entry")
        if rec is None or rec.rank != rank:
            return  # another token's (refused at join), or misfiled
        if own is not None and rank == own.rank and rec.agent_id == own.agent_id:
            rec = own  # ours as we last published it: an older put may still be on its way
        else:
            regions = self._regions.get(rank)
            if regions is not None and regions.agent_id == rec.agent_id:
                rec = regions  # the rank as joined, with the regions it published since
        if rank not in self.records:
            self._membership += 1
        self.records[rank] = rec

    async def _next_change(self, waited: int) -> None:
        await self._changed.wait()

    def _done_key(self, key: str, gen: int) -> bytes:
        return self.root + f"done/{quote(key, safe='')}/{gen}".encode()

    async def _arrive(self, key: str, gen: int, group: str, expected: int) -> None:
        """Enter: one transaction writes our arrival and reads, at its revision, the barrier's
        arrivals and the ranks. Whoever finds it complete (the last to enter, or a rank that sees
        a member go) writes ``done/K/G``; the others are released by that key's event, so a rank
        that leaves right after cannot undo it. No rank watches the arrivals: at N ranks that
        was N x N events per barrier."""
        assert self.own is not None
        tx = self.client.transactions
        bk = (key, gen)
        self._waiting[bk] = (group, expected)
        arrivals = self.root + f"barrier/{quote(key, safe='')}/{gen}/".encode()
        ranks = self.root + b"rank/"
        reads = [tx.get(arrivals, _range_end(arrivals)), tx.get(ranks, _range_end(ranks))]
        try:
            ops = [tx.put(self._barrier_key(key, gen, self.own.rank), b"", lease=self.lease)]
            if gen > 1:  # every rank of the last one was released at a revision before this one
                ops.append(tx.delete(self._barrier_key(key, gen - 1, self.own.rank)))
            seen = self._membership
            _, replies = await self._call(
                f"barrier {key}", self.client.transaction, compare=[], success=ops + reads, failure=[]
            )
            while True:
                if self._complete_at(bk, group, expected, replies[-2], replies[-1]):
                    await self._release_all(key, gen)
                    return
                if bk in self._released:
                    return
                self.check(f"barrier {key}")
                await self.wait_for(
                    f"barrier {key}",
                    lambda seen=seen: True if bk in self._released or self._membership != seen else None,  # type: ignore[misc]
                    math.inf,
                )
                if bk in self._released:
                    return
                seen = self._membership  # a rank came or went: read the arrivals again
                _, replies = await self._call(
                    f"barrier {key}", self.client.transaction, compare=[], success=reads, failure=[]
                )
        finally:
            self._waiting.pop(bk, None)
            self._released.discard(bk)
            self._arrived.pop(bk, None)

    async def _release_all(self, key: str, gen: int) -> None:
        """Write ``done/K/G``: the other ranks wait for nothing else, so a failed call (an etcd
        restarting, a leader election) is tried again until it lands or the store counts as
        lost (no answer for a lease: ``check`` raises). It is idempotent."""
        tx = self.client.transactions
        done = [tx.put(self._done_key(key, gen), b"", lease=self.lease)]
        if gen > 1:
            done.append(tx.delete(self._done_key(key, gen - 1)))
        while True:
            try:
                await self._call(f"barrier {key}", self.client.transaction, compare=[], success=done, failure=[])
                return
            except StoreLost:
                self.check(f"barrier {key}")
                await anyio.sleep(0.1)  # a backoff between calls, not a wait for a state

    def _complete_at(self, bk: tuple[str, int], group: str, expected: int, arrivals: Any, ranks: Any) -> bool:
        """Whether the barrier is complete by one revision's arrivals and ranks (read together)."""
        arrived = {int(bytes(meta.key).rsplit(b"/", 1)[1]) for _, meta in arrivals}
        self._arrived[bk] = arrived
        records: dict[int, RankRecord] = {}
        for value, _ in ranks:
            rec = self._decode(value, "etcd rank entry")
            if rec is not None:
                records[rec.rank] = rec
        return barrier_complete(records, group, expected, arrived)

    def _barrier_detail(self, key: str, gen: int) -> str:
        return f"; entered: ranks {sorted(self._arrived.get((key, gen), set()))}"

    async def _leave(self) -> None:
        if self.lease is not None:
            try:
                await self._call("leave", self.client.revoke_lease, self.lease.id)  # our keys go with it
            except HixlError:
                pass

    async def aclose(self) -> None:
        await super().aclose()
        with anyio.CancelScope(shield=True):
            try:
                await self.client.close()  # ends the watch
            except Exception:
                pass


_HINT = " (is AIOHIXL_TOKEN the agents' token?)"


def _refusal(text: str) -> bool:
    """Whether etcd's message is a refusal of the credentials (it says so as INVALID_ARGUMENT)."""
    return any(s in text for s in ("authentication failed", "permission denied", "user name is empty"))
