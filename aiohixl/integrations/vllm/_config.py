"""The connector's settings, read from ``kv_connector_extra_config``, and the pair's compatibility key."""

from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidArgument

STORE_ENV = "AIOHIXL_STORE"
TRACE_ENV = "AIOHIXL_VLLM_TRACE"

# Every key kv_connector_extra_config may hold, with its default (docs/vllm.md lists them).
DEFAULTS: dict[str, Any] = {
    "store": None,  # rank-store URL (tcp://HOST:PORT, redis://..., etcd://...); else $AIOHIXL_STORE
    "token_env": "AIOHIXL_TOKEN",  # the environment variable holding the shared token
    "namespace": "vllm",  # the store namespace (job) the instances meet in
    "transports": "auto",  # "auto", or a list such as ["tcp"] to keep shared memory out
    "rank_base": None,  # first aiohixl rank of this instance's workers; default from the engine id
    "layerwise": True,  # push each layer from save_kv_layer; False: everything after the forward
    "registration_wait_s": 0.2,  # P: how long a request may wait for decode's REG before computing anyway
    "registration_timeout_s": 30.0,  # D: fail a request whose KV has not arrived by then; P: lease
    "save_timeout_s": 30.0,  # P: longest wait_for_save waits for this step's puts
    "cancel_timeout_s": 10.0,  # D: longest wait for the prefill side to confirm it stopped writing
    "copy_threads": 1,  # aiohixl Agent(copy_threads=...)
    "loop_cpus": None,  # CPUs of the connector's event-loop thread (default: every CPU)
    "listen": None,  # where the worker's agent listens (default: the interface reaching the store)
    "trace": None,  # path prefix for per-request JSON-lines timings; else $AIOHIXL_VLLM_TRACE
}


@dataclass(frozen=True)
class Settings:
    store: str
    token: str
    namespace: str
    transports: str | tuple[str, ...]
    rank_base: int
    layerwise: bool
    registration_wait_s: float
    registration_timeout_s: float
    save_timeout_s: float
    cancel_timeout_s: float
    copy_threads: int
    loop_cpus: tuple[int, ...] | None
    listen: str | None
    trace: str | None


def default_rank_base(engine_id: str) -> int:
    """Ranks far apart per engine id, so instances sharing a store need not be numbered by hand."""
    return 1 + (zlib.crc32(engine_id.encode()) % (1 << 20)) * 1024


def read_settings(extra: dict[str, Any], engine_id: str) -> Settings:
    what = "AiohixlConnector: kv_connector_extra_config"
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise InvalidArgument(f"{what}: unknown key(s) {unknown}; the keys are {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **extra}
    store = cfg["store"] or os.environ.get(STORE_ENV)
    if not store:
        raise InvalidArgument(
            f'{what}: give "store" (a rank-store URL such as tcp://127.0.0.1:29600) or set {STORE_ENV}'
        )
    token = os.environ.get(str(cfg["token_env"]))
    if not token:
        raise InvalidArgument(f"{what}: set ${cfg['token_env']} to the token every instance and the store share")
    transports = cfg["transports"]
    if isinstance(transports, list):
        transports = tuple(str(t) for t in transports)
    cpus = cfg["loop_cpus"]
    return Settings(
        store=str(store),
        token=token,
        namespace=str(cfg["namespace"]),
        transports=transports,
        rank_base=int(cfg["rank_base"]) if cfg["rank_base"] is not None else default_rank_base(engine_id),
        layerwise=bool(cfg["layerwise"]),
        registration_wait_s=float(cfg["registration_wait_s"]),
        registration_timeout_s=float(cfg["registration_timeout_s"]),
        save_timeout_s=float(cfg["save_timeout_s"]),
        cancel_timeout_s=float(cfg["cancel_timeout_s"]),
        copy_threads=int(cfg["copy_threads"]),
        loop_cpus=tuple(int(c) for c in cpus) if cpus is not None else None,
        listen=cfg["listen"],
        trace=cfg["trace"] or os.environ.get(TRACE_ENV) or None,
    )


@dataclass(frozen=True)
class Layout:
    """What must be equal on both sides for a raw page copy to be a valid KV cache."""

    model: str
    dtype: str
    block_size: int
    page_bytes: int
    num_layers: int
    tp_size: int
    backend: str

    def key(self) -> str:
        """Readable and short (it travels in the rank's group name, at most 255 bytes)."""
        model = hashlib.sha256(self.model.encode()).hexdigest()[:12]
        return (
            f"model={model},dtype={self.dtype},block={self.block_size},page={self.page_bytes},"
            f"layers={self.num_layers},tp={self.tp_size},backend={self.backend}"
        )


def group_name(role: str, engine_id: str, layout: Layout) -> str:
    """``vllm|P|p0|model=...``: the role and engine in the store, and the layout peers check at startup."""
    return f"vllm|{role}|{engine_id}|{layout.key()}"


def parse_group(group: str) -> tuple[str, str, str] | None:
    """(role, engine id, layout key) of a connector rank's group, None for anything else."""
    parts = group.split("|", 3)
    if len(parts) != 4 or parts[0] != "vllm" or parts[1] not in ("P", "D"):
        return None
    return parts[1], parts[2], parts[3]
