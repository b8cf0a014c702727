"""A rank context across a partition: its op fails with ConnectionLost, its next op after the heal works.

This process is rank 0 (serving the tcp store on the bridge's gateway address); rank 1 runs in
a host namespace (tests/ranks_worker.py). The store's connection is cut by the partition too.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

import aiohixl
from tests.harness import ROOT, LineProcess, pattern, sha

TOKEN = "hosts-tier-token"
INTERVAL, TIMEOUT = 0.5, 1.5


class Worker(LineProcess):
    async def cmd(self, **kw) -> dict:
        reply = await self.ask(kw, 60)
        assert reply.get("ok"), reply
        return reply


async def worker(host, store: str, ranks: str, world: int) -> Worker:
    argv = [sys.executable, "-m", "tests.ranks_worker", "--store", store, "--token", TOKEN, "--ranks", ranks]
    proc = await anyio.open_process(
        host.argv([*argv, "--world", str(world)]), cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=None
    )
    out = BufferedByteReceiveStream(proc.stdout)
    with anyio.fail_after(60):
        ready = json.loads(await out.receive_until(b"\n", 1 << 20))
    assert ready["ready"], ready
    return Worker(proc, out)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def test_rank_op_fails_in_a_partition_and_the_next_one_after_the_heal_works(hosts):
    store = f"tcp://{hosts.gateway}:{free_port(hosts.gateway)}"
    w: Worker | None = None
    ctx: aiohixl.Context | None = None
    try:
        async with anyio.create_task_group() as tg:

            async def rank0() -> None:
                nonlocal ctx
                ctx = await aiohixl.init(
                    0, "prefill", store, world_size=2, token=TOKEN, heartbeat_interval=INTERVAL,
                    heartbeat_timeout=TIMEOUT, timeout=60,
                )  # fmt: skip

            tg.start_soon(rank0)
            w = await worker(hosts[0], store, "1:decode", 2)
        assert ctx is not None
        remote = await ctx.get_remote_mem(1, 4096)
        src = ctx.register(pattern(4096, 9))
        assert (await ctx.peer(1)).transport == "tcp"
        await aiohixl.put(ctx, remote, src, notify=b"before")
        assert (await w.cmd(op="note"))["data"] == "before"

        with hosts.partitioned(hosts[0], hosts.gateway):
            dropped = time.monotonic()
            try:
                with anyio.fail_after(TIMEOUT + 10):
                    await aiohixl.put(ctx, remote, src, notify=b"lost")
                raise AssertionError("a put across the partition succeeded")
            except aiohixl.ConnectionLost as exc:
                print(f"rank put: {type(exc).__name__} {time.monotonic() - dropped:.2f} s after the drop: {exc}")

        src2 = ctx.register(pattern(4096, 10))
        await aiohixl.put(ctx, remote, src2, notify=b"after")  # reconnects to rank 1
        got = await w.cmd(op="note")
        if got["data"] == "lost":  # the lost put landed after all (its answer was what the partition cut)
            got = await w.cmd(op="note")
        assert got["data"] == "after" and got["sha"] == sha(pattern(4096, 10)), got
        async with anyio.create_task_group() as tg:  # the store, through the partition too, serves both
            tg.start_soon(functools.partial(w.cmd, op="barrier"))
            await ctx.barrier(timeout=30)
    finally:
        if w is not None:
            await w.aclose()
        if ctx is not None:
            await ctx.aclose()
