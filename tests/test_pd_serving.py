"""examples/pd_serving end to end: a real model, an aiohttp prefill server and a FastAPI decode
server finding each other through the ranks store, KV pushed layer by layer with aiohixl.

Needs torch, transformers, aiohttp, fastapi, uvicorn and prometheus_client (`make test
WITH_TORCH=1` installs them: the `demo` extra); skipped without them.
"""

import asyncio
import sys
from pathlib import Path

import pytest

for module in ("torch", "transformers", "safetensors", "aiohttp", "fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module)

import aiohttp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "pd_serving"))

from common import MODEL  # noqa: E402
from run import Cluster, check_exact, prompts, send  # noqa: E402

from .waiting import wait_until  # noqa: E402

BLOCKS = 256
MAX_NEW = 8
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-logs")
    c = Cluster(blocks=BLOCKS, max_tokens=1024, log_dir=logs)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        for log in sorted(logs.iterdir()):  # shown when a test failed
            print(f"--- {log.name}\n{log.read_text()[-4000:]}")


def kv_bytes(tokens: int) -> int:
    head_dim = MODEL["hidden_size"] // MODEL["num_attention_heads"]
    return MODEL["num_hidden_layers"] * 2 * tokens * MODEL["num_key_value_heads"] * head_dim * 4


async def health(session, url: str) -> dict:
    async with session.get(f"{url}/health") as r:
        assert r.status == 200
        return await r.json()


async def puts_posted(session, url: str) -> int:
    """Ops the server's agent has posted, over every transport (its /health stats)."""
    return sum(t["ops"] for t in (await health(session, url))["stats"]["transports"].values())


async def test_concurrent_requests_are_exact_and_free_their_blocks(cluster):
    reqs = prompts([100, 257, 512, 777], 1, seed=5)
    async with aiohttp.ClientSession() as session:
        records = await asyncio.gather(
            *(send(session, cluster.prefill_url, p, MAX_NEW, "layerwise", i) for i, p in enumerate(reqs))
        )
        assert [r["status"] for r in records] == [200] * 4, records
        check_exact(records, reqs, MAX_NEW)
        for rec, prompt in zip(records, reqs, strict=True):
            assert rec["exact"], rec
            assert len(rec["tokens"]) == MAX_NEW
            assert rec["kv_bytes"] == kv_bytes(len(prompt))
            assert rec["transport"] == "shm-memfd"
            assert rec["puts"] == MODEL["num_hidden_layers"] + 1  # one put_many per layer, then the notification
            assert 0.0 <= rec["overlap"] <= 1.0
        decode = await health(session, cluster.decode_url)
        assert decode["free_blocks"] == BLOCKS and decode["pending"] == 0
        assert decode["stats"]["notifications"]["received"] >= 4
        prefill = await health(session, cluster.prefill_url)
        shm = prefill["stats"]["transports"]["shm"]
        assert shm["bytes"] >= sum(kv_bytes(len(p)) for p in reqs) and shm["errors"] == 0
        for url in (cluster.prefill_url, cluster.decode_url):
            async with session.get(f"{url}/metrics") as r:
                text = await r.text()
            assert r.status == 200 and "aiohixl_bytes_total" in text and "aiohixl_ops_total" in text


@pytest.mark.parametrize("mode", ["whole", "http"])
async def test_baselines_are_exact(cluster, mode):
    reqs = prompts([200], 1, seed=6)
    async with aiohttp.ClientSession() as session:
        rec = await send(session, cluster.prefill_url, reqs[0], MAX_NEW, mode, 0)
        check_exact([rec], reqs, MAX_NEW)
        assert rec["exact"] and rec["kv_bytes"] == kv_bytes(200) and rec["overlap"] == 0.0, rec
        assert (await health(session, cluster.decode_url))["free_blocks"] == BLOCKS


async def test_decode_death_gives_503_and_prefill_goes_on(cluster):
    reqs = prompts([1024, 300], 1, seed=7)
    async with aiohttp.ClientSession() as session:
        before = await puts_posted(session, cluster.prefill_url)
        request = asyncio.create_task(send(session, cluster.prefill_url, reqs[0], MAX_NEW, "layerwise", 0))

        async def layers_in() -> bool:  # the decode server reserved the blocks, and layers go out
            reserved = (await health(session, cluster.decode_url))["pending"]
            return reserved and await puts_posted(session, cluster.prefill_url) >= before + 3

        await wait_until(layers_in, timeout=60, what="a few layers of the prefill put")
        cluster.kill_decode()
        rec = await asyncio.wait_for(request, 60)
        assert rec["status"] == 503, rec
        assert "decode server" in rec["error"]
        print("503:", rec["error"])

        # Nothing to talk to: still a clear 503, quickly.
        rec = await asyncio.wait_for(send(session, cluster.prefill_url, reqs[1], MAX_NEW, "layerwise", 1), 60)
        assert rec["status"] == 503 and "decode server" in rec["error"], rec

        cluster.start_decode()  # rank 1 again, found through the store
        rec = await asyncio.wait_for(send(session, cluster.prefill_url, reqs[1], MAX_NEW, "layerwise", 1), 60)
        assert rec["status"] == 200, rec
        check_exact([rec], reqs, MAX_NEW)
        assert rec["exact"]
        assert (await health(session, cluster.decode_url))["free_blocks"] == BLOCKS
