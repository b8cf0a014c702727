"""The Redis rendezvous store: ``redis://[:PASSWORD@]HOST:PORT/DB[?lease=SECONDS]``.

For clusters that already run Redis (the ``redis`` extra: redis-py's asyncio
client; asyncio only). Keys of a job namespace NS, all under the hash tag
``{NS}`` (docs/ranks.md)::

    aiohixl:{NS}:rank:R      hash  owner = agent id (hex), record = RankRecord bytes   PX lease
    aiohixl:{NS}:ranks       set   of R (an index; entries whose hash expired are pruned)
    aiohixl:{NS}:auth        HMAC-SHA256(token, "aiohixl-store:" NS), hex            PX lease
    aiohixl:{NS}:barrier:K:G set   of ranks that entered barrier K, generation G     PX 1 h
    aiohixl:{NS}:barrier:K:G:done  "1" once a rank saw it complete                   PX 1 h
    aiohixl:{NS}:version     counter, raised by every change of an entry             PX lease
    aiohixl:{NS}:changes     sorted set: R scored by the version that last changed it PX lease

Each live rank refreshes its entry every lease/3 seconds; a dead rank's entry
expires within one lease. A rank that waits reads only what changed since the
version it last saw (nothing, when the version is the same): N ranks polling
a namespace of N entries would otherwise read N x N records per round.
Claims, refreshes and removals are Lua scripts, so they are atomic. Values are
the records' binary encoding, never pickled.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import anyio

from ..errors import AuthenticationError, ConnectTimeout, HixlError, StoreLost
from .record import RankRecord, StoreURL
from .store import Store, barrier_complete, client_library

__all__ = ["RedisStore"]

# The version counter of a namespace that (re)starts begins at Redis's clock in microseconds, so
# every change after a restart of an empty Redis scores above every version a rank saw before it:
# reading what changed since then finds each entry written again.
_BUMP = """
local function bump(k)
  if redis.call('EXISTS', k) == 0 then
    local t = redis.call('TIME')
    redis.call('SET', k, string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2])))
  end
  return redis.call('INCR', k)
end
"""

_JOIN = (
    _BUMP
    + """
local fp = redis.call('GET', KEYS[3])
if fp and fp ~= ARGV[5] then return {2} end
local cur = redis.call('HGET', KEYS[1], 'owner')
if cur and cur ~= ARGV[1] then return {1, redis.call('HGET', KEYS[1], 'record')} end
if redis.call('HGET', KEYS[1], 'record') ~= ARGV[2] then
  redis.call('ZADD', KEYS[5], bump(KEYS[4]), ARGV[4])
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'record', ARGV[2])
for i = 1, 5 do if i ~= 3 then redis.call('PEXPIRE', KEYS[i], ARGV[3]) end end
redis.call('SADD', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[5], 'PX', ARGV[3])
return {0}
"""
)

# every entry: {version, record...}; an entry that expired is pruned (and that is a change)
_LIST = (
    _BUMP
    + """
local out = {0}
for _, r in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local rec = redis.call('HGET', ARGV[1] .. r, 'record')
  if rec then table.insert(out, rec) else
    redis.call('SREM', KEYS[1], r)
    redis.call('ZADD', KEYS[3], bump(KEYS[2]), r)
  end
end
out[1] = tonumber(redis.call('GET', KEYS[2]) or '0')
return out
"""
)

# what changed since version ARGV[1]: {version, rank, record or '' (gone), ...}
_CHANGES = """
local ver = tonumber(redis.call('GET', KEYS[1]) or '0')
local out = {ver}
if ver <= tonumber(ARGV[1]) then return out end
for _, r in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[1], '+inf')) do
  table.insert(out, r)
  table.insert(out, redis.call('HGET', ARGV[2] .. r, 'record') or '')
end
return out
"""

# prunes the entries that expired (each a change) as _LIST does, without reading any:
# {version, how many entries the index holds}
_PRUNE = (
    _BUMP
    + """
for _, r in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. r) == 0 then
    redis.call('SREM', KEYS[1], r)
    redis.call('ZADD', KEYS[3], bump(KEYS[2]), r)
  end
end
return {tonumber(redis.call('GET', KEYS[2]) or '0'), redis.call('SCARD', KEYS[1])}
"""
)

_LEAVE = (
    _BUMP
    + """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  redis.call('ZADD', KEYS[4], bump(KEYS[3]), ARGV[2])
