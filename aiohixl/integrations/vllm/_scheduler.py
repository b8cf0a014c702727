"""The scheduler-side half of the connector: no network, only bookkeeping per engine step.

Decode (consumer): a request whose ``kv_transfer_params`` say ``do_remote_prefill`` waits
for its whole prompt to arrive asynchronously; once vLLM has allocated its blocks, their
ids go to the worker, which announces them to the prefill worker. Prefill (producer): every
step that computes prompt tokens of a ``do_remote_decode`` request tells the worker which
blocks and tokens it covers; the finished request's blocks stay allocated until the worker
reports the transfer over.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ._meta import AiohixlMetadata, AiohixlWorkerMetadata, Registration, SendStep, Skip

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.aiohixl")


def _transfer_id(params: dict[str, Any] | None) -> str | None:
    t = (params or {}).get("transfer_id")
    return t if isinstance(t, str) and 0 < len(t) <= 128 else None


class SchedulerSide:
    def __init__(self, engine_id: str, producer: bool, block_size: int, registration_wait_s: float) -> None:
        self.engine_id = engine_id
        self.registration_wait_s = registration_wait_s
        self.producer = producer
        self.block_size = block_size
        self._meta = AiohixlMetadata()
        self._sending: dict[str, Request] = {}  # prefill: live do_remote_decode requests
        self._final_scheduled: set[str] = set()
        # prefill: decode's blocks known to the worker (so layers can go out during the forward)
        self._registered: dict[str, float] = {}  # transfer id -> when heard
        self._waiting_since: dict[str, float] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if self.producer:
            return self._until_registered(request), False
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if _transfer_id(params) is None:
            log.warning(
                "aiohixl: request %s asks for a remote prefill without a transfer_id: computing it here",
                request.request_id,
            )
            return 0, False
        missing = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (missing, True) if missing > 0 else (0, False)

    def _until_registered(self, request: Request) -> int | None:
        """0: schedule it; None: not yet, decode's REG is on its way (at most ``registration_wait_s``).

        Pushing layer by layer needs decode's block ids before the forward: the proxy sends
        both requests at once, and decode's announcement usually arrives within milliseconds."""
        params = request.kv_transfer_params
        t = _transfer_id(params)
        if not params or not params.get("do_remote_decode") or t is None or t in self._registered:
            return 0
        now = time.monotonic()
        since = self._waiting_since.setdefault(request.request_id, now)
        return 0 if now - since >= self.registration_wait_s else None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, AiohixlWorkerMetadata):
            now = time.monotonic()
            if len(self._registered) > 4096:  # REGs meant for other prefill instances, never claimed here
                self._registered = {t: at for t, at in self._registered.items() if now - at < 60.0}
            self._registered.update(dict.fromkeys(meta.registered, now))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        t = _transfer_id(params)
        if self.producer:
            if params.get("do_remote_decode") and t is not None:
                self._sending[request.request_id] = request
                self._waiting_since.pop(request.request_id, None)
            return
        if not params.get("do_remote_prefill") or t is None:
            return
        params["do_remote_prefill"] = False  # one transfer per request, preempted or not
        remote = params.get("remote_engine_id")
        remote = remote if isinstance(remote, str) else None
        if num_external_tokens <= 0:
            self._meta.skips.append(Skip(t, remote))
            return
        n = len(request.prompt_token_ids or ())
        local = n - num_external_tokens
        bs = self.block_size
        assert local % bs == 0, (local, bs)  # vLLM offers block-aligned local hits
        first = local // bs
        ids = blocks.get_block_ids()[0][first : -(-n // bs)]
        self._meta.registrations.append(Registration(t, request.request_id, first, list(ids), n, remote))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> AiohixlMetadata:
        meta, self._meta = self._meta, AiohixlMetadata()
        if self.producer and self._sending:
            state = scheduler_output.kv_connector_block_state
            for req_id, req in self._sending.items():
                n = scheduler_output.num_scheduled_tokens.get(req_id)
                prompt = req.num_prompt_tokens
                if not n or req.num_computed_tokens >= prompt or state is None:
                    continue
                table = state.get_block_ids(req_id)
                if table is None:
                    continue
                step = SendStep(
                    req_id,
                    _transfer_id(req.kv_transfer_params) or "",
                    list(table[0]),
                    req.num_computed_tokens,
                    n,
                    prompt,
                )
                meta.sends.append(step)
                if step.final:
                    self._final_scheduled.add(req_id)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._waiting_since.pop(request.request_id, None)
        req = self._sending.pop(request.request_id, None)
        if req is None:
            return False, None
        t = _transfer_id(req.kv_transfer_params) or ""
        self._registered.pop(t, None)
        if request.request_id not in self._final_scheduled:
            # Its prompt never finished here (aborted): nothing is in flight between steps,
            # so its blocks go now, and decode hears that nothing will come.
            self._meta.aborted.append(t)
            return False, None
        self._final_scheduled.discard(request.request_id)
        # The blocks stay until the worker reports the push over (finished_sending).
        return True, {"transfer_id": t, "engine_id": self.engine_id}
