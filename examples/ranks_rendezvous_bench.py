"""How long N ranks take to rendezvous through each store, and what a first put to a new rank costs.

    python examples/ranks_rendezvous_bench.py [--ranks 64] [--procs 4] [--stores tcp,redis] [--transports tcp]

The ranks run in ``--procs`` processes (half prefill, half decode). Each process imports
and waits; then all are told to go at once, and the wall time is from "go" until the last
rank's ``aiohixl.init(..., world_size=N)`` returned. Then rank 0 times, to decode ranks in
other processes, the first ``get_remote_mem`` + 4 KiB put (connection set-up included) and a
4 KiB put on the established peer. The redis store needs redis-server on PATH (started here
on a free port) and the ``redis`` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

TOKEN = "bench-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def child(store: str, ranks: list[int], world: int, job: str, transports: str) -> None:
    import aiohixl

    print(json.dumps({"loaded": True}), flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # go

    async def join(rank: int) -> aiohixl.Context:
        group = "prefill" if rank < world // 2 else "decode"
        ctx = await aiohixl.init(
            rank,
            group,
            store,
            world_size=world,
            token=TOKEN,
            namespace=job,
            timeout=300,
            transports="auto" if transports == "auto" else tuple(transports.split(",")),
        )
        if group == "decode":
            ctx.allocate_registered(1 << 20, name="kv")
        return ctx

    ctxs = await asyncio.gather(*(join(r) for r in ranks))
    print(json.dumps({"done": time.monotonic()}), flush=True)
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        cmd = json.loads(line) if line.strip() else {"op": "exit"}
        out: dict = {}
        if cmd["op"] == "latency":
            ctx = ctxs[0]
            src = ctx.register(bytearray(4096))
            first = []
            for target in cmd["targets"]:
                t0 = time.perf_counter()
                remote = await ctx.get_remote_mem(target)
                await ctx.put(remote[0:4096], src)
                first.append(time.perf_counter() - t0)
            remote = await ctx.get_remote_mem(cmd["targets"][0])
            established = []
            for _ in range(200):
                t0 = time.perf_counter()
                await ctx.put(remote[0:4096], src)
                established.append(time.perf_counter() - t0)
            out = {"first": first, "established": established}
        elif cmd["op"] == "barrier":
            await asyncio.gather(*(c.barrier(timeout=120) for c in ctxs))
        print(json.dumps(out), flush=True)
        if cmd["op"] == "exit":
            break
    for c in reversed(ctxs):
        await c.aclose()


def run(store: str, n: int, procs: int, transports: str) -> dict:
    job = f"bench-{os.getpid()}-{time.monotonic_ns()}"
    per = n // procs
    layout = [list(range(i * per, (i + 1) * per if i < procs - 1 else n)) for i in range(procs)]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", store, ",".join(map(str, ranks)), str(n), job, transports],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for ranks in layout
    ]

    def ask(proc: subprocess.Popen, line: str | None = None) -> dict:
        assert proc.stdin is not None and proc.stdout is not None
        if line is not None:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    try:
        for proc in children:
            ask(proc)  # loaded
        t0 = time.monotonic()
        for proc in children:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        done = [ask(proc)["done"] for proc in children]
        wall = max(done) - t0
        targets = layout[-1][:8]  # decode ranks in another process than rank 0
        lat = ask(children[0], json.dumps({"op": "latency", "targets": targets}))
        for proc in children:  # rank 0 may serve the store: everybody stops using it first
            proc.stdin.write(json.dumps({"op": "barrier"}) + "\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        for proc in children:
            ask(proc)
        for proc in reversed(children):
            ask(proc, json.dumps({"op": "exit"}))
    finally:
        for proc in children:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {
        "wall_s": wall,
        "first_ms": statistics.median(lat["first"]) * 1e3,
        "first_max_ms": max(lat["first"]) * 1e3,
        "established_us": statistics.median(lat["established"]) * 1e6,
    }


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        store, ranks, world, job, transports = sys.argv[2:7]
        asyncio.run(child(store, [int(r) for r in ranks.split(",")], int(world), job, transports))
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--stores", default="tcp,redis")
    p.add_argument("--transports", default="auto", help="data paths for the puts, e.g. tcp (default: auto, shm here)")
    args = p.parse_args()
    redis_proc = None
    print(f"{args.ranks} ranks in {args.procs} processes ({os.cpu_count()} CPUs), transports {args.transports}")
    try:
        for kind in args.stores.split(","):
            if kind == "tcp":
                url = f"tcp://127.0.0.1:{free_port()}"
            else:
                exe = shutil.which("redis-server")
                if exe is None:
                    print("redis: skipped (no redis-server on PATH)")
                    continue
                port = free_port()
                redis_proc = subprocess.Popen(
                    [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                    stdout=subprocess.DEVNULL,
                )
                time.sleep(0.5)
                url = f"redis://127.0.0.1:{port}/0"
            r = run(url, args.ranks, args.procs, args.transports)
            print(
                f"{kind:5}  rendezvous {r['wall_s']:.2f} s   first get_remote_mem+put {r['first_ms']:.1f} ms"
                f" (max {r['first_max_ms']:.1f})   established put {r['established_us']:.0f} us  (4 KiB)"
            )
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
