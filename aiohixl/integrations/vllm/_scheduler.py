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
from typing import TYPE_CHECKING, Any

from ._meta import AiohixlMetadata, Registration, SendStep, Skip

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.aiohixl")


def _transfer_id(params: dict[str, Any] | None) -> str | None:
    t = (params or {}).get("transfer_id")
    return t if isinstance(t, str) and 0 < len(t) <= 128 else None


class SchedulerSide:
    def __init__(self, engine_id: str, producer: bool, block_size: int) -> None:
        self.engine_id = engine_id
        self.producer = producer
        self.block_size = block_size
        self._meta = AiohixlMetadata()
        self._sending: dict[str, Request] = {}  # prefill: live do_remote_decode requests
        self._final_scheduled: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.producer or not params or not params.get("do_remote_prefill"):
            return 0, False
        if _transfer_id(params) is None:
            log.warning(
                "aiohixl: request %s asks for a remote prefill without a transfer_id: computing it here",
                request.request_id,
            )
            return 0, False
        missing = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (missing, True) if missing > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        t = _transfer_id(params)
        if self.producer:
            if params.get("do_remote_decode") and t is not None:
                self._sending[request.request_id] = request
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
        req = self._sending.pop(request.request_id, None)
        if req is None:
            return False, None
        t = _transfer_id(req.kv_transfer_params) or ""
        if request.request_id not in self._final_scheduled:
            # Its prompt never finished here (aborted): nothing is in flight between steps,
            # so its blocks go now, and decode hears that nothing will come.
            self._meta.aborted.append(t)
            return False, None
        self._final_scheduled.discard(request.request_id)
        # The blocks stay until the worker reports the push over (finished_sending).
        return True, {"transfer_id": t, "engine_id": self.engine_id}
