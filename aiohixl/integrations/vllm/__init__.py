"""aiohixl as a vLLM KV connector: the prefill worker pushes each layer's KV into the decode instance.

    --kv-transfer-config '{"kv_connector": "AiohixlConnector",
                           "kv_connector_module_path": "aiohixl.integrations.vllm",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {"store": "tcp://127.0.0.1:29600"}}'

Importing this package is cheap and starts nothing (vLLM's API-server process imports it
too): the connector class, and vLLM with it, load on first access. The proxy is
``python -m aiohixl.integrations.vllm.proxy``. See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AiohixlConnector"]


def __getattr__(name: str) -> Any:
    if name == "AiohixlConnector":
        from .connector import AiohixlConnector

        return AiohixlConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
