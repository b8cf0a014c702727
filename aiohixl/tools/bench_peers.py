"""The same workload through NVIDIA NIXL and Mooncake Transfer Engine, for ``bench --peers``.

Each peer runs as two processes of its own (this module's ``initiator`` spawns
its ``target``), with host DRAM on both sides, warm-up first, the same sizes
as aiohixl's bench, one awaited write at a time, and the target's bytes
checked against the source afterwards. Settings, as their documentation
describes the fast path:

- NIXL: ``nixl_agent`` with the UCX backend and its progress thread; memory
  registered once; one transfer handle per size made once (``initialize_xfer``)
  and re-posted with ``transfer()``; completion by polling
  ``check_xfer_state``. UCX picks its transports unless ``UCX_TLS`` is set.
- Mooncake: ``TransferEngine`` with ``P2PHANDSHAKE`` metadata and the ``tcp``
  protocol; memory registered once; ``transfer_sync_write``.

Neither package is a dependency: without them, the bench says so and skips.

    python -m aiohixl.tools.bench_peers nixl|mooncake --sizes 4096,65536,... --seconds 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._child import LineChild


def available(kind: str) -> str | None:
    """None if the peer's package imports here, else why not."""
    module = {"nixl": "nixl_cu12._api", "mooncake": "mooncake.engine"}[kind]
    try:
        __import__(module)
    except Exception as exc:
        return f"{module} not importable ({type(exc).__name__}: {exc})"[:200]
    return None


def _pattern(n: int) -> np.ndarray:
    return np.random.default_rng(77).integers(0, 256, n, dtype=np.uint8)


# ---------- target processes ----------


