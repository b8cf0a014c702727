"""The interpreter's floor under a notification: a one-way cross-process wake-up through asyncio.

Two processes, each running an asyncio loop, wake each other through a pair of
eventfds: ``loop.add_reader`` calls back, the callback resolves a future, the
task awaiting it resumes and writes the other's eventfd. Half the round trip is
what any asyncio library pays to wake a task in another process, before it does
anything of its own: the native one-way wake-up (``baselines.wake_rtt_us``,
two threads blocked in ``read``) plus the loop's selector turn, its callback and
the task's resumption on each side.

Run as a script (``python wake_floor.py SECONDS [CPU]``: with a CPU, both
processes are pinned to it) it prints its figures as JSON: only the standard
library is imported, nothing of aiohixl.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time

WARMUP = 200
MAX_SAMPLES = 200_000


class _Bell:
    """An eventfd read by the loop: ``wait()`` returns once the other side wrote it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self.loop, self.fd = loop, fd
        self.fut: asyncio.Future[int] | None = None
        loop.add_reader(fd, self._ready)

    def _ready(self) -> None:
        value = os.eventfd_read(self.fd)
        fut = self.fut
        if fut is not None and not fut.done():
            fut.set_result(value)

    def wait(self) -> asyncio.Future[int]:
        self.fut = self.loop.create_future()
        return self.fut


async def _respond(ping: int, pong: int, report: int) -> None:
    bell = _Bell(asyncio.get_running_loop(), ping)
    cpu, n = 0.0, 0
    while True:
        cpu0 = time.thread_time()
        value = await bell.wait()
        cpu += time.thread_time() - cpu0
        n += 1
        if value != 1:
            break
        os.eventfd_write(pong, 1)
    # The loop thread's CPU per wait, the wait and its wake-up included (the last wait's too).
    os.write(report, repr(cpu / n).encode())


async def _ping(ping: int, pong: int, seconds: float) -> list[float]:
    bell = _Bell(asyncio.get_running_loop(), pong)
    clock = time.perf_counter
    samples: list[float] = []
    start = 0.0
    for i in range(-WARMUP, MAX_SAMPLES):
        if i == 0:
            start = clock()
        fut = bell.wait()
        t0 = clock()
        os.eventfd_write(ping, 1)
        await fut
        if i >= 0:
            t = clock()
            samples.append(t - t0)
            if t - start >= seconds and len(samples) >= 100:
                break
    os.eventfd_write(ping, 2)  # the end
    return samples


def measure(seconds: float, cpu: int | None = None) -> dict[str, float]:
    """The round trip in microseconds (median, p99, mean, ops; one way is half), and the
    responder's loop-thread CPU per wait, its wake-up included (``responder_cpu_us``).
    ``cpu``: this process, and so the responder it forks, pinned to that CPU."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    ping = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    pong = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(rd)
            asyncio.run(_respond(ping, pong, wr))
            code = 0
        finally:
            os._exit(code)
    os.close(wr)
    try:
        samples = sorted(asyncio.run(_ping(ping, pong, seconds)))
        responder_cpu = os.read(rd, 64)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(ping)
        os.close(pong)
        os.close(rd)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError("the asyncio wake-up responder failed")
    return {
        "responder_cpu_us": float(responder_cpu) * 1e6,
        "median": statistics.median(samples) * 1e6,
        "p99": samples[int(len(samples) * 0.99)] * 1e6,
        "mean": statistics.fmean(samples) * 1e6,
        "ops": len(samples),
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(measure(float(args[0]) if args else 1.0, int(args[1]) if len(args) > 1 else None)))
