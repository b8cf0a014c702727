"""Prefill/decode over tcp, in two processes.

The decode worker registers a KV-cache region and publishes it as "kv"; it
then does nothing while the prefill worker puts blocks straight into it.

Run: .venv/bin/python examples/pd_two_processes.py
"""

import asyncio
import multiprocessing as mp
import os

import aiohixl
from aiohixl import Access

TOKEN = os.environ.setdefault("AIOHIXL_TOKEN", "example-shared-secret")
BLOCK = 256 * 1024
BLOCKS = 64


def decode_worker(ready: "mp.Queue", done: "mp.Queue") -> None:
    async def main() -> None:
        async with aiohixl.Agent("decode", listen="127.0.0.1:0") as agent:
            kv = agent.allocate(BLOCK * BLOCKS, name="kv", access=Access.REMOTE_WRITE)
            ready.put(agent.address)
            await asyncio.get_running_loop().run_in_executor(None, done.get)  # the decode loop would run here
            blocks = [bytes(kv.memory[i * BLOCK : i * BLOCK + 8]) for i in range(BLOCKS)]
            print(f"decode: first bytes of blocks 0 and {BLOCKS - 1}: {blocks[0]!r} {blocks[-1]!r}")

    asyncio.run(main())


async def prefill(address: str) -> None:
    async with aiohixl.Agent("prefill") as agent:
        peer = await agent.connect(address)  # token from AIOHIXL_TOKEN
        kv = await peer.region("kv")
        cache = agent.allocate(BLOCK * BLOCKS)
        for i in range(BLOCKS):  # "compute" the KV cache
            cache.memory[i * BLOCK : (i + 1) * BLOCK] = f"blk{i:04d}".encode().ljust(BLOCK, b".")
        # Push every block; the awaits overlap, each returns once its bytes are in decode's memory.
        await asyncio.gather(
            *(peer.put(kv[i * BLOCK : (i + 1) * BLOCK], cache[i * BLOCK : (i + 1) * BLOCK]) for i in range(BLOCKS))
        )
        print(f"prefill: pushed {BLOCKS} blocks of {BLOCK // 1024} KiB via {peer.transport}")


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    decode = ctx.Process(target=decode_worker, args=(ready, done))
    decode.start()
    asyncio.run(prefill(ready.get(timeout=30)))
    done.put(True)
    decode.join(30)
