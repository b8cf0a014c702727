"""Ranks, groups and the rendezvous stores, with real processes (tests/ranks_worker.py), a
real redis-server and a real etcd (each skipped, with the reason, when it is not installed).

Every test runs over the three stores where the behaviour is the same: the embedded tcp store
(hosted by whichever process has rank 0), Redis and etcd (entries with a lease).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import anyio
import numpy as np
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

import aiohixl

from .harness import ROOT, TOKEN, LineProcess, pattern
from .store_servers import Etcd, Redis, free_port, private
from .waiting import wait_until

SLOT = 256 << 10  # what each prefill rank writes into each decode rank's pool
LEASE = 2.0  # redis and etcd lease in these tests: a dead rank's entry is gone within it


@pytest.fixture(scope="module")
def redis_url():
    server = Redis()
    server.start()
    try:
        yield f"redis://127.0.0.1:{server.port}/0?lease={LEASE:g}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def etcd_url():
    server = Etcd()
    server.start()
    try:
        yield f"etcd://127.0.0.1:{server.port}/aiohixl-test?lease={LEASE:g}"
    finally:
        server.remove()


@pytest.fixture(params=["tcp", "redis", "etcd"])
def store(request):
    """A store URL for one test and a fresh job namespace."""
    if request.param == "tcp":
        return {"kind": "tcp", "url": f"tcp://127.0.0.1:{free_port()}", "job": "default"}
    return {"kind": request.param, "url": request.getfixturevalue(f"{request.param}_url"), "job": uuid.uuid4().hex[:12]}


class Worker(LineProcess):
    """Some ranks in a process of their own (tests/ranks_worker.py)."""

    EXIT_TIMEOUT = 20.0

    def __init__(self, proc, out, ready: dict) -> None:
        super().__init__(proc, out)
        self.ready = ready

    @classmethod
    async def start(cls, store: dict, ranks: str, world: int | None = None, pool: int = 4 * SLOT, check=True):
        cmd = [sys.executable, "-m", "tests.ranks_worker", "--store", store["url"], "--token", TOKEN]
        cmd += ["--ranks", ranks, "--pool", str(pool), "--job", store["job"]]
        if world is not None:
            cmd += ["--world", str(world)]
        proc = await anyio.open_process(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=None)
        out = BufferedByteReceiveStream(proc.stdout)
        with anyio.fail_after(150):
            ready = json.loads(await out.receive_until(b"\n", 1 << 20))
        if check:
            assert ready["ready"], ready
        return cls(proc, out, ready)

    async def cmd(self, **kw) -> dict:
        return await self.ask(kw, 150)


def init(store: dict, rank: int, group: str = "prefill", **kw):
    kw.setdefault("token", TOKEN)
    kw.setdefault("timeout", 60)
    return aiohixl.init(rank, group, store["url"], namespace=store["job"], **kw)


def sha(arr) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr)).hexdigest()


async def test_eight_ranks_in_four_processes_put_into_every_decode_pool(store):
    layout = ["0:prefill,1:prefill", "2:prefill,3:prefill", "4:decode,5:decode", "6:decode,7:decode"]
    workers: list[Worker] = []
    try:
        # All at once: ranks whose store is not up yet (rank 0 serves the tcp one) retry until it is.
        async with anyio.create_task_group() as tg:

            async def start(ranks: str) -> None:
                workers.append(await Worker.start(store, ranks, world=8))

            for ranks in layout:
                tg.start_soon(start, ranks)
        workers.sort(key=lambda w: w.ready["ranks"][0])
        assert (await workers[0].cmd(op="ranks", group="decode"))["ranks"] == [4, 5, 6, 7]
        assert (await workers[3].cmd(op="ranks", group="prefill"))["ranks"] == [0, 1, 2, 3]
        async with anyio.create_task_group() as tg:
            for w in workers[:2]:
                tg.start_soon(lambda w=w: w.cmd(op="push", targets=[4, 5, 6, 7], slot=SLOT, slots=4))
        for w in workers[2:]:
            got = await w.cmd(op="collect", n=4, slot=SLOT, slots=4)
            assert got["ok"], got
            for target in w.ready["ranks"]:
                mine = got[str(target)]
                assert mine["notes"] == [f"{p}->{target}" for p in range(4)]
                assert mine["senders"] == [f"rank{p}-prefill" for p in range(4)]
                # every byte: each prefill rank's slot holds that rank's pattern for this target
                assert mine["slots"] == [sha(pattern(SLOT, p * 1000 + target)) for p in range(4)], target
        # a barrier of all 8 ranks, across the 4 processes
        replies: list[dict] = []

        async def barrier(w: Worker) -> None:
            replies.append(await w.cmd(op="barrier"))

        async with anyio.create_task_group() as tg:
            for w in workers:
                tg.start_soon(barrier, w)
        assert replies == [{"ok": True}] * 4, replies
    finally:
        for w in reversed(workers):  # rank 0 (the tcp store's host) last
            await w.aclose()


async def test_a_killed_rank_leaves_the_store_and_its_restart_is_reached(store):
    async with await init(store, 0) as ctx:
        worker = await Worker.start(store, "5:decode")
        try:
            remote = await ctx.get_remote_mem(5, SLOT)
            src = ctx.register(pattern(SLOT, 1))
            await ctx.put(remote, src, SLOT, notify=b"first")
            assert (await worker.cmd(op="note"))["data"] == "first"
            worker.kill()
            await worker.proc.wait()
            t0 = time.monotonic()
            # The entry goes: embedded, when the connection drops; Redis and etcd, within the lease.
            # (Redis: the lease task reads the store every lease/3 s; etcd: the watch tells at once)
            await wait_until(lambda: 5 not in ctx.ranks(), timeout=30, what="rank 5 gone from the store")
            gone_after = time.monotonic() - t0
            # tcp: the kernel closes the dead process's socket at once; Redis: the lease (2 s) ends
            # and the lease task (every lease/3 s) reads the store again; etcd: the lease ends (etcd
            # checks expiry every 0.5 s) and the watch brings the deletion. Loose: a busy machine.
            bound = {"tcp": 10, "redis": LEASE * 3 + 5, "etcd": LEASE + 2}[store["kind"]]
            assert gone_after < bound, gone_after
            with pytest.raises(aiohixl.ConnectionLost):
                await ctx.put(remote, src, SLOT)
        finally:
            await worker.aclose()
        worker = await Worker.start(store, "5:decode")  # restarted: a new agent, a new address
        try:
            # Our view of the store learns of the new rank 5 on its own schedule (etcd: the watch
            # event; Redis: the lease task's read): until then rank 5 has "left the store" for us.
            await wait_until(lambda: 5 in ctx.ranks(), timeout=30, what="rank 5 back in our view of the store")
            with pytest.raises(aiohixl.ConnectionLost, match="rank 5 restarted"):
                await ctx.put(remote, src)  # the old region is gone with the old process
            remote = await ctx.get_remote_mem(5, SLOT, timeout=60)
            await ctx.put(remote[0:4096], src[0:4096], notify=b"again")
            got = await worker.cmd(op="note")
            assert got["data"] == "again" and got["sha"] == sha(pattern(SLOT, 1)[:4096])
        finally:
            await worker.aclose()


async def test_the_embedded_store_host_dying_is_a_clear_error():
    store = {"kind": "tcp", "url": f"tcp://127.0.0.1:{free_port()}", "job": "default"}
    host = await Worker.start(store, "0:prefill")
    try:
        async with await init(store, 1, "decode") as ctx:
            assert ctx.ranks() == [0, 1]
            waiting: list[BaseException] = []

            async def wait_for_a_rank_that_never_comes() -> None:
                try:
                    await ctx.get_remote_mem(9, timeout=120)
                except aiohixl.HixlError as exc:
                    waiting.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_for_a_rank_that_never_comes)
                await anyio.wait_all_tasks_blocked()  # the waiter waits on the store now
                assert not waiting
                host.kill()
                t0 = time.monotonic()
                await wait_until(lambda: waiting, timeout=30, what="the waiter told")  # not a hang
            assert time.monotonic() - t0 < 30
            exc = waiting[0]
            assert isinstance(exc, aiohixl.StoreLost) and isinstance(exc, aiohixl.ConnectionLost)
            assert store["url"] in str(exc), exc
            with pytest.raises(aiohixl.StoreLost, match="127.0.0.1"):
                await ctx.barrier(timeout=60)
            with pytest.raises(aiohixl.StoreLost):
                await ctx.get_remote_mem(0, timeout=60)
    finally:
        await host.aclose()


async def _waiter(ctx, rank: int, outcome: list) -> None:
    """get_remote_mem of ``rank``, its result or exception put in ``outcome``."""
    try:
        outcome.append(await ctx.get_remote_mem(rank, timeout=120))
    except aiohixl.HixlError as exc:
        outcome.append(exc)


@pytest.mark.parametrize("kind", ["tcp", "redis", "etcd"])
async def test_a_store_gone_for_good_tells_every_waiter(kind):
    """The store's server killed under live ranks: waiters raise StoreLost (tcp at once, Redis and
    etcd once a whole lease passed without an answer), never hang; so does every later call."""
    server, url = private(kind, TOKEN, lease=2)
    store = {"kind": kind, "url": url, "job": "gone"}
    try:
        async with await init(store, 1, "decode") as ctx:
            outcome: list = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_waiter, ctx, 9, outcome)
                await anyio.wait_all_tasks_blocked()
                assert not outcome
                server.kill()
                await wait_until(lambda: outcome, timeout=60, what="the waiter told")  # not a hang
            exc = outcome[0]
            assert isinstance(exc, aiohixl.StoreLost), exc
            assert url.split("?")[0] in str(exc), exc
            with pytest.raises(aiohixl.StoreLost):
                await ctx.barrier(timeout=60)
            with pytest.raises(aiohixl.StoreLost):
                await ctx.wait_ranks(5, timeout=60)
    finally:
        server.remove()


@pytest.mark.parametrize("kind", ["tcp", "redis", "etcd"])
async def test_a_store_restarted_within_a_lease_under_live_ranks(kind):
    """tcp: the connection is the entry, so a restarted standalone store is StoreLost for its
    clients. Redis and etcd: the ranks carry on (Redis: the next refresh writes the entries again;
    etcd: its data and leases survive, the watch resumes after the last revision seen), and a
    waiter from before the restart finds a rank that joined after it."""
    server, url = private(kind, TOKEN, lease=15)
    store = {"kind": kind, "url": url, "job": "restart"}
    try:
        async with await init(store, 1, "decode") as a, await init(store, 2, "decode") as b:
            outcome: list = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(_waiter, a, 3, outcome)
                await anyio.wait_all_tasks_blocked()
                server.kill()
                server.start()
                if kind == "tcp":
                    await wait_until(lambda: outcome, timeout=60, what="the waiter told")
                    assert isinstance(outcome[0], aiohixl.StoreLost), outcome
                    with pytest.raises(aiohixl.StoreLost):
                        await b.barrier(timeout=60)
                    return
                async with await init(store, 3, "decode") as c:
                    kv = c.allocate_registered(4096)
                    await wait_until(lambda: outcome, timeout=60, what="the waiter finding rank 3")
                    remote = outcome[0]
                    assert isinstance(remote, aiohixl.RemoteRegion), remote
                    src = a.register(pattern(4096, 5))
                    await a.put(remote, src)
                    assert bytes(kv.memory) == pattern(4096, 5).tobytes()
                    for ctx in (a, b, c):
                        await wait_until(lambda ctx=ctx: ctx.ranks() == [1, 2, 3], timeout=60, what="every rank listed")
                    await asyncio.gather(a.barrier(timeout=60), b.barrier(timeout=60), c.barrier(timeout=60))
    finally:
        server.remove()


async def test_etcd_users_right_credentials_join_wrong_ones_are_refused():
    server, url = private("etcd", TOKEN, lease=15)
    try:
        server.ctl("user", "add", "root:root-pw")
        server.ctl("user", "grant-role", "root", "root")
        server.ctl("user", "add", "rank:rank-pw")
        server.ctl("role", "add", "ranks")
        server.ctl("role", "grant-permission", "ranks", "--prefix=true", "readwrite", "jobs/")
        server.ctl("user", "grant-role", "rank", "ranks")
        server.ctl("auth", "enable")
        base = f"127.0.0.1:{server.port}"
        store = {"url": f"etcd://rank:rank-pw@{base}/jobs", "job": "auth"}
        async with await init(store, 0) as a, await init(store, 1, "decode") as b:
            await asyncio.gather(a.barrier(timeout=30), b.barrier(timeout=30))
            assert a.ranks() == b.ranks() == [0, 1]
        refusals = {
            f"etcd://rank:wrong@{base}/jobs": "invalid user ID or password",
            f"etcd://{base}/jobs": "user name is empty",
            f"etcd://rank:rank-pw@{base}/elsewhere": "permission denied",
        }
        for url, why in refusals.items():
            with pytest.raises(aiohixl.AuthenticationError, match=why) as info:
                await init({"url": url, "job": "auth"}, 2, timeout=5)
            assert "rank-pw" not in str(info.value)
    finally:
        server.remove()


async def test_a_rank_leaving_right_after_a_barrier_does_not_hold_back_the_others(store):
    """Once every rank entered, the barrier is over for all of them, even if one leaves at once."""
    b, a = await asyncio.gather(init(store, 0, world_size=2), init(store, 1, "decode", world_size=2))
    async with b:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: b.barrier(timeout=30))
            await anyio.wait_all_tasks_blocked()  # b waits in the barrier; a completes it and leaves
            async with a:
                await a.barrier(timeout=30)


async def test_a_second_live_process_claiming_a_rank_is_refused(store):
    worker = await Worker.start(store, "3:prefill,0:prefill")
    try:
        with pytest.raises(aiohixl.RankConflict, match=rf"rank 3 .*held by a live process.*pid {worker.ready['pid']}"):
            await init(store, 3)
        # the holder is untouched
        assert (await worker.cmd(op="ranks"))["ranks"] == [0, 3]
    finally:
        await worker.aclose()


async def test_unknown_rank_and_unknown_region_name_what_the_store_holds(store):
    async with await init(store, 0) as ctx, await init(store, 4, "decode") as other:
        other.allocate_registered(4096, name="kv")
        with pytest.raises(aiohixl.UnknownRank, match=r"no rank 42 .*ranks 0 \(prefill\), 4 \(decode\)"):
            await ctx.get_remote_mem(42, timeout=0.5)
        with pytest.raises(aiohixl.UnknownRank, match=r"no rank 42 .*within 0.5 s"):
            await ctx.notify(42, b"x", timeout=0.5)  # its timeout bounds the lookup too
        with pytest.raises(aiohixl.UnknownRank, match=r"rank 4 \(decode\).*no region 'weights'.*\['kv'\]"):
            await ctx.get_remote_mem(4, name="weights", timeout=1)
        with pytest.raises(aiohixl.OutOfBounds, match="8192 bytes.*4096"):
            await ctx.get_remote_mem(4, 8192, timeout=10)
        with pytest.raises(aiohixl.RendezvousTimeout, match="2 of 3 ranks"):
            await ctx.wait_ranks(3, timeout=0.3)


async def test_get_remote_mem_of_nbytes_is_a_window_of_nbytes(store):
    async with await init(store, 0) as ctx, await init(store, 4, "decode") as other:
        kv = other.allocate_registered(1 << 16, name="kv")
        remote = await ctx.get_remote_mem(4, 4096, timeout=10)
        assert remote.nbytes == 4096
        src = ctx.register(pattern(4096, 2))
        await ctx.put(remote, src)  # the whole 64 KiB region would be a LengthMismatch
        assert bytes(kv.memory[:4096]) == pattern(4096, 2).tobytes() and not any(kv.memory[4096:])
        assert (await ctx.get_remote_mem(4, 1 << 16)).nbytes == (await ctx.get_remote_mem(4)).nbytes == 1 << 16
        with pytest.raises(aiohixl.InvalidArgument, match="nbytes must be an int"):
            await ctx.get_remote_mem(4, -1)
        for call, text in [
            (lambda: ctx.get_remote_mem("4"), "rank must be an int, not str"),
            (lambda: ctx.get_remote_mem(-1), r"rank=-1 must be in \[0, "),
            (lambda: ctx.get_remote_mem(4, name=None), "name must be a str, not NoneType"),
            (lambda: ctx.get_remote_mem(4, timeout="x"), "timeout must be a number"),
            (lambda: ctx.put(None, src), "expected a RemoteRegion"),
            (lambda: ctx.put(remote, src, "x"), "nbytes must be an int or None, not str"),
            (lambda: ctx.barrier(group=123), "group must be a str"),
            (lambda: ctx.wait_ranks("x"), "n must be an int"),
            (lambda: ctx.notify(7, "x"), "data takes bytes"),  # before waiting for rank 7
            (lambda: ctx.deregister("kv"), "expected a Region, not str"),
        ]:
            with pytest.raises(aiohixl.InvalidArgument, match=text):
                await call()
        with pytest.raises(aiohixl.InvalidArgument, match="rank must be an int"):
            ctx.group_of([1])


async def test_an_unreachable_store_is_a_connect_timeout_naming_it(store):
    url = {"tcp": "tcp://{}", "redis": "redis://{}/0", "etcd": "etcd://{}"}[store["kind"]]
    url = url.format(f"127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    with pytest.raises(aiohixl.ConnectTimeout, match=url):
        await aiohixl.init(1, "decode", url, token=TOKEN, timeout=1.0)
    assert time.monotonic() - t0 < 30


async def test_a_wrong_token_is_an_authentication_error(store):
    async with await init(store, 0):
        with pytest.raises(aiohixl.AuthenticationError, match="token"):
            await init(store, 1, token="not-the-token")


async def test_standalone_store_and_the_functional_spelling():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiohixl", "store", "--listen", f"127.0.0.1:{port}", "--token", TOKEN],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"aiohixl store listening on tcp://127.0.0.1:{port}"
        store = {"url": f"tcp://127.0.0.1:{port}", "job": "default"}
        a, b = await asyncio.gather(init(store, 0, world_size=2), init(store, 1, "decode", world_size=2))
        async with a, b:
            assert not a.hosts_store  # the port was taken by the standalone store: rank 0 is a client
            kv = b.allocate_registered(1 << 16, access=aiohixl.Access.REMOTE_WRITE | aiohixl.Access.REMOTE_READ)
            arr = pattern(1 << 16, 3)
            a.register(arr)
            remote = await a.get_remote_mem(1, 1 << 16)
            await aiohixl.put(a, remote, arr, 1 << 15)  # a registered array as the local side
            await aiohixl.put(a, remote[1 << 15 :], arr[1 << 15 :], notify=b"kv ready")  # a view of it
            note = await b.agent.notification(timeout=30)
            assert note.data == b"kv ready" and note.peer == "rank0-prefill"
            assert bytes(kv.memory) == arr.tobytes()
            back = a.register(bytearray(16))
            await aiohixl.get(a, back, remote, 16)
            assert bytes(back.memory) == arr[:16].tobytes()
            await asyncio.gather(a.barrier(timeout=30), b.barrier(timeout=30))
            with pytest.raises(aiohixl.InvalidArgument, match="unregistered bytearray"):
                await a.put(remote[0:4], bytearray(4))
    finally:
        proc.terminate()
        proc.wait(10)


def test_bad_arguments_are_refused_before_anything_starts():
    async def go(**kw):
        return await aiohixl.init(**kw)

    with pytest.raises(aiohixl.InvalidArgument, match="store="):
        asyncio.run(go(rank=0, token=TOKEN))
    with pytest.raises(aiohixl.InvalidArgument, match="not tcp://HOST:PORT"):
        asyncio.run(go(rank=0, store="http://x:1", token=TOKEN))
    with pytest.raises(aiohixl.InvalidArgument, match="whole number of seconds"):
        asyncio.run(go(rank=0, store="etcd://127.0.0.1:1?lease=1.5", token=TOKEN))
    with pytest.raises(aiohixl.InvalidArgument, match="only option is lease"):
        asyncio.run(go(rank=0, store="etcd://127.0.0.1:1/p?ttl=3", token=TOKEN))
    with pytest.raises(aiohixl.InvalidArgument, match="world_size 2"):
        asyncio.run(go(rank=2, world_size=2, store="tcp://127.0.0.1:1", token=TOKEN))
    with pytest.raises(aiohixl.InvalidArgument, match="rank="):
        asyncio.run(go(store="tcp://127.0.0.1:1", token=TOKEN))
    # Each of these was a TypeError, AttributeError or struct.error from deep inside.
    tcp = {"store": "tcp://127.0.0.1:1", "token": TOKEN}
    for kw, text in [
        ({"rank": "0"}, "rank must be an int, not str"),
        ({"rank": 0, "world_size": 1.5}, "world_size must be an int, not float"),
        ({"rank": 0, "group": 123}, "group must be a str, not int"),
        ({"rank": 0, "namespace": b"job"}, "namespace must be a str, not bytes"),
        ({"rank": 0, "timeout": "x"}, "timeout must be a number of seconds, not str"),
        ({"rank": 0, "token": 4}, "a token is str or bytes, not int"),
        ({"rank": 0, "group": ""}, "group='' names nothing"),  # was taken as "default"
        ({"rank": 0, "namespace": ""}, "namespace='' names nothing"),
    ]:
        with pytest.raises(aiohixl.InvalidArgument, match=text):
            asyncio.run(go(**{**tcp, **kw}))
    with pytest.raises(aiohixl.InvalidArgument, match="store must be a URL string, not int"):
        asyncio.run(go(rank=0, store=123, token=TOKEN))


async def test_a_failed_rank_0_init_releases_the_store_it_started():
    """Agent() refusing an option raises right after rank 0 started the tcp store, before the
    store's task first ran: that store was left serving, and rank 1 joined a job with no rank 0."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    with pytest.raises(aiohixl.InvalidArgument, match="max_inflight"):
        await aiohixl.init(0, "prefill", url, token=TOKEN, max_inflight=0)
    assert not [t for t in asyncio.all_tasks() if t.get_name() == f"aiohixl-store-127.0.0.1:{port}"]
    with socket.socket() as s:  # nothing listens there: the port binds again
        s.bind(("127.0.0.1", port))
    with pytest.raises(aiohixl.ConnectTimeout, match=url):
        await aiohixl.init(1, "decode", url, token=TOKEN, timeout=1.0)


