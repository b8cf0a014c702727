"""PD-disaggregated serving, end to end: starts a prefill and a decode server, sends requests, compares.

    python examples/pd_serving/run.py                      # the short default workload (make demo)
    python examples/pd_serving/run.py --lengths 128,512,1024,2048 --repeat 2 --concurrency 4 --json out.json

The prefill server (aiohttp, rank 0, serving the embedded rendezvous store) and the decode
server (FastAPI + uvicorn, rank 1) run as processes and find each other through the store
(``aiohixl.init``). Every request is sent in each mode, the same requests in the same order:

  layerwise  KV pushed with aiohixl layer by layer while the prefill computes (the point)
  whole      KV pushed with aiohixl after the whole prefill (no overlap)
  http       KV serialized (safetensors, no pickle) in the body of an HTTP POST to the decode server

Per request: TTFT (the client sent the request -> the decode server holds the whole KV and
the first token, which the prefill computed: CLOCK_MONOTONIC, one clock for the host's
processes), KV bytes moved, KV transfer time (the time some KV op was in flight), overlap
(the part of it hidden behind the forward pass), decode tokens/s, and ``exact``: the tokens
and the KV digest equal those of the same model run prefill+decode in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MODES, free_port, token  # noqa: E402


@dataclass
class Place:
    """Where a server runs: a command its own runs under (``ip netns exec NS``: another host,
    tests/hosts) and the address it serves HTTP on, which its aiohixl agent listens on too."""

    prefix: tuple[str, ...] = ()
    host: str = "127.0.0.1"


class Cluster:
    """The two servers as child processes; ``restart_decode`` after ``kill_decode``.

    ``store``: a rendezvous store already running (else the prefill server, rank 0, serves one on
    127.0.0.1); ``places``: where "prefill" and "decode" run (else here, on 127.0.0.1).
    """

    def __init__(
        self,
        blocks: int = 512,
        max_tokens: int = 2048,
        log_dir: Path | None = None,
        transports: str = "auto",
        store: str | None = None,
        places: dict[str, Place] | None = None,
    ) -> None:
        self.transports = transports
        token()  # AIOHIXL_TOKEN for both children
        self.store = store or f"tcp://127.0.0.1:{free_port()}"
        self.places = places or {}
        self.blocks, self.max_tokens = blocks, max_tokens
        self.log_dir = log_dir
        self.prefill: subprocess.Popen | None = None
        self.decode: subprocess.Popen | None = None
        self.prefill_url = self.decode_url = ""

    def _start(self, script: str, *args: str) -> tuple[subprocess.Popen, str]:
        role = Path(script).stem.split("_")[0]
        place = self.places.get(role, Place())
        err = open(self.log_dir / f"{Path(script).stem}.log", "a") if self.log_dir else subprocess.DEVNULL  # noqa: SIM115
        proc = subprocess.Popen(
            [*place.prefix, sys.executable, str(HERE / script), "--store", self.store, "--host", place.host, *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "READY http://host:port ..." once it serves
        if not line.startswith("READY "):
            proc.kill()
            raise RuntimeError(f"{script} did not start (exit {proc.wait()}); see its log")
        return proc, line.split()[1]

    def start(self) -> Cluster:
        # The prefill server is rank 0: it serves the store, so it starts first.
        self.prefill, self.prefill_url = self._start(
            "prefill_server.py", "--max-tokens", str(self.max_tokens), "--transports", self.transports
        )
        self.start_decode()
        return self

    def start_decode(self) -> None:
        self.decode, self.decode_url = self._start("decode_server.py", "--blocks", str(self.blocks))

    def kill_decode(self) -> None:
        assert self.decode is not None
        self.decode.send_signal(signal.SIGKILL)
        self.decode.wait()

    def stop(self) -> None:
        for proc in (self.decode, self.prefill):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.decode, self.prefill):
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def prompts(lengths: list[int], repeat: int, seed: int, vocab: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for _ in range(repeat) for n in lengths]


async def send(session: Any, url: str, prompt: list[int], max_new: int, mode: str, idx: int = -1) -> dict:
    """One request; the record the table and the JSON are made of."""
    from common import now

    t0 = now()
    async with session.post(
        f"{url}/generate", json={"prompt_ids": prompt, "max_new_tokens": max_new, "mode": mode}
    ) as r:
        body = await r.json()
        if r.status != 200:
            return dict(mode=mode, prompt_idx=idx, prompt_len=len(prompt), status=r.status, error=body.get("error"))
    t = body["timing"]
    decode_rate = (max_new - 1) / t["decode_s"] if t["decode_s"] > 0 and max_new > 1 else 0.0
    return dict(
        mode=mode,
        prompt_idx=idx,
        prompt_len=len(prompt),
        status=200,
        tokens=body["tokens"],
        kv_sha256=body["kv_sha256"],
        ttft_ms=(t["t_ready"] - t0) * 1e3,
        kv_bytes=t["kv_bytes"],
        transfer_ms=t["transfer_s"] * 1e3,
        exposed_ms=t["exposed_s"] * 1e3,
        overlap=t["overlap"],
        compute_ms=t["compute_s"] * 1e3,
        queue_ms=t["queue_s"] * 1e3,
        decode_tok_s=decode_rate,
        transport=t["transport"],
        puts=t["puts"],
    )


async def workload(url: str, reqs: list[list[int]], max_new: int, modes: list[str], concurrency: int) -> list[dict]:
    import aiohttp

    out: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        # Warm-up (not measured): first mappings of the pool, first forward passes.
        for mode in modes:
            await send(session, url, reqs[0][:64], 2, mode)
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, mode: str) -> dict:
            async with sem:
                return await send(session, url, reqs[i], max_new, mode, i)

        for mode in modes:  # one mode after the other: they do not compete for the CPU
            out += await asyncio.gather(*(one(i, mode) for i in range(len(reqs))))
    return out


def check_exact(records: list[dict], reqs: list[list[int]], max_new: int) -> None:
    """Each record's ``exact``: tokens and KV digest as the same model computes them in one process."""
    from common import build_model, reference

    model = build_model()
    refs = [reference(model, prompt, max_new) for prompt in reqs]
    for rec in records:
        tokens, digest = refs[rec["prompt_idx"]]
        rec["exact"] = rec["status"] == 200 and rec["tokens"] == tokens and rec["kv_sha256"] == digest


