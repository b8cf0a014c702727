"""An OpenAI ``/v1/completions`` front for prefill/decode pairs running ``AiohixlConnector``.

    python -m aiohixl.integrations.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Each request goes to one prefill and one decode instance (round robin over each list: xPyD)
at the same time, with a shared ``transfer_id`` in ``kv_transfer_params``: decode allocates
blocks and announces them while prefill computes and pushes the KV layer by layer. The
client gets decode's answer (streamed when asked). Failures are answered with HTTP 502 and
a JSON error naming the instance and the cause. Needs aiohttp (the ``vllm`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import uuid
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("aiohixl.vllm.proxy")


class Upstream(Exception):
    """An instance failed a request: ``who`` names it, the message says how."""

    def __init__(self, who: str, message: str) -> None:
        super().__init__(f"{who}: {message}")
        self.who = who


# How long an idle connection to an instance is kept for the next request. Below the
# instances' own keep-alive (vLLM's: 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): with aiohttp's 15 s,
# a request sent on a connection the instance was closing failed as ServerDisconnectedError.
KEEPALIVE = 2.0


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float, keepalive: float = KEEPALIVE) -> None:
        self.prefill, self.decode = prefill, decode
        self.keepalive = keepalive
        self._p = itertools.cycle(prefill)
        self._d = itertools.cycle(decode)
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.engines: dict[str, str] = {}  # prefill URL -> engine id, learned from its answers
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive)
        self.session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def bodies(self, body: dict[str, Any], transfer_id: str, p_url: str) -> tuple[dict[str, Any], dict[str, Any]]:
        p_body = copy.deepcopy(body)
        p_body.update(max_tokens=1, stream=False)
        for key in ("stream_options", "min_tokens"):
            p_body.pop(key, None)
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
        d_body = copy.deepcopy(body)
        d_params: dict[str, Any] = {"do_remote_prefill": True, "transfer_id": transfer_id}
        if p_url in self.engines:
            d_params["remote_engine_id"] = self.engines[p_url]
        d_body["kv_transfer_params"] = d_params
        return p_body, d_body

    async def run_prefill(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        assert self.session is not None
        who = f"prefill instance {url}"
        try:
            async with self.session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                text = await r.text()
                if r.status != 200:
                    raise Upstream(who, f"HTTP {r.status}: {text[:500]}")
                params = (json.loads(text).get("kv_transfer_params") or {}) if text else {}
                if isinstance(params.get("engine_id"), str):
                    self.engines[url] = params["engine_id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise Upstream(who, f"{type(exc).__name__}: {exc}") from None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"bad request body: {exc}")
        assert self.session is not None
        transfer_id = uuid.uuid4().hex
        p_url, d_url = next(self._p), next(self._d)
        p_body, d_body = self.bodies(body, transfer_id, p_url)
        headers = {"X-Request-Id": f"aiohixl-{transfer_id}"}
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        prefill = asyncio.ensure_future(self.run_prefill(p_url, p_body, headers))
        try:
            return await self.relay(request, body, d_url, d_body, headers, prefill, transfer_id)
        finally:
            # The client went away (the handler is cancelled): closing both upstream requests
            # makes vLLM abort them, which frees their blocks on both sides.
            if not prefill.done():
                prefill.cancel()

    async def relay(
        self,
        request: web.Request,
        body: dict[str, Any],
        d_url: str,
        d_body: dict[str, Any],
        headers: dict[str, str],
        prefill: asyncio.Future[None],
        transfer_id: str,
    ) -> web.StreamResponse:
        assert self.session is not None
        who = f"decode instance {d_url}"
        try:
            try:
                resp = await self.session.post(f"{d_url}/v1/completions", json=d_body, headers=headers)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                raise Upstream(who, f"{type(exc).__name__}: {exc}") from None
            async with resp:
                if resp.status != 200:
                    text = await resp.text()
                    raise Upstream(who, f"HTTP {resp.status}: {text[:500]}")
                stream = bool(body.get("stream"))
                # Decode's first bytes, unless prefill fails first: then decode's request
                # (whose KV will not come) is closed, which aborts it, and prefill is named.
                first: asyncio.Future[bytes] = asyncio.ensure_future(resp.content.readany() if stream else resp.read())
                racing: set[asyncio.Future[Any]] = {first, prefill}
                await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
                if prefill.done() and prefill.exception() is not None and not first.done():
                    first.cancel()
                    raise prefill.exception()  # type: ignore[misc]
                try:
                    chunk = await first
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    raise Upstream(who, f"{type(exc).__name__}: {exc}") from None
                if not stream:
                    await _settle(prefill)
                    return web.Response(body=chunk, content_type="application/json")
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                while chunk:
                    await out.write(chunk)  # a client gone raises here: both upstreams are closed
                    try:
                        chunk = await resp.content.readany()
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                        # Headers are out: the error goes in the stream, as vLLM's own do.
                        err = {"error": {"message": f"{who}: {type(exc).__name__}: {exc}", "type": "upstream"}}
                        await out.write(f"data: {json.dumps(err)}\n\n".encode())
                        break
                await out.write_eof()
                await _settle(prefill)
                return out
        except Upstream as exc:
            # Decode's failure often has prefill's as its cause: name both.
            causes = [str(exc)]
            if prefill.done() or exc.who.startswith("decode"):
                perr = await _settle(prefill, 5.0)
                if perr is not None and str(perr) not in causes:
                    causes.append(str(perr))
            log.warning("request %s failed: %s", transfer_id, "; ".join(causes))
            return _error(502, "; ".join(causes))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"prefill": self.prefill, "decode": self.decode})


async def _settle(task: asyncio.Future[None], timeout: float | None = None) -> BaseException | None:
    """Wait for the prefill request; its error, if any (decode's answer is what the client gets)."""
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout)
    except Upstream as exc:
        log.warning("%s", exc)
        return exc
    except asyncio.TimeoutError:
        return None
    return None


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "upstream" if status == 502 else "bad_request"}}, status=status
    )


def make_app(
    prefill: list[str], decode: list[str], timeout: float = 600.0, keepalive: float = KEEPALIVE
) -> web.Application:
    proxy = Proxy(prefill, decode, timeout, keepalive)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_get("/health", proxy.health)
    return app


def _urls(text: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("give at least one URL")
    return urls


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m aiohixl.integrations.vllm.proxy", description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=_urls, required=True, help="prefill instance URL[,URL...]")
    ap.add_argument("--decode", type=_urls, required=True, help="decode instance URL[,URL...]")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one upstream request may take")
    ap.add_argument(
        "--keepalive",
        type=float,
        default=KEEPALIVE,
        help="seconds an idle connection to an instance is kept; below the instances' own (vLLM: 5)",
    )
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # handler_cancellation: a client that goes away cancels its handler, which aborts both upstreams.
    app = make_app(a.prefill, a.decode, a.timeout, a.keepalive)
    web.run_app(app, host=a.host, port=a.port, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
