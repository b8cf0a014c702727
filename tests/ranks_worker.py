"""Some ranks of a job in one process, driven over stdin/stdout with JSON lines.

    python -m tests.ranks_worker --store URL --token T --ranks 4:decode,5:decode [--world 8] [--pool N]

Each rank joins with ``aiohixl.init``; a decode rank allocates its pool "kv" (``--pool``
bytes). It prints {"ready": ...} once every rank of it joined, then answers one line per
command: push (each prefill rank here puts a slot of its pattern into every target with
notify=), collect (each decode rank here takes n notifications, then hashes its slots),
ranks, reach (get_remote_mem + put + notify to one rank), exit. The test checks the bytes
through these answers, against patterns it computes itself.
"""

import argparse
import asyncio
import hashlib
import json
import os
import sys

import numpy as np

import aiohixl

POOLS: dict = {}  # rank -> its registered pool "kv"


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--ranks", required=True, help="rank:group,...")
    p.add_argument("--world", type=int, default=None)
    p.add_argument("--pool", type=int, default=1 << 20)
    p.add_argument("--job", default="default")
    args = p.parse_args()
    spec = [(int(r), g) for r, g in (item.split(":") for item in args.ranks.split(","))]

    async def join(rank: int, group: str) -> aiohixl.Context:
        ctx = await aiohixl.init(
            rank, group, args.store, world_size=args.world, token=args.token, namespace=args.job, timeout=120
        )
        if group == "decode":
            POOLS[rank] = ctx.allocate_registered(args.pool, access="remote_write|remote_read", name="kv")
        return ctx

    try:
        ctxs = await asyncio.gather(*(join(r, g) for r, g in spec))
    except aiohixl.HixlError as exc:
        print(json.dumps({"ready": False, "error": type(exc).__name__, "message": str(exc)}), flush=True)
        return
    print(json.dumps({"ready": True, "pid": os.getpid(), "ranks": [c.rank for c in ctxs]}), flush=True)
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            out: dict = {"ok": True}
            try:
                await command(ctxs, cmd, out)
            except aiohixl.HixlError as exc:
                out = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
            print(json.dumps(out), flush=True)
            if cmd["op"] == "exit":
                return
    finally:
        for ctx in ctxs:
            await ctx.aclose()


async def command(ctxs: list, cmd: dict, out: dict) -> None:
    op = cmd["op"]
    if op == "push":
        slot = cmd["slot"]

        async def push(ctx, target: int) -> None:
            remote = await ctx.get_remote_mem(target, slot * cmd["slots"], timeout=60)
            src = ctx.register(pattern(slot, ctx.rank * 1000 + target))
            await aiohixl.put(
                ctx, remote[ctx.rank * slot : (ctx.rank + 1) * slot], src, notify=f"{ctx.rank}->{target}".encode()
            )

        await asyncio.gather(*(push(ctx, t) for ctx in ctxs for t in cmd["targets"]))
    elif op == "collect":
        slot, n = cmd["slot"], cmd["n"]
        for ctx in ctxs:
            notes = [await ctx.agent.notification(timeout=60) for _ in range(n)]
            kv = np.frombuffer(POOLS[ctx.rank].memory, dtype=np.uint8)
            out[str(ctx.rank)] = {
                "notes": sorted(note.data.decode() for note in notes),
                "senders": sorted(note.peer for note in notes),
                "slots": [hashlib.sha256(kv[i * slot : (i + 1) * slot]).hexdigest() for i in range(cmd["slots"])],
            }
    elif op == "ranks":
        out["ranks"] = ctxs[0].ranks(cmd.get("group"))
    elif op == "barrier":
        await asyncio.gather(*(ctx.barrier(timeout=60) for ctx in ctxs))
    elif op == "reach":
        ctx = ctxs[0]
        remote = await ctx.get_remote_mem(cmd["rank"], timeout=cmd.get("timeout", 30))
        src = ctx.register(pattern(4096, 7))
        await ctx.put(remote[0:4096], src, notify=b"reached")
    elif op == "note":
        note = await ctxs[0].agent.notification(timeout=cmd.get("timeout", 60))
        out.update(
            data=note.data.decode(), peer=note.peer, sha=hashlib.sha256(POOLS[ctxs[0].rank].memory[:4096]).hexdigest()
        )


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks when we hang on exit
    asyncio.run(main())