def table(records: list[dict], modes: list[str]) -> str:
    """Per prompt length (the mean over its requests): TTFT, KV transfer time and its exposed part
    (after the forward pass ended: what the transfer adds to TTFT) side by side for every mode."""
    lines = []
    head = f"{'prompt':>6} {'KV MiB':>7} |" + "".join(f" {'TTFT ' + m:>14}" for m in modes) + " |"
    head += "".join(f" {'xfer ' + m:>14}" for m in modes) + " |"
    head += "".join(f" {'exposed ' + m:>17}" for m in modes) + " | overlap(lw) | dec tok/s | exact"
    lines.append(head)
    lines.append("-" * len(head))
    for n in sorted({r["prompt_len"] for r in records}):
        rows = {
            m: [r for r in records if r["prompt_len"] == n and r["mode"] == m and r["status"] == 200] for m in modes
        }

        def mean(m: str, key: str, rows: dict = rows) -> float:
            xs = [r[key] for r in rows[m]]
            return sum(xs) / len(xs) if xs else float("nan")

        kv = max((r["kv_bytes"] for m in modes for r in rows[m]), default=0) / 2**20
        line = f"{n:>6} {kv:>7.2f} |" + "".join(f" {mean(m, 'ttft_ms'):>11.1f} ms" for m in modes) + " |"
        line += "".join(f" {mean(m, 'transfer_ms'):>11.2f} ms" for m in modes) + " |"
        line += "".join(f" {mean(m, 'exposed_ms'):>14.2f} ms" for m in modes) + " |"
        lw = "layerwise" if "layerwise" in modes else modes[0]
        rate = sum(mean(m, "decode_tok_s") for m in modes) / len(modes)
        exact = all(r.get("exact") for r in records if r["prompt_len"] == n)
        line += f" {mean(lw, 'overlap') * 100:>10.0f}% | {rate:>9.1f} | {'yes' if exact else 'NO'}"
        lines.append(line)
    failed = [r for r in records if r["status"] != 200]
    if failed:
        lines.append(f"{len(failed)} requests failed: {failed[0].get('error')}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,512,1024,2048", help="prompt lengths in tokens")
    ap.add_argument("--repeat", type=int, default=2, help="requests per prompt length (per mode)")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight at once")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--blocks", type=int, default=512, help="decode pool size in blocks of 16 tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transports", default="auto", help='the prefill agent\'s: "auto" (shm here) or "tcp"')
    ap.add_argument("--json", help="write every request's figures and the table here")
    ap.add_argument("--logs", help="a folder for the servers' stderr")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        ap.error(f"modes are {MODES}")
    reqs = prompts(lengths, args.repeat, args.seed)
    log_dir = Path(args.logs) if args.logs else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with Cluster(args.blocks, max(lengths), log_dir, args.transports) as cluster:
        print(f"prefill {cluster.prefill_url}, decode {cluster.decode_url}, store {cluster.store}", flush=True)
        records = asyncio.run(workload(cluster.prefill_url, reqs, args.max_new_tokens, modes, args.concurrency))
    check_exact(records, reqs, args.max_new_tokens)
    text = table(records, modes)
    print(text)
    print(
        f"{len(records)} requests, {args.max_new_tokens} new tokens each, concurrency {args.concurrency}, "
        f"transport {records[0].get('transport')} (layerwise/whole), {time.monotonic() - t0:.0f} s in all"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), requests=records, table=text), indent=1))
    return 0 if all(r.get("exact") for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
