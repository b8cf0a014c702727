"""Processes in the other guest of the two-guest tier (tests/softroce/run-two.sh).

Guest B runs ``python -m tests.rdma_two.bridge``: it listens on its link address, port
``PORT``, and for each connection reads one JSON line ``{"argv": [...]}``, starts that
program (``target`` is tests/target.py, ``pyverbs_peer`` tests/rdma/pyverbs_peer.py under the
system python3; otherwise one of ``ALLOWED``) and relays the
connection to its stdin and stdout. The program is killed when the connection ends, and
the connection ends when the program does. Guest A's tests start their targets through it
(``harness.Target`` does, when ``AIOHIXL_TEST_BRIDGE`` names the bridge).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time

import anyio
from anyio.abc import SocketStream

PORT = 7100
PYVERBS_PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rdma", "pyverbs_peer.py")
ALLOWED = ("ib_write_bw", "ib_read_bw", "ib_write_lat")  # perftest's servers (tests/rdma_two/perf.py)


def _argv(asked: list[str], addr: str) -> list[str]:
    if asked[:1] == ["target"]:
        argv = [sys.executable, "-m", "tests.target", *asked[1:]]
        if "--listen" in argv:  # the caller's host means "this guest": listen on the link
            i = argv.index("--listen") + 1
            argv[i] = f"{addr}:{argv[i].rpartition(':')[2]}"
        return argv
    if asked[:1] == ["pyverbs_peer"]:  # the raw RC peer (tests/rdma/test_raw_rc.py), no aiohixl in it
        return ["/usr/bin/python3", PYVERBS_PEER, *asked[1:]]
    if asked[:1] and asked[0] in ALLOWED:
        return asked
    raise ValueError(f"bridge: not a program it runs: {asked!r}")


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, addr: str) -> None:
    try:
        argv = _argv(json.loads(await reader.readline())["argv"], addr)
        env = os.environ
        if argv[0] == "/usr/bin/python3":  # Debian's pyverbs, not our venv's packages
            env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        child = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None, env=env
        )
    except Exception as exc:  # a bad request: say why, drop it
        writer.write((json.dumps({"bridge_error": str(exc)}) + "\n").encode())
        writer.close()
        return
    assert child.stdin and child.stdout

    async def inward() -> None:
        while data := await reader.read(1 << 16):
            child.stdin.write(data)
            await child.stdin.drain()
        child.kill()  # the caller's end closed: its target dies with it

    async def outward() -> None:
        while data := await child.stdout.read(1 << 16):
            writer.write(data)
            await writer.drain()

    relay = asyncio.ensure_future(inward())
    try:
        await outward()
        await child.wait()
    except (ConnectionError, BrokenPipeError):
        child.kill()
        await child.wait()
    finally:
        relay.cancel()
        writer.close()


async def main() -> None:
    addr = os.environ.get("SOFTROCE_ADDR", "127.0.0.1")
    server = await asyncio.start_server(lambda r, w: _serve(r, w, addr), addr, PORT, reuse_address=True)
    print(f"bridge: serving on {addr}:{PORT}", flush=True)
    async with server:
        await server.serve_forever()


class BridgedProcess:
    """What harness.LineProcess uses of a child process, for one the bridge runs in guest B."""

    def __init__(self, stream: SocketStream) -> None:
        self.stdin = self.stdout = stream
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:  # ending our side makes the bridge kill it
            self.stdin.extra(anyio.abc.SocketAttribute.raw_socket).shutdown(socket.SHUT_WR)

    async def wait(self) -> int:
        try:
            while await self.stdout.receive():
                pass
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        self.returncode = 0
        return 0

    async def aclose(self) -> None:
        await self.stdin.aclose()


async def open_bridged(argv: list[str], bridge: str, timeout: float = 0.0) -> BridgedProcess:
    """``argv`` started in guest B; retries connecting for ``timeout`` s (B may be booting)."""
    host, _, port = bridge.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with anyio.fail_after(5):  # a powered-off guest does not refuse: it is silent
                stream = await anyio.connect_tcp(host, int(port))
            break
        except (OSError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.2)  # a booting guest: nothing to wait on but its port
    await stream.send((json.dumps({"argv": argv}) + "\n").encode())
    return BridgedProcess(stream)


if __name__ == "__main__":
    asyncio.run(main())
