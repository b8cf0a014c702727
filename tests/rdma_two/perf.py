"""perftest between the two guests, and aiohixl's verbs put/get of the same sizes as a ratio.

    python -m tests.rdma_two.perf [--total MIB] [--sizes B,B] [--netem-sizes B,B] [--lat-iters N]

(in guest A of tests/softroce/run-two.sh)

perftest's servers run in guest B through tests/rdma_two/bridge.py, its clients here; then
an aiohixl target in guest B and puts/gets from here with as many in flight as perftest's
default TX depth (128). The same again with netem (2 ms delay, 1% loss) on guest A's
egress. Writes markdown tables to the figures file (docs/rdma.md, "Two guests"). Figures, not a test: emulated
rxe says nothing of a NIC's speed, the ratio says what the library adds on top of verbs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time

import anyio

import aiohixl

from ..harness import BRIDGE, TOKEN, Target, pattern
from .bridge import open_bridged

PEER = BRIDGE.rpartition(":")[0]
DEPTH = 128  # perftest's default TX depth for its bandwidth tests
PERFTEST = ["-d", "rxe0", "-x", "1", "-F"]  # GID 1: the RoCE v2 IPv4 one on rxe


def report(text: str) -> None:
    """Figures for docs/rdma.md, into a file `make test-rdma-two` prints at the end."""
    with open(os.path.join(os.environ["SOFTROCE_TWO_CTL"], "figures.md"), "a") as f:
        print(text, file=f)


async def perftest(tool: str, args: list[str]) -> list[str]:
    """Runs ``tool`` against its server in guest B; its result line, split."""
    server = await open_bridged([tool, *PERFTEST, *args], BRIDGE)
    for _ in range(100):  # the server listens once it has started: nothing else to wait on
        out = subprocess.run([tool, *PERFTEST, *args, PEER], capture_output=True, text=True)
        if out.returncode == 0:
            break
        await anyio.sleep(0.2)
    else:
        server.send_signal(signal.SIGKILL)
    await server.wait()  # the server ends after one client
    await server.aclose()
    if out.returncode:
        raise RuntimeError(f"{tool}: {out.stdout}{out.stderr}")
    size = args[args.index("-s") + 1]
    return next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == [size])


async def perftest_bw(tool: str, size: int, iters: int) -> float:
    """MB/s."""
    row = await perftest(tool, ["-s", str(size), "-n", str(iters), "--report_gbits"])
    return float(row[3]) * 1e9 / 8 / 1e6


async def perftest_lat(size: int, iters: int) -> float:
    """ib_write_lat's typical (median) latency, µs: half a ping-pong round trip."""
    return float((await perftest("ib_write_lat", ["-s", str(size), "-n", str(iters)]))[4])


async def ours_bw(peer: aiohixl.Peer, kv, src, size: int, iters: int, op: str) -> float:
    # perftest's depth, up to 8 MiB in flight: more only queues behind an emulated link
    window = asyncio.Semaphore(max(1, min(DEPTH, (8 << 20) // size)))
    span = kv.info.nbytes // size

    async def one(i: int) -> None:
        off = (i % span) * size
        if op == "put":
            await peer.put(kv[off : off + size], src[off : off + size])
        else:
            await peer.get(src[off : off + size], kv[off : off + size])
        window.release()

    t0 = time.perf_counter()
    tasks = []
    for i in range(iters):
        await window.acquire()
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return size * iters / (time.perf_counter() - t0) / 1e6


async def ours_lat(peer: aiohixl.Peer, kv, src, size: int, iters: int) -> float:
    """A put awaited: one WRITE and its ACK, a full round trip, µs (median)."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await peer.put(kv[:size], src[:size])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


async def table(sizes: tuple[int, ...], total: int, lat_iters: int) -> list[str]:
    rows = []
    target = await Target.start()
    try:
        await target.alloc("kv", 4 << 20)
        async with aiohixl.Agent("perf", token=TOKEN, transports=("verbs",)) as a:  # default heartbeats
            peer = await a.connect(target.address)
            kv = await peer.region("kv")
            src = a.register(pattern(4 << 20, 1))
            for size in sizes:
                iters = max(total // size, 8)
                for tool, op in (("ib_write_bw", "put"), ("ib_read_bw", "get")):
                    print(f"{tool} and {op}, {size} B x {iters}", file=sys.stderr, flush=True)
                    base = await perftest_bw(tool, size, iters)
                    ours = await ours_bw(peer, kv, src, size, iters, op)
                    rows.append(f"| {op} {size} B | {tool} {base:.1f} MB/s | {ours:.1f} MB/s | {ours / base:.2f} |")
                    print(rows[-1], flush=True)  # progress: a slow emulated link takes minutes
            base = await perftest_lat(64, lat_iters)
            ours = await ours_lat(peer, kv, src, 64, lat_iters)
            rows.append(
                f"| put 64 B latency | ib_write_lat {base:.0f} µs (x2 = {2 * base:.0f}) | {ours:.0f} µs "
                f"| {2 * base / ours:.2f} |"
            )
    finally:
        await target.aclose()
    return rows


def sizes(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--total", type=int, default=2, help="MiB moved per bandwidth figure")
    p.add_argument("--sizes", type=sizes, default=(4096, 65536, 1 << 20), help="clean link, bytes")
    p.add_argument("--netem-sizes", type=sizes, default=(65536, 1 << 20), help="lossy link, bytes")
    p.add_argument("--lat-iters", type=int, default=100)
    args = p.parse_args()
    total = args.total << 20
    head = ["| op, size | perftest | aiohixl | ratio |", "|---|---|---|---|"]
    # each table is written once complete: a run cut short by a time cap keeps what it measured
    clean = await table(args.sizes, total, args.lat_iters)
    report("\n".join(["", "perftest and aiohixl, clean link:", "", *head, *clean]))
    dev = os.environ.get("SOFTROCE_NETDEV", "eth0")
    subprocess.run(["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "2ms", "loss", "1%"], check=True)
    try:
        rows = await table(args.netem_sizes, total // 2, args.lat_iters)
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], check=True)
    report("\n".join(["", "netem delay 2ms loss 1% on guest A's egress:", "", *head, *rows]))


if __name__ == "__main__":
    asyncio.run(main())
