"""The vLLM tier: real vLLM api_server instances (CPU build) with AiohixlConnector, through the proxy.

Collected only by ``make test-vllm`` (AIOHIXL_TEST_VLLM=1, in the venv tests/vllm/setup_venv.sh
makes): starting vLLM is the expensive part, so every instance is started once per session
and shared. Instances: ``ref`` (no connector: the reference tokens), ``p`` (prefill, shared
memory), ``pt`` (prefill, tcp only, prefill chunked into 64-token steps), ``d`` (decode,
serving both), each with its proxy.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if not os.environ.get("AIOHIXL_TEST_VLLM"):
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "vllm-tier-token"
BLOCK = 32
MAX_LEN = 1024
STARTUP_S = 900.0  # two cores shared by four engines: startups queue behind each other


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, check: Any, timeout: float, every: float = 0.25) -> Any:
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, text


class Proc:
    """A child process with its output in a log file under ``logdir``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.log = logdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to its whole process group (SIGSTOP / SIGCONT: vLLM's engine processes too)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill its whole process group (vLLM's engine and worker processes too) and reap it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        # The group outlives its leader while the engine's children exit.
        wait_until(f"{self.name}'s processes to exit", lambda: not _group_alive(self.proc.pid), 60)

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


class Server(Proc):
    """One vLLM api_server."""

    def __init__(
        self,
        name: str,
        model: Path,
        logdir: Path,
        store: str,
        *,
        role: str | None = None,
        cpu: int = 0,
        extra: dict[str, Any] | None = None,
        args: tuple[str, ...] = (),
        token: str = TOKEN,
        trace: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_LEN),
            "--block-size",
            str(BLOCK),
            "--port",
            str(self.port),
            "--kv-cache-memory-bytes",
            str(256 << 20),
            "--served-model-name",
            "m",
            *args,
        ]
        if role is not None:
            cfg = {"store": store, **(extra or {})}
            if trace is not None:
                cfg["trace"] = str(trace / name)
            kv = {
                "kv_connector": "AiohixlConnector",
                "kv_connector_module_path": "aiohixl.integrations.vllm",
                "kv_role": role,
                "engine_id": name,
                "kv_connector_extra_config": cfg,
            }
            argv += ["--kv-transfer-config", json.dumps(kv)]
        # VLLM_CPU_KVCACHE_SPACE would override --kv-cache-memory-bytes (vllm/platforms/cpu.py).
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        env = dict(
            env,
            AIOHIXL_TOKEN=token,
            VLLM_CPU_OMP_THREADS_BIND=str(cpu),
            HF_HUB_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        super().__init__(name, argv, env, logdir)

    def healthy(self) -> bool:
        if not self.alive():
            raise AssertionError(f"{self.name} exited while starting:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout: float = STARTUP_S) -> None:
        wait_until(f"{self.name} healthy", self.healthy, timeout, every=1.0)

    def metric(self, name: str) -> float:
        """The first sample of ``name`` (a prometheus metric of vLLM's /metrics)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name):
                    return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{self.name}: no {name} in /metrics")

    def kv_usage(self) -> float:
        return self.metric("vllm:kv_cache_usage_perc")

    def wait_drained(self, timeout: float = 60.0) -> None:
        wait_until(f"{self.name}'s KV cache usage back to 0", lambda: self.kv_usage() == 0.0, timeout)


class Cluster:
    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model = root, model
        self.trace = root / "trace"
        self.trace.mkdir()
        self.store_url = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, AIOHIXL_TOKEN=TOKEN)
        self.store = Proc(
            "store",
            [sys.executable, "-m", "aiohixl", "store", "--listen", self.store_url.removeprefix("tcp://")],
            env,
            root,
        )
        s = self.store_url
        self.ref = Server("ref", model, root, s, cpu=1)
        self.p = Server("p", model, root, s, role="kv_producer", cpu=0, trace=self.trace)
        self.pt = Server(
            "pt",
            model,
            root,
            s,
            role="kv_producer",
            cpu=0,
            trace=self.trace,
            extra={"transports": ["tcp"]},
            args=("--enable-chunked-prefill", "--max-num-batched-tokens", "64"),
        )
        self.d = Server("d", model, root, s, role="kv_consumer", cpu=1, trace=self.trace)
        self.proxy = self.make_proxy("proxy", self.p, self.d)
        self.proxy_tcp = self.make_proxy("proxy-tcp", self.pt, self.d)

    def make_proxy(self, name: str, p: Server, d: Server) -> Proc:
        port = free_port()
        proc = Proc(
            name,
            [
                sys.executable,
                "-m",
                "aiohixl.integrations.vllm.proxy",
                "--prefill",
                p.url,
                "--decode",
                d.url,
                "--port",
                str(port),
            ],
            dict(os.environ),
            self.root,
        )
        proc.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
        return proc

    def servers(self) -> list[Server]:
        return [self.ref, self.p, self.pt, self.d]

    def start(self) -> None:
        self.store.start()
        for server in self.servers():
            server.start()
        self.proxy.start()
        self.proxy_tcp.start()
        for server in self.servers():
            server.wait_healthy()

    def stop(self) -> None:
        for proc in [self.proxy, self.proxy_tcp, *self.servers(), self.store]:
            if proc.alive():
                proc.kill(signal.SIGTERM)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    subprocess.run(
        [sys.executable, str(ROOT / "examples/vllm_pd/make_model.py"), str(out)], check=True, stdout=subprocess.DEVNULL
    )
    return out


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("vllm"), model_dir)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        print(f"\nvLLM tier logs: {c.root}")
