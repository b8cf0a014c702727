"""A 64 MiB aiohixl put against iperf3 over the same rate-limited link (root; apt iperf3 nftables).

    sudo .venv/bin/python examples/hosts/capped_link.py                 # 1gbit and 200mbit
    sudo .venv/bin/python examples/hosts/capped_link.py --rates 500mbit --repeat 5

Two hosts are network namespaces (netns.py) joined through a bridge whose ports are shaped
with tbf (netem is not needed). For each rate, in the same run: iperf3 from host 0 to host 1
(one tcp stream, what the link carries), then aiohixl puts of 64 MiB from an agent on host 0
into a region an agent on host 1 allocated, over tcp. It prints both rates and their ratio;
the goal is 0.9x or more (the best put; the mean is printed too). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import netns  # noqa: E402

TOKEN = "capped-link-token"
SIZE = 64 << 20


async def serve(listen: str) -> None:
    """Host 1: a region to put into; prints its address, ends when stdin closes."""
    import aiohixl

    async with aiohixl.Agent("sink", listen=listen, token=TOKEN) as agent:
        agent.allocate(SIZE, name="sink", access=aiohixl.Access.REMOTE_WRITE)
        print(json.dumps({"address": agent.address}), flush=True)
        await asyncio.to_thread(sys.stdin.read)


async def put(address: str, repeat: int) -> None:
    """Host 0: ``repeat`` puts of 64 MiB; prints each one's seconds."""
    import aiohixl

    async with aiohixl.Agent("source", token=TOKEN) as agent:
        src = agent.register(bytearray(b"\x5a" * SIZE))
        peer = await agent.connect(address)
        dst = await peer.region("sink")
        await peer.put(dst[: 1 << 20], src[: 1 << 20])  # the connection's first bytes: slow start, not measured
        seconds = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            await peer.put(dst, src)
            seconds.append(time.perf_counter() - t0)
        print(json.dumps({"seconds": seconds, "transport": peer.transport}), flush=True)


def iperf3(hosts: netns.Hosts, seconds: int) -> float:
    """What one tcp stream carries from host 0 to host 1, bits/s (iperf3's receiver figure)."""
    server = hosts[1].popen(["iperf3", "-s", "-1", "-B", hosts[1].address], stdout=subprocess.DEVNULL)
    try:
        for _ in range(50):  # until it listens
            got = hosts[0].run(["iperf3", "-c", hosts[1].address, "-t", str(seconds), "-J"], check=False)
            report = json.loads(got.stdout or "{}")
            if "sum_received" in report.get("end", {}):
                return float(report["end"]["sum_received"]["bits_per_second"])
            time.sleep(0.1)
        raise RuntimeError(f"iperf3 failed: {report.get('error')} {got.stderr[-500:]}")
    finally:
        server.kill()
        server.wait()


def aiohixl_rate(hosts: netns.Hosts, repeat: int) -> tuple[float, list[float], str]:
    """The best of ``repeat`` 64 MiB puts from host 0 to host 1 (bits/s), each one's seconds, the transport."""
    me = str(Path(__file__).resolve())
    sink = hosts[1].python(me, "--serve", f"{hosts[1].address}:0", stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert sink.stdout is not None
        address = json.loads(sink.stdout.readline())["address"]
        out = hosts[0].run([sys.executable, me, "--put", address, "--repeat", str(repeat)])
        result = json.loads(out.stdout.splitlines()[-1])
    finally:
        sink.communicate(timeout=30)
    seconds = result["seconds"]
    return SIZE * 8 / min(seconds), seconds, result["transport"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="1gbit,200mbit", help="tbf rates, tc's spelling")
    ap.add_argument("--repeat", type=int, default=3, help="64 MiB puts per rate (the best counts)")
    ap.add_argument("--iperf-seconds", type=int, default=3)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--put", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    if args.put:
        asyncio.run(put(args.put, args.repeat))
        return 0
    netns.sweep()
    print(f"{'link':>9} | {'iperf3':>11} | {'64 MiB put, best':>16} | ratio | {'mean':>11} | ratio | puts (s)")
    with netns.Hosts(2) as hosts:
        for rate in [r for r in args.rates.split(",") if r]:
            hosts.cap(None if rate == "none" else rate)
            link = iperf3(hosts, args.iperf_seconds)
            best, seconds, transport = aiohixl_rate(hosts, args.repeat)
            assert transport == "tcp", transport
            times = " ".join(f"{s:.3f}" for s in seconds)
            mean = SIZE * 8 * len(seconds) / sum(seconds)
            print(
                f"{rate:>9} | {link / 1e6:>6.0f} Mbit/s | {best / 1e6:>9.0f} Mbit/s | {best / link:>5.2f} | "
                f"{mean / 1e6:>4.0f} Mbit/s | {mean / link:>5.2f} | {times}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
