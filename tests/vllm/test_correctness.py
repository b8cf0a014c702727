"""Greedy tokens through the proxy equal a single instance's, over shared memory and over tcp."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest

from .conftest import BLOCK, MAX_LEN, Cluster, http_json

MAX_TOKENS = 8


def prompt(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1024) for _ in range(n)]


def body(ids: list[int], max_tokens: int = MAX_TOKENS, **kw: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }


def tokens(url: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    status, out = http_json(f"{url}/v1/completions", body(ids, max_tokens))
    assert status == 200, out
    return list(out["choices"][0]["token_ids"])


async def tokens_async(session: aiohttp.ClientSession, url: str, ids: list[int], stream: bool) -> list[int]:
    async with session.post(f"{url}/v1/completions", json=body(ids, stream=stream)) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return list((await r.json())["choices"][0]["token_ids"])
        got: list[int] = []
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                got += chunk["choices"][0].get("token_ids") or []
        return got


@pytest.fixture(params=["shm", "tcp"])
def proxy(request: pytest.FixtureRequest, cluster: Cluster) -> str:
    return cluster.proxy.url if request.param == "shm" else cluster.proxy_tcp.url  # type: ignore[attr-defined]


LENGTHS = [
    5,  # shorter than a block
    BLOCK,  # exactly one block
    BLOCK + 1,  # one full block and one token of the next
    3 * BLOCK - 7,  # partial last block
    200,  # chunked on the tcp pair (64-token steps), whole on the shm pair
    MAX_LEN - MAX_TOKENS,  # as long as max_model_len allows
]


@pytest.mark.parametrize("n", LENGTHS)
def test_tokens_equal_single_instance(cluster: Cluster, proxy: str, n: int) -> None:
    ids = prompt(n, seed=n)
    assert tokens(proxy, ids) == tokens(cluster.ref.url, ids)


def test_streaming_equals_single_instance(cluster: Cluster, proxy: str) -> None:
    ids = prompt(150, seed=7)

    async def run() -> list[int]:
        async with aiohttp.ClientSession() as s:
            return await tokens_async(s, proxy, ids, stream=True)

    assert asyncio.run(run()) == tokens(cluster.ref.url, ids)


def test_decode_prefix_hits(cluster: Cluster, proxy: str) -> None:
    """Decode already holds part of the prompt: only the rest is pushed, and the tokens stay exact."""
    base = prompt(4 * BLOCK, seed=11 if proxy == cluster.proxy.url else 12)  # type: ignore[attr-defined]
    assert tokens(proxy, base) == tokens(cluster.ref.url, base)
    again = base  # every full block but the last hits decode's cache
    assert tokens(proxy, again) == tokens(cluster.ref.url, again)
    partial = base[: 2 * BLOCK + 5] + prompt(40, seed=13)  # two blocks hit, the rest is new
    assert tokens(proxy, partial) == tokens(cluster.ref.url, partial)


def test_concurrent_mixed_lengths(cluster: Cluster, proxy: str) -> None:
    rnd = random.Random(3)
    prompts = [prompt(rnd.choice([3, 31, 33, 64, 100, 257, 500, 900]), seed=100 + i) for i in range(16)]
    want = [tokens(cluster.ref.url, ids) for ids in prompts]

    async def run() -> list[list[int]]:
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(
                *[tokens_async(s, proxy, ids, stream=i % 2 == 0) for i, ids in enumerate(prompts)]
            )

    assert asyncio.run(run()) == want


def test_kv_caches_drain(cluster: Cluster) -> None:
    """After everything above, no instance holds a block for a finished request."""
    for server in (cluster.p, cluster.pt, cluster.d):
        server.wait_drained()


def test_trace_has_every_event(cluster: Cluster) -> None:
    events: dict[str, set[str]] = {}
    for path in cluster.trace.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            events.setdefault(e["transfer_id"], set()).add(e["event"])
    assert events
    full = {"first_put", "forward_end", "last_put_done", "done_sent", "done_received"}
    assert any(seen == full for seen in events.values()), events
