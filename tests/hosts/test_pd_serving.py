"""examples/pd_serving across hosts: prefill on one namespace host, decode on another, the
rendezvous store (``python -m aiohixl store``) on a third; KV over tcp, every request exact.

Needs the demo's packages (the `demo` extra and torch); skipped without them.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

for module in ("torch", "transformers", "safetensors", "aiohttp", "fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module)

import aiohttp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "pd_serving"))

from run import Cluster, Place, check_exact, prompts, send  # noqa: E402

MAX_NEW = 4
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def store(hosts):
    """A standalone store on host 2; its URL."""
    from common import token

    token()  # AIOHIXL_TOKEN, for the store and both servers
    proc = hosts[2].python(
        "-m", "aiohixl", "store", "--listen", f"{hosts[2].address}:0", stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()  # "aiohixl store listening on tcp://HOST:PORT"
        assert "listening on tcp://" in line, line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(10)


async def test_requests_across_three_hosts_are_exact_over_tcp(hosts, store, tmp_path):
    places = {
        "prefill": Place(tuple(hosts[0].argv([])), hosts[0].address),
        "decode": Place(tuple(hosts[1].argv([])), hosts[1].address),
    }
    cluster = Cluster(blocks=64, max_tokens=512, log_dir=tmp_path, store=store, places=places)
    try:
        cluster.start()
        assert hosts[0].address in cluster.prefill_url and hosts[1].address in cluster.decode_url
        reqs = prompts([90, 300], 1, seed=11)
        async with aiohttp.ClientSession() as session:
            records = await asyncio.gather(
                *(send(session, cluster.prefill_url, p, MAX_NEW, "layerwise", i) for i, p in enumerate(reqs))
            )
            records.append(await send(session, cluster.prefill_url, reqs[0], MAX_NEW, "whole", 0))
            async with session.get(f"{cluster.prefill_url}/health") as r:
                stats = (await r.json())["stats"]["transports"]
        assert [r["status"] for r in records] == [200] * 3, records
        check_exact(records, reqs, MAX_NEW)
        for rec in records:
            assert rec["exact"], rec
            assert rec["transport"] == "tcp", rec
        assert stats["tcp"]["bytes"] > 0 and stats["tcp"]["errors"] == 0 and stats["shm"]["ops"] == 0, stats
    finally:
        cluster.stop()
        for log in sorted(tmp_path.iterdir()):  # shown when the test failed
            print(f"--- {log.name}\n{log.read_text()[-4000:]}")
