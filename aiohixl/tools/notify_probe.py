"""Where a notification's time goes: timestamps on each step, initiator to the target's task.

    python -m aiohixl.tools.notify_probe [--transports shm,tcp] [--ops 2000]

One ``put(notify=)`` of 4 KiB at a time, as the bench's notification rows, with the
clock every process of a host shares (CLOCK_MONOTONIC) read at each step:

- issue: the initiator calls ``put(notify=)`` (the time is the message);
- put returned: the initiator's ``await`` ended;
- drain: the target's loop ran the agent's wake-fd callback (``Engine.drain``), the
  first one after the target's task began waiting;
- resolved: ``Inbox.pull`` handed the notification to the waiting task's future;
- returned: ``notification()`` returned in the target's task.

It prints the median of each step's time from the one before, the number of
wake-fd callbacks per notification, and the asyncio floor beside them
(``wake_floor``: the same one-way wake-up through asyncio, no aiohixl in it).
The target's steps are read by wrapping the library's methods, which adds a
few hundred nanoseconds to each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

import aiohixl

from ._child import LineChild

TOKEN = "notify-probe"
SIZE = 4096


def _instrument() -> dict[str, Any]:
    """Wrap the target's steps; returns the record they write into."""
    from aiohixl import notifications as notes_mod
    from aiohixl._loop import engine as engine_mod

    rec: dict[str, Any] = {"waiting": False, "drain": None, "drains": 0, "resolved": None}
    clock, cpu = time.monotonic, time.thread_time
    drain = engine_mod.Engine.drain

    def timed_drain(self: Any, woken: bool = True) -> None:
        if rec["waiting"]:
            rec["drains"] += 1
            if rec["drain"] is None:
                rec["drain"], rec["drain_cpu"] = clock(), cpu()
        drain(self, woken)

    engine_mod.Engine.drain = timed_drain  # type: ignore[method-assign]
    serve = notes_mod.Inbox._serve

    def timed_serve(self: Any) -> None:
        waiting = len(self._waiters)
        serve(self)
        if waiting and len(self._waiters) < waiting and rec["resolved"] is None:
            rec["resolved"], rec["resolved_cpu"] = clock(), cpu()

    notes_mod.Inbox._serve = timed_serve  # type: ignore[method-assign]
    return rec


