"""Why a saturated emulated link loses the peer: 1 MiB puts with many in flight, the link sampled.

    python -m tests.rdma_two.starve [--in-flight N] [--seconds S]   (in guest A of run-two.sh)

Puts 1 MiB from here to a target in guest B, ``--in-flight`` at a time, for ``--seconds``, and
samples once a second guest A's qdisc (backlog, drops) and the TCP sockets to guest B
(``ss -tin``: the control connection's retransmits, RTO and backoff). Diagnostics, not a test:
the samples go to diag.log beside the figures file (docs/rdma.md, "Two guests").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time

import aiohixl

from ..harness import BRIDGE, TOKEN, Target, pattern

MIB = 1 << 20


def sample(log, t0: float) -> None:
    dev = os.environ.get("SOFTROCE_NETDEV", "eth0")
    peer = BRIDGE.rpartition(":")[0]
    qdisc = subprocess.run(["tc", "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
    socks = subprocess.run(["ss", "-tinoe", "dst", peer], capture_output=True, text=True).stdout
    with open("/proc/stat") as f:
        cpu = f.readline().strip()  # user nice system idle iowait irq softirq steal (jiffies)
    with open("/proc/net/snmp") as f:
        tcp = [ln.strip() for ln in f if ln.startswith("Tcp:")][-1]
    print(f"--- t={time.monotonic() - t0:.1f} s\n{cpu}\n{tcp}\n{qdisc}{socks}", file=log, flush=True)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--in-flight", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--op", choices=("put", "get"), default="put")
    # the library's defaults (1 s / 5 s); the target's timeout is 3 of its intervals
    p.add_argument("--heartbeat", type=float, nargs=2, default=(1.0, 5.0), metavar=("INTERVAL", "TIMEOUT"))
    p.add_argument("--target-heartbeat", type=float, default=5.0 / 3)
    args = p.parse_args()
    log = open(os.path.join(os.environ["SOFTROCE_TWO_CTL"], "diag.log"), "a")  # noqa: SIM115 (the run's length)
    target = await Target.start(heartbeat=args.target_heartbeat)
    try:
        await target.alloc("kv", args.in_flight * MIB)
        async with aiohixl.Agent(
            "starve",
            token=TOKEN,
            transports=("verbs",),
            heartbeat_interval=args.heartbeat[0],
            heartbeat_timeout=args.heartbeat[1],
        ) as a:
            peer = await a.connect(target.address)
            kv = await peer.region("kv")
            src = a.register(pattern(MIB, 1))
            done = 0
            t0 = time.monotonic()

            async def pump(i: int) -> None:
                nonlocal done
                while time.monotonic() - t0 < args.seconds:
                    if args.op == "put":
                        await peer.put(kv[i * MIB : (i + 1) * MIB], src)
                    else:
                        await peer.get(src, kv[i * MIB : (i + 1) * MIB])
                    done += 1

            async def sampler() -> None:
                while True:
                    sample(log, t0)
                    await asyncio.sleep(1.0)  # a sampling period, not a synchronisation

            s = asyncio.create_task(sampler())
            results = await asyncio.gather(*(pump(i) for i in range(args.in_flight)), return_exceptions=True)
            s.cancel()
            sample(log, t0)
            errors = [repr(r) for r in results if isinstance(r, BaseException)]
            line = (
                f"starve: {args.op} {args.in_flight} x 1 MiB in flight, {done} ops in {time.monotonic() - t0:.1f} s, "
                f"peer broken: {peer.broken!r}, errors: {errors[:1]}"
            )
            print(line, file=log, flush=True)
            print(line, flush=True)
    finally:
        await target.aclose()


if __name__ == "__main__":
    asyncio.run(main())
