"""Decode server (FastAPI + uvicorn): owns the paged KV pool; generates from what lands in it.

Joins the job as a rank of group "decode" (``aiohixl.init``). The pool is one
``allocate_registered`` of fixed-size blocks, published as "kv"; a small region "meta"
(REMOTE_READ) says where this server's HTTP endpoint is and the pool's geometry, so the
prefill server needs nothing but the rendezvous store to find both.

    POST /reserve {"tokens", "max_new_tokens"} -> {"req": id, "blocks": [...]}   blocks for a request
    aiohixl notification b"kv:<req>:<first token>"  -> the request's KV is all in place: generate
    POST /kv/<req>  (body: safetensors, header X-First-Token)  -> the HTTP-body baseline's way in
    GET  /result/<req>  -> {"tokens", "t_ready", "decode_s", "kv_sha256"}  (waits for it)
    POST /cancel/<req>, GET /health (free blocks), GET /metrics (Prometheus)

While KV lands this server calls nothing: the prefill server's puts write the pool, and the
notification, delivered only after every byte is in place, starts the generation.
Generation runs on one worker thread so the event loop keeps taking notifications.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import logging
import socket
import sys

import torch
import uvicorn
from common import BLOCK_TOKENS, Geometry, build_model, cache_from_kv, decode, kv_digest, now, token
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from safetensors.torch import load as st_load

import aiohixl
from aiohixl.metrics import AgentCollector

log = logging.getLogger("decode")


class Pending:
    def __init__(self, rid: int, tokens: int, max_new: int, blocks: list[int]) -> None:
        self.rid, self.tokens, self.max_new, self.blocks = rid, tokens, max_new, blocks
        self.result: asyncio.Future = asyncio.get_running_loop().create_future()
        self.started = False
        self.freed = False
        self.timer: asyncio.TimerHandle | None = None


class DecodeServer:
    def __init__(self, ctx: aiohixl.Context, num_blocks: int, reserve_timeout: float) -> None:
        self.ctx = ctx
        self.model = build_model()
        self.g = Geometry.of(self.model)
        self.num_blocks = num_blocks
        g = self.g
        self.pool_region = ctx.allocate_registered(
            g.layers * num_blocks * BLOCK_TOKENS * g.token_bytes, access="remote_write", name="kv"
        )
        self.pool = torch.frombuffer(self.pool_region.memory, dtype=torch.float32).view(
            g.layers, num_blocks, BLOCK_TOKENS, 2, g.kv_heads, g.head_dim
        )
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.pending: dict[int, Pending] = {}
        self.next_id = 1
        self.reserve_timeout = reserve_timeout
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode")
        self.metrics = CollectorRegistry()
        AgentCollector(ctx.agent).register(self.metrics)
        Gauge("pd_decode_free_blocks", "Free blocks in the KV pool", registry=self.metrics).set_function(
            lambda: len(self.free)
        )
        self.served = 0

    def publish_meta(self, http: str) -> None:
        meta = json.dumps(
            dict(
                http=http,
                blocks=self.num_blocks,
                block_tokens=BLOCK_TOKENS,
                layers=self.g.layers,
                kv_heads=self.g.kv_heads,
                head_dim=self.g.head_dim,
                dtype="float32",
                layout="[layers, blocks, block_tokens, 2, kv_heads, head_dim]",
            )
        ).encode()
        region = self.ctx.allocate_registered(4096, access="remote_read", name="meta")
        region.memory[: len(meta)] = meta

    # ---- blocks ----

    def reserve(self, tokens: int, max_new: int) -> Pending:
        need = self.g.blocks_for(tokens)
        if tokens < 1 or need > len(self.free):
            raise HTTPException(503, f"KV pool full: {tokens} tokens need {need} blocks, {len(self.free)} free")
        blocks = sorted(self.free.popleft() for _ in range(need))
        p = Pending(self.next_id, tokens, max_new, blocks)
        self.next_id += 1
        self.pending[p.rid] = p
        # A request whose KV never comes (its prefill failed) gives its blocks back.
        p.timer = asyncio.get_running_loop().call_later(self.reserve_timeout, self.expire, p.rid)
        return p

    def release(self, p: Pending) -> None:
        """The request's blocks go back to the pool (once); its result stays until fetched."""
        if p.freed:
            return
        p.freed = True
        if p.timer is not None:
            p.timer.cancel()
        self.free.extend(p.blocks)
        # a result nobody fetches is dropped after a while
        asyncio.get_running_loop().call_later(self.reserve_timeout, self.pending.pop, p.rid, None)

    def expire(self, rid: int) -> None:
        p = self.pending.get(rid)
        if p is not None and not p.started:
            self.release(p)
            if not p.result.done():
                p.result.set_exception(HTTPException(504, f"request {rid}: no KV arrived in {self.reserve_timeout} s"))

    # ---- generation ----

    def kv_of(self, p: Pending) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The request's K and V per layer, gathered from its blocks: [1, kv_heads, tokens, head_dim]."""
        idx = torch.tensor(p.blocks)
        out = []
        for layer in range(self.g.layers):
            x = self.pool[layer].index_select(0, idx).reshape(-1, 2, self.g.kv_heads, self.g.head_dim)[: p.tokens]
            out.append(tuple(x[:, s].permute(1, 0, 2).unsqueeze(0).contiguous() for s in (0, 1)))
        return out

    def start(self, p: Pending, first: int) -> None:
        """Every byte of the request's KV is in the pool: build the cache and generate."""
        t_ready = now()
        p.started = True
        if p.timer is not None:
            p.timer.cancel()

        def run() -> dict:
            t0 = now()
            kv = self.kv_of(p)
            tokens = decode(self.model, cache_from_kv(self.model, kv), first, p.max_new)
            t1 = now()
            return dict(tokens=tokens, t_ready=t_ready, decode_s=t1 - t0, kv_sha256=kv_digest(kv))

        fut = asyncio.get_running_loop().run_in_executor(self.worker, run)

        def done(f: asyncio.Future) -> None:
            self.release(p)
            self.served += 1
            if p.result.done():
                return
            if f.exception() is not None:
                p.result.set_exception(f.exception())
            else:
                p.result.set_result(f.result())

        fut.add_done_callback(done)

    async def notifications(self) -> None:
        """One task takes every notification and starts the request it names."""
        async for note in self.ctx.agent.notifications():
            try:
                kind, rid, first = note.data.decode().split(":")
                p = self.pending.get(int(rid))
            except ValueError:
                log.warning("decode: unexpected notification %r", note.data)
                continue
            if kind == "kv" and p is not None and not p.started:
                self.start(p, int(first))


