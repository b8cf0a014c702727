"""``python -m aiohixl bench``: latency, bandwidth and CPU, with baselines from the same run.

The initiator is this process; the target is a second process started with
``python -m aiohixl.bench --serve`` (its application does nothing while ops
land). Baselines are measured in the same run: a single-threaded memcpy of the
same sizes and a raw tcp stream over loopback between two processes; every
result is also printed as a ratio to its baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohixl

KiB, MiB = 1 << 10, 1 << 20
TOKEN = "aiohixl-bench"


@dataclass
class Plan:
    lat_sizes: tuple[int, ...] = (4 * KiB, 64 * KiB)
    bw_sizes: tuple[int, ...] = (64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB)
    inflight: int = 8
    lat_ops: int = 5000
    bw_seconds: float = 1.0
    small_ops: int = 20000
    idle_seconds: float = 5.0

    @classmethod
    def make(cls, quick: bool, full: bool) -> Plan:
        if quick:
            return cls(bw_sizes=(64 * KiB, 1 * MiB, 16 * MiB), lat_ops=1000, bw_seconds=0.25,
                       small_ops=4000, idle_seconds=1.0)
        if full:
            return cls(bw_sizes=cls.bw_sizes + (256 * MiB,))
        return cls()


@dataclass
class Results:
    machine: dict[str, Any] = field(default_factory=dict)
    baselines: dict[str, Any] = field(default_factory=dict)
    transports: dict[str, dict[str, Any]] = field(default_factory=dict)


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


class Progress:
    """One line on stderr, rewritten in place, when stderr is a terminal."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if self.tty:
            width = 30
            filled = width * self.done // max(self.total, 1)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label:<40}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + " " * 90 + "\r")


# ---------- baselines ----------


def memcpy_gbps(size: int, seconds: float) -> float:
    import numpy as np

    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    np.copyto(dst, src)  # fault the pages in first
    n, start = 0, time.perf_counter()
    while True:
        np.copyto(dst, src)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and n >= 3:
            return n * size / elapsed / 1e9


_SINK = r"""
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(1 << 20)
mode = c.recv(1)
if mode == b"S":
    while c.recv_into(buf):
        pass
    c.sendall(b"k")
else:
    while True:
        n = 0
        while n < 4096:
            r = c.recv_into(memoryview(buf)[n:4096])
            if not r:
                sys.exit(0)
            n += r
        c.sendall(b"k")
"""


def _sink(mode: bytes) -> tuple[subprocess.Popen, socket.socket]:
    proc = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(mode)
    return proc, sock


def raw_socket_gbps(seconds: float) -> float:
    """A raw tcp stream over loopback to another process, 1 MiB sends."""
    proc, sock = _sink(b"S")
    chunk = memoryview(bytearray(MiB))
    sent, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sock.sendall(chunk)
        sent += MiB
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # the sink has read everything
    elapsed = time.perf_counter() - start
    sock.close()
    proc.wait()
    return sent / elapsed / 1e9


def raw_socket_rtt_us(ops: int) -> float:
    """Median time to send 4 KiB to another process and read its 1-byte answer."""
    proc, sock = _sink(b"R")
    payload = bytes(4096)
    samples = []
    for i in range(ops + 200):
        t = time.perf_counter()
        sock.sendall(payload)
        sock.recv(1)
        if i >= 200:
            samples.append(time.perf_counter() - t)
    sock.close()
    proc.wait()
    return statistics.median(samples) * 1e6


# ---------- the target process ----------