def test_the_two_process_example_runs_as_written():
    env = dict(os.environ, AIOHIXL_STORE=f"tcp://127.0.0.1:{free_port()}")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ranks_two_processes.py")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "cache intact: True" in proc.stdout and "pushed 4194304 bytes to rank 1" in proc.stdout


def test_ranks_under_trio():
    trio = pytest.importorskip("trio")
    url = f"tcp://127.0.0.1:{free_port()}"

    async def main() -> None:
        ctxs: dict[int, aiohixl.Context] = {}

        async def join(rank: int, group: str) -> None:
            ctxs[rank] = await aiohixl.init(rank, group, url, world_size=2, token=TOKEN)

        async with trio.open_nursery() as n:
            n.start_soon(join, 0, "prefill")
            n.start_soon(join, 1, "decode")
        a, b = ctxs[0], ctxs[1]
        kv = b.allocate_registered(4096)
        src = a.register(bytearray(b"t" * 4096))
        await a.put(await a.get_remote_mem(1, 4096), src, notify=b"trio")
        assert (await b.agent.notification(timeout=30)).data == b"trio"
        assert bytes(kv.memory) == bytes(src.memory)
        async with trio.open_nursery() as n:
            n.start_soon(a.barrier)
            n.start_soon(b.barrier)
        await b.aclose()
        await a.aclose()

    trio.run(main)


