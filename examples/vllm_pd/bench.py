"""vLLM prefill/decode pairs on one host: AiohixlConnector beside NixlConnector, same requests.

One run starts, in turn, each arm's real ``api_server`` instances (and its proxy), sends them the
same token-id prompts (greedy, ``ignore_eos``, fixed ``max_tokens``) at concurrency 1 and 4,
measures the pair idle, stops it, and prints one table (and writes JSON). Arms:

- ``single``: one instance, no connector: the reference tokens, TTFT without disaggregation,
  and the idle CPU of one instance (subtracted from each pair's).
- ``nixl``: ``NixlConnector`` (pull: decode READs after the prefill answered), through
  ``nixl_proxy.py`` (toy_proxy_server's flow).
- ``aiohixl-shm`` / ``aiohixl-tcp``: ``AiohixlConnector`` layer-wise (prefill pushes each layer
  while the next computes), over shared memory / over tcp, through
  ``python -m aiohixl.integrations.vllm.proxy``.
- ``aiohixl-whole``: ``AiohixlConnector`` pushing the whole cache after the forward
  (``"layerwise": false``): what the layer-wise overlap buys.

Per request: TTFT at the client through the proxy (streaming), KV bytes, transfer time,
exposed transfer time (the part after the prefill forward ended), decode tokens/s, and whether
the tokens equal the single instance's. Where the figures come from:

- aiohixl: each connector worker's trace (``"trace"`` in ``kv_connector_extra_config``): JSON
  lines ``{transfer_id, req_id, event, t_ns, bytes}`` with ``time.monotonic_ns()`` (one clock for
  the host). transfer = done_received - first_put, exposed = done_received - forward_end.
- NIXL: the decode instance's Prometheus histograms ``vllm:nixl_xfer_time_seconds`` and
  ``vllm:nixl_bytes_transferred``, read before and after each round (a round's mean per
  transfer; exact at concurrency 1). A pull starts only after the prefill request answered, so
  the whole transfer is exposed: exposed = transfer (a lower bound; the proxy's hand-off, from
  the prefill's answer to the decode's first token, is reported too as "handoff").

Idle CPU: utime+stime from /proc of every thread of the pair (API servers, engine cores,
workers) over ``--idle-s`` seconds with no request, minus twice one idle single instance's: what
the connector costs while nothing moves. For aiohixl that difference is within the noise of
vLLM's own idle work, so its threads (named ``hixl-*`` natively, ``aiohixl-*`` for the
connector's event loop) are also summed on their own: the connector's idle CPU, measured.

    python examples/vllm_pd/bench.py --model /tmp/tiny-llama --json bench.json

Needs vLLM's CPU build and ``nixl-cu12`` (``--no-deps``) in the Python that runs it (or
``--python``), and aiohixl importable there (``PYTHONPATH`` at this checkout works).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL_NAME = "bench"  # --served-model-name of every instance
ARMS = ("single", "nixl", "aiohixl-shm", "aiohixl-tcp", "aiohixl-whole")
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Arm:
    name: str
    connector: str | None = None  # None, "nixl" or "aiohixl"
    extra: dict[str, Any] = field(default_factory=dict)  # aiohixl's kv_connector_extra_config beyond store/trace


ARM_SPECS = {
    "single": Arm("single"),
    "nixl": Arm("nixl", "nixl"),
    "aiohixl-shm": Arm("aiohixl-shm", "aiohixl", {"layerwise": True}),
    "aiohixl-tcp": Arm("aiohixl-tcp", "aiohixl", {"layerwise": True, "transports": ["tcp"]}),
    "aiohixl-whole": Arm("aiohixl-whole", "aiohixl", {"layerwise": False}),
}


# ---------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child in its own session (so the engine core and workers it spawns stop with it)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 (open for the child's life)
        self.popen = subprocess.Popen(
            cmd, env=env, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL after 15 s (an api_server may take that long or ignore it)."""
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
            try:  # the leader is gone: its engine core and workers may not be yet
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        self._log_file.close()


