"""Real store servers for the ranks tests: redis-server and etcd on free ports, started and stopped here."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import urllib.request

import pytest

from .waiting import wait_until_sync

# make test-asan preloads libasan: not for redis-server or etcd, but the tcp store is our Python
# with the instrumented module, which aborts at import without it.
ENV = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One store server process; ``kill()`` ends it as a crash would, ``start()`` brings it back."""

    def __init__(self, argv: list[str], port: int, env: dict[str, str] = ENV) -> None:
        self.argv = argv
        self.port = port
        self.env = env
        self.proc: subprocess.Popen | None = None

    def answers(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                pytest.fail(f"{self.argv[0]} exited at start ({self.proc.returncode})")
            return self.answers()

        wait_until_sync(up, timeout=30, what=f"{os.path.basename(self.argv[0])} answering on {self.port}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def remove(self) -> None:
        self.kill()


class Redis(Server):
    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (.ci/run installs it: apt-get install redis-server)")
        pytest.importorskip("redis", reason="redis-py is not installed (the test extra has it)")
        port = free_port()
        super().__init__([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], port)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class Etcd(Server):
    """A one-member etcd with its data in a temporary folder (kept across kill/start, removed by ``remove()``)."""

    def __init__(self) -> None:
        exe = shutil.which("etcd")
        if exe is None:
            pytest.skip("etcd is not installed (.ci/run installs it: apt-get install etcd-server)")
        pytest.importorskip("aetcd", reason="aetcd is not installed (the test extra has it)")
        self.data = tempfile.mkdtemp(prefix="aiohixl-etcd-")
        port, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
        argv = [exe, "--name", "test", "--data-dir", self.data, "--listen-client-urls", client_url]
        argv += ["--advertise-client-urls", client_url, "--listen-peer-urls", peer_url]
        argv += ["--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"test={peer_url}"]
        super().__init__(argv, port)

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as reply:
                return b'"true"' in reply.read()
        except OSError:
            return False

    def ctl(self, *args: str) -> None:
        exe = shutil.which("etcdctl")
        if exe is None:
            pytest.skip("etcdctl is not installed (.ci/run installs it: apt-get install etcd-client)")
        cmd = [exe, f"--endpoints=http://127.0.0.1:{self.port}", *args]
        subprocess.run(cmd, check=True, capture_output=True, env=ENV, timeout=30)

    def remove(self) -> None:
        super().remove()
        shutil.rmtree(self.data, ignore_errors=True)


class TcpStore(Server):
    """A standalone tcp store (``python -m aiohixl store``)."""

    def __init__(self, token: str) -> None:
        import sys

        port = free_port()
        super().__init__(
            [sys.executable, "-m", "aiohixl", "store", "--listen", f"127.0.0.1:{port}", "--token", token],
            port,
            dict(os.environ),
        )

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False


def private(kind: str, token: str, lease: int) -> tuple[Server, str]:
    """A store server of one test's own (it may kill it) and its URL."""
    if kind == "tcp":
        server: Server = TcpStore(token)
        url = f"tcp://127.0.0.1:{server.port}"
    elif kind == "redis":
        server = Redis()
        url = f"redis://127.0.0.1:{server.port}/0?lease={lease}"
    else:
        server = Etcd()
        url = f"etcd://127.0.0.1:{server.port}?lease={lease}"
    server.start()
    return server, url