def make_app(server: DecodeServer) -> FastAPI:
    app = FastAPI()

    @app.post("/reserve")
    async def reserve(body: dict) -> dict:
        p = server.reserve(int(body["tokens"]), int(body.get("max_new_tokens", 16)))
        return {"req": p.rid, "blocks": p.blocks}

    @app.post("/kv/{rid}")
    async def kv_body(rid: int, request: Request) -> dict:
        """The HTTP baseline: the whole KV in the body (safetensors: raw tensor bytes and a JSON
        header, no pickle), copied into the request's blocks."""
        p = server.pending.get(rid)
        if p is None or p.started:
            raise HTTPException(404, f"no request {rid} waiting for KV")
        body = await request.body()
        kv = st_load(body)["kv"]  # [layers, tokens, 2, kv_heads, head_dim]
        if tuple(kv.shape) != (server.g.layers, p.tokens, 2, server.g.kv_heads, server.g.head_dim):
            raise HTTPException(400, f"KV of shape {tuple(kv.shape)} for a request of {p.tokens} tokens")
        for j, b in enumerate(p.blocks):
            n = min(BLOCK_TOKENS, p.tokens - j * BLOCK_TOKENS)
            server.pool[:, b, :n] = kv[:, j * BLOCK_TOKENS : j * BLOCK_TOKENS + n]
        server.start(p, int(request.headers["x-first-token"]))
        return {"req": rid, "bytes": len(body)}

    @app.get("/result/{rid}")
    async def result(rid: int) -> dict:
        p = server.pending.get(rid)
        if p is None:
            raise HTTPException(404, f"no request {rid}")
        out = await asyncio.shield(p.result)
        server.pending.pop(rid, None)
        return out

    @app.post("/cancel/{rid}")
    async def cancel(rid: int) -> dict:
        p = server.pending.get(rid)
        if p is not None and not p.started:
            server.release(p)
            server.pending.pop(rid, None)
            p.result.cancel()
        return {"req": rid}

    @app.get("/health")
    async def health() -> dict:
        return {
            "free_blocks": len(server.free),
            "blocks": server.num_blocks,
            "pending": sum(not p.freed for p in server.pending.values()),
            "served": server.served,
            "stats": server.ctx.agent.stats(),
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(server.metrics).decode())

    return app


async def main(args: argparse.Namespace) -> None:
    token()
    ctx = await aiohixl.init(rank=args.rank, group="decode", store=args.store, listen=args.listen or f"{args.host}:0")
    async with ctx:
        server = DecodeServer(ctx, args.blocks, args.reserve_timeout)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen(256)  # connections queue from now: READY means reachable
        http = f"http://{args.host}:{sock.getsockname()[1]}"
        server.publish_meta(http)
        config = uvicorn.Config(make_app(server), loop="asyncio", log_level="warning", lifespan="off")
        web = uvicorn.Server(config)
        notes = asyncio.create_task(server.notifications())
        print(f"READY {http} rank={args.rank} agent={ctx.agent.address}", flush=True)
        try:
            await web.serve(sockets=[sock])
        finally:
            notes.cancel()
            server.worker.shutdown(wait=True, cancel_futures=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True, help="tcp://HOST:PORT of the rendezvous store (rank 0 serves it)")
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--host", default="127.0.0.1", help="the HTTP server's address")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--listen", help="HOST:PORT of the aiohixl agent (default: --host, a free port)")
    ap.add_argument("--blocks", type=int, default=512, help="blocks of 16 tokens in the KV pool")
    ap.add_argument("--reserve-timeout", type=float, default=120.0)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main(ap.parse_args()))