@pytest.mark.parametrize("kind", ["tcp", "redis", "etcd"])
def test_32_ranks_in_2_processes_each_put_to_3_others_and_connect_to_only_those(kind, tmp_path):
    """examples/ranks_scale.py at a size the suite can afford (the 256-rank run is the script's):
    every put lands, and each rank holds peers only for the 3 ranks it put to (connected lazily)."""
    server = {"redis": "redis-server", "etcd": "etcd"}.get(kind)
    if server is not None and shutil.which(server) is None:
        pytest.skip(f"{server} is not installed (.ci/run installs it)")
    if kind == "redis":
        pytest.importorskip("redis", reason="redis-py is not installed (the test extra has it)")
    if kind == "etcd":
        pytest.importorskip("aetcd", reason="aetcd is not installed (the test extra has it)")
    rows = tmp_path / "rows.json"
    script = str(ROOT / "examples" / "ranks_scale.py")
    cmd = [sys.executable, script, "--ranks", "32", "--procs", "2", "--store", kind, "--json", str(rows)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # a hang guard
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    [row] = json.loads(rows.read_text())
    assert row["ranks"] == 32 and row["bad"] == 0, row
    assert row["peers_per_rank"] == 3, row


async def test_a_rank_waiting_for_world_size_returns_once_all_joined_and_lists_them_all(store):
    """init(world_size=N) joins without the namespace (the store gives it once N ranks are
    there): it returns only then, listing every rank, and a rank joined without world_size
    hears of each join as before."""
    waiting = [asyncio.ensure_future(init(store, r, world_size=4)) for r in (0, 1)]
    ctxs: list = []
    try:
        async with await init(store, 3, "decode") as observer:
            assert await observer.wait_ranks(3, timeout=60) == [0, 1, 3]
            assert not any(t.done() for t in waiting)  # 3 of 4: neither can have returned
            ctxs.append(await init(store, 2, world_size=4))
            ctxs += await asyncio.gather(*waiting)
            for ctx in ctxs:
                assert ctx.ranks() == [0, 1, 2, 3] and ctx.group_of(3) == "decode"
            await wait_until(lambda: observer.ranks() == [0, 1, 2, 3], timeout=60, what="the observer hears rank 2")
            # publishing and lookups work on the mirror given at once
            kv = observer.allocate_registered(4096)
            remote = await ctxs[0].get_remote_mem(3, timeout=60)
            await ctxs[0].put(remote, ctxs[0].register(pattern(4096, 7)))
            assert bytes(kv.memory) == pattern(4096, 7).tobytes()
            await asyncio.gather(observer.barrier(timeout=60), *(c.barrier(timeout=60) for c in ctxs))
    finally:
        for t in waiting:
            t.cancel()
        for ctx in sorted(ctxs, key=lambda c: c.rank, reverse=True):  # rank 0 (the tcp store) last
            await ctx.aclose()


async def test_a_world_size_never_reached_is_a_rendezvous_timeout_naming_who_joined(store):
    async with await init(store, 0) as first:
        with pytest.raises(aiohixl.RendezvousTimeout, match=r"2 of 3 ranks .*holds ranks 0-1 \(prefill\)"):
            await init(store, 1, world_size=3, timeout=1)
        assert first.ranks() in ([0], [0, 1])  # rank 1 left when init failed (Redis/etcd: at once or within a lease)


async def test_tcp_store_tells_a_waiting_rank_of_no_join_before_its_count():
    """Over tcp, a client that asked for the membership at n ranks (STORE_MEMBERS before its
    join) hears of no join before the store holds n ranks, then gets every record at once."""
    from aiohixl._control import handshake as c
    from aiohixl.ranks.record import RankRecord, parse_store_url
    from aiohixl.ranks.tcp import StoreServer, TcpStore

    server = StoreServer("127.0.0.1", 0, TOKEN.encode())
    await server.start()
    url = parse_store_url(f"tcp://{server.address}", "test")
    stores: list[TcpStore] = []

    async def join(rank: int, group: str, members_at: int) -> TcpStore:
        me = c.Identity(os.urandom(16), f"r{rank}", c.HostIdentity.local(), [])
        st = await TcpStore.connect(url, "job", TOKEN.encode(), me, 10)
        stores.append(st)
        rec = RankRecord(rank, group, "127.0.0.1:1", me.agent_id, me.name, "h", os.getpid(), members_at)
        await st.join(rec, 10, members_at=members_at)
        return st

    try:
        waiting = await join(0, "solo", 3)
        await join(1, "prefill", 0)
        # a barrier of waiting's own group is released on its connection after anything the store
        # sent it for rank 1's join: once it returns, waiting has read all of that
        await waiting.barrier("solo", 0, 10, "barrier")
        assert sorted(waiting.records) == [0] and not waiting._complete()
        third = await join(2, "prefill", 0)
        assert await waiting.wait_ranks(3, None, 10, "wait") == [0, 1, 2]
        assert sorted(third.records) == [0, 1, 2]
    finally:
        for st in stores:
            await st.aclose()
        await server.aclose()


async def test_a_region_published_after_a_rank_was_looked_up_is_found_and_a_restart_replaces_it(store):
    """A rank's later regions reach the ranks that looked it up (tcp: STORE_WATCH; etcd: a watch
    on its regions key alone), and its restarted process's regions replace the old ones."""
    async with await init(store, 0) as ctx:
        async with await init(store, 4, "decode") as other:
            other.allocate_registered(4096, name="kv")
            first = await ctx.get_remote_mem(4, timeout=60)
            weights = other.allocate_registered(8192, name="weights")
            remote = await ctx.get_remote_mem(4, name="weights", timeout=60)
            assert remote.nbytes == 8192 and first.nbytes == 4096
            await ctx.put(remote[:4096], ctx.register(pattern(4096, 9)))
            assert bytes(weights.memory[:4096]) == pattern(4096, 9).tobytes()
        async with await init(store, 4, "decode", timeout=60) as again:
            again.allocate_registered(16384, name="kv")
            await wait_until(
                lambda: (r := ctx.store.records.get(4)) is not None and r.agent_id == again.agent.id,
                timeout=60,
                what="the new rank 4",
            )
            assert (await ctx.get_remote_mem(4, timeout=60)).nbytes == 16384
