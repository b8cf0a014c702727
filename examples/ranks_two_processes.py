"""Two ranks, one per process: prefill rank 0 pushes a KV cache into decode rank 1.

    python examples/ranks_two_processes.py            # starts both ranks as two processes
    python examples/ranks_two_processes.py --rank 1 & python examples/ranks_two_processes.py --rank 0

Rank 0 serves the embedded rendezvous store (AIOHIXL_STORE, default tcp://127.0.0.1:29600);
nobody exchanges addresses by hand. Every process needs the same AIOHIXL_TOKEN (the example
sets one when it is not given).
"""

import argparse
import asyncio
import os
import subprocess
import sys

import aiohixl as hixl

KV_CACHE_SIZE = 4 << 20
os.environ.setdefault("AIOHIXL_TOKEN", "example-token")
os.environ.setdefault("AIOHIXL_STORE", "tcp://127.0.0.1:29600")


async def prefill() -> None:
    async with await hixl.init(rank=0, group="prefill", world_size=2) as ctx:
        kv = ctx.allocate_registered(KV_CACHE_SIZE, name=None)  # local memory: nothing to publish
        kv.memory[:] = bytes(range(256)) * (KV_CACHE_SIZE // 256)  # "computed" KV cache
        remote = await hixl.get_remote_mem(ctx, rank=1, size=KV_CACHE_SIZE)
        await hixl.put(ctx, remote, kv, KV_CACHE_SIZE, notify=b"req-1: kv ready")
        print(f"prefill: pushed {KV_CACHE_SIZE} bytes to rank 1 ({ctx.ranks('decode')} decode ranks)")
        await ctx.barrier()  # rank 0 serves the store: leave only once rank 1 is done with it


async def decode() -> None:
    async with await hixl.init(rank=1, group="decode", world_size=2) as ctx:
        kv = ctx.allocate_registered(KV_CACHE_SIZE, access="remote_write", name="kv")
        note = await ctx.agent.notification(timeout=60, match=b"req-1: kv ready")
        ok = bytes(kv.memory) == bytes(range(256)) * (KV_CACHE_SIZE // 256)
        print(f"decode: {note.data.decode()!r} from {note.peer}; cache intact: {ok}")
        await ctx.barrier()
        if not ok:
            raise SystemExit(1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, choices=(0, 1))
    args = p.parse_args()
    if args.rank is not None:
        asyncio.run(prefill() if args.rank == 0 else decode())
        return 0
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r)]) for r in (1, 0)]
    return max(proc.wait(120) for proc in procs)


if __name__ == "__main__":
    sys.exit(main())
