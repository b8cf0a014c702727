"""Failures mid-transfer and at startup: bounded, freed, named, and served again afterwards.

Runs after test_correctness (it kills and restarts the shared decode and tcp-prefill instances).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import time
from pathlib import Path

import aiohttp
import pytest

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
        every=0.002,
    )


def stopped_mid_transfer(cluster: Cluster, before: set[str]) -> bool:
    """Stops the tcp prefill instance (SIGSTOP) as it pushes the transfer it started after
    ``before``: True with the instance stopped and that transfer unfinished. A transfer can be
    over within 0.2 s of its first put (15 steps on a fast host): then the instance is let go on
    (SIGCONT) and False says so; the caller tries another request."""
    transfer = when_pushing(cluster, before)
    cluster.pt.send_signal(signal.SIGSTOP)
    if transfer not in transfers(cluster.trace, "pt", "last_put_done"):
        return True
    cluster.pt.send_signal(signal.SIGCONT)
    return False


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
    for seed in range(22, 22 + 5 * 100, 100):
        ids = prompt(LONG, seed=seed)
        before = transfers(cluster.trace, "pt", "first_put")
        t0 = time.monotonic()
        answer = post_in_thread(url, ids)
        if stopped_mid_transfer(cluster, before):
            break
        assert answer.result(120)[0] == 200  # over before it was stopped: another prompt
    else:
        pytest.fail("each of 5 transfers was over before the prefill instance could be stopped")
    cluster.pt.kill()
    status, out = answer.result(120)  # decode's waiting request fails: it never waits forever
    assert status == 502, out
    assert time.monotonic() - t0 < 120
    cluster.d.wait_drained(60)
    restart(cluster.pt)
    assert tokens(url, ids) == tokens(cluster.ref.url, ids)


def test_client_abort_mid_transfer(cluster: Cluster) -> None:
    url = cluster.proxy_tcp.url  # type: ignore[attr-defined]

    async def abort() -> None:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as s:
            for seed in range(23, 23 + 5 * 100, 100):
                ids = prompt(LONG, seed=seed)
                before = transfers(cluster.trace, "pt", "first_put")
                request = asyncio.ensure_future(s.post(f"{url}/v1/completions", json=body(ids, stream=True)))
                if await loop.run_in_executor(None, stopped_mid_transfer, cluster, before):
                    break
                async with await request as answer:  # over before it was stopped: another prompt
                    await answer.read()
            else:
                pytest.fail("each of 5 transfers was over before the prefill instance could be stopped")
            request.cancel()  # the client goes away mid-transfer
            try:
                (await request).close()
            except asyncio.CancelledError:
                pass
            finally:
                cluster.pt.send_signal(signal.SIGCONT)  # the instance goes on, its client gone

    asyncio.run(abort())
    # Both sides free the request's blocks...
    cluster.pt.wait_drained(120)
    cluster.d.wait_drained(120)
    # ...and no late push lands in blocks given to later requests: their tokens stay exact.
    for n, seed in ((LONG, 24), (300, 25)):
        again = prompt(n, seed=seed)
        assert tokens(url, again) == tokens(cluster.ref.url, again)
