"""The Redis rendezvous store: ``redis://[:PASSWORD@]HOST:PORT/DB[?lease=SECONDS]``.

For clusters that already run Redis (the ``redis`` extra: redis-py's asyncio
client; asyncio only). Keys of a job namespace NS, all under the hash tag
``{NS}`` (docs/ranks.md)::

    aiohixl:{NS}:rank:R      hash  owner = agent id (hex), record = RankRecord bytes   PX lease
    aiohixl:{NS}:ranks       set   of R (an index; entries whose hash expired are pruned)
    aiohixl:{NS}:auth        HMAC-SHA256(token, "aiohixl-store:" NS), hex            PX lease
    aiohixl:{NS}:barrier:K:G set   of ranks that entered barrier K, generation G     PX 1 h
    aiohixl:{NS}:barrier:K:G:done  "1" once a rank saw it complete                   PX 1 h

Each live rank refreshes its entry every lease/3 seconds; a dead rank's entry
expires within one lease. Claims, refreshes and removals are Lua scripts, so
they are atomic. Values are the records' binary encoding, never pickled.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import anyio
import sniffio

from ..errors import AuthenticationError, ConnectTimeout, HixlError, InvalidArgument, StoreLost
from .record import RankRecord, StoreURL
from .store import Store, barrier_complete

__all__ = ["RedisStore"]

_JOIN = """
local fp = redis.call('GET', KEYS[3])
if fp and fp ~= ARGV[5] then return {2} end
local cur = redis.call('HGET', KEYS[1], 'owner')
if cur and cur ~= ARGV[1] then return {1, redis.call('HGET', KEYS[1], 'record')} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'record', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[5], 'PX', ARGV[3])
return {0}
"""

_LIST = """
local out = {}
for _, r in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local rec = redis.call('HGET', ARGV[1] .. r, 'record')
  if rec then table.insert(out, rec) else redis.call('SREM', KEYS[1], r) end
end
return out
"""

_LEAVE = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
end
return 0
"""

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
        self._leave_script = client.register_script(_LEAVE)
        self._last_ok = anyio.current_time()
        self._refreshing = False

    @classmethod
    async def connect(cls, url: StoreURL, namespace: str, token: bytes, timeout: float) -> RedisStore:
        what = f"store {url}"
        if sniffio.current_async_library() != "asyncio":
            raise InvalidArgument(f"{what}: the redis store runs on asyncio only (use a tcp:// store under trio)")
        try:
            import redis.asyncio as aioredis
            from redis.exceptions import AuthenticationError as RedisAuthError
            from redis.exceptions import AuthorizationError, RedisError
        except ImportError as exc:
            raise InvalidArgument(f"{what}: needs redis-py (pip install 'aiohixl[redis]'): {exc}") from None
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
        keys = [self._key(record.rank), self.prefix + "ranks", self.prefix + "auth"]
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
                    await self._refresh_mirror()
                except StoreLost:
                    continue  # said again by fail() once a whole lease passed without Redis
        except Exception as exc:  # a background task must not raise
            self.fail(f"refreshing the lease failed: {exc!r}")

    async def _refresh_mirror(self) -> None:
        blobs = await self._call("list", self._list_script, keys=[self.prefix + "ranks"], args=[self.prefix + "rank:"])
        records = {}
        for blob in blobs:
            rec = RankRecord.decode(blob, "redis rank entry")
            records[rec.rank] = rec
        if records != self.records:
            self.records = records
            self._changed_now()

    async def sync(self) -> None:
        try:
            await self._refresh_mirror()
        except StoreLost:
            pass  # the mirror stays as it was; fail() says when the store is lost for good

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
                pipe = self.client.pipeline(transaction=False)
                pipe.smembers(bkey)
                pipe.exists(done_key)
                members, done_count = await self._call("barrier", pipe.execute)
                arrived.clear()
                arrived.update(int(m) for m in members)
                done = done or bool(done_count)
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
            keys = [self._key(self.own.rank), self.prefix + "ranks"]
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
