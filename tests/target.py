"""A target agent in its own process, driven over stdin/stdout with JSON lines.

    python -m tests.target --token T [--listen HOST:PORT] [--transports tcp]

It prints {"address": ...} once listening, then answers one line per command:
alloc (name, size, access, seed, publish), register (same, over a numpy array), hash
(name, offset, len), close (name), state (what a test waits on: ops outstanding,
notifications received, the library's warnings so far), block (a line as its loop
stops, another as it runs again), exit. The test process checks the target's memory
through these answers, never through the library under test.
"""

import argparse
import asyncio
import hashlib
import json
import logging
import sys
import time

import numpy as np

import aiohixl
from aiohixl import Access


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


class Warnings(logging.Handler):
    """The library's warnings, for the state command (e.g. "cannot accept connections")."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def main() -> None:
    warnings = Warnings()
    logging.getLogger("aiohixl").addHandler(warnings)
    p = argparse.ArgumentParser()
    p.add_argument("--token", required=True)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--rdma-timeout", type=int, default=14)
    p.add_argument("--stall", type=float, default=10.0)
    p.add_argument("--max-notes", type=int, default=4096)
    p.add_argument("--busy-poll", type=int, default=0)
    p.add_argument("--notify-poll", type=int, default=50)
    args = p.parse_args()
    async with aiohixl.Agent(
        "target",
        listen=args.listen,
        token=args.token,
        heartbeat_interval=args.heartbeat,
        heartbeat_timeout=args.heartbeat * 3,
        rdma_timeout=args.rdma_timeout,
        rdma_retry_count=1,
        stall_timeout=args.stall,
        max_notifications=args.max_notes,
        busy_poll_us=args.busy_poll,
        notify_poll_us=args.notify_poll,
    ) as agent:
        regions = {}
        arrays = {}
        print(json.dumps({"address": agent.address}), flush=True)
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            op = cmd["op"]
            out: dict = {"ok": True}
            if op in ("alloc", "register"):
                access = Access(cmd.get("access", 3))
                # publish=false: no name, reachable by its descriptor only
                name = cmd["name"] if cmd.get("publish", True) else None
                if op == "alloc":
                    region = agent.allocate(cmd["size"], name=name, access=access)
                    view = np.frombuffer(region.memory, dtype=np.uint8)
                else:
                    view = np.zeros(cmd["size"], dtype=np.uint8)
                    region = agent.register(view, name=name, access=access)
                if cmd.get("seed") is not None:
                    # Off the loop: a busy machine takes seconds for 256 MiB, longer than a heartbeat.
                    view[:] = await asyncio.to_thread(pattern, cmd["size"], cmd["seed"])
                regions[cmd["name"]] = region
                arrays[cmd["name"]] = view
                out["descriptor"] = region.descriptor().hex()
            elif op == "hash":
                view = arrays[cmd["name"]]
                chunk = view[cmd["offset"] : cmd["offset"] + cmd["len"]]
                out["sha256"] = await asyncio.to_thread(lambda c=chunk: hashlib.sha256(c).hexdigest())
            elif op == "pump":
                # Puts into a region of the test process while it puts into ours.
                transports = tuple(cmd["transports"]) if cmd.get("transports") else None
                peer = await agent.connect(cmd["address"], transports=transports)
                remote = await peer.region(cmd["name"])
                size, count = cmd["size"], cmd["count"]
                src = agent.register(await asyncio.to_thread(pattern, size * count, cmd["seed"]))
                await asyncio.gather(
                    *(peer.put(remote[i * size : (i + 1) * size], src[i * size : (i + 1) * size]) for i in range(count))
                )
                out.update(transport=peer.transport, reason=peer.transport_reason)
                await peer.aclose()
            elif op == "notify":
                # The next RDMA WRITE WITH IMM that lands here.
                note = await asyncio.wait_for(agent.notification(), cmd.get("timeout", 60))
                out.update(imm=note.imm, nbytes=note.nbytes)
            elif op == "take_note":
                # The next notification names a range and its expected hash:
                # check the bytes the moment it arrives.
                note = await agent.notification(timeout=cmd.get("timeout", 60))
                name, off, n, digest = note.data.decode().split(":")
                chunk = arrays[name][int(off) : int(off) + int(n)]
                got = await asyncio.to_thread(lambda c=chunk: hashlib.sha256(c).hexdigest())
                out.update(in_place=got == digest, peer=note.peer)
            elif op == "collect":
                notes = [await agent.notification(timeout=cmd.get("timeout", 120)) for _ in range(cmd["n"])]
                out.update(
                    notes=[[n.peer, n.data.decode()] for n in notes],
                    imms=[n.imm for n in notes],
                    dropped=agent.notifications_dropped,
                )
            elif op == "take_block":
                # Takes notifications until its loop reads tcp itself (at least n, at most 1000),
                # then blocks at once, as a handler's synchronous work would.
                from aiohixl import _testing as hooks

                taken, served = 0, (0, 0)
                while taken < 1000 and (taken < cmd["n"] or served != (1, 1)):
                    await agent.notification(timeout=60)
                    taken += 1
                    served = hooks.tcp_served(agent)
                print(json.dumps({"ok": True, "blocking": True, "served": served, "taken": taken}), flush=True)
                time.sleep(cmd["seconds"])
            elif op == "block":
                print(json.dumps({"ok": True, "blocking": True}), flush=True)  # nothing runs from here
                time.sleep(cmd["seconds"])  # the event loop stops: a synchronous forward pass
                out["pending"] = agent.outstanding
            elif op == "state":
                out.update(
                    outstanding=agent.outstanding,
                    received=agent.stats()["notifications"]["received"],
                    dropped=agent.notifications_dropped,
                    warnings=warnings.messages,
                )
            elif op == "info":
                usable = [n for n in agent.transports if n not in agent.unavailable]
                out.update(verbs=agent.verbs_unavailable or "ready", transports=usable)
            elif op == "close":
                start = time.monotonic()
                await regions.pop(cmd["name"]).close()
                out["seconds"] = time.monotonic() - start
            elif op == "exit":
                print(json.dumps(out), flush=True)
                return
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks when we hang on exit
    asyncio.run(main())
