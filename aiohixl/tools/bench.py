"""``python -m aiohixl bench``: latency, bandwidth and CPU, with baselines from the same run.

The initiator is this process; the target is a second process started with
``python -m aiohixl.tools.bench --serve`` (its application does nothing while ops
land). Baselines are physical limits measured natively in the same run (see
``baselines``): memcpy on one thread and cut across the copy engine's threads,
process_vm_writev likewise, a tcp stream and a tcp round trip between two
processes (and iperf3 beside the stream when installed). Every bandwidth is
printed as a ratio to the limit of its kind; a ratio above 1.05 is flagged,
since a result cannot beat the physical limit: the baseline is then suspect.
tcp also gets 4 KiB latency lines in its opt-in latency mode (``Agent(busy_poll_us=50)`` on
both sides, with a target process of its own); idle CPU is measured with it off.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

import aiohixl

from .._loop.backends import DoneOp
from . import baselines
from ._child import LineChild
from .bench_report import INLINE_PATHS, REG_ROUNDS, ROUNDS, KiB, MiB, Results, annotate, fmt_size, plot, render

# What --transports takes, and the path each section must run over: another path's figures
# are never printed under its name (a section is skipped, saying why, instead).
PATH_OF = {"loopback": "loopback", "shm": "shm-memfd", "shm-cma": "shm-cma", "tcp": "tcp", "verbs": "verbs"}
TOKEN = "aiohixl-bench"


@dataclass
class Plan:
    lat_sizes: tuple[int, ...] = (4 * KiB, 64 * KiB)
    bw_sizes: tuple[int, ...] = (64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB)
    inflight: int = 8
    lat_ops: int = 5000
    bw_seconds: float = 1.0
    small_ops: int = 40000
    idle_seconds: float = 5.0
    copy_seconds: float = 0.1  # each native copy baseline
    stream_seconds: float = 1.0  # the native tcp stream (iperf3 runs whole seconds)
    rtt_seconds: float = 0.5  # each native round-trip baseline
    reg_sizes: tuple[int, ...] = (1 << 30, 4 << 30)  # allocate/register throughput, loop stall
    busy_poll_us: int = 50  # tcp's latency mode, on both sides, for its own latency lines

    @classmethod
    def make(cls, quick: bool, full: bool) -> Plan:
        if quick:
            return cls(
                bw_sizes=(64 * KiB, 1 * MiB, 16 * MiB),
                reg_sizes=(256 * MiB,),
                lat_ops=1000,
                bw_seconds=0.25,
                small_ops=4000,
                idle_seconds=1.0,
                copy_seconds=0.05,
                stream_seconds=0.5,
                rtt_seconds=0.2,
            )
        if full:
            return cls(bw_sizes=cls.bw_sizes + (256 * MiB,))
        return cls()


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


# ---------- the target process ----------


async def serve(max_size: int, busy_poll_us: int = 0, serve_poll_us: int = 20, notify_poll_us: int = 50) -> None:
    async with aiohixl.Agent(
        "bench-target",
        listen="127.0.0.1:0",
        token=TOKEN,
        busy_poll_us=busy_poll_us,
        serve_poll_us=serve_poll_us,
        notify_poll_us=notify_poll_us,
    ) as agent:
        user = np.zeros(max_size, dtype=np.uint8)
        regions = {
            "dst": agent.allocate(max_size, name="dst"),  # memfd: mapped by same-host peers
            # user memory: cross-memory attach
            "udst": agent.register(user, name="udst", access=aiohixl.Access.REMOTE_READ | aiohixl.Access.REMOTE_WRITE),
        }
        print(agent.address, flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or line.strip() == "exit":
                return
            cmd = line.split()
            if cmd[0] == "hash":  # hash <region> <nbytes>: what landed, for verification
                region = regions[cmd[1]]
                print(hashlib.sha256(region.memory[: int(cmd[2])]).hexdigest(), flush=True)
            elif cmd[0] == "notes":  # notes <n>: "ready", a line as each arrives, then their delays
                print("ready", flush=True)
                print(json.dumps(await _note_delays(agent, int(cmd[1]))), flush=True)
            else:
                print(time.process_time(), flush=True)  # "cpu"


async def _note_delays(agent: Any, n: int) -> list[float]:
    """For n notifications: seconds from the sender's issuing its put (the monotonic clock,
    which every process of a host shares, in the message) to notification() returning here."""
    delays = []
    for _ in range(n):
        note = await agent.notification(timeout=60)
        delays.append(time.monotonic() - float(note.data))
        print("got", flush=True)  # the sender sends the next now: one at a time, as the wake-up baseline
    return delays


def _summary(delays: list[float]) -> dict[str, float]:
    delays = sorted(delays)
    return {"median_us": statistics.median(delays) * 1e6, "p99_us": delays[int(len(delays) * 0.99)] * 1e6}


def _populate_gibps(nbytes: int, memfd: bool) -> float:
    """The kernel's bulk populate of fresh memory (one madvise on one thread): the limit for registration."""
    import ctypes
    import mmap

    fd = os.memfd_create("bench-populate", os.MFD_CLOEXEC) if memfd else -1
    try:
        if memfd:
            os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED if memfd else mmap.MAP_PRIVATE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        libc = ctypes.CDLL(None, use_errno=True)
        start = time.perf_counter()
        rc = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), 23)  # MADV_POPULATE_WRITE
        seconds = time.perf_counter() - start
        del addr
        mm.close()
        return float("nan") if rc else nbytes / seconds / (1 << 30)
    finally:
        if fd >= 0:
            os.close(fd)


