"""How rendezvous grows with the number of ranks: join + barrier time, sockets and memory per rank.

    python examples/ranks_scale.py [--ranks 16,64,256] [--procs 4] [--store tcp|redis|etcd[=URL]]

N ranks run in ``--procs`` processes. Each process imports, starts and waits for "go"; then
every rank joins (``aiohixl.init(..., world_size=N)``), publishes one region, and all enter a
``barrier()``: "join+barrier" is from "go" until the last rank left that barrier. Then each
rank puts 4 KiB to 3 others (ranks in other processes, mostly), a second barrier, and each
checks that the 3 puts to it landed ("puts+barrier" is that phase, connections included;
"first put" the median over every rank's 3 of one ``get_remote_mem`` + 4 KiB put to a rank it
has not used yet: the store lookup, the connection and its handshake, the put).
Sockets per rank: the process's open sockets (store connection, listener, peers' control
and data connections, both directions) divided by its ranks; RSS per rank: the process's
resident memory after the run, less what it held before the first rank started, divided by
its ranks.

Stores: ``tcp`` (embedded in rank 0's process), ``redis`` (a redis-server started here on a
free port; needs the ``redis`` extra), ``etcd`` (an etcd server started here when ``etcd`` is
on PATH, or ``etcd=URL`` for one that runs; needs aiohixl's etcd store).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

TOKEN = "scale-token"
SLOT = 4096
FANOUT = 3
# A process's event loop serves all its ranks; on a small shared machine it can stall for longer
# than the default 5 s heartbeat timeout, which would count its peers as lost.
HEARTBEAT = 60.0
HEADER = "{:>6} {:>13} {:>8} {:>13} {:>10} {:>13} {:>11} {:>10}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def targets(rank: int, world: int) -> list[int]:
    """The ranks ``rank`` puts to: spread over the world, so most live in other processes."""
    step = max(1, world // (FANOUT + 1))
    out: list[int] = []
    for k in range(1, world):
        t = (rank + k * step + (k - 1)) % world
        if t != rank and t not in out:
            out.append(t)
        if len(out) == FANOUT:
            break
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def open_sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


async def child(store: str, ranks: list[int], world: int, job: str) -> None:
    import aiohixl

    base_rss, base_sockets = rss_bytes(), open_sockets()
    print(json.dumps({"loaded": True}), flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # go
    cpu0 = sum(os.times()[:2])

    async def join(rank: int) -> tuple[aiohixl.Context, Any]:
        ctx = await aiohixl.init(
            rank,
            "default",
            store,
            world_size=world,
            token=TOKEN,
            namespace=job,
            timeout=600,
            heartbeat_interval=HEARTBEAT / 5,
            heartbeat_timeout=HEARTBEAT,
        )
        region = ctx.allocate_registered(SLOT * FANOUT, name="kv")
        await ctx.barrier(timeout=600)
        return ctx, region

    joined = await asyncio.gather(*(join(r) for r in ranks))
    t_joined = time.monotonic()
    cpu_joined = sum(os.times()[:2]) - cpu0

    first: list[float] = []

    async def put_all(ctx: aiohixl.Context) -> None:
        src = ctx.register(bytearray(ctx.rank.to_bytes(4, "little") * (SLOT // 4)))
        for k, t in enumerate(targets(ctx.rank, world)):
            t0 = time.perf_counter()
            remote = await ctx.get_remote_mem(t, timeout=600)
            await ctx.put(remote[k * SLOT : (k + 1) * SLOT], src)  # slot k: one sender per slot
            first.append(time.perf_counter() - t0)
        await ctx.barrier(timeout=600)

    await asyncio.gather(*(put_all(ctx) for ctx, _ in joined))
    t_put = time.monotonic()
    bad = 0
    for ctx, region in joined:
        senders = [s for s in range(world) if ctx.rank in targets(s, world)]
        for s in senders:
            k = targets(s, world).index(ctx.rank)
            want = s.to_bytes(4, "little") * (SLOT // 4)
            bad += bytes(region.memory[k * SLOT : (k + 1) * SLOT]) != want
    report = {
        "joined": t_joined,
        "cpu_joined": cpu_joined,
        "put": t_put,
        "bad": bad,
        "ranks": len(ranks),
        "rss": rss_bytes() - base_rss,
        "sockets": open_sockets() - base_sockets,
        "peers": sum(len(ctx._peers) for ctx, _ in joined),
        "first": first,
    }
    print(json.dumps(report), flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # everybody is done: leave (rank 0's process last)
    for ctx, _ in reversed(joined):
        await ctx.aclose()
    print(json.dumps({"closed": True}), flush=True)


def run(store: str, n: int, procs: int) -> dict[str, float]:
    job = f"scale-{os.getpid()}-{time.monotonic_ns()}"
    procs = min(procs, n)
    layout = [list(range(i, n, procs)) for i in range(procs)]  # rank 0's process holds every procs-th rank
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", store, ",".join(map(str, ranks)), str(n), job],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for ranks in layout
    ]

    def say(proc: subprocess.Popen[str], line: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()

    def hear(proc: subprocess.Popen[str]) -> dict[str, Any]:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a child process ended (exit {proc.wait()}): see its stderr above")
        return dict(json.loads(line))

    try:
        for proc in children:
            hear(proc)  # loaded
        t0 = time.monotonic()
        for proc in children:
            say(proc, "go")
        reports = [hear(proc) for proc in children]
        for proc in reversed(children):  # rank 0's process (the tcp store's host) last
            say(proc, "exit")
            hear(proc)
    finally:
        for proc in children:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    joined = max(r["joined"] for r in reports) - t0
    return {
        "join_barrier_s": joined,
        "puts_barrier_s": max(r["put"] for r in reports) - t0 - joined,
        "join_barrier_cpu_s": sum(r["cpu_joined"] for r in reports),
        "bad": sum(r["bad"] for r in reports),
        "sockets_per_rank": sum(r["sockets"] for r in reports) / n,
        "peers_per_rank": sum(r["peers"] for r in reports) / n,
        "rss_mib_per_rank": sum(r["rss"] for r in reports) / n / (1 << 20),
        "first_put_ms": statistics.median(t for r in reports for t in r["first"]) * 1e3,
    }


class StoreServer:
    """The store a run goes through: its URL, and the server process started for it (if any)."""

    def __init__(self, kind: str) -> None:
        self.kind, _, self.url = kind.partition("=")
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> str | None:
        """The URL to give init() for the next run; None (after saying why) when this store cannot run here."""
        self.stop()
        if self.kind == "tcp":
            return f"tcp://127.0.0.1:{free_port()}"
        port = free_port()
        if self.kind == "redis":
            exe = shutil.which("redis-server")
            if exe is None:
                print("redis: skipped (no redis-server on PATH)")
                return None
            cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            cmd += ["--maxclients", "10000"]
            url = f"redis://127.0.0.1:{port}/0"
        elif self.kind == "etcd":
            if self.url:
                return self.url
            exe = shutil.which("etcd")
            if exe is None:
                print("etcd: skipped (no etcd on PATH; give --store etcd=etcd://HOST:PORT for a running one)")
                return None
            self.dir = tempfile.TemporaryDirectory(prefix="aiohixl-etcd-")
            peer = free_port()
            cmd = [exe, "--data-dir", self.dir.name, "--listen-client-urls", f"http://127.0.0.1:{port}"]
            cmd += ["--advertise-client-urls", f"http://127.0.0.1:{port}"]
            cmd += ["--listen-peer-urls", f"http://127.0.0.1:{peer}"]
            url = f"etcd://127.0.0.1:{port}"
        else:
            raise SystemExit(f"--store: tcp, redis or etcd[=URL], not {self.kind!r}")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:  # until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return url
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit(f"{self.kind}: the server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
        if self.dir is not None:
            self.dir.cleanup()
            self.dir = None


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        store, ranks, world, job = sys.argv[2:6]
        profile = os.environ.get("RANKS_SCALE_PROFILE")
        if profile:  # a cProfile dump per process, for finding where the time goes
            import cProfile

            with cProfile.Profile() as prof:
                asyncio.run(child(store, [int(r) for r in ranks.split(",")], int(world), job))
            prof.dump_stats(os.path.join(profile, f"{world}-{ranks.split(',')[0]}.prof"))
            return 0
        asyncio.run(child(store, [int(r) for r in ranks.split(",")], int(world), job))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="16,64,256", help="comma-separated world sizes")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--store", default="tcp", help="tcp, redis, or etcd[=URL]")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--profile", metavar="DIR", help="write a cProfile dump of each process here")
    args = p.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["RANKS_SCALE_PROFILE"] = os.path.abspath(args.profile)
    # every rank holds a few sockets and every process a few per rank: lift the fd limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server = StoreServer(args.store)
    print(f"store {server.kind}, {args.procs} processes, {os.cpu_count()} CPUs; each rank: 1 region, barrier,")
    print(f"{FANOUT} puts of {SLOT} B to other ranks, barrier")
    cols = ("ranks", "join+barrier", "(CPU)", "puts+barrier", "first put", "sockets/rank", "peers/rank", "RSS/rank")
    print(HEADER.format(*cols))
    rows = []
    try:
        for n in (int(x) for x in args.ranks.split(",")):
            url = server.start()
            if url is None:
                return 0
            r = run(url, n, args.procs)
            rows.append({"store": server.kind, "ranks": n, **r})
            ok = "" if r["bad"] == 0 else f"   {int(r['bad'])} PUTS WRONG"
            cells = [f"{r['join_barrier_s']:.2f} s", f"{r['join_barrier_cpu_s']:.2f} s", f"{r['puts_barrier_s']:.2f} s"]
            cells += [f"{r['first_put_ms']:.1f} ms"]
            cells += [f"{r['sockets_per_rank']:.1f}", f"{r['peers_per_rank']:.1f}", f"{r['rss_mib_per_rank']:.2f} MiB"]
            print(HEADER.format(n, *cells) + ok, flush=True)
    finally:
        server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["bad"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