async def serve() -> None:
    rec = _instrument()
    async with aiohixl.Agent("probe-target", listen="127.0.0.1:0", token=TOKEN) as agent:
        agent.allocate(1 << 20, name="dst")
        print(agent.address, flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or line.strip() == "exit":
                return
            n, answer_late = int(line.split()[1]), line.split()[2:] != ["early"]
            print("ready", flush=True)
            rows = []
            profile = None
            if os.environ.get("AIOHIXL_PROBE_PROFILE"):  # a cProfile of the target's notes, to that file
                import cProfile

                profile = cProfile.Profile()
                profile.enable()
            answered = [0.0]  # the answer's CPU, when the loop writes it during the next wait

            def answer(answered: list[float] = answered) -> None:
                c0 = time.thread_time()
                print("got", flush=True)
                answered[0] = time.thread_time() - c0

            for i in range(n):
                rec.update(waiting=True, drain=None, drains=0, resolved=None, drain_cpu=None, resolved_cpu=None)
                answered[0] = 0.0
                cpu0 = time.thread_time()
                note = await agent.notification(timeout=60)
                returned, cpu1 = time.monotonic(), time.thread_time()
                rec["waiting"] = False
                cpus = (cpu1 - cpu0 - answered[0], rec["drain_cpu"], rec["resolved_cpu"], cpu1, cpu0 + answered[0])
                rows.append((float(note.data), rec["drain"], rec["resolved"], returned, rec["drains"], *cpus))
                if answer_late and i < n - 1:  # once this task waits again: the sender finds it blocked
                    loop.call_soon(answer)
                else:  # at once (the bench's way): the sender may overtake the rest of this step
                    print("got", flush=True)
            if profile is not None:
                profile.disable()
                profile.dump_stats(os.environ["AIOHIXL_PROBE_PROFILE"])
            print(json.dumps({"rows": rows}), flush=True)


class Target(LineChild):
    def __init__(self) -> None:
        super().__init__("aiohixl.tools.notify_probe", "--serve")
        self.address = self.first


def _med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6 if xs else float("nan")


async def probe(name: str, target: Target, ops: int, early: bool = False) -> dict[str, Any]:
    async with aiohixl.Agent(f"probe-{name}", token=TOKEN) as agent:
        local = agent.allocate(1 << 20)
        np.frombuffer(local.memory, dtype=np.uint8)[:] = 7
        peer = await agent.connect(target.address, transports=("tcp",) if name == "tcp" else None)
        remote = await peer.region("dst")
        path = await peer.path(remote)
        r, loc = remote[:SIZE], local[:SIZE]
        for _ in range(500):
            await peer.put(r, loc)
        put_alone = []
        for _ in range(ops):
            t = time.monotonic()
            await peer.put(r, loc)
            put_alone.append(time.monotonic() - t)
        target.tell(f"notes {ops}" + (" early" if early else ""))
        if target.answer() != "ready":
            raise RuntimeError("the probe target did not start")
        put_notify = []
        for _ in range(ops):
            t = time.monotonic()
            await peer.put(r, loc, notify=repr(t).encode())
            put_notify.append(time.monotonic() - t)
            if target.answer() != "got":
                raise RuntimeError("the probe target did not take a notification")
        got = json.loads(target.answer())
        rows = got["rows"]
    steps: dict[str, list[float]] = {"issue -> drain": [], "drain -> resolved": [], "resolved -> returned": []}
    cpu_steps: dict[str, list[float]] = {"waiting -> drain": [], "drain -> resolved": [], "resolved -> returned": []}
    total, drains, cpu = [], [], []
    for issued, drain, resolved, returned, n, own, drain_cpu, resolved_cpu, returned_cpu, wait_cpu in rows:
        total.append(returned - issued)
        drains.append(n)
        cpu.append(own)
        if drain is not None and resolved is not None and drain <= resolved:
            steps["issue -> drain"].append(drain - issued)
            steps["drain -> resolved"].append(resolved - drain)
            steps["resolved -> returned"].append(returned - resolved)
            cpu_steps["waiting -> drain"].append(drain_cpu - wait_cpu)
            cpu_steps["drain -> resolved"].append(resolved_cpu - drain_cpu)
            cpu_steps["resolved -> returned"].append(returned_cpu - resolved_cpu)
    return {
        "path": path,
        "put_us": _med(put_alone),
        "put_notify_us": _med(put_notify),
        "total_us": _med(total),
        "steps_us": {k: _med(v) for k, v in steps.items()},
        "timed": len(steps["issue -> drain"]),
        "ops": len(rows),
        "drains_per_note": statistics.fmean(drains),
        "target_loop_cpu_us": _med(cpu),
        "target_cpu_steps_us": {k: _med(v) for k, v in cpu_steps.items()},
        "woken_before_wait": sum(1 for row in rows if row[1] is None) / len(rows),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiohixl.tools.notify_probe", description=__doc__.splitlines()[0])
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--transports", default="shm,tcp")
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--early", action="store_true", help="the target answers before it waits again (as the bench does)")
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(serve())
        return 0
    from . import wake_floor

    out: dict[str, Any] = {"asyncio_wake_rtt_us": wake_floor.measure(1.0)}
    target = Target()
    try:
        for name in args.transports.split(","):
            out[name] = asyncio.run(probe(name, target, args.ops, args.early))
    finally:
        target.close()
    floor = out["asyncio_wake_rtt_us"]["median"] / 2
    print(
        f"asyncio one-way wake-up (wake_floor): {floor:.1f} us; its responder's loop-thread CPU per wait"
        f" {out['asyncio_wake_rtt_us']['responder_cpu_us']:.1f} us"
    )
    for name in args.transports.split(","):
        v = out[name]
        print(
            f"{name} ({v['path']}): put {v['put_us']:.1f} us, put(notify=) returns {v['put_notify_us']:.1f} us,"
            f" issue -> notification() returned {v['total_us']:.1f} us"
            f" = put + {(v['total_us'] - v['put_us']) / floor:.2f}x the asyncio wake-up"
        )
        steps = ", ".join(f"{k} {us:.1f}" for k, us in v["steps_us"].items())
        print(
            f"  steps (median us, {v['timed']} of {v['ops']} timed): {steps};"
            f" wake-fd callbacks per note {v['drains_per_note']:.2f}; the note there before the wait"
            f" {100 * v['woken_before_wait']:.0f}%"
        )
        steps = ", ".join(f"{k} {us:.1f}" for k, us in v["target_cpu_steps_us"].items())
        print(
            f"  the target loop thread's CPU (median us) in notification(), its wait and wake-up included,"
            f" {v['target_loop_cpu_us']:.1f}: {steps}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
