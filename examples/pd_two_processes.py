"""Prefill/decode in two processes: the KV cache lands, then a notification says so.

The decode worker registers a KV-cache region and publishes it as "kv"; it
calls nothing while the prefill worker puts blocks straight into it, and
learns that a request's cache is complete from a notification
(``agent.notification(match=...)``), delivered only once every byte is in place.

Transport: both workers are on this host, so the puts go over shared memory
(``shm``: a memfd region mapped by the prefill process, the decode process
does nothing); the notification travels on the peer's native channel, a tcp
connection served by the decode agent's native thread. Two hosts would use
tcp (or verbs with RDMA devices) with no change to this code.

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
REQUEST = b"req-17"


def decode_worker(ready: "mp.Queue") -> None:
    async def main() -> None:
        async with aiohixl.Agent("decode", listen="127.0.0.1:0") as agent:
            kv = agent.allocate(BLOCK * BLOCKS, name="kv", access=Access.REMOTE_WRITE)
            ready.put(agent.address)
            # The decode loop waits for this request's cache; its bytes are all in place now.
            note = await agent.notification(match=REQUEST, timeout=60)
            blocks = [bytes(kv.memory[i * BLOCK : i * BLOCK + 8]) for i in range(BLOCKS)]
            print(
                f"decode: {note.data.decode()} from {note.peer}: blocks 0 and {BLOCKS - 1} "
                f"start with {blocks[0]!r} {blocks[-1]!r}"
            )

    asyncio.run(main())


async def prefill(address: str) -> None:
    async with aiohixl.Agent("prefill") as agent:
        peer = await agent.connect(address)  # token from AIOHIXL_TOKEN
        kv = await peer.region("kv")
        cache = agent.allocate(BLOCK * BLOCKS)
        for i in range(BLOCKS):  # "compute" the KV cache
            cache.memory[i * BLOCK : (i + 1) * BLOCK] = f"blk{i:04d}".encode().ljust(BLOCK, b".")
        # Every block in one submission; the message is delivered after the last byte lands.
        await peer.put_many(
            [(kv[i * BLOCK : (i + 1) * BLOCK], cache[i * BLOCK : (i + 1) * BLOCK]) for i in range(BLOCKS)],
            notify=REQUEST,
        )
        print(f"prefill: pushed {BLOCKS} blocks of {BLOCK // 1024} KiB via {await peer.path(kv)}, notified {REQUEST!r}")


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    decode = ctx.Process(target=decode_worker, args=(ready,))
    decode.start()
    asyncio.run(prefill(ready.get(timeout=30)))
    decode.join(30)
    raise SystemExit(decode.exitcode)
