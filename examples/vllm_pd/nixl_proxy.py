"""NixlConnector's pull flow as an OpenAI ``/v1/completions`` proxy, for the bench's NIXL arm.

What vLLM's ``toy_proxy_server.py`` does (it is not shipped in the wheel), with no vLLM patch:
send the prefill instance the request with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``, then the decode instance the client's own
request with the ``kv_transfer_params`` of the prefill's response (block ids, engine, side
channel), streaming the decode's answer back. Both requests carry one ``X-Request-Id``.

With ``--trace FILE`` each request appends one JSON line of ``time.monotonic_ns()`` stamps (one
clock for every process of the host): when the prefill request was sent and answered, when the
decode request was sent and its first token came back. The bench reads them: "prefill answered"
is the earliest a pull can start, so NIXL's whole transfer is exposed (after the forward).

    python examples/vllm_pd/nixl_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8192
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web


class PullProxy:
    def __init__(self, prefill: str, decode: str, trace: str | None) -> None:
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115 (open for the server's life)
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body: dict[str, Any] = await request.json()
        req_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = {"X-Request-Id": req_id}
        stamps: dict[str, Any] = {"req_id": req_id, "p_sent": time.monotonic_ns()}

        prefill_body = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        prefill_body.pop("stream_options", None)
        async with self.session.post(f"{self.prefill}/v1/completions", json=prefill_body, headers=headers) as r:
            if r.status != 200:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
            prefill_answer = await r.json()
        stamps["p_done"] = time.monotonic_ns()
        params = prefill_answer.get("kv_transfer_params")
        if not params:
            return web.json_response({"error": "prefill answered without kv_transfer_params"}, status=502)

        decode_body = dict(body, kv_transfer_params=params)
        stamps["d_sent"] = time.monotonic_ns()
        async with self.session.post(f"{self.decode}/v1/completions", json=decode_body, headers=headers) as r:
            if not body.get("stream"):
                payload = await r.read()
                stamps["d_first"] = time.monotonic_ns()
                self._log(stamps)
                return web.Response(status=r.status, body=payload, content_type="application/json")
            out = web.StreamResponse(status=r.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                if "d_first" not in stamps:
                    stamps["d_first"] = time.monotonic_ns()
                await out.write(chunk)
            await out.write_eof()
        self._log(stamps)
        return out

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def _log(self, stamps: dict[str, Any]) -> None:
        if self.trace is not None:
            self.trace.write(json.dumps(stamps) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, metavar="URL")
    ap.add_argument("--decode", required=True, metavar="URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--trace", default=None, metavar="FILE", help="append per-request monotonic_ns stamps here")
    args = ap.parse_args()
    proxy = PullProxy(args.prefill, args.decode, args.trace)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_get("/health", proxy.health)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