async def wait_http(proc: Proc, url: str, timeout_s: float) -> None:
    """Until ``url`` answers 200 (the server is up), the process died, or the time is up."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)  # polling a server that is starting; nothing to wait on instead
    raise RuntimeError(f"{proc.name} not up after {timeout_s:.0f} s:\n{proc.tail()}")


async def wait_port(proc: Proc, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{proc.name} not listening on {port} after {timeout_s:.0f} s:\n{proc.tail()}")


def tree(root: int) -> list[int]:
    """``root`` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


Ticks = dict[tuple[int, int], tuple[str, int]]


def thread_ticks(pids: list[int]) -> Ticks:
    """(pid, tid) -> (process:thread name, utime+stime ticks) for every thread of ``pids``."""
    out = {}
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            out[(pid, int(tid))] = (f"{comm}:{name}", int(fields[11]) + int(fields[12]))
    return out


async def idle_cpu(roots: list[int], seconds: float) -> dict[str, Any]:
    """CPU of the process trees under ``roots`` over ``seconds`` with no request, in cores."""
    pids = [p for r in roots for p in tree(r)]
    before = thread_ticks(pids)
    await asyncio.sleep(seconds)  # the measurement window itself
    return cpu_between(before, thread_ticks(pids), seconds)


def cpu_between(before: Ticks, after: Ticks, seconds: float) -> dict[str, Any]:
    """Cores used between two ``thread_ticks`` snapshots, and the busiest threads."""
    pids = {pid for pid, _ in after}
    deltas = {k: (after[k][0], after[k][1] - before[k][1]) for k in after if k in before}
    total = sum(d for _, d in deltas.values())
    ours = sum(d for name, d in deltas.values() if name.split(":", 1)[1].startswith(AIOHIXL_THREADS))
    top = sorted(deltas.items(), key=lambda kv: -kv[1][1])[:6]
    return {
        "cores": total / CLK_TCK / seconds,
        "aiohixl_thread_cores": ours / CLK_TCK / seconds,
        "seconds": seconds,
        "processes": len(pids),
        "top_threads": [
            {"thread": name, "cores": d / CLK_TCK / seconds, "affinity": _affinity(tid)}
            for (_, tid), (name, d) in top
            if d
        ],
    }


AIOHIXL_THREADS = ("hixl-", "aiohixl-")  # the names aiohixl gives its threads


def _affinity(tid: int) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(tid))
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# one arm's servers


@dataclass
class Setup:
    args: argparse.Namespace
    workdir: Path
    token: str

    def server(self, arm: Arm, role: str, port: int, kv_config: dict[str, Any] | None, env_extra: dict[str, str]):
        a = self.args
        cmd = [
            a.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", a.model, "--served-model-name", MODEL_NAME,
            "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32",
            "--block-size", str(a.block_size), "--kv-cache-memory-bytes", str(a.kv_cache_bytes),
            "--max-model-len", str(a.max_model_len), "--seed", "0",
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            AIOHIXL_TOKEN=self.token,
            VLLM_CPU_OMP_THREADS_BIND="0" if role in ("single", "prefill") else "1",
            # NIXL's prefill forward of 2048 tokens took over the default 300 s on the loaded 2-core box.
            VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=str(int(a.request_timeout * 4)),
            **env_extra,
        )
        return Proc(f"{arm.name}.{role}", cmd, env, self.workdir / f"{arm.name}.{role}.log")

    def helper(self, arm: Arm, role: str, cmd: list[str]) -> Proc:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            AIOHIXL_TOKEN=self.token,
        )
        return Proc(f"{arm.name}.{role}", cmd, env, self.workdir / f"{arm.name}.{role}.log")


