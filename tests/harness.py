"""A target agent in another process (tests/target.py), driven from a test."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import anyio
import numpy as np
from anyio.streams.buffered import BufferedByteReceiveStream

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token-4f1d"
# "host:port" of tests/rdma_two/bridge.py: targets start in the other guest of the two-guest tier
BRIDGE = os.environ.get("AIOHIXL_TEST_BRIDGE", "")
BRIDGE_WAIT = 600.0  # that guest may be booting (the power-off test reboots it)


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def sha(arr) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr)).hexdigest()


class LineProcess:
    """A test helper process answering one JSON line per line we send; {"op": "exit"} ends it."""

    EXIT_TIMEOUT = 10.0  # how long a polite exit may take before it is killed

    def __init__(self, proc, out) -> None:
        self.proc = proc
        self.out = out

    async def ask(self, kw: dict, timeout: float) -> dict:
        await self.proc.stdin.send((json.dumps(kw) + "\n").encode())
        with anyio.fail_after(timeout):
            return json.loads(await self.out.receive_until(b"\n", 1 << 20))

    async def cmd(self, **kw) -> dict:
        raise NotImplementedError

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    async def aclose(self) -> None:
        if self.proc.returncode is None:
            try:
                with anyio.fail_after(self.EXIT_TIMEOUT):
                    await self.cmd(op="exit")
            except Exception:
                self.kill()
        hung = False
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.EXIT_TIMEOUT) as waiting:
                await self.proc.wait()
            if waiting.cancelled_caught:  # a hang on exit is a bug to see, not to wait on
                hung = True
                self.proc.send_signal(signal.SIGUSR1)  # its Python stacks (faulthandler), into our output
                await anyio.sleep(1.0)
                self.kill()
                await self.proc.wait()
            await self.proc.aclose()
        if hung:
            raise AssertionError(f"{type(self).__name__} did not exit within {self.EXIT_TIMEOUT} s of being asked")


class Target(LineProcess):
    def __init__(self, proc, out, address: str) -> None:
        super().__init__(proc, out)
        self.address = address
        self.port = int(address.rpartition(":")[2])

    @classmethod
    async def start(
        cls,
        listen: str = "127.0.0.1:0",
        heartbeat: float = 1.0,
        token: str = TOKEN,
        prefix: tuple[str, ...] = (),
        rdma_timeout: int = 14,
        stall: float = 10.0,
        max_notes: int = 4096,
        busy_poll_us: int = 0,
        notify_poll_us: int = 50,
    ) -> Target:
        """``prefix`` runs the target under another command (e.g. unshare)."""
        args = [
            "--token",
            token,
            "--listen",
            listen,
            "--heartbeat",
            str(heartbeat),
            "--rdma-timeout",
            str(rdma_timeout),
            "--stall",
            str(stall),
            "--max-notes",
            str(max_notes),
            "--busy-poll",
            str(busy_poll_us),
            "--notify-poll",
            str(notify_poll_us),
        ]
        if BRIDGE:
            from .rdma_two.bridge import open_bridged

            assert not prefix, "a target in the other guest runs as it is"
            proc = await open_bridged(["target", *args], BRIDGE, timeout=BRIDGE_WAIT)
        else:
            proc = await anyio.open_process(
                [*prefix, sys.executable, "-m", "tests.target", *args],
                cwd=ROOT,
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                stderr=None,
            )
        out = BufferedByteReceiveStream(proc.stdout)
        with anyio.fail_after(300 if os.environ.get("SOFTROCE_GUEST") else 30):  # emulated VM: slow start
            first = json.loads(await out.receive_until(b"\n", 1 << 20))
        return cls(proc, out, first["address"])

    async def cmd(self, **kw) -> dict:
        reply = await self.ask(kw, self.REPLY_TIMEOUT)
        assert reply.get("ok"), reply
        return reply

    REPLY_TIMEOUT = 600 if os.environ.get("SOFTROCE_GUEST") else 60

    async def state(self) -> dict:
        """What the target is at: ops outstanding, notifications received, library warnings."""
        return await self.cmd(op="state")

    async def block(self, seconds: float) -> None:
        """Stop the target's event loop for ``seconds``; returns once it has stopped.
        ``unblocked()`` then reads the answer it gives when it runs again."""
        reply = await self.ask({"op": "block", "seconds": seconds}, self.REPLY_TIMEOUT)
        assert reply.get("blocking"), reply

    async def unblocked(self) -> dict:
        with anyio.fail_after(self.REPLY_TIMEOUT):
            reply = json.loads(await self.out.receive_until(b"\n", 1 << 20))
        assert reply.get("ok"), reply
        return reply

    async def alloc(
        self, name: str, size: int, *, access: int = 3, seed: int | None = None, kind: str = "alloc", publish=True
    ):
        return await self.cmd(op=kind, name=name, size=size, access=access, seed=seed, publish=publish)

    async def hash(self, name: str, offset: int, length: int) -> str:
        return (await self.cmd(op="hash", name=name, offset=offset, len=length))["sha256"]


def tcp_queues(sock) -> tuple[int, int]:
    """For a connection over 127.0.0.1: (bytes this end sent that the other end's process has
    not read yet, bytes the other end sent that this end has not read), from the kernel's
    socket table (/proc/net/tcp: each end's send queue not yet acknowledged, receive queue
    not yet read). A state to wait on instead of a guess of how long the other side takes."""
    here, there = sock.getsockname()[1], sock.getpeername()[1]
    sent = received = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local, remote = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
            tx, rx = (int(q, 16) for q in fields[4].split(":"))
            if (local, remote) == (here, there):
                sent, received = sent + tx, received + rx
            elif (local, remote) == (there, here):
                sent, received = sent + rx, received + tx
    return sent, received