def _loop_thread_sched() -> tuple[float, float]:
    """Seconds the calling thread has run on a CPU, and has waited, runnable, for one
    (Linux schedstat; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) * 1e-9, int(waited) * 1e-9
    except (OSError, ValueError):
        return 0.0, 0.0


def _loop_thread_cpu() -> float:
    """Seconds the calling thread has run on a CPU (0 where Linux's schedstat is missing)."""
    return _loop_thread_sched()[0]


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _steal() -> float:
    """Seconds the host has run something else while the guest's CPUs wanted to run, summed
    over them (``steal`` in /proc/stat, in ticks of 10 ms; 0 where there is none)."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


async def _loop_lag(stop: asyncio.Event) -> tuple[float, float, float, int, float]:
    """The event loop's longest stall, in seconds, until ``stop`` is set (1 ms sleeps that
    overrun); the CPU time the loop's thread ran in that sleep (its own work), the time it
    waited, runnable, for a CPU, the page faults it took that read from disk, and the host's
    steal time on the guest's CPUs meanwhile (the host ran something else on them). The rest
    of the stall it was blocked (a lock, such a fault)."""
    import resource

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_majflt

    worst = worst_cpu = worst_wait = worst_steal = 0.0
    worst_faults = 0
    while not stop.is_set():
        t, (cpu, wait), majflt, steal = time.perf_counter(), _loop_thread_sched(), faults(), _steal()
        await asyncio.sleep(0.001)
        lag = time.perf_counter() - t - 0.001
        if lag > worst:
            cpu_after, wait_after = _loop_thread_sched()
            worst, worst_cpu, worst_wait = lag, cpu_after - cpu, wait_after - wait
            worst_faults, worst_steal = faults() - majflt, _steal() - steal
    return worst, worst_cpu, worst_wait, worst_faults, worst_steal


async def _first_allocate_stall(size: int) -> tuple[float, ...]:
    """The issue's probes, with 1 ms ``asyncio.sleep``s beside each call, in a fresh process:
    its first ``allocate_async(size)`` (the longest overrun and the most CPU time the loop
    thread spent in one of those sleeps), then ``await region.close()`` of that region and
    ``agent.aclose()`` of an agent holding another one (their longest overruns), in seconds.
    The CPU figure is the loop's own work; an overrun with little of it was the loop waiting
    for a CPU (a busy host), not working."""
    worst: dict[str, float] = {}
    phase = "allocate"

    async def probe() -> None:
        while phase != "done":
            t, cpu, now = time.perf_counter(), _loop_thread_cpu(), phase
            await asyncio.sleep(0.001)
            worst[now] = max(worst.get(now, 0.0), time.perf_counter() - t - 0.001)
            worst[now + " cpu"] = max(worst.get(now + " cpu", 0.0), _loop_thread_cpu() - cpu)

    task = asyncio.create_task(probe())
    async with aiohixl.Agent("bench-stall") as agent:
        await asyncio.sleep(0.01)  # the probe runs before the call starts
        region = await agent.allocate_async(size)
        # Each switch of phase is followed by a sleep: the probe's sleep that spans it
        # belongs to the phase it started in.
        phase = "idle"
        await asyncio.sleep(0.01)
        phase = "close"
        await region.close()
        phase = "idle"
        region = await agent.allocate_async(size)
        await asyncio.sleep(0.01)
        phase = "aclose"
    phase = "idle"
    await asyncio.sleep(0.01)
    phase = "done"
    await task
    del region
    phases = ("allocate", "allocate cpu", "close", "close cpu", "aclose", "aclose cpu")
    return tuple(worst.get(p, 0.0) for p in phases)


def _first_allocate_stall_in_child(size: int) -> tuple[float, ...]:
    """_first_allocate_stall in a process of its own: nothing started or warmed before it."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "aiohixl.tools.bench", "--stall-probe", str(size)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return tuple(float(x) for x in out[-6:])


def _keep_max(row: dict[str, float], key: str, value: float) -> None:
    row[key] = max(row.get(key, value), value)


async def registration(sizes: tuple[int, ...], progress: Progress) -> dict[str, dict[str, Any]]:
    """allocate/register throughput next to the bulk populate of the same size, and the
    event loop's longest stall while allocate_async faults a pool in.

    Each figure is the best of REG_ROUNDS (the stall: the worst), the rounds alternating:
    how fast fresh memory faults in swings from moment to moment in a VM whose freed pages
    go back to the host (free page reporting), for the populate as much as for us."""
    out: dict[str, dict[str, Any]] = {}
    async with aiohixl.Agent("bench-registration") as agent:
        for size in sizes:
            row: dict[str, float] = {}
            # The highest of each: best throughput, worst stall.
            keep = partial(_keep_max, row)
            for _ in range(REG_ROUNDS):
                # Each region is dropped (unmapped) before the next timing starts: rebinding
                # one name would unmap the last GiBs inside the next measurement.
                keep("populate_memfd_gibps", _populate_gibps(size, True))
                start = time.perf_counter()
                region = agent.allocate(size)
                keep("allocate_gibps", size / (time.perf_counter() - start) / (1 << 30))
                await region.close()
                del region
                keep("populate_anon_gibps", _populate_gibps(size, False))
                buf = np.empty(size, dtype=np.uint8)  # malloc'd, not yet touched
                start = time.perf_counter()
                region = agent.register(buf)
                keep("register_gibps", size / (time.perf_counter() - start) / (1 << 30))
                await region.close()
                del region, buf
                stop = asyncio.Event()
                task = asyncio.create_task(_loop_lag(stop))
                start = time.perf_counter()
                region = await agent.allocate_async(size)
                keep("allocate_async_gibps", size / (time.perf_counter() - start) / (1 << 30))
                stop.set()
                lag, lag_cpu, lag_wait, lag_faults, lag_steal = await task
                if lag * 1e3 > row.get("allocate_async_max_stall_ms", -1.0):
                    row["allocate_async_max_stall_cpu_ms"] = lag_cpu * 1e3
                    row["allocate_async_max_stall_runq_ms"] = lag_wait * 1e3
                    row["allocate_async_max_stall_disk_faults"] = lag_faults
                    row["allocate_async_max_stall_steal_ms"] = lag_steal * 1e3
                keep("allocate_async_max_stall_ms", lag * 1e3)
                await region.close()
                del region
            # Once: a process of its own costs seconds.
            probes = _first_allocate_stall_in_child(size)
            for key, value in zip(
                (
                    "first_allocate_stall",
                    "first_allocate_stall_cpu",
                    "close_stall",
                    "close_stall_cpu",
                    "aclose_stall",
                    "aclose_stall_cpu",
                ),
                probes,
                strict=True,
            ):
                row[key + "_ms"] = value * 1e3
            out[f"{size >> 20} MiB" if size < (1 << 30) else f"{size >> 30} GiB"] = row
            progress.step(f"registration {size >> 20} MiB")
    return out