def _private_stdout() -> Any:
    """Our answers on a stdout of our own; what the peers' libraries print goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


_OUT: Any = None


def _say(text: str) -> None:
    _OUT.write(text + "\n")
    _OUT.flush()


def _serve(buf: np.ndarray, hello: dict, on_line: Callable[[str], object] | None = None) -> None:
    _say(json.dumps(hello))
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            return
        if cmd[0] == "hash":
            off, n = int(cmd[1]), int(cmd[2])
            _say(hashlib.sha256(buf[off : off + n].tobytes()).hexdigest())
        elif on_line is not None:
            on_line(line)
            _say("ok")


def nixl_target(size: int) -> None:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("bench-target", nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(size, dtype=np.uint8)
    buf[:] = 1  # fault the pages in
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    hello = {"meta": agent.get_agent_metadata().hex(), "addr": buf.ctypes.data}
    _serve(buf, hello, lambda line: agent.add_remote_agent(bytes.fromhex(line.split()[1])))


def mooncake_target(size: int) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake: initialize failed")
    buf = np.zeros(size, dtype=np.uint8)
    buf[:] = 1
    if engine.register_memory(buf.ctypes.data, size) != 0:
        raise SystemExit("mooncake: register_memory failed")
    _serve(buf, {"hostname": f"127.0.0.1:{engine.get_rpc_port()}", "addr": buf.ctypes.data})


# ---------- the initiator ----------


class _Target(LineChild):
    def __init__(self, kind: str, size: int) -> None:
        super().__init__("aiohixl.tools.bench_peers", f"{kind}-target", "--size", str(size))
        self.hello = json.loads(self.first)


def _measure(
    write: Callable[[int], None], sizes: list[int], lat_sizes: list[int], ops: int, seconds: float
) -> dict[str, Any]:
    out: dict[str, Any] = {"latency_us": {}, "bandwidth_gbps": {}}
    for size in lat_sizes:
        for _ in range(min(ops, 500)):
            write(size)
        samples = []
        for _ in range(ops):
            t = time.perf_counter()
            write(size)
            samples.append(time.perf_counter() - t)
        samples.sort()
        out["latency_us"][str(size)] = {
            "median": statistics.median(samples) * 1e6,
            "p99": samples[int(len(samples) * 0.99)] * 1e6,
        }
    for size in sizes:
        write(size)
        n, start = 0, time.perf_counter()
        while True:
            write(size)
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds and n >= 3:
                break
        out["bandwidth_gbps"][str(size)] = n * size / elapsed / 1e9
    return out


def initiator(
    kind: str, sizes: list[int], lat_sizes: list[int], ops: int, seconds: float, idle_seconds: float = 2.0
) -> dict[str, Any]:
    size = max(sizes + lat_sizes)
    src = _pattern(size)
    target = _Target(kind, size)
    try:
        raddr = target.hello["addr"]
        if kind == "nixl":
            from nixl_cu12._api import nixl_agent, nixl_agent_config

            agent = nixl_agent("bench-initiator", nixl_agent_config(backends=["UCX"]))
            agent.register_memory([(src.ctypes.data, size, 0, "")], "DRAM")
            remote = agent.add_remote_agent(bytes.fromhex(target.hello["meta"]))
            target.ask("peer " + agent.get_agent_metadata().hex())
            handles: dict[int, Any] = {}

            def write(n: int) -> None:
                h = handles.get(n)
                if h is None:
                    local = agent.get_xfer_descs([(src.ctypes.data, n, 0)], "DRAM")
                    far = agent.get_xfer_descs([(raddr, n, 0)], "DRAM")
                    h = handles[n] = agent.initialize_xfer("WRITE", local, far, remote)
                state = agent.transfer(h)
                while state == "PROC":
                    state = agent.check_xfer_state(h)
                if state != "DONE":
                    raise RuntimeError(f"nixl transfer of {n} bytes: {state}")
        else:
            from mooncake.engine import TransferEngine

            engine = TransferEngine()
            if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("mooncake: initialize failed")
            engine.register_memory(src.ctypes.data, size)
            hostname = target.hello["hostname"]

            def write(n: int) -> None:
                if engine.transfer_sync_write(hostname, src.ctypes.data, raddr, n) != 0:
                    raise RuntimeError(f"mooncake transfer of {n} bytes failed")

        result = _measure(write, sizes, lat_sizes, ops, seconds)
        verified = target.ask(f"hash 0 {size}") == hashlib.sha256(src.tobytes()).hexdigest()
        result["verified"] = verified
        # What the initiator's process burns while connected and doing nothing.
        cpu0, t0 = time.process_time(), time.perf_counter()
        time.sleep(idle_seconds)
        result["idle_cpu_pct"] = 100 * (time.process_time() - cpu0) / (time.perf_counter() - t0)
        result["settings"] = (
            f"UCX backend, progress thread, prepared handles, polling check_xfer_state, "
            f"UCX_TLS={os.environ.get('UCX_TLS', '(UCX default)')}"
            if kind == "nixl"
            else "P2PHANDSHAKE, protocol tcp, transfer_sync_write"
        )
        return result
    finally:
        target.close()


def run(
    kind: str,
    sizes: list[int],
    lat_sizes: list[int],
    ops: int,
    seconds: float,
    env: dict[str, str] | None = None,
    idle_seconds: float = 2.0,
) -> dict[str, Any]:
    """Runs the peer in a process of its own (its libraries and env stay out of ours)."""
    cmd = [
        sys.executable,
        "-m",
        "aiohixl.tools.bench_peers",
        kind,
        "--sizes",
        ",".join(map(str, sizes)),
        "--lat-sizes",
        ",".join(map(str, lat_sizes)),
        "--ops",
        str(ops),
        "--seconds",
        str(seconds),
        "--idle",
        str(idle_seconds),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"]}
    result = json.loads(lines[-1])
    if proc.returncode != 0:  # seen here: NIXL 1.5.1 segfaults at interpreter exit
        result["exit"] = f"process exited with {proc.returncode} after reporting"
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiohixl.tools.bench_peers")
    p.add_argument("kind", choices=["nixl", "mooncake", "nixl-target", "mooncake-target"])
    p.add_argument("--size", type=int, default=0)
    p.add_argument("--sizes", default="65536,1048576")
    p.add_argument("--lat-sizes", default="4096,65536")
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--idle", type=float, default=2.0)
    args = p.parse_args(argv)
    global _OUT
    _OUT = _private_stdout()
    if args.kind == "nixl-target":
        nixl_target(args.size)
    elif args.kind == "mooncake-target":
        mooncake_target(args.size)
    else:
        sizes = [int(s) for s in args.sizes.split(",")]
        lat = [int(s) for s in args.lat_sizes.split(",")]
        _say(json.dumps(initiator(args.kind, sizes, lat, args.ops, args.seconds, args.idle)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