@dataclass
class Running:
    """An arm's processes and where the client sends requests."""

    url: str
    servers: list[Proc]
    others: list[Proc]
    decode_url: str | None = None
    trace_prefix: Path | None = None
    proxy_trace: Path | None = None
    store: Proc | None = None
    server_urls: list[str] = field(default_factory=list)

    def stop(self) -> None:
        # The store last: instances losing it mid-shutdown only log about it.
        for p in [*self.others, *self.servers, *([self.store] if self.store else [])]:
            p.stop()


async def start_arm(setup: Setup, arm: Arm) -> Running:
    a = setup.args
    python = a.python
    started: list[Proc] = []
    try:
        if arm.connector is None:
            port = free_port()
            single = setup.server(arm, "single", port, None, {})
            started.append(single)
            await wait_http(single, f"http://127.0.0.1:{port}/health", a.start_timeout)
            url = f"http://127.0.0.1:{port}"
            return Running(url, [single], [], server_urls=[url])

        p_port, d_port, proxy_port = free_port(), free_port(), free_port()
        others: list[Proc] = []
        store = None
        trace_prefix = proxy_trace = None
        if arm.connector == "nixl":
            kv: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
            p_kv, d_kv = kv, kv
            p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        else:
            store_port = free_port()
            listen = f"127.0.0.1:{store_port}"
            store = setup.helper(arm, "store", [python, "-m", "aiohixl", "store", "--listen", listen])
            started.append(store)
            await wait_port(store, store_port, 60)
            trace_prefix = setup.workdir / f"{arm.name}.trace"
            # A loaded 2-core machine can take longer than the default 30 s to prefill 4 x 2048 tokens.
            extra = {
                "store": f"tcp://127.0.0.1:{store_port}",
                "trace": str(trace_prefix),
                "registration_timeout_s": a.request_timeout,
                **arm.extra,
            }
            base: dict[str, Any] = {
                "kv_connector": "AiohixlConnector",
                "kv_connector_module_path": "aiohixl.integrations.vllm",
            }
            p_kv = {**base, "kv_role": "kv_producer", "engine_id": "p0", "kv_connector_extra_config": extra}
            d_kv = {**base, "kv_role": "kv_consumer", "engine_id": "d0", "kv_connector_extra_config": extra}
            p_env = d_env = {}
        prefill = setup.server(arm, "prefill", p_port, p_kv, p_env)
        started.append(prefill)
        decode = setup.server(arm, "decode", d_port, d_kv, d_env)
        started.append(decode)
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        if arm.connector == "nixl":
            proxy_trace = setup.workdir / f"{arm.name}.proxy.jsonl"
            cmd = [sys.executable, str(HERE / "nixl_proxy.py"), "--trace", str(proxy_trace)]
        else:
            cmd = [python, "-m", "aiohixl.integrations.vllm.proxy"]
        proxy = setup.helper(arm, "proxy", [*cmd, "--prefill", p_url, "--decode", d_url, "--port", str(proxy_port)])
        started.append(proxy)
        others.append(proxy)
        await asyncio.gather(
            wait_http(prefill, f"{p_url}/health", a.start_timeout),
            wait_http(decode, f"{d_url}/health", a.start_timeout),
            wait_port(proxy, proxy_port, a.start_timeout),
        )
        url = f"http://127.0.0.1:{proxy_port}"
        return Running(url, [prefill, decode], others, d_url, trace_prefix, proxy_trace, store, [p_url, d_url])
    except BaseException:
        for p in reversed(started):
            p.stop()
        raise


