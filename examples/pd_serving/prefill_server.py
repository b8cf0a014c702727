"""Prefill server (aiohttp): runs the prompt's forward pass and pushes its KV into a decode server.

    POST /generate {"prompt_ids": [...], "max_new_tokens": N, "mode": "layerwise"}
      -> {"tokens": [...], "timing": {...}}, or HTTP 503 {"error": reason} when no decode server
         could take the request (none found, it died, its pool is full)
    GET /health, GET /metrics (Prometheus: the agent's counters and the requests served)

Rank 0 of group "prefill" (``aiohixl.init``); by default it serves the rendezvous store
(embedded, tcp). Decode servers are found in the store: ``find_decode`` is the one
function that knows how (group "decode", their regions "kv" and "meta").

Per request: the decode server reserves blocks in its pool and hands back the block table;
the forward pass runs on one compute thread, and a forward hook per decoder layer copies
that layer's K and V into a registered staging buffer and asks the event loop
(``call_soon_threadsafe``) to ``put_many`` them into the request's blocks at once, so the
transfer of layer i overlaps the compute of layers i+1...; when the forward pass is done
and every put has completed, one notification ``kv:<req>:<first token>`` tells the decode
server to generate. Why a thread and not yielding between layers: the forward is
transformers' own (one call), so the hooks cannot await; on its thread torch releases the
GIL in its kernels and the event loop stays free to post puts, take completions and serve
HTTP while the layers compute.

Modes (for the comparison in run.py): "layerwise" (above), "whole" (one put_many of every
layer after the forward pass: no overlap), "http" (the KV serialized with safetensors, no
pickle, in the body of an HTTP POST to the decode server: what users do today).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import torch
from aiohttp import web
from common import MODES, Geometry, LayerTap, build_model, layer_pairs, now, prefill, token
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from safetensors.torch import save as st_save

import aiohixl
from aiohixl.metrics import AgentCollector

log = logging.getLogger("prefill")


class DecodeUnavailable(Exception):
    """No decode server can take the request now: the client gets HTTP 503 with this reason."""


@dataclass
class Decode:
    """A decode server as found in the store."""

    rank: int
    http: str
    blocks: int
    peer: Any
    kv: Any  # its pool, a RemoteRegion


async def find_decode(ctx: aiohixl.Context, session: aiohttp.ClientSession, n: int, timeout: float) -> Decode:
    """Discovery, all of it: the ``n``-th decode rank (round robin) in the store, its pool and its meta."""
    try:
        ranks = await ctx.wait_ranks(1, group="decode", timeout=timeout)
        rank = sorted(ranks)[n % len(ranks)]
        kv = await ctx.get_remote_mem(rank, name="kv", timeout=timeout)
        meta_remote = await ctx.get_remote_mem(rank, name="meta", timeout=timeout)
        peer = await ctx.peer(rank, timeout=timeout)
    except (aiohixl.HixlError, OSError) as exc:
        raise DecodeUnavailable(f"no decode server found: {exc}") from None
    local = ctx.agent.register(bytearray(meta_remote.nbytes))
    try:
        await peer.get(local, meta_remote)
        meta = json.loads(bytes(local.memory).rstrip(b"\0"))
    finally:
        await local.close()
    return Decode(rank, meta["http"], meta["blocks"], peer, kv)


@dataclass
class Timing:
    t_recv: float = 0.0
    compute_start: float = 0.0
    compute_end: float = 0.0
    puts: list[tuple[float, float]] = field(default_factory=list)  # (posted, completed) per put_many
    notified: float = 0.0
    kv_bytes: int = 0

    def summary(self) -> dict[str, float]:
        """transfer_s: time in which some KV op was in flight (the union of their intervals);
        exposed_s: the part of it after the forward pass ended; overlap: the rest, as a fraction."""
        busy = exposed = 0.0
        end = -1.0
        for a, b in sorted(self.puts):
            a = max(a, end)
            if b > a:
                busy += b - a
                exposed += max(0.0, b - max(a, self.compute_end))
                end = b
        return dict(
            t_recv=self.t_recv,
            compute_s=self.compute_end - self.compute_start,
            queue_s=self.compute_start - self.t_recv,
            transfer_s=busy,
            exposed_s=exposed,
            overlap=(busy - exposed) / busy if busy > 0 else 0.0,
            kv_bytes=self.kv_bytes,
            puts=len(self.puts),
        )


class PrefillServer:
    def __init__(self, ctx: aiohixl.Context, max_tokens: int, slots: int, discover_timeout: float = 5.0) -> None:
        self.ctx = ctx
        self.discover_timeout = discover_timeout
        self.model = build_model()
        self.g = Geometry.of(self.model)
        self.tap = LayerTap(self.model)
        self.max_tokens = max_tokens
        g = self.g
        # Staging: registered once, `slots` requests' worth; peers may do nothing with it.
        self.slot_bytes = g.layers * max_tokens * g.token_bytes
        self.staging = ctx.agent.allocate(slots * self.slot_bytes, access=aiohixl.Access.NONE)
        whole = torch.frombuffer(self.staging.memory, dtype=torch.float32)
        self.views = [
            whole[s * self.slot_bytes // 4 : (s + 1) * self.slot_bytes // 4].view(
                g.layers, max_tokens, 2, g.kv_heads, g.head_dim
            )
            for s in range(slots)
        ]
        self.slots: asyncio.Queue[int] = asyncio.Queue()
        for s in range(slots):
            self.slots.put_nowait(s)
        self.compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill")
        self.decode: Decode | None = None
        self.lock = asyncio.Lock()
        self.turn = 0
        self.session: aiohttp.ClientSession | None = None
        self.metrics = CollectorRegistry()
        AgentCollector(ctx.agent).register(self.metrics)
        self.requests = Counter("pd_prefill_requests", "Requests", ["mode", "outcome"], registry=self.metrics)
        self.ttft = Histogram("pd_prefill_kv_ready_seconds", "Request received to KV at decode", registry=self.metrics)

    async def get_decode(self) -> Decode:
        async with self.lock:
            if self.decode is None or self.decode.peer.broken is not None or self.decode.peer.closed:
                assert self.session is not None
                self.decode = await find_decode(self.ctx, self.session, self.turn, self.discover_timeout)
                self.turn += 1
            return self.decode

    def forget(self, decode: Decode) -> None:
        if self.decode is decode:
            self.decode = None

    async def generate(self, prompt: list[int], max_new: int, mode: str) -> dict:
        tm = Timing(t_recv=now())
        if not 0 < len(prompt) <= self.max_tokens:
            raise web.HTTPBadRequest(text=f"prompt of {len(prompt)} tokens: 1 to {self.max_tokens}")
        if not all(isinstance(t, int) and 0 <= t < self.model.config.vocab_size for t in prompt):
            raise web.HTTPBadRequest(text="prompt_ids must be token ids below the vocabulary size")
        decode = await self.get_decode()
        session = self.session
        assert session is not None
        try:
            async with session.post(
                f"{decode.http}/reserve", json={"tokens": len(prompt), "max_new_tokens": max_new}
            ) as r:
                if r.status != 200:
                    raise DecodeUnavailable(f"decode server refused: {r.status} {await r.text()}")
                reserved = await r.json()
            rid, blocks = reserved["req"], reserved["blocks"]
        except (aiohttp.ClientError, OSError) as exc:
            self.forget(decode)
            raise DecodeUnavailable(f"decode server unreachable: {exc!r}") from None
        slot = await self.slots.get()
        try:
            first = await self.push(decode, rid, blocks, prompt, slot, mode, tm)
        except (aiohixl.HixlError, aiohttp.ClientError, OSError) as exc:
            self.forget(decode)
            await self.cancel(decode, rid)
            raise DecodeUnavailable(f"decode server lost during the KV transfer: {exc!r}") from None
        finally:
            self.slots.put_nowait(slot)
        try:
            async with session.get(f"{decode.http}/result/{rid}") as r:
                if r.status != 200:
                    raise DecodeUnavailable(f"decode server failed request {rid}: {r.status} {await r.text()}")
                out = await r.json()
        except (aiohttp.ClientError, OSError) as exc:
            self.forget(decode)
            raise DecodeUnavailable(f"decode server lost while generating: {exc!r}") from None
        timing = tm.summary() | dict(
            t_ready=out["t_ready"],
            decode_s=out["decode_s"],
            first_token=first,
            decode_rank=decode.rank,
            transport=await decode.peer.path(decode.kv) if mode != "http" else "http",
        )
        self.ttft.observe(out["t_ready"] - tm.t_recv)
        return dict(req=rid, tokens=out["tokens"], kv_sha256=out["kv_sha256"], timing=timing)

    async def push(self, decode: Decode, rid: int, blocks: list[int], prompt: list[int], slot: int, mode: str, tm):
        """The forward pass on the compute thread, the KV into the decode server's blocks: the first token."""
        loop = asyncio.get_running_loop()
        view, base = self.views[slot], slot * self.slot_bytes
        tokens = len(prompt)
        puts: list[asyncio.Task] = []

        def pairs(layer: int) -> list[tuple[Any, Any]]:
            return [
                (decode.kv[r : r + n], self.staging[base + l : base + l + n])
                for r, l, n in layer_pairs(self.g, layer, tokens, blocks, decode.blocks, self.max_tokens)
            ]

        async def put(layers: range) -> None:
            ps = [p for layer in layers for p in pairs(layer)]
            t0 = now()
            try:
                await decode.peer.put_many(ps)
            finally:
                tm.puts.append((t0, now()))
            tm.kv_bytes += sum(len(p[1]) for p in ps)

        def on_layer(i: int, k: torch.Tensor, v: torch.Tensor) -> None:  # on the compute thread
            view[i, :tokens, 0].copy_(k[0].transpose(0, 1))
            view[i, :tokens, 1].copy_(v[0].transpose(0, 1))
            if mode == "layerwise":
                loop.call_soon_threadsafe(lambda: puts.append(loop.create_task(put(range(i, i + 1)))))

        def forward() -> int:
            tm.compute_start = now()
            try:
                return prefill(self.model, prompt, self.tap, on_layer)[0]
            finally:
                tm.compute_end = now()

        try:
            first = await loop.run_in_executor(self.compute, forward)
        finally:
            await asyncio.sleep(0)  # the puts the last hooks scheduled are tasks now
            results = await asyncio.gather(*puts, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        if mode == "whole":
            await put(range(self.g.layers))
        elif mode == "http":
            await self.http_body(decode, rid, view[:, :tokens], first, tm)
            return first
        t0 = now()
        await decode.peer.notify(f"kv:{rid}:{first}".encode())
        tm.notified = now()
        tm.puts.append((t0, tm.notified))
        return first

    async def http_body(self, decode: Decode, rid: int, kv: torch.Tensor, first: int, tm: Timing) -> None:
        assert self.session is not None
        t0 = now()
        body = st_save({"kv": kv.contiguous()})  # safetensors: a JSON header and the raw bytes
        async with self.session.post(f"{decode.http}/kv/{rid}", data=body, headers={"X-First-Token": str(first)}) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status, message=await r.text())
        tm.puts.append((t0, now()))
        tm.kv_bytes += kv.numel() * kv.element_size()

    async def cancel(self, decode: Decode, rid: int) -> None:
        assert self.session is not None
        try:
            async with self.session.post(f"{decode.http}/cancel/{rid}", timeout=aiohttp.ClientTimeout(total=2)):
                pass
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass


def make_app(server: PrefillServer) -> web.Application:
    routes = web.RouteTableDef()

    @routes.post("/generate")
    async def generate(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            prompt = [int(t) for t in body["prompt_ids"]]
            max_new = int(body.get("max_new_tokens", 16))
            mode = body.get("mode", "layerwise")
        except (ValueError, KeyError, TypeError) as exc:
            raise web.HTTPBadRequest(text=f"bad request: {exc!r}") from None
        if mode not in MODES or not 1 <= max_new <= 256:
            raise web.HTTPBadRequest(text=f"mode must be one of {MODES}, max_new_tokens 1 to 256")
        try:
            out = await server.generate(prompt, max_new, mode)
        except DecodeUnavailable as exc:
            server.requests.labels(mode, "503").inc()
            log.warning("prefill: 503: %s", exc)
            return web.json_response({"error": str(exc)}, status=503)
        server.requests.labels(mode, "ok").inc()
        return web.json_response(out)

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"stats": server.ctx.agent.stats(), "decode": getattr(server.decode, "http", None)})

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(server.metrics), content_type="text/plain")

    app = web.Application(client_max_size=1 << 20)
    app.add_routes(routes)
    return app


async def main(args: argparse.Namespace) -> None:
    token()
    transports = "auto" if args.transports == "auto" else tuple(args.transports.split(","))
    listen = args.listen or f"{args.host}:0"
    ctx = await aiohixl.init(rank=args.rank, group="prefill", store=args.store, listen=listen, transports=transports)
    async with ctx:
        server = PrefillServer(ctx, args.max_tokens, args.slots, args.discover_timeout)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            server.session = session
            runner = web.AppRunner(make_app(server), access_log=None)
            await runner.setup()
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((args.host, args.port))
            await web.SockSite(runner, sock).start()
            port = sock.getsockname()[1]
            print(f"READY http://{args.host}:{port} rank={args.rank} store={args.store}", flush=True)
            try:
                await asyncio.Event().wait()
            finally:
                await runner.cleanup()
                server.compute.shutdown(wait=True, cancel_futures=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True, help="tcp://HOST:PORT: served here when rank is 0 (embedded store)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1", help="the HTTP server's address")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--listen", help="HOST:PORT of the aiohixl agent (default: --host, a free port)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=3, help="requests staged at once")
    ap.add_argument("--transports", default="auto", help='"auto" (shm on one host) or e.g. "tcp"')
    ap.add_argument("--discover-timeout", type=float, default=5.0, help="how long to wait for a decode server")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main(ap.parse_args()))