async def notify_latency(
    agent: Any, peer: Any, target: Any, remote: Any, local: Any, size: int, ops: int
) -> dict[str, float]:
    """Median time from put(notify=) being issued to agent.notification() returning at the target."""
    return _summary(await _notify_delays(agent, peer, target, remote, local, size, ops))


async def _notify_delays(
    agent: Any, peer: Any, target: Any, remote: Any, local: Any, size: int, ops: int
) -> list[float]:
    """Seconds from each put(notify=) being issued to agent.notification() returning at the target."""
    r, loc = remote[:size], local[:size]
    if target is None:  # loopback: the target is this agent
        delays = []
        for _ in range(ops):
            t = time.monotonic()
            await peer.put(r, loc, notify=repr(t).encode())
            await agent.notification(timeout=60)
            delays.append(time.monotonic() - t)
        return delays
    target.tell(f"notes {ops}")
    if target.answer() != "ready":
        raise RuntimeError("the bench target did not take the notes command")
    for _ in range(ops):
        await peer.put(r, loc, notify=repr(time.monotonic()).encode())
        # A ping-pong, as the native wake-up baseline: the next goes once the target took this
        # one (a put that returns before its message is read would otherwise outrun the reader).
        if target.answer() != "got":
            raise RuntimeError("the bench target did not take a notification")
    return list(json.loads(target.answer()))


class TargetProcess(LineChild):
    def __init__(self, max_size: int, busy_poll_us: int = 0, serve_poll_us: int = 20, notify_poll_us: int = 50) -> None:
        super().__init__(
            "aiohixl.tools.bench",
            "--serve",
            str(max_size),
            "--serve-busy-poll",
            str(busy_poll_us),
            "--serve-poll",
            str(serve_poll_us),
            "--serve-notify-poll",
            str(notify_poll_us),
        )
        self.address = self.first

    def cpu(self) -> float:
        return float(self.ask("cpu"))


# ---------- measurements through a peer ----------


async def _timed(op: Any, args: tuple[Any, ...], ops: int, warm: int) -> list[float]:
    """Seconds each of ``ops`` awaited ``op(*args)`` took, after ``warm`` untimed ones."""
    for _ in range(warm):
        await op(*args)
    samples = []
    clock = time.perf_counter
    for _ in range(ops):
        t = clock()
        await op(*args)
        samples.append(clock() - t)
    return samples


async def latency(peer: Any, op: str, remote: Any, local: Any, size: int, ops: int) -> dict[str, float]:
    r, l = remote[:size], local[:size]
    fn, args = (peer.put, (r, l)) if op == "put" else (peer.get, (l, r))
    samples = await _timed(fn, args, ops, min(ops, 500))
    samples.sort()
    return {"median_us": statistics.median(samples) * 1e6, "p99_us": samples[int(len(samples) * 0.99)] * 1e6}


async def rtt_beside(peer: Any, remote: Any, local: Any, size: int, ops: int, seconds: float) -> dict[str, Any]:
    """The put of ``size`` and the blocking C round trip (a request of the same size and a
    1-byte reply) timed in alternating rounds, each keeping its best median: their ratio is
    not the machine's drift between the baselines, timed first, and this path."""
    best_put = best_rtt = math.inf
    for _ in range(ROUNDS):
        try:
            best_rtt = min(best_rtt, baselines.tcp_rtt_us(seconds, False, size)["median"])
        except OSError as exc:  # said, as a baseline that failed is: the rest of the run goes on
            return {"error": str(exc)}
        best_put = min(best_put, (await latency(peer, "put", remote, local, size, ops))["median_us"])
    return {"put_us": best_put, "rtt_us": best_rtt, "ratio": best_put / best_rtt, "rounds": ROUNDS}


@contextmanager
def _pinned(target: TargetProcess, apart: bool) -> Iterator[None]:
    """This thread (the bench's event loop) on the first CPU it may run on, and the target's
    loop thread (its main thread) on the second (``apart``) or the same one: placed as the
    wake-up baselines pinned are. Both given back their CPUs after."""
    mine, theirs = os.sched_getaffinity(0), os.sched_getaffinity(target.proc.pid)
    first, *rest = sorted(mine)
    os.sched_setaffinity(0, {first})
    os.sched_setaffinity(target.proc.pid, {rest[0] if apart else first})
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
        os.sched_setaffinity(target.proc.pid, theirs)