# ---------------------------------------------------------------------------------------------
# requests


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, req_id: str):
    """One streamed completion: token ids and when each arrived (monotonic ns)."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.monotonic_ns()
    tokens: list[int] = []
    stamps: list[int] = []
    async with session.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": req_id}) as r:
        if r.status != 200:
            return {"req_id": req_id, "error": f"HTTP {r.status}: {(await r.text())[:300]}"}
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return {"req_id": req_id, "error": str(chunk["error"])[:300]}
            for choice in chunk.get("choices", []):
                new = choice.get("token_ids") or []
                tokens.extend(new)
                stamps.extend([time.monotonic_ns()] * len(new))
    t_end = time.monotonic_ns()
    if not tokens:
        return {"req_id": req_id, "error": "no tokens streamed"}
    decode_s = (stamps[-1] - stamps[0]) / 1e9
    return {
        "req_id": req_id,
        "t0_ns": t0,
        "ttft_ms": (stamps[0] - t0) / 1e6,
        "e2e_ms": (t_end - t0) / 1e6,
        "decode_tok_s": (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else None,
        "tokens": tokens,
    }


def prompts_for(args: argparse.Namespace, vocab: int) -> dict[str, list[int]]:
    """The same seeded token-id prompts for every arm, keyed ``L<len>.c<conc>.r<round>.i<index>``."""
    rng = random.Random(args.seed)
    out = {}
    for length in (min(args.lengths), max(args.lengths)):  # warm-up: first request of each shape
        out[f"warm.L{length}"] = [rng.randrange(3, vocab) for _ in range(length)]
    for c in args.concurrency:
        for length in args.lengths:
            for r in range(math.ceil(args.requests / c)):
                for i in range(c):
                    out[f"L{length}.c{c}.r{r}.i{i}"] = [rng.randrange(3, vocab) for _ in range(length)]
    return out


# ---------------------------------------------------------------------------------------------
# transfer figures


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over label sets} for NIXL's histograms."""
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"(vllm:nixl_[a-z_]+?)(_sum|_count)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            key = m.group(1) + m.group(2)
            out[key] = out.get(key, 0.0) + float(m.group(4))
    return out


async def wait_drained(session: aiohttp.ClientSession, urls: list[str], timeout_s: float) -> None:
    """Until no instance runs or queues a request (a failed request may still be prefilling)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for url in urls:
            async with session.get(f"{url}/metrics") as r:
                for line in (await r.text()).splitlines():
                    if re.match(r"vllm:num_requests_(running|waiting)\{", line):
                        busy += float(line.rsplit(" ", 1)[1])
        if busy == 0:
            return
        await asyncio.sleep(0.5)  # polling the servers' gauges
    raise RuntimeError(f"instances still busy {timeout_s:.0f} s after the last request")


async def nixl_round_stats(session, d_url: str, before: dict[str, float], expected: int) -> dict[str, Any]:
    """The transfers of one round from D's histograms; waits (bounded) for their stats to arrive."""
    deadline = time.monotonic() + 10
    while True:
        after = await scrape(session, d_url)
        delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
        n = delta.get("vllm:nixl_xfer_time_seconds_count", 0.0)
        if n >= expected or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)  # stats reach Prometheus with the engine's next stats update
    if n <= 0:
        return {"transfers": 0}
    return {
        "transfers": int(n),
        "transfer_ms": delta.get("vllm:nixl_xfer_time_seconds_sum", 0.0) / n * 1e3,
        "post_ms": delta.get("vllm:nixl_post_time_seconds_sum", 0.0) / n * 1e3,
        "kv_bytes": delta.get("vllm:nixl_bytes_transferred_sum", 0.0) / n,
    }


