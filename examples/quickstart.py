"""aiohixl quickstart: register memory, publish it, put into it and get from it.

Run: make example   (or: .venv/bin/python examples/quickstart.py)
"""

import asyncio

import aiohixl
from aiohixl import Access


async def main() -> None:
    async with aiohixl.Agent("quickstart") as agent:
        # The "decode" side: memory that peers may write, published as "kv".
        kv = agent.allocate(1 << 20, name="kv", access=Access.REMOTE_WRITE | Access.REMOTE_READ)

        # The "prefill" side: a local buffer holding what to send.
        cache = agent.register(bytearray(b"KV-block" * (1 << 17)))

        peer = agent.loopback()  # a peer to ourselves; agent.connect() reaches other processes
        remote_kv = await peer.region("kv")

        # One-sided: the owner of "kv" calls nothing. Ops overlap with asyncio.gather.
        await asyncio.gather(
            peer.put(remote_kv[0:4096], cache[0:4096]),
            peer.put(remote_kv[4096 : 1 << 20], cache[4096 : 1 << 20]),
        )
        assert bytes(kv.memory) == bytes(cache.memory)

        # Read part of it back into a fresh buffer.
        back = agent.register(bytearray(16))
        await peer.get(back, remote_kv[8:24])
        print("got back:", bytes(back.memory))

        # Refusals are typed and name the call.
        try:
            await peer.put(remote_kv[0:16], cache[0:8])
        except aiohixl.LengthMismatch as exc:
            print("refused:", exc)


if __name__ == "__main__":
    asyncio.run(main())