async def notify_beside(
    agent: Any, peer: Any, target: Any, remote: Any, local: Any, size: int, ops: int, seconds: float
) -> dict[str, Any]:
    """``put(notify=)`` -> ``notification()``, the put alone, and the native and asyncio
    one-way wake-ups (``wake_floor``) timed in alternating rounds, each keeping its best median:
    the ratios of the notify rows, free of the machine's drift between the baselines and this
    path. To a target process, also with the two loops pinned to two CPUs and to one, beside
    the native wake-up placed the same way: like against like, whichever way the scheduler
    runs the unpinned rounds."""
    note = put = floor = wake = apart = one = math.inf
    pinned = {"two_cpus": math.inf, "one_cpu": math.inf} if target is not None else {}
    if len(os.sched_getaffinity(0)) < 2:
        pinned.pop("two_cpus", None)
    for _ in range(ROUNDS):
        try:
            floor = min(floor, baselines.asyncio_wake_rtt_us(seconds)["median"] / 2)
            wake = min(wake, baselines.wake_rtt_us(seconds)["median"] / 2)
            one = min(one, baselines.wake_rtt_us(seconds, cpus=1)["median"] / 2)
        except OSError as exc:  # said, as a baseline that failed is: the rest of the run goes on
            return {"error": str(exc)}
        try:
            apart = min(apart, baselines.wake_rtt_us(seconds, cpus=2)["median"] / 2)
        except OSError:  # one CPU: the line says so
            pass
        put = min(put, (await latency(peer, "put", remote, local, size, ops))["median_us"])
        note = min(note, (await notify_latency(agent, peer, target, remote, local, size, ops))["median_us"])
        for arm in pinned:
            with _pinned(target, arm == "two_cpus"):
                timed = await notify_latency(agent, peer, target, remote, local, size, ops)
            pinned[arm] = min(pinned[arm], timed["median_us"])
    out = {
        "median_us": note,
        "put_median_us": put,
        "asyncio_wake_us": floor,
        "beyond_over_asyncio_wake": (note - put) / floor,
        "native_wake_us": wake,
        "beyond_over_native_wake": (note - put) / wake,
        "native_wake_one_cpu_us": one,
        "over_put": note / put,
        "rounds": ROUNDS,
    }
    if apart < math.inf:
        out.update(native_wake_apart_us=apart, beyond_over_native_wake_apart=(note - put) / apart)
    if "two_cpus" in pinned and apart < math.inf:
        us = pinned["two_cpus"]
        out.update(pinned_two_cpus_us=us, pinned_two_cpus_beyond_over_native_wake=(us - put) / apart)
    if "one_cpu" in pinned:
        us = pinned["one_cpu"]
        out.update(pinned_one_cpu_us=us, pinned_one_cpu_beyond_over_native_wake=(us - put) / one)
    return out


