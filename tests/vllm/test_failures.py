"""Failures mid-transfer and at startup: bounded, freed, named, and served again afterwards.

Runs after test_correctness (it kills and restarts the shared decode and tcp-prefill instances).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from pathlib import Path

import aiohttp

from .conftest import Cluster, Server, http_json, wait_until
from .test_correctness import body, prompt, tokens

LONG = 960  # 15 prefill steps of 64 tokens on the tcp pair: time to act mid-transfer


def transfers(trace: Path, engine: str, event: str) -> set[str]:
    out = set()
    for path in trace.glob(f"{engine}.*.jsonl"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == event:
                out.add(e["transfer_id"])
    return out


def when_pushing(cluster: Cluster, before: set[str]) -> str:
    """The transfer the tcp prefill instance started pushing after ``before`` was taken."""
    return wait_until(
        "a new transfer's first put",
        lambda: next(iter(transfers(cluster.trace, "pt", "first_put") - before), None),
        120,
    )


def post_in_thread(url: str, ids: list[int]) -> concurrent.futures.Future[tuple[int, object]]:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(http_json, f"{url}/v1/completions", body(ids), 300.0)
    pool.shutdown(wait=False)
    return fut


def restart(server: Server) -> None:
    server.start()
    server.wait_healthy()


def test_startup_refuses_mismatched_block_size_and_wrong_token(cluster: Cluster) -> None:
    bad_block = Server(
        "d-block64",
        cluster.model,
        cluster.root,
        cluster.store_url,
        role="kv_consumer",
        cpu=1,
        args=("--block-size", "64"),
    )
    # --block-size is given twice: the last one wins.
    bad_token = Server(
        "d-token", cluster.model, cluster.root, cluster.store_url, role="kv_consumer", cpu=1, token="not-the-token"
    )
    for s in (bad_block, bad_token):
        s.start()
    for s in (bad_block, bad_token):
        wait_until(f"{s.name} to exit", lambda s=s: not s.alive(), 900, every=1.0)
    log = bad_block.log.read_text(errors="replace")
    assert "different KV layouts" in log and "block: 64 here, 32 there" in log, bad_block.tail()
    log = bad_token.log.read_text(errors="replace")
    assert "AuthenticationError" in log, bad_token.tail()


def test_decode_killed_mid_transfer(cluster: Cluster) -> None:
    url = cluster.proxy_tcp.url  # type: ignore[attr-defined]
    ids = prompt(LONG, seed=21)
    before = transfers(cluster.trace, "pt", "first_put")
    answer = post_in_thread(url, ids)
    when_pushing(cluster, before)
    cluster.d.kill()
    status, out = answer.result(120)
    assert status == 502 and "decode instance" in json.dumps(out), out
    # Prefill frees the request's blocks and keeps serving.
    cluster.pt.wait_drained(120)
    assert tokens(cluster.pt.url, ids[:50]) == tokens(cluster.ref.url, ids[:50])
    restart(cluster.d)
    assert tokens(url, ids) == tokens(cluster.ref.url, ids)
    cluster.d.wait_drained()


def test_prefill_killed_mid_transfer(cluster: Cluster) -> None:
    url = cluster.proxy_tcp.url  # type: ignore[attr-defined]
    ids = prompt(LONG, seed=22)
    before = transfers(cluster.trace, "pt", "first_put")
    t0 = time.monotonic()
    answer = post_in_thread(url, ids)
    when_pushing(cluster, before)
    cluster.pt.kill()
    status, out = answer.result(120)  # decode's waiting request fails: it never waits forever
    assert status == 502, out
    assert time.monotonic() - t0 < 120
    cluster.d.wait_drained(60)
    restart(cluster.pt)
    assert tokens(url, ids) == tokens(cluster.ref.url, ids)


def test_client_abort_mid_transfer(cluster: Cluster) -> None:
    url = cluster.proxy_tcp.url  # type: ignore[attr-defined]
    ids = prompt(LONG, seed=23)
    before = transfers(cluster.trace, "pt", "first_put")

    async def abort() -> None:
        async with aiohttp.ClientSession() as s:
            request = asyncio.ensure_future(s.post(f"{url}/v1/completions", json=body(ids, stream=True)))
            await asyncio.get_running_loop().run_in_executor(None, when_pushing, cluster, before)
            request.cancel()  # the client goes away mid-transfer
            try:
                (await request).close()
            except asyncio.CancelledError:
                pass

    asyncio.run(abort())
    # Both sides free the request's blocks...
    cluster.pt.wait_drained(120)
    cluster.d.wait_drained(120)
    # ...and no late push lands in blocks given to later requests: their tokens stay exact.
    for n, seed in ((LONG, 24), (300, 25)):
        again = prompt(n, seed=seed)
        assert tokens(url, again) == tokens(cluster.ref.url, again)
