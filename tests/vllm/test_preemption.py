"""Preemption on the decode side: a request whose KV arrived, preempted while it decodes, is
recomputed there (never asked of prefill twice) and still gives the single instance's tokens.

Decode here has room for 47 blocks of 32 tokens (6 MiB): four requests of 10-block prompts are
all admitted, then outgrow it as they decode (17 blocks each by the end), so vLLM must preempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from .conftest import BLOCK, Cluster, Proc, Server, http_json, wait_until
from .test_correctness import body, prompt, tokens

PROMPT = 10 * BLOCK
MAX_TOKENS = 7 * BLOCK - 4
REQUESTS = 4


@pytest.fixture(scope="module")
def small_decode(cluster: Cluster) -> Iterator[tuple[Server, Proc]]:
    ds = Server(
        "ds",
        cluster.model,
        cluster.root,
        cluster.store_url,
        role="kv_consumer",
        cpu=1,
        trace=cluster.trace,
        args=("--kv-cache-memory-bytes", str(6 << 20)),  # the last one given wins
    )
    proxy = cluster.make_proxy("proxy-small", cluster.p, ds)
    ds.start()
    proxy.start()
    try:
        ds.wait_healthy()
        wait_until("the proxy to answer", lambda: _answers(proxy), 120)
        yield ds, proxy
    finally:
        for proc in (proxy, ds):
            if proc.alive():
                proc.kill()


def _answers(proxy: Proc) -> bool:
    try:
        return http_json(f"{proxy.url}/health", timeout=5)[0] == 200  # type: ignore[attr-defined]
    except OSError:
        return False


async def _completions(url: str, prompts: list[list[int]]) -> list[list[int]]:
    async def one(session: aiohttp.ClientSession, ids: list[int]) -> list[int]:
        async with session.post(f"{url}/v1/completions", json=body(ids, MAX_TOKENS)) as r:
            assert r.status == 200, await r.text()
            return list((await r.json())["choices"][0]["token_ids"])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        return await asyncio.gather(*(one(session, ids) for ids in prompts))


def test_decode_preempts_and_recomputes_with_the_same_tokens(
    cluster: Cluster, small_decode: tuple[Server, Proc]
) -> None:
    ds, proxy = small_decode
    prompts = [prompt(PROMPT, seed=500 + i) for i in range(REQUESTS)]
    preempted = ds.metric("vllm:num_preemptions_total")
    got = asyncio.run(_completions(proxy.url, prompts))  # type: ignore[attr-defined]
    assert ds.metric("vllm:num_preemptions_total") > preempted, "decode never preempted: the test proves nothing"
    for ids, out in zip(prompts, got, strict=True):
        assert out == tokens(cluster.ref.url, ids, MAX_TOKENS)
    ds.wait_drained()
    cluster.p.wait_drained()