async def user_path_latency(peer: Any, remote: Any, local: Any, size: int, ops: int) -> dict[str, float]:
    """A put as a user writes it, ``peer.put(kv[a:b], cache[c:d])``: both slices made per op,
    over 8 ranges in turn. Timed in rounds alternating with the presliced put of the same
    ranges, so that the ratio of the two is not the machine's drift between them."""
    presliced = [(remote[a : a + size], local[a : a + size]) for a in range(0, 8 * size, size)]
    for _ in range(min(ops, 500)):
        await peer.put(remote[size : 2 * size], local[:size])
    user: list[float] = []
    pre: list[float] = []
    clock = time.perf_counter
    for round_ in range(ROUNDS * 2):
        for i in range(ops // (ROUNDS * 2)):
            if round_ & 1:
                r, l = presliced[i & 7]
                t = clock()
                await peer.put(r, l)
                pre.append(clock() - t)
            else:
                a = (i & 7) * size
                b = a + size
                t = clock()
                await peer.put(remote[a:b], local[a:b])
                user.append(clock() - t)
    user.sort()
    return {
        "median_us": statistics.median(user) * 1e6,
        "p99_us": user[int(len(user) * 0.99)] * 1e6,
        "presliced_median_us": statistics.median(pre) * 1e6,
    }


async def bandwidth(
    peer: Any,
    remote: Any,
    local: Any,
    size: int,
    inflight: int,
    seconds: float,
    slots: int | None = None,
    in_turn: bool = False,
    then_gather_done: bool = False,
) -> float:
    """Puts of ``size``: ``inflight`` at a time (1: each awaited before the next, as a caller
    writes it; more: ``asyncio.gather``, or with ``in_turn`` all posted, then each awaited in
    turn), over ``slots`` distinct ranges (default ``inflight``) taken in turn. One at a time
    over the same ranges as N in flight touches the same memory, so the two compare
    concurrency, not a cache-hot range against N cache-cold ones.

    ``then_gather_done`` (one at a time): after each pass over the ranges, ``asyncio.gather``
    over as many ops that had already ended: one at a time plus gather's own cost where it
    runs, after the same copies (the floor N in flight through gather cannot beat)."""
    span = len(local) // size
    count = min(span, slots or inflight)
    ranges = [(remote[i * size : (i + 1) * size], local[i * size : (i + 1) * size]) for i in range(count)]
    await asyncio.gather(*(peer.put(r, l) for r, l in ranges))  # warm-up
    n, start = 0, time.perf_counter()
    while True:
        if inflight == 1:
            for r, l in ranges:
                await peer.put(r, l)
            if then_gather_done:
                done: list[Any] = [DoneOp() for _ in ranges]
                await asyncio.gather(*done)
        elif in_turn:
            for op in [peer.put(r, l) for r, l in ranges]:
                await op
        else:
            await asyncio.gather(*(peer.put(r, l) for r, l in ranges))
        n += len(ranges)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and n >= 3:
            return n * size / elapsed / 1e9


async def gather_floor(n: int) -> float:
    """Microseconds ``asyncio.gather`` itself takes over ``n`` ops that ended as they were
    posted (the awaitable the library returns for each, with nothing left to do): a Task
    per op, its step, its done callback, and resuming the gathering task. One awaited put
    at a time pays none of it (awaiting an op that ended does not yield), so at sizes whose
    copies take little longer than this, N in flight through gather cannot reach one at a
    time; ``put_many`` pays it once per batch."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            ops: list[Any] = [DoneOp() for _ in range(n)]
            await asyncio.gather(*ops)
        best = min(best, (time.perf_counter() - start) / 2000)
    return best * 1e6


async def small_ops(peer: Any, remote: Any, local: Any, total: int) -> dict[str, float]:
    """4 KiB puts per second, ``gather`` of 256 against ``put_many`` of 256: the best of
    ROUNDS alternating rounds of each, like the bandwidth rows."""
    size, batch = 4 * KiB, 256
    pairs = [(remote[i * size : (i + 1) * size], local[i * size : (i + 1) * size]) for i in range(batch)]
    batches = max(1, total // batch // ROUNDS)
    out = {"gather_ops_per_s": 0.0, "put_many_ops_per_s": 0.0}
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(batches):
            await asyncio.gather(*(peer.put(r, l) for r, l in pairs))
        out["gather_ops_per_s"] = max(out["gather_ops_per_s"], batches * batch / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(batches):
            await peer.put_many(pairs)
        out["put_many_ops_per_s"] = max(out["put_many_ops_per_s"], batches * batch / (time.perf_counter() - start))
    return out


class _Path(NamedTuple):
    """What one path's measurements go through."""

    name: str
    agent: Any
    peer: Any
    remote: Any
    local: Any
    target: TargetProcess | None
    only: tuple[str, ...] | None  # connect(transports=): the path's own, for the targets made beside


async def run_transport(name: str, plan: Plan, results: Results, progress: Progress, target: TargetProcess | None):
    """Measure ``name`` into results.transports, or say in results.skipped why not."""
    if name == "loopback":
        target = None  # the target process plays no part; its CPU says nothing
    out: dict[str, Any] = {"latency": {}, "bandwidth": {}}
    max_size = max(plan.bw_sizes) * max(1, plan.inflight if max(plan.bw_sizes) <= 16 * MiB else 1)
    max_size = max(max_size, 256 * 4 * KiB)
    async with AsyncExitStack() as stack:
        agent = await stack.enter_async_context(aiohixl.Agent(f"bench-{name}", token=TOKEN))
        # shm-cma: user memory at both ends, numpy's as the peers' bench buffers are (malloc'd,
        # 16 bytes into a page): the same geometry for every contender on that path.
        local = agent.register(np.zeros(max_size, dtype=np.uint8)) if name == "shm-cma" else agent.allocate(max_size)
        np.frombuffer(local.memory, dtype=np.uint8)[:] = np.random.default_rng(5).integers(
            0, 256, max_size, dtype=np.uint8
        )
        dst = None
        only = {"tcp": ("tcp",), "verbs": ("verbs", "tcp")}.get(name)
        if name == "loopback":
            dst = agent.allocate(max_size, name="dst")
            peer = agent.loopback()
        else:
            assert target is not None
            peer = await agent.connect(target.address, transports=only)
        remote = await peer.region("udst" if name == "shm-cma" else "dst")
        out["path"] = await peer.path(remote)
        if out["path"] != PATH_OF[name]:
            results.skipped[name] = f"ops would run over {out['path']} here, not {PATH_OF[name]}"
            if name == "shm-cma":
                results.skipped[name] += " (cross-memory attach refused: see `aiohixl info`)"
            return
        path = _Path(name, agent, peer, remote, local, target, only)
        await _latencies(path, plan, progress, out)
        out["notify"] = await _notifications(path, plan, progress, out["latency"])
        spliced = await stack.enter_async_context(_splicing(target, max_size)) if name == "tcp" else None
        for size in plan.bw_sizes:
            out["bandwidth"][fmt_size(size)] = await _bandwidth_row(path, plan, size, max_size, spliced)
            progress.step(f"{name} bandwidth {fmt_size(size)}")
        out["gather_floor_us"], out["gather_floor_n"] = await gather_floor(plan.inflight), plan.inflight
        out["small_ops"] = await small_ops(peer, remote, local, plan.small_ops)
        progress.step(f"{name} small ops")
        # The same check the peers get: the target's bytes equal the source's.
        await peer.put(remote[:max_size], local)
        want = hashlib.sha256(local.memory).hexdigest()
        if dst is not None:
            got = hashlib.sha256(dst.memory[:max_size]).hexdigest()
        else:
            assert target is not None
            got = target.ask(f"hash {'udst' if name == 'shm-cma' else 'dst'} {max_size}")
        out["verified"] = got == want
    results.transports[name] = out


async def _latencies(path: _Path, plan: Plan, progress: Progress, out: dict[str, Any]) -> None:
    """One op at a time: put and get, tcp's latency mode, the put as users slice it, and tcp's
    put beside the C round trip and to a target whose poll is off."""
    name, agent, peer, remote, local = path.name, path.agent, path.peer, path.remote, path.local
    for size in plan.lat_sizes:
        for op in ("put", "get"):
            out["latency"][f"{op} {fmt_size(size)}"] = await latency(peer, op, remote, local, size, plan.lat_ops)
            progress.step(f"{name} {op} latency {fmt_size(size)}")
    size = plan.lat_sizes[0]
    if name == "tcp":
        out["latency"].update(await busy_poll_latency(plan, size))
        progress.step(f"{name} latency, busy_poll_us={plan.busy_poll_us}")
    out["latency"][f"put {fmt_size(size)} (slices per op)"] = await user_path_latency(
        peer, remote, local, size, plan.lat_ops
    )
    if name == "tcp":
        out["rtt_beside"] = await rtt_beside(
            peer, remote, local, baselines.RTT_REQUEST, plan.lat_ops // ROUNDS, plan.rtt_seconds / 2
        )
        progress.step(f"{name} put latency beside the C round trip")
        out["serve_poll_beside"] = await serve_poll_beside(agent, peer, remote, local, plan.lat_ops // ROUNDS)
        progress.step(f"{name} put latency with the target's poll off, beside")


async def _notifications(
    path: _Path, plan: Plan, progress: Progress, latencies: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """put(notify=) -> notification() at 4 KiB and 1 MiB; at 4 KiB also timed beside its limits,
    and against targets made otherwise (its loop blocking after each; tcp: its I/O thread awake)."""
    name, agent, peer, remote, local, target, only = path
    rows: dict[str, dict[str, Any]] = {}
    for size in (4 * KiB, 1 * MiB):
        ops = plan.lat_ops // 5 if size > 64 * KiB else plan.lat_ops
        note = await notify_latency(agent, peer, target, remote, local, size, ops)
        put = latencies.get(f"put {fmt_size(size)}") or await latency(peer, "put", remote, local, size, ops)
        rows[fmt_size(size)] = timed = {**note, "put_median_us": put["median_us"]}
        if size == 4 * KiB:
            timed["beside"] = await notify_beside(
                agent, peer, target, remote, local, size, ops // ROUNDS, plan.rtt_seconds / 2
            )
            if target is not None:
                timed["poll_off_beside"] = await notify_poll_beside(
                    agent, peer, target, remote, local, size, ops // ROUNDS, only
                )
            if name == "tcp":
                timed["awake_target_beside"] = await notify_awake_beside(
                    agent, peer, target, remote, local, size, ops // ROUNDS, only
                )
        progress.step(f"{name} notification latency {fmt_size(size)}")
    return rows


# The copies a same-host put from 4 MiB is compared with in its own rounds: (kind, between memfds).
BESIDE_COPIES = {
    "memcpy_threaded_gbps": ("memcpy", False),
    "stream_threaded_gbps": ("stream", False),
    "stream_memfd_threaded_gbps": ("stream", True),
}


async def _bandwidth_row(
    path: _Path, plan: Plan, size: int, max_size: int, spliced: tuple[Any, Any, Any] | None
) -> dict[str, Any]:
    """One size's bandwidth: 1 in flight, then one at a time over N and N in flight in
    alternating rounds (with, beside them in the same rounds, what each path compares with)."""
    peer, remote, local, target = path.peer, path.remote, path.local, path.target
    tcp = path.name == "tcp"
    depth = plan.inflight if size * plan.inflight <= max_size else max(1, max_size // size)
    row: dict[str, Any] = {"one_gbps": await bandwidth(peer, remote, local, size, 1, plan.bw_seconds)}
    # One at a time over the N ranges the N in flight use: what N in flight is compared
    # with. The two alternate in rounds, each keeping its best, so that a machine
    # slowing down or speeding up mid-run does not decide their ratio.
    row["inflight"] = depth
    row["one_span_gbps"] = row["inflight_gbps"] = 0.0
    # Where ops end as they are posted, gather's own cost is most of N in flight's
    # (see gather_floor): the same N posted together and awaited in turn shows the
    # library's part alone.
    in_turn = PATH_OF[path.name] in INLINE_PATHS and depth > 1 and size <= MiB  # run_transport checked the path
    if in_turn:
        row["in_turn_gbps"] = row["gather_bound_gbps"] = 0.0
    # tcp: the blocking stream (row 6's limit) timed in the same rounds, each keeping its best.
    if tcp:
        row["stream_beside_gbps"] = 0.0
    # Same-host copies the engine shares: the put 1 in flight and the copies it is held to, timed
    # in the same rounds, each keeping its fastest: the host's speed moves between the passes.
    copies_beside = PATH_OF[path.name] in ("loopback", "shm-memfd") and size >= baselines.STREAM_MIN
    if copies_beside:
        row["beside"] = dict.fromkeys(("one_gbps", *BESIDE_COPIES), 0.0)
    cpu_s = elapsed = 0.0
    seconds = plan.bw_seconds / ROUNDS
    for _ in range(ROUNDS):
        if tcp and "stream_beside_error" not in row:
            # Its whole round, as the puts' figure is theirs (and iperf3's is its run's).
            try:
                stream = baselines.tcp_stream(seconds)["whole"]
                row["stream_beside_gbps"] = max(row["stream_beside_gbps"], stream)
            except OSError as exc:
                row["stream_beside_error"] = str(exc)
                row["stream_beside_gbps"] = None
        if copies_beside:
            beside = row["beside"]
            beside["one_gbps"] = max(beside["one_gbps"], await bandwidth(peer, remote, local, size, 1, seconds))
            for key, (kind, memfd) in BESIDE_COPIES.items():
                fastest = baselines.copy_gbps(kind, size, baselines.COPY_THREADS, seconds, memfd)[0]
                beside[key] = max(beside[key], fastest)
        one = await bandwidth(peer, remote, local, size, 1, seconds, depth)
        row["one_span_gbps"] = max(row["one_span_gbps"], one)
        cpu0 = target.cpu() if target else 0.0
        t0 = time.perf_counter()
        many = await bandwidth(peer, remote, local, size, depth, seconds)
        elapsed += time.perf_counter() - t0
        cpu_s += (target.cpu() - cpu0) if target else 0.0
        row["inflight_gbps"] = max(row["inflight_gbps"], many)
        if spliced:  # the same puts with Agent(tcp_send="splice"), in the same rounds
            spl = await bandwidth(*spliced, size, depth, seconds)
            row["splice_gbps"] = max(row.get("splice_gbps", 0.0), spl)
        if in_turn:
            turn = await bandwidth(peer, remote, local, size, depth, seconds, in_turn=True)
            row["in_turn_gbps"] = max(row["in_turn_gbps"], turn)
            bound = await bandwidth(peer, remote, local, size, 1, seconds, depth, then_gather_done=True)
            row["gather_bound_gbps"] = max(row["gather_bound_gbps"], bound)
    if target:
        row["target_cpu_pct"] = 100 * cpu_s / elapsed
    return row


@asynccontextmanager
async def _splicing(target: TargetProcess | None, size: int) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A tcp peer of the target whose agent splices large puts (``tcp_send="splice"``), with its
    remote and local regions (the same kinds as the default agent's)."""
    assert target is not None
    async with aiohixl.Agent("bench-tcp-splice", token=TOKEN, tcp_send="splice") as agent:
        local = agent.allocate(size)
        np.frombuffer(local.memory, dtype=np.uint8)[:] = np.random.default_rng(6).integers(0, 256, size, dtype=np.uint8)
        peer = await agent.connect(target.address, transports=("tcp",))
        yield peer, await peer.region("dst"), local


@asynccontextmanager
async def _target_with(
    agent: Any, size: int, region: str, only: Any, **knobs: int
) -> AsyncIterator[tuple[Any, Any, TargetProcess]]:
    """A second target process made with ``knobs`` (one of its polls off): a peer of it
    through ``only``, its region ``region``, and the process."""
    proc = TargetProcess(size, **knobs)
    try:
        peer = await agent.connect(proc.address, transports=only)
        yield peer, await peer.region(region), proc
        await peer.aclose()
    finally:
        proc.close()


def _off_against_default(on: list[float], off: list[float]) -> dict[str, float]:
    """The medians (us) of the default's samples and the poll-off target's, and their ratio."""
    on_us, off_us = statistics.median(on) * 1e6, statistics.median(off) * 1e6
    return {"default_us": on_us, "off_us": off_us, "off_over_default": off_us / on_us}


async def serve_poll_beside(agent: Any, peer: Any, remote: Any, local: Any, ops: int) -> dict[str, Any]:
    """Lone puts to the bench's target (its tcp I/O thread polls ``serve_poll_us``, 20 us, for the
    next request) and to a target process made with ``serve_poll_us=0`` (its thread blocks after
    each), in alternating rounds: what waking the target's thread for every request costs on this
    host (docs/tcp.md, "The target's poll"). Each is the median of all its rounds' puts, not the
    best round's: which CPU the scheduler gives the blocking target's thread, the initiator's (no
    wake-up to pay) or the other, holds for seconds, and a round is shorter."""
    sizes = (4 * KiB, 64 * KiB)
    samples: dict[int, tuple[list[float], list[float]]] = {s: ([], []) for s in sizes}
    async with _target_with(agent, max(sizes), "dst", ("tcp",), serve_poll_us=0) as (peer_off, remote_off, _):
        arms = ((peer, remote), (peer_off, remote_off))
        for _ in range(ROUNDS):
            for s in sizes:
                for (p, r), out in zip(arms, samples[s], strict=True):
                    out += await _timed(p.put, (r[:s], local[:s]), ops, min(ops, 100))
    result = {fmt_size(s): _off_against_default(on, no) for s, (on, no) in samples.items()}
    return {"sizes": result, "rounds": ROUNDS, "ops": ROUNDS * ops}


async def _notify_against_target_with(
    agent: Any,
    peer: Any,
    target: Any,
    remote: Any,
    local: Any,
    size: int,
    ops: int,
    only: Any,
    with_puts: bool = False,
    **knobs: int,
) -> tuple[list[float], list[float], list[float]]:
    """``put(notify=)`` -> ``notification()`` delays to the bench's target and to a second
    target process made with ``knobs``, in ROUNDS alternating rounds; ``with_puts``: and lone
    puts to the second in the same rounds."""
    on: list[float] = []
    other: list[float] = []
    puts: list[float] = []
    async with _target_with(agent, size, remote.name, only, **knobs) as (p2, r2, t2):
        for _ in range(ROUNDS):
            on += await _notify_delays(agent, peer, target, remote, local, size, ops)
            other += await _notify_delays(agent, p2, t2, r2, local, size, ops)
            if with_puts:
                puts += await _timed(p2.put, (r2[:size], local[:size]), ops, min(ops, 100))
    return on, other, puts


async def notify_poll_beside(
    agent: Any, peer: Any, target: Any, remote: Any, local: Any, size: int, ops: int, only: Any
) -> dict[str, Any]:
    """``put(notify=)`` -> ``notification()`` to the bench's target (its loop turns
    ``notify_poll_us``, 50 us, for the next while they come that often) and to a target process
    made with ``notify_poll_us=0`` (its loop blocks in its selector after each), in alternating
    rounds: what waking the receiving loop for every notification costs on this host
    (docs/api.md, "Notifications"). Medians of all of each arm's notifications."""
    on, no, _ = await _notify_against_target_with(agent, peer, target, remote, local, size, ops, only, notify_poll_us=0)
    return {**_off_against_default(on, no), "rounds": ROUNDS, "ops": len(on)}


AWAKE_US = 1000  # serve_poll_us of notify_awake_beside's target: its I/O thread polls through the gaps


async def notify_awake_beside(
    agent: Any, peer: Any, target: Any, remote: Any, local: Any, size: int, ops: int, only: Any
) -> dict[str, Any]:
    """tcp: ``put(notify=)`` -> ``notification()`` to a target process whose I/O thread never
    blocks between them (``serve_poll_us=AWAKE_US``: 1 ms, through the ping-pong's 100-150 us
    gaps), in rounds alternating with the bench's target, and lone puts to it: what is left
    of row 2 once waking the target's thread costs nothing. Medians of all of each arm's."""
    on, awake, puts = await _notify_against_target_with(
        agent, peer, target, remote, local, size, ops, only, with_puts=True, serve_poll_us=AWAKE_US
    )
    on_us, awake_us, put_us = (statistics.median(x) * 1e6 for x in (on, awake, puts))
    return {
        "default_us": on_us,
        "awake_us": awake_us,
        "awake_put_us": put_us,
        "awake_over_put": awake_us / put_us,
        "serve_poll_us": AWAKE_US,
        "rounds": ROUNDS,
        "ops": len(on),
    }


async def busy_poll_latency(plan: Plan, size: int) -> dict[str, dict[str, float]]:
    """tcp's opt-in latency mode: both agents made with busy_poll_us (a target process of its own)."""
    out = {}
    target = TargetProcess(size, plan.busy_poll_us)
    try:
        async with aiohixl.Agent("bench-tcp-busy-poll", token=TOKEN, busy_poll_us=plan.busy_poll_us) as agent:
            local = agent.allocate(size)
            peer = await agent.connect(target.address, transports=("tcp",))
            remote = await peer.region("dst")
            for op in ("put", "get"):
                key = f"{op} {fmt_size(size)}, busy_poll_us={plan.busy_poll_us}"
                out[key] = await latency(peer, op, remote, local, size, plan.lat_ops)
    finally:
        target.close()
    return out


async def idle_cpu(seconds: float, target: TargetProcess) -> dict[str, float]:
    async with aiohixl.Agent("bench-idle", token=TOKEN) as agent:
        await agent.connect(target.address)  # a connected agent: heartbeats included
        await asyncio.sleep(0.2)
        cpu0, tcpu0, t0 = time.process_time(), target.cpu(), time.perf_counter()
        await asyncio.sleep(seconds)
        elapsed = time.perf_counter() - t0
        return {
            "initiator_pct": 100 * (time.process_time() - cpu0) / elapsed,
            "target_pct": 100 * (target.cpu() - tcpu0) / elapsed,
            "seconds": seconds,
        }


PEER_RUNS: tuple[tuple[str, str, dict[str, str], str], ...] = (
    # (label, peer, env, the aiohixl transport it is compared with)
    ("nixl (UCX default)", "nixl", {}, "shm-cma"),
    ("nixl UCX_TLS=tcp", "nixl", {"UCX_TLS": "tcp"}, "tcp"),
    ("mooncake tcp", "mooncake", {}, "tcp"),
)


def run_peers(plan: Plan, results: Results, progress: Progress) -> None:
    from . import bench_peers

    sizes = list(plan.bw_sizes)
    for label, kind, env, ours in PEER_RUNS:
        why = bench_peers.available(kind)
        if why is None:
            out = bench_peers.run(
                kind,
                sizes,
                list(plan.lat_sizes),
                plan.lat_ops,
                plan.bw_seconds,
                env,
                idle_seconds=min(plan.idle_seconds, 2.0),
            )
        else:
            out = {"error": [why]}
        out["compare_with"] = ours
        results.peers[label] = out
        progress.step(f"peer {label}")


def unavailable() -> dict[str, str]:
    """The transports this machine cannot run, and why (as ``aiohixl info`` says)."""
    from .info import transports

    why = {t.name: t.detail for t in transports() if not t.available}
    if "shm" in why:
        why["shm-cma"] = why["shm"]
    return why


def default_transports() -> list[str]:
    missing = unavailable()
    return [name for name in PATH_OF if name not in missing]


async def bench(args: argparse.Namespace) -> Results:
    plan = Plan.make(args.quick, args.full)
    results = Results(
        machine={"cpus": os.cpu_count(), "python": sys.version.split()[0], "quick": args.quick, "full": args.full}
    )
    transports = default_transports()
    if args.transports:
        missing = unavailable()
        results.skipped = {name: missing[name] for name in args.transports if name in missing}
        transports = [name for name in args.transports if name not in missing]
    steps = 5 + 4 * len(plan.bw_sizes) + len(transports) * (2 * len(plan.lat_sizes) + len(plan.bw_sizes) + 3) + 1
    steps += 3 * ("tcp" in transports)  # its latency mode, its put beside the C round trip and with the poll off
    steps += len(PEER_RUNS) if args.peers else 0
    steps += len(plan.reg_sizes)
    progress = Progress(steps)

    def measure_baselines(with_iperf3: bool) -> dict[str, Any]:
        return baselines.measure(
            list(plan.bw_sizes),
            fmt_size,
            plan.copy_seconds,
            plan.stream_seconds,
            plan.rtt_seconds,
            progress.step,
            with_iperf3,
        )

    passes = [measure_baselines(True)]
    max_size = max(plan.bw_sizes) * (plan.inflight if max(plan.bw_sizes) <= 16 * MiB else 1)
    target = TargetProcess(max(max_size, MiB)) if any(t != "loopback" for t in transports) else None
    try:
        for name in transports:
            await run_transport(name, plan, results, progress, target)
        if target:
            results.machine["idle"] = await idle_cpu(plan.idle_seconds, target)
            progress.step("idle CPU")
        passes.append(measure_baselines(False))  # the second pass: see baselines.combine
        if args.peers:
            run_peers(plan, results, progress)
        # Last: populating and freeing GiBs keeps the kernel busy for a while after (small
        # ops run slower meanwhile), which would tell on what follows.
        results.registration = await registration(plan.reg_sizes, progress)
    finally:
        if target:
            target.close()
        progress.close()
    results.baselines = baselines.combine(passes)
    results.machine["above_physical_limit"] = annotate(results)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="aiohixl bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run that finishes within a minute")
    p.add_argument("--full", action="store_true", help="also 256 MiB ops")
    p.add_argument(
        "--transports",
        default=None,
        type=_transport_list,
        help="comma-separated: loopback, shm (memfd region), shm-cma (user memory), tcp, verbs"
        " (default: all available here; one not available is skipped, saying why)",
    )
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw bandwidth and latency (needs matplotlib)")
    p.add_argument(
        "--peers",
        action="store_true",
        help="also run NIXL (nixl-cu12) and Mooncake (mooncake-transfer-engine-non-cuda) when installed",
    )
    p.add_argument("--serve", type=int, metavar="BYTES", help=argparse.SUPPRESS)
    p.add_argument("--stall-probe", type=int, metavar="BYTES", help=argparse.SUPPRESS)
    p.add_argument("--serve-busy-poll", type=int, default=0, metavar="US", help=argparse.SUPPRESS)
    p.add_argument("--serve-poll", type=int, default=20, metavar="US", help=argparse.SUPPRESS)
    p.add_argument("--serve-notify-poll", type=int, default=50, metavar="US", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install 'aiohixl[plot]'")  # before a bench it could not draw
    if args.stall_probe:
        print(*asyncio.run(_first_allocate_stall(args.stall_probe)))
        return 0
    if args.serve:
        asyncio.run(serve(args.serve, args.serve_busy_poll, args.serve_poll, args.serve_notify_poll))
        return 0
    results = asyncio.run(bench(args))
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(results), f, indent=2)
    if args.plot:
        plot(results, args.plot)
    return 0


def _transport_list(text: str) -> list[str]:
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in PATH_OF]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(map(repr, unknown)) or 'empty list'}: choose from {', '.join(PATH_OF)}"
        )
    return names


if __name__ == "__main__":
    sys.exit(main())