async def serve(max_size: int) -> None:
    async with aiohixl.Agent("bench-target", listen="127.0.0.1:0", token=TOKEN) as agent:
        agent.allocate(max_size, name="dst")  # memfd: mapped by same-host peers
        import numpy as np

        user = np.zeros(max_size, dtype=np.uint8)
        agent.register(user, name="udst")  # user memory: cross-memory attach
        print(agent.address, flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or line.strip() == "exit":
                return
            print(time.process_time(), flush=True)  # "cpu"


class TargetProcess:
    def __init__(self, max_size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aiohixl.bench", "--serve", str(max_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            raise RuntimeError("the bench target did not start")

    def cpu(self) -> float:
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        try:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


# ---------- measurements through a peer ----------


async def latency(peer: Any, op: str, remote: Any, local: Any, size: int, ops: int) -> dict[str, float]:
    r, l = remote[:size], local[:size]
    fn, args = (peer.put, (r, l)) if op == "put" else (peer.get, (l, r))
    for _ in range(min(ops, 500)):
        await fn(*args)
    samples = []
    clock = time.perf_counter
    for _ in range(ops):
        t = clock()
        await fn(*args)
        samples.append(clock() - t)
    samples.sort()
    return {"median_us": statistics.median(samples) * 1e6, "p99_us": samples[int(len(samples) * 0.99)] * 1e6}


async def bandwidth(peer: Any, remote: Any, local: Any, size: int, inflight: int, seconds: float) -> float:
    span = len(local) // size
    slots = [(remote[i * size : (i + 1) * size], local[i * size : (i + 1) * size]) for i in range(min(span, inflight))]
    await asyncio.gather(*(peer.put(r, l) for r, l in slots))  # warm-up
    n, start = 0, time.perf_counter()
    while True:
        if len(slots) == 1:  # one awaited op at a time, as a caller writes it
            await peer.put(*slots[0])
        else:
            await asyncio.gather(*(peer.put(r, l) for r, l in slots))
        n += len(slots)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and n >= 3:
            return n * size / elapsed / 1e9


async def small_ops(peer: Any, remote: Any, local: Any, total: int) -> dict[str, float]:
    size, batch = 4 * KiB, 256
    pairs = [(remote[i * size : (i + 1) * size], local[i * size : (i + 1) * size]) for i in range(batch)]
    out = {}
    start = time.perf_counter()
    for _ in range(total // batch):
        await asyncio.gather(*(peer.put(r, l) for r, l in pairs))
    out["gather_ops_per_s"] = (total // batch) * batch / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(total // batch):
        await peer.put_many(pairs)
    out["put_many_ops_per_s"] = (total // batch) * batch / (time.perf_counter() - start)
    return out


async def run_transport(name: str, plan: Plan, results: Results, progress: Progress, target: TargetProcess | None):
    if name == "loopback":
        target = None  # the target process plays no part; its CPU says nothing
    out: dict[str, Any] = {"latency": {}, "bandwidth": {}}
    max_size = max(plan.bw_sizes) * max(1, plan.inflight if max(plan.bw_sizes) <= 16 * MiB else 1)
    max_size = max(max_size, 256 * 4 * KiB)
    async with aiohixl.Agent(f"bench-{name}", token=TOKEN) as agent:
        local = agent.allocate(max_size)
        if name == "loopback":
            agent.allocate(max_size, name="dst")
            peer = agent.loopback()
        else:
            only = {"tcp": ("tcp",), "verbs": ("verbs", "tcp")}.get(name)
            peer = await agent.connect(target.address, transports=only)
        remote = await peer.region("udst" if name == "shm-cma" else "dst")
        out["path"] = await peer.path(remote)
        if name.startswith("shm") and out["path"] != name.replace("shm", "shm-memfd", 1) and out["path"] != name:
            print(f"note: {name} runs over {out['path']} on this machine", file=sys.stderr)
        for size in plan.lat_sizes:
            for op in ("put", "get"):
                out["latency"][f"{op} {_fmt_size(size)}"] = await latency(peer, op, remote, local, size, plan.lat_ops)
                progress.step(f"{name} {op} latency {_fmt_size(size)}")
        for size in plan.bw_sizes:
            depth = plan.inflight if size * plan.inflight <= max_size else max(1, max_size // size)
            row = {"one_gbps": await bandwidth(peer, remote, local, size, 1, plan.bw_seconds)}
            cpu0 = target.cpu() if target else None
            t0 = time.perf_counter()
            row["inflight"] = depth
            row["inflight_gbps"] = await bandwidth(peer, remote, local, size, depth, plan.bw_seconds)
            if target:
                row["target_cpu_pct"] = 100 * (target.cpu() - cpu0) / (time.perf_counter() - t0)
            out["bandwidth"][_fmt_size(size)] = row
            progress.step(f"{name} bandwidth {_fmt_size(size)}")
        out["small_ops"] = await small_ops(peer, remote, local, plan.small_ops)
        progress.step(f"{name} small ops")
    results.transports[name] = out


async def idle_cpu(seconds: float, target: TargetProcess) -> dict[str, float]:
    async with aiohixl.Agent("bench-idle", token=TOKEN) as agent:
        await agent.connect(target.address)  # a connected agent: heartbeats included
        await asyncio.sleep(0.2)
        cpu0, tcpu0, t0 = time.process_time(), target.cpu(), time.perf_counter()
        await asyncio.sleep(seconds)
        elapsed = time.perf_counter() - t0
        return {"initiator_pct": 100 * (time.process_time() - cpu0) / elapsed,
                "target_pct": 100 * (target.cpu() - tcpu0) / elapsed, "seconds": seconds}


# ---------- report ----------


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def render(r: Results) -> str:
    b = r.baselines
    lines = [f"aiohixl {aiohixl.__version__} bench  ({r.machine.get('cpus')} CPUs, Python {r.machine.get('python')})", ""]
    lines.append("baselines (same run):")
    for size, gbps in b["memcpy_gbps"].items():
        lines.append(f"  memcpy {size:>7}: {gbps:6.2f} GB/s")
    lines.append(f"  raw tcp stream (loopback, 2 processes): {b['raw_socket_gbps']:.2f} GB/s")
    lines.append(f"  raw tcp 4 KiB send + 1-byte reply:      {b['raw_socket_rtt_us']:.1f} us")
    for name, t in r.transports.items():
        memcpy_based = name not in ("tcp", "verbs")
        base_bw = (lambda s: b["memcpy_gbps"][s]) if memcpy_based else (lambda s: b["raw_socket_gbps"])
        base_name = "memcpy" if memcpy_based else "raw tcp"
        lines += ["", f"{name} (path: {t['path']}):", "  latency            median      p99"]
        for key, v in t["latency"].items():
            extra = ""
            if name == "tcp" and key == "put 4 KiB":
                extra = f"   ({ratio(v['median_us'], b['raw_socket_rtt_us'])} raw tcp round trip)"
            lines.append(f"  {key:<14} {v['median_us']:8.1f} us {v['p99_us']:8.1f} us{extra}")
        lines.append(f"  bandwidth (put)    1 in flight          N in flight           vs {base_name}")
        for size, v in t["bandwidth"].items():
            cpu = f"  target CPU {v['target_cpu_pct']:.0f}%" if "target_cpu_pct" in v else ""
            lines.append(
                f"  {size:>7}        {v['one_gbps']:6.2f} GB/s   {v['inflight']:>2} x {v['inflight_gbps']:6.2f} GB/s"
                f"     {ratio(v['one_gbps'], base_bw(size))} / {ratio(v['inflight_gbps'], base_bw(size))}{cpu}"
            )
        s = t["small_ops"]
        lines.append(f"  4 KiB puts/s: gather {s['gather_ops_per_s']:,.0f}   put_many {s['put_many_ops_per_s']:,.0f}")
    if "idle" in r.machine:
        i = r.machine["idle"]
        lines += ["", f"idle connected agents over {i['seconds']:.0f} s: initiator {i['initiator_pct']:.2f}% "
                      f"of a core, target {i['target_pct']:.2f}%"]
    return "\n".join(lines)


def default_transports() -> list[str]:
    names = ["loopback", "shm", "shm-cma", "tcp"]
    from .info import transports

    if any(t.name == "verbs" and t.available for t in transports()):
        names.append("verbs")
    return names


async def bench(args: argparse.Namespace) -> Results:
    plan = Plan.make(args.quick, args.full)
    transports = args.transports.split(",") if args.transports else default_transports()
    results = Results(machine={"cpus": os.cpu_count(), "python": sys.version.split()[0],
                               "quick": args.quick, "full": args.full})
    steps = 2 + len(plan.bw_sizes) + len(transports) * (2 * len(plan.lat_sizes) + len(plan.bw_sizes) + 1) + 1
    progress = Progress(steps)
    results.baselines["memcpy_gbps"] = {}
    for size in plan.bw_sizes:
        results.baselines["memcpy_gbps"][_fmt_size(size)] = memcpy_gbps(size, plan.bw_seconds / 2)
        progress.step(f"memcpy {_fmt_size(size)}")
    results.baselines["raw_socket_gbps"] = raw_socket_gbps(plan.bw_seconds)
    progress.step("raw tcp stream")
    results.baselines["raw_socket_rtt_us"] = raw_socket_rtt_us(plan.lat_ops)
    progress.step("raw tcp round trip")
    max_size = max(plan.bw_sizes) * (plan.inflight if max(plan.bw_sizes) <= 16 * MiB else 1)
    target = TargetProcess(max(max_size, MiB)) if any(t != "loopback" for t in transports) else None
    try:
        for name in transports:
            await run_transport(name, plan, results, progress, target)
        if target:
            results.machine["idle"] = await idle_cpu(plan.idle_seconds, target)
            progress.step("idle CPU")
    finally:
        if target:
            target.close()
        progress.close()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="aiohixl bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run that finishes within a minute")
    p.add_argument("--full", action="store_true", help="also 256 MiB ops")
    p.add_argument("--transports", default=None,
                   help="comma-separated: loopback, shm (memfd region), shm-cma (user memory), tcp, verbs"
                        " (default: all available here)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--serve", type=int, metavar="BYTES", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    results = asyncio.run(bench(args))
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(results), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
