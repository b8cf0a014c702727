"""Median awaited put latency through the loopback peer, and an idle agent's CPU.

Run: .venv/bin/python examples/latency.py [size_bytes] [iterations]
"""

import asyncio
import statistics
import sys
import time

import aiohixl


async def main(size: int, iterations: int) -> None:
    async with aiohixl.Agent("latency") as agent:
        agent.allocate(size, name="dst")
        src = agent.allocate(size)
        peer = agent.loopback()
        dst = await peer.region("dst")
        for _ in range(1000):  # warm-up
            await peer.put(dst, src)
        samples = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            await peer.put(dst, src)
            samples.append(time.perf_counter() - t0)
        samples.sort()
        print(
            f"loopback put {size} B: median {statistics.median(samples) * 1e6:.2f} us, "
            f"p99 {samples[int(len(samples) * 0.99)] * 1e6:.2f} us over {iterations} ops"
        )

        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(2.0)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        print(f"idle agent: {cpu * 1e3:.1f} ms CPU in {wall:.2f} s ({100 * cpu / wall:.2f}% of one core)")


if __name__ == "__main__":
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 50_000
    asyncio.run(main(size, iterations))