def read_traces(prefix: Path) -> dict[str, dict[str, Any]]:
    """aiohixl connector traces -> {transfer_id: {event: t_ns, "req_id", "bytes"}}."""
    out: dict[str, dict[str, Any]] = {}
    for path in prefix.parent.glob(prefix.name + ".*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue  # a line being written as the arm stopped
            t = out.setdefault(str(ev.get("transfer_id")), {"bytes": 0})
            t["req_id"] = ev.get("req_id") or t.get("req_id")
            name = ev.get("event")
            if name == "first_put":
                t[name] = min(ev["t_ns"], t.get(name, ev["t_ns"]))
            elif name:  # forward_end too: the last chunk's forward is where the prefill ends
                t[name] = max(ev["t_ns"], t.get(name, ev["t_ns"]))
            if ev.get("bytes") and name in ("last_put_done", "done_sent"):
                t["bytes"] = max(t["bytes"], int(ev["bytes"]))
    return out


def aiohixl_figures(t: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"kv_bytes": t.get("bytes") or None, "transfer_id_req": t.get("req_id")}
    if "done_received" in t and "first_put" in t:
        out["transfer_ms"] = (t["done_received"] - t["first_put"]) / 1e6
    if "done_received" in t and "forward_end" in t:
        out["exposed_ms"] = max(0, t["done_received"] - t["forward_end"]) / 1e6
    return out


# ---------------------------------------------------------------------------------------------
# the run


async def run_arm(setup: Setup, arm: Arm, prompts: dict[str, list[int]]) -> dict[str, Any]:
    a = setup.args
    t_start = time.monotonic()
    print(f"[{arm.name}] starting", flush=True)
    try:
        running = await start_arm(setup, arm)
    except Exception as exc:
        print(f"[{arm.name}] did not start: {exc}", flush=True)
        return {"status": f"did not start: {exc}"}
    print(f"[{arm.name}] up after {time.monotonic() - t_start:.0f} s", flush=True)
    result: dict[str, Any] = {
        "status": "ok",
        "startup_s": time.monotonic() - t_start,
        "loadavg_at_start": os.getloadavg(),  # the machine is shared: how busy it was
        "requests": [],
    }
    timeout = aiohttp.ClientTimeout(total=a.request_timeout)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for key in [k for k in prompts if k.startswith("warm.")]:
                warm = await complete(session, running.url, prompts[key], a.max_tokens, f"{arm.name}-{key}")
                if "error" in warm:
                    raise RuntimeError(f"warm-up request failed: {warm['error']}")
            traces_seen: set[str] = set(read_traces(running.trace_prefix)) if running.trace_prefix else set()
            budget_end = time.monotonic() + a.arm_budget_s
            server_pids = [pid for p in running.servers for pid in tree(p.pid)]
            busy_from, busy_t0 = thread_ticks(server_pids), time.monotonic()
            for c in a.concurrency:
                for length in a.lengths:
                    for r in range(math.ceil(a.requests / c)):
                        if time.monotonic() > budget_end:
                            result["status"] = f"stopped early: over --arm-budget-s {a.arm_budget_s:.0f}"
                            print(f"[{arm.name}] over its time budget: skipping c={c} L={length} r={r}", flush=True)
                            continue
                        keys = [f"L{length}.c{c}.r{r}.i{i}" for i in range(c)]
                        nixl_d = running.decode_url if arm.connector == "nixl" else None
                        before = await scrape(session, nixl_d) if nixl_d else {}
                        done = await asyncio.gather(
                            *(complete(session, running.url, prompts[k], a.max_tokens, f"{arm.name}-{k}") for k in keys)
                        )
                        nixl = {}
                        if nixl_d:
                            nixl = await nixl_round_stats(session, nixl_d, before, c)
                        transfers: list[dict[str, Any]] = []
                        if running.trace_prefix is not None:
                            traces = read_traces(running.trace_prefix)
                            new = [tid for tid in traces if tid not in traces_seen]
                            traces_seen.update(new)
                            transfers = [aiohixl_figures(traces[tid]) for tid in new]
                        for k, req in zip(keys, done, strict=True):
                            req.update(key=k, length=length, concurrency=c)
                            if arm.connector == "nixl":
                                req.update({f"nixl_{n}": v for n, v in nixl.items()})
                                req["transfer_ms"] = nixl.get("transfer_ms")
                                req["exposed_ms"] = nixl.get("transfer_ms")  # pull: all after the forward
                                req["kv_bytes"] = nixl.get("kv_bytes")
                            elif transfers:
                                # The proxy may name requests its own way: a lone transfer is the round's.
                                mine = [t for t in transfers if req["req_id"] in str(t.get("transfer_id_req"))]
                                if not mine and len(transfers) == len(keys) == 1:
                                    mine = transfers
                                if mine:
                                    req.update(mine[0])
                            result["requests"].append(req)
                        if transfers:
                            result.setdefault("transfers", []).extend(
                                dict(t, length=length, concurrency=c) for t in transfers
                            )
                        errors = [d["error"] for d in done if "error" in d]
                        print(
                            f"[{arm.name}] c={c} L={length} r={r}: "
                            + (f"errors {errors}" if errors else f"TTFT {[round(d['ttft_ms']) for d in done]} ms"),
                            flush=True,
                        )
            if running.proxy_trace is not None and running.proxy_trace.exists():
                stamps = {}
                for line in running.proxy_trace.read_text().splitlines():
                    s = json.loads(line)
                    stamps[s["req_id"]] = s
                for req in result["requests"]:
                    s = stamps.get(req["req_id"])
                    if s and "d_first" in s:
                        req["prefill_ms"] = (s["p_done"] - s["p_sent"]) / 1e6
                        req["handoff_ms"] = (s["d_first"] - s["p_done"]) / 1e6
            # Where the pair's CPU went while it served (NIXL: its progress threads beside the forward).
            result["busy_cpu"] = cpu_between(busy_from, thread_ticks(server_pids), time.monotonic() - busy_t0)
            roots = [p.pid for p in running.servers]
            await wait_drained(session, running.server_urls, a.request_timeout)
            await asyncio.sleep(a.settle_s)  # vLLM's workers poll for work a while after the last step
            result["idle_cpu"] = await idle_cpu(roots, a.idle_s)
            print(f"[{arm.name}] idle CPU {result['idle_cpu']['cores'] * 100:.2f}% of a core", flush=True)
    except Exception as exc:
        result["status"] = f"failed: {exc}"
        print(f"[{arm.name}] failed: {exc}", flush=True)
    finally:
        running.stop()
    return result


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile, interpolated between ranks (p50 of two values: their mean)."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    x = q * (len(values) - 1)
    lo = int(x)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (x - lo)


def summarize(arms: dict[str, dict[str, Any]], args: argparse.Namespace, geometry: dict[str, int]) -> dict[str, Any]:
    ref = {r["key"]: r["tokens"] for r in arms.get("single", {}).get("requests", []) if "tokens" in r}
    rows = []
    for name, res in arms.items():
        reqs = res.get("requests", [])
        for c in args.concurrency:
            for length in args.lengths:
                rs = [r for r in reqs if r.get("length") == length and r.get("concurrency") == c]
                ok = [r for r in rs if "error" not in r]
                ts = [t for t in res.get("transfers", []) if t["length"] == length and t["concurrency"] == c]
                src = ts if ts else ok  # aiohixl: every transfer of the cell; NIXL: per round, on each request
                compared = [r for r in ok if r["key"] in ref]
                rows.append(
                    {
                        "arm": name,
                        "concurrency": c,
                        "length": length,
                        "requests": len(rs),
                        "errors": len(rs) - len(ok),
                        "ttft_p50_ms": pct([r["ttft_ms"] for r in ok], 0.5),
                        "ttft_p90_ms": pct([r["ttft_ms"] for r in ok], 0.9),
                        "transfer_p50_ms": pct([t.get("transfer_ms") for t in src], 0.5),
                        "exposed_p50_ms": pct([t.get("exposed_ms") for t in src], 0.5),
                        "kv_bytes": pct([t.get("kv_bytes") for t in src], 0.5),
                        "decode_tok_s_p50": pct([r.get("decode_tok_s") for r in ok], 0.5),
                        "handoff_p50_ms": pct([r.get("handoff_ms") for r in ok], 0.5),
                        "tokens_equal": f"{sum(r['tokens'] == ref[r['key']] for r in compared)}/{len(compared)}",
                    }
                )
    single_idle = arms.get("single", {}).get("idle_cpu", {}).get("cores")
    idle = {}
    for name, res in arms.items():
        cores = res.get("idle_cpu", {}).get("cores")
        if name != "single" and cores is not None and single_idle is not None:
            idle[name] = {
                "pair_cores": cores,
                "connector_cores": cores - 2 * single_idle,
                "aiohixl_thread_cores": res["idle_cpu"].get("aiohixl_thread_cores"),
            }
    return {"rows": rows, "idle": idle, "single_idle_cores": single_idle, "goals": goals(rows, idle, args)}


def goals(rows: list[dict[str, Any]], idle: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    def cell(arm: str, c: int, length: int) -> dict[str, Any] | None:
        return next((r for r in rows if (r["arm"], r["concurrency"], r["length"]) == (arm, c, length)), None)

    out = []
    for arm in [a for a in args.arms if a.startswith("aiohixl")]:
        for c in args.concurrency:
            for length in args.lengths:
                mine, nixl = cell(arm, c, length), cell("nixl", c, length)
                if mine is None or nixl is None:
                    continue
                if length >= 1024:
                    out.append(_goal(arm, f"exposed <= 0.2x NIXL, c={c} L={length}", mine["exposed_p50_ms"],
                                     nixl["exposed_p50_ms"], 0.2))  # fmt: skip
                out.append(_goal(arm, f"TTFT p50 <= NIXL, c={c} L={length}", mine["ttft_p50_ms"],
                                 nixl["ttft_p50_ms"], 1.0))  # fmt: skip
        if arm in idle:
            v = idle[arm]["aiohixl_thread_cores"]
            if v is not None:
                out.append({"arm": arm, "goal": "idle connector CPU < 1% of a core (its threads)", "value": v,
                            "met": v < 0.01})  # fmt: skip
            v = idle[arm]["connector_cores"]
            out.append({"arm": arm, "goal": "idle pair CPU - 2 x single < 1% of a core", "value": v, "met": v < 0.01})
    if "nixl" in idle:
        out.append({"arm": "nixl", "goal": "idle connector CPU (measured)", "value": idle["nixl"]["connector_cores"]})
    return out


def _goal(arm: str, goal: str, mine: float | None, nixl: float | None, factor: float) -> dict[str, Any]:
    met = None if mine is None or nixl is None else mine <= factor * nixl
    return {"arm": arm, "goal": goal, "value": mine, "nixl": nixl, "met": met}


def fmt(v: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def print_table(summary: dict[str, Any]) -> str:
    head = ("arm", "c", "tokens", "n", "TTFT p50", "TTFT p90", "KV MiB", "xfer p50", "exposed p50", "tok/s", "equal")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["rows"]:
        n = f"{r['requests']}" + (f" ({r['errors']} err)" if r["errors"] else "")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["arm"],
                    str(r["concurrency"]),
                    str(r["length"]),
                    n,
                    fmt(r["ttft_p50_ms"]),
                    fmt(r["ttft_p90_ms"]),
                    fmt(r["kv_bytes"], 1 / 2**20, 2),
                    fmt(r["transfer_p50_ms"], 1, 2),
                    fmt(r["exposed_p50_ms"], 1, 2),
                    fmt(r["decode_tok_s_p50"]),
                    r["tokens_equal"],
                ]
            )  # fmt: skip
            + " |"
        )
    lines.append("")
    lines.append(f"single instance idle: {fmt(summary['single_idle_cores'], 100, 2)}% of a core")
    for name, v in summary["idle"].items():
        lines.append(
            f"{name}: pair idle {fmt(v['pair_cores'], 100, 2)}% of a core, "
            f"connector (pair - 2 x single) {fmt(v['connector_cores'], 100, 2)}%, "
            f"aiohixl's threads {fmt(v.get('aiohixl_thread_cores'), 100, 2)}%"
        )
    lines.append("")
    for g in summary["goals"]:
        met = {True: "met", False: "NOT met", None: "n/a"}[g.get("met")] if "met" in g else "measured"
        extra = f" (NIXL {fmt(g['nixl'], 1, 2)})" if g.get("nixl") is not None else ""
        val = fmt(g["value"], 100, 2) + "% of a core" if "CPU" in g["goal"] else fmt(g["value"], 1, 2) + " ms"
        lines.append(f"{g['arm']}: {g['goal']}: {val}{extra}: {met}")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def model_geometry(model: str) -> dict[str, int]:
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return {
        "layers": cfg["num_hidden_layers"],
        "kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": head_dim,
        "vocab": cfg["vocab_size"],
        "dtype_bytes": 4,  # the bench serves --dtype float32
    }