end
return 0
"""
)

BARRIER_TTL_MS = 3_600_000


class RedisStore(Store):
    """A rank's entry in Redis, with a lease refreshed in the background."""

    def __init__(self, url: StoreURL, namespace: str, token: bytes, client: Any) -> None:
        super().__init__(url, namespace)
        self.conflict_grace = url.lease + 1.0  # a dead holder's entry is gone within one lease
        self.client = client
        self.prefix = f"aiohixl:{{{namespace}}}:"
        self.fingerprint = hmac.new(token, b"aiohixl-store:" + namespace.encode(), hashlib.sha256).hexdigest()
        self._join_script = client.register_script(_JOIN)
        self._list_script = client.register_script(_LIST)
        self._changes_script = client.register_script(_CHANGES)
        self._prune_script = client.register_script(_PRUNE)
        self._leave_script = client.register_script(_LEAVE)
        self._last_ok = anyio.current_time()
        self._refreshing = False
        self._version = -1  # of the namespace, when the mirror was last brought up to date

    @classmethod
    async def connect(cls, url: StoreURL, namespace: str, token: bytes, timeout: float) -> RedisStore:
        what = f"store {url}"
        with client_library(what, "redis", "redis-py"):
            import redis.asyncio as aioredis
            from redis.exceptions import AuthenticationError as RedisAuthError
            from redis.exceptions import AuthorizationError, RedisError
        client = aioredis.Redis(
            host=url.host,
            port=url.port,
            db=url.db,
            username=url.username,
            password=url.password,
            socket_connect_timeout=min(timeout, 5.0),
            socket_timeout=max(5.0, url.lease / 2),
            socket_keepalive=True,
        )
        deadline = anyio.current_time() + timeout
        pause = 0.05
        while True:
            try:
                with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                    await client.ping()
                return cls(url, namespace, token, client)
            except (RedisError, OSError, TimeoutError) as exc:
                if isinstance(exc, (RedisAuthError, AuthorizationError)):
                    await client.aclose()
                    raise AuthenticationError(f"{what}: Redis refused the credentials: {exc}") from None
                if anyio.current_time() + pause >= deadline:
                    await client.aclose()
                    raise ConnectTimeout(
                        f"{what}: unreachable for {timeout} s (last: {exc or type(exc).__name__})"
                    ) from None
            await anyio.sleep(pause)
            pause = min(pause * 2, 0.5)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}rank:{rank}"

    def _change_keys(self) -> list[str]:
        return [self.prefix + "version", self.prefix + "changes"]

    def _list_keys(self) -> list[str]:
        return [self.prefix + "ranks", *self._change_keys()]

    async def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """One Redis call; after a whole lease without an answer the store counts as lost."""
        from redis.exceptions import RedisError

        try:
            result = await fn(*args, **kw)
        except (RedisError, OSError) as exc:
            if anyio.current_time() - self._last_ok > self.url.lease:
                self.fail(f"no answer from Redis for {self.url.lease} s: {exc}")
            raise StoreLost(f"{what}: {self.label}: {exc}") from None
        self._last_ok = anyio.current_time()
        return result

    async def _claim(self, record: RankRecord) -> list[Any]:
        keys = [self._key(record.rank), self.prefix + "ranks", self.prefix + "auth", *self._change_keys()]
        args = [record.agent_id.hex(), record.encode(), int(self.url.lease * 1000), record.rank, self.fingerprint]
        return list(await self._call(f"rank {record.rank}", self._join_script, keys=keys, args=args))

    async def _join(self, record: RankRecord) -> RankRecord | None:
        reply = await self._claim(record)
        if reply[0] == 2:
            raise AuthenticationError(
                f"{self.label}: the job's entries were made with another token (is AIOHIXL_TOKEN the agents' token?)"
            )
        if reply[0] == 1:
            return RankRecord.decode(reply[1], "redis rank entry")
        if self.members_at <= 1:  # else wait_ranks reads the namespace once the count is there
            await self._refresh_mirror()
        if not self._refreshing:
            self._refreshing = True
            self._backend.spawn(self._keep_lease, f"aiohixl-store-lease-{record.rank}")
        return None

    async def _put_record(self, record: RankRecord) -> None:
        reply = await self._claim(record)
        if reply[0] != 0:
            self.fail(f"rank {record.rank}'s entry was taken over (did this process stall past its lease?)")

    async def _keep_lease(self) -> None:
        """Refresh our entry every lease/3 s (and the mirror with it) until closed."""
        try:
            while not self.closed and self.broken is None:
                await anyio.sleep(self.url.lease / 3)
                if self.closed or self.own is None:
                    return
                try:
                    reply = await self._claim(self.own)
                    if reply[0] != 0:
                        self.fail(
                            f"rank {self.own.rank}'s entry was taken over (did this process stall past its lease?)"
                        )
                        return
                    # entries that expired are found here (pruned in Redis: a change each), and the
                    # mirror reads what changed: not every entry, every lease/3 s, on every rank
                    _, count = await self._call(
                        "prune", self._prune_script, keys=self._list_keys(), args=[self.prefix + "rank:"]
                    )
                    # a mirror that lists another number of ranks missed something (a Redis that
                    # restarted empty does not list the ranks that died meanwhile): read it whole.
                    # Not read yet (a join storm: wait_ranks reads it once the count is there): not now.
                    if self._version >= 0:
                        await self._refresh_mirror(whole=int(count) != len(self.records))
                except StoreLost:
                    continue  # said again by fail() once a whole lease passed without Redis
        except Exception as exc:  # a background task must not raise
            self.fail(f"refreshing the lease failed: {exc!r}")

    async def _refresh_mirror(self, whole: bool = False) -> None:
        """Bring the mirror up to date: what changed since our version, or (``whole``) every entry."""
        if not whole and self._version >= 0:
            reply = await self._call(
                "changes", self._changes_script, keys=self._change_keys(), args=[self._version, self.prefix + "rank:"]
            )
            version = int(reply[0])
            if version < self._version:  # the namespace expired and began again
                whole = True
            elif version > self._version:
                records = dict(self.records)
                for rank, blob in zip(reply[1::2], reply[2::2], strict=True):
                    if blob:
                        rec = RankRecord.decode_shared(blob, "redis rank entry")
                        records[rec.rank] = rec
                    else:
                        records.pop(int(rank), None)
                self._apply(records, version)
        if whole or self._version < 0:
            blobs = await self._call("list", self._list_script, keys=self._list_keys(), args=[self.prefix + "rank:"])
            records = {}
            for blob in blobs[1:]:
                rec = RankRecord.decode_shared(blob, "redis rank entry")
                records[rec.rank] = rec
            self._apply(records, int(blobs[0]))

    def _apply(self, records: dict[int, RankRecord], version: int) -> None:
        self._version = version
        if records != self.records:
            self.records = records
            self._changed_now()

    async def sync(self) -> None:
        try:
            await self._refresh_mirror()
        except StoreLost:
            pass  # the mirror stays as it was; fail() says when the store is lost for good

    async def _until_count(self, n: int, what: str) -> None:
        """Poll the index's size (one integer) until it lists ``n`` ranks; the records are read after.

        The index may still list an entry that expired (pruned at the next refresh): then the
        mirror's wait that follows finds fewer, and polls what changed, as before."""
        waited = 0
        while True:
            self.check(what)
            try:
                if await self._call("count", self.client.scard, self.prefix + "ranks") >= n:
                    return
            except StoreLost:
                pass  # tried again at the next poll; fail() says when it is over
            await anyio.sleep(min(0.02 * 2**waited, 0.25))
            waited += 1

    async def _whole_mirror(self) -> None:
        await self.sync()

    async def _next_change(self, waited: int) -> None:
        await anyio.sleep(min(0.02 * 2**waited, 0.25))
        try:
            await self._refresh_mirror()
        except StoreLost:
            pass  # tried again at the next poll; fail() says when it is over

    async def _arrive(self, key: str, gen: int, group: str, expected: int) -> None:
        assert self.own is not None
        bkey = f"{self.prefix}barrier:{key}:{gen}"

        async def enter() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.sadd(bkey, self.own.rank)  # type: ignore[union-attr]
            pipe.pexpire(bkey, BARRIER_TTL_MS)
            await pipe.execute()

        await self._call("barrier", enter)
        # The rank that sees the barrier complete marks it done: polls see only snapshots, and a
        # rank leaving right after it was released must not leave the others short of a member.
        done_key = f"{bkey}:done"
        arrived: set[int] = set()
        done = False

        async def poll(waited: int) -> None:
            nonlocal done
            await self._next_change(waited)
            try:
                # A count first: the members are read only once enough ranks entered.
                pipe = self.client.pipeline(transaction=False)
                pipe.scard(bkey)
                pipe.exists(done_key)
                count, done_count = await self._call("barrier", pipe.execute)
                done = done or bool(done_count)
                covered = sum(1 for rec in self.records.values() if not group or rec.group == group)
                if done or covered < expected or count < covered:
                    return
                members = await self._call("barrier", self.client.smembers, bkey)
                arrived.clear()
                arrived.update(int(m) for m in members)
            except (StoreLost, ValueError):
                pass

        await poll(0)
        waited = 0
        while not done:
            if barrier_complete(self.records, group, expected, arrived):
                try:
                    await self._call("barrier", self.client.set, done_key, b"1", px=BARRIER_TTL_MS)
                except StoreLost:
                    pass  # the others see it complete themselves, unless one of us leaves first
                return
            self.check(f"barrier {key}")
            waited += 1
            await poll(waited)

    async def _leave(self) -> None:
        if self.own is not None:
            keys = [self._key(self.own.rank), self.prefix + "ranks", *self._change_keys()]
            try:
                await self._call("leave", self._leave_script, keys=keys, args=[self.own.agent_id.hex(), self.own.rank])
            except HixlError:
                pass
        await self.client.aclose()

    async def aclose(self) -> None:
        await super().aclose()
        with anyio.CancelScope(shield=True):
            try:
                await self.client.aclose()
            except Exception:
                pass
