"""``AiohixlConnector``: vLLM's KV-connector interface over aiohixl (docs/vllm.md).

vLLM builds one per engine in its scheduler process (role SCHEDULER: bookkeeping only, see
``_scheduler``) and one per worker process (role WORKER: the aiohixl rank, see ``_worker``).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from ...errors import InvalidArgument
from ._config import Layout, read_settings
from ._meta import AiohixlMetadata, AiohixlWorkerMetadata
from ._scheduler import SchedulerSide
from ._worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["AiohixlConnector"]


class AiohixlConnector(KVConnectorBase_V1):
    """Prefill (``kv_producer``) pushes each layer's KV into decode (``kv_consumer``) blocks."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kvt = self._kv_transfer_config
        if kvt.kv_role not in ("kv_producer", "kv_consumer"):
            raise InvalidArgument(
                f'AiohixlConnector: kv_role {kvt.kv_role!r}: use "kv_producer" (prefill) or "kv_consumer" (decode)'
            )
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise InvalidArgument("AiohixlConnector: models with several KV cache groups (hybrid) are not supported")
        self.engine_id = str(kvt.engine_id)
        self.producer = kvt.kv_role == "kv_producer"
        self.block_size = int(vllm_config.cache_config.block_size)
        self.settings = read_settings(dict(kvt.kv_connector_extra_config or {}), self.engine_id)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                self.engine_id, self.producer, self.block_size, self.settings.registration_wait_s
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(
                self.settings, self.engine_id, self.producer, get_tensor_model_parallel_rank(), self.block_size
            )

    @property
    def requires_kv_delivery(self) -> bool:
        # A prefill request preempted before its push ended is recomputed (and pushes again).
        return self.producer

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBHNC"  # vLLM's CPU layout: one contiguous page per (layer, block)

    # ---- worker ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, self._layout(kv_caches))

    def _layout(self, kv_caches: dict[str, torch.Tensor]) -> Layout:
        cfg = self._vllm_config
        first = next(iter(kv_caches.values()))
        hf = cfg.model_config.hf_text_config.to_dict()
        arch = {k: v for k, v in sorted(hf.items()) if not k.startswith("_") and k != "transformers_version"}
        model = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()
        return Layout(
            model=model,
            dtype=str(cfg.model_config.dtype).removeprefix("torch."),
            block_size=self.block_size,
            page_bytes=first.stride(0) * first.element_size(),
            num_layers=len(kv_caches),
            tp_size=cfg.parallel_config.tensor_parallel_size,
            backend=_attention_backend(cfg, self.block_size),
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None and isinstance(connector_metadata, AiohixlMetadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # decode calls nothing for the bytes: prefill writes them

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        registered = self._worker.take_registered()
        return AiohixlWorkerMetadata(registered) if registered else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler ----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)


def _attention_backend(cfg: VllmConfig, block_size: int) -> str:
    """The attention kernel's page format: raw pages only copy between equal ones."""
    try:
        import torch
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        dtype = cfg.model_config.dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return "cpu-" + _get_attn_isa(dtype, block_size, cfg.model_config.get_head_size(), cfg.cache_config.cache_dtype)
    except (ImportError, AttributeError, NotImplementedError, ValueError, TypeError):
        return f"{cfg.device_config.device_type}-{cfg.cache_config.cache_dtype}"