def resummarize(path: str) -> int:
    """Print the table and goals of an earlier run's JSON again (with this version's summary)."""
    out = json.loads(Path(path).read_text())
    args = argparse.Namespace(**out["meta"]["args"])
    out["summary"] = summarize(out["arms"], args, out["meta"]["geometry"])
    out["table"] = print_table(out["summary"])
    Path(path).write_text(json.dumps(out, indent=1))
    return 0


async def amain(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or f"/tmp/vllm_pd_bench.{os.getpid()}")
    workdir.mkdir(parents=True, exist_ok=True)
    geometry = model_geometry(args.model)
    prompts = prompts_for(args, geometry["vocab"])
    setup = Setup(args, workdir, secrets.token_hex(16))
    print(f"workdir {workdir}; arms {', '.join(args.arms)}", flush=True)
    arms: dict[str, dict[str, Any]] = {}
    for name in args.arms:
        arms[name] = await run_arm(setup, ARM_SPECS[name], prompts)
    summary = summarize(arms, args, geometry)
    table = print_table(summary)
    token_bytes = 2 * geometry["layers"] * geometry["kv_heads"] * geometry["head_dim"] * geometry["dtype_bytes"]
    out = {
        "meta": {
            "argv": sys.argv,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "geometry": geometry,
            "kv_bytes_per_token": token_bytes,
            "args": vars(args),
        },
        "summary": summary,
        "table": table,
        "arms": arms,
    }
    Path(args.json or workdir / "bench.json").write_text(json.dumps(out, indent=1))
    print(f"JSON: {args.json or workdir / 'bench.json'}", flush=True)
    return 0 if all(v.get("status") == "ok" for v in arms.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory (examples/vllm_pd/make_model.py OUTDIR)")
    ap.add_argument("--summarize", metavar="JSON", help="only print (and rewrite) the summary of an earlier run")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--lengths", default="128,512,1024,2048", help="prompt lengths in tokens")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=4, help="requests per length and concurrency")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's CPU default")
    ap.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the longest prompt + max-tokens")
    ap.add_argument("--idle-s", type=float, default=10.0, help="idle CPU window")
    ap.add_argument("--settle-s", type=float, default=10.0, help="quiet time before the idle window")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="per arm (the machine may be busy)")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--arm-budget-s", type=float, default=600.0, help="no new round after this long measuring one arm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--python", default=sys.executable, help="the Python with vLLM installed")
    ap.add_argument("--workdir", default=None, help="logs and traces (default /tmp/vllm_pd_bench.PID)")
    ap.add_argument("--json", default=None, help="where to write the results (default WORKDIR/bench.json)")
    args = ap.parse_args()
    if args.summarize:
        return resummarize(args.summarize)
    if not args.model:
        ap.error("--model is required")
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in args.arms if a not in ARM_SPECS]
    if unknown:
        ap.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    if args.max_model_len is None:
        args.max_model_len = max(args.lengths) + args.max_tokens
    return asyncio.run(with_signals(amain(args)))


async def with_signals(coro: Any) -> int:
    """SIGTERM/SIGINT cancel the run, so that each arm's ``finally`` stops its servers."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        print("interrupted: servers stopped", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
