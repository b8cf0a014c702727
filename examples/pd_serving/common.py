"""What the PD servers and the driver share: the model, the KV layout, prefill and decode.

The model is a real Llama-architecture causal LM from transformers, small, with weights
drawn from a fixed seed: every process builds the same weights, nothing is downloaded.
Everything runs in float32 on one CPU thread per process, so the same forward gives the
same bits in every process: the decode server's tokens can be compared bit for bit with
a prefill+decode run in one process.

KV layout (the decode server's paged pool, one ``allocate``):
``[layers, blocks, BLOCK_TOKENS, 2, kv_heads, head_dim]`` float32, token-major inside a
block (K and V of one token side by side), so the first n tokens of a block are one
contiguous range and a request moves exactly its tokens' bytes, no padding. The prefill
server stages a request's KV as ``[layers, max_tokens, 2, kv_heads, head_dim]``: the
tokens of block j of layer i are then one range on each side (consecutive blocks merge).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

SEED = 1234
MODEL = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,  # GQA: 2 query heads per KV head
    max_position_embeddings=4096,
    initializer_range=0.05,  # wider than the default 0.02: random weights that do not repeat one token
)
BLOCK_TOKENS = 16
DTYPE = torch.float32
MODES = ("layerwise", "whole", "http")  # aiohixl per layer, aiohixl after the prefill, KV in the HTTP body


def now() -> float:
    """CLOCK_MONOTONIC: one clock for every process on the host, so times compare across them."""
    return time.monotonic()


def build_model() -> LlamaForCausalLM:
    torch.set_num_threads(1)  # deterministic and polite on a shared machine
    torch.manual_seed(SEED)
    config = LlamaConfig(**MODEL)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_size: int = 4

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> Geometry:
        c = model.config
        return cls(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads)

    @property
    def token_bytes(self) -> int:
        """One token's K and V in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_size

    def kv_bytes(self, tokens: int) -> int:
        """What a request of ``tokens`` moves: layers x 2 x tokens x kv_heads x head_dim x dtype size."""
        return self.layers * tokens * self.token_bytes

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // BLOCK_TOKENS)


def layer_pairs(g: Geometry, layer: int, tokens: int, blocks: list[int], pool_blocks: int, max_tokens: int):
    """(remote offset, local offset, length) of one layer of a request: its blocks' ranges in the
    pool and in the staging buffer, consecutive blocks merged into one range."""
    out: list[list[int]] = []
    for j, b in enumerate(blocks):
        n = min(BLOCK_TOKENS, tokens - j * BLOCK_TOKENS)
        roff = ((layer * pool_blocks + b) * BLOCK_TOKENS) * g.token_bytes
        loff = (layer * max_tokens + j * BLOCK_TOKENS) * g.token_bytes
        if out and j and blocks[j - 1] + 1 == b and out[-1][0] + out[-1][2] == roff:
            out[-1][2] += n * g.token_bytes
        else:
            out.append([roff, loff, n * g.token_bytes])
    return [tuple(p) for p in out]


class LayerTap:
    """Forward hooks on every decoder layer: after layer i ran, ``on_layer(i, k, v)`` gets its
    K and V (``[1, kv_heads, tokens, head_dim]``) from the cache the forward is filling.

    One forward at a time per model (the servers run them on one compute thread)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.cache: Any = None
        self.on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module: Any, args: Any, output: Any) -> None:
            if self.on_layer is not None and self.cache is not None:
                entry = self.cache.layers[i]
                self.on_layer(i, entry.keys, entry.values)

        return hook


@torch.no_grad()
def prefill(model: LlamaForCausalLM, prompt_ids: list[int], tap: LayerTap | None = None, on_layer=None):
    """The prompt's forward pass: (first token, cache). ``on_layer`` is called per layer as it finishes."""
    cache = DynamicCache(config=model.config)
    if tap is not None:
        tap.cache, tap.on_layer = cache, on_layer
    try:
        out = model(input_ids=torch.tensor([prompt_ids]), cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        if tap is not None:
            tap.cache = tap.on_layer = None
    return int(out.logits[0, -1].argmax()), cache


@torch.no_grad()
def decode(model: LlamaForCausalLM, cache: Any, first_token: int, max_new_tokens: int) -> list[int]:
    """Greedy decoding from a filled cache: the first token came from the prefill."""
    tokens = [first_token]
    while len(tokens) < max_new_tokens:
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True, logits_to_keep=1)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def cache_from_kv(model: LlamaForCausalLM, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    return DynamicCache(ddp_cache_data=kv, config=model.config)


def kv_digest(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """sha256 over every layer's K then V, each as contiguous ``[kv_heads, tokens, head_dim]``."""
    h = hashlib.sha256()
    for k, v in kv:
        for t in (k, v):
            h.update(t.reshape(t.shape[-3:]).contiguous().numpy().tobytes())
    return h.hexdigest()


def reference(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], str]:
    """Prefill and decode in one process: the tokens, and the digest of the prompt's KV."""
    first, cache = prefill(model, prompt_ids)
    digest = kv_digest([(layer.keys, layer.values) for layer in cache.layers])
    return decode(model, cache, first, max_new_tokens), digest


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def token() -> str:
    return os.environ.setdefault("AIOHIXL_TOKEN", "pd-serving-" + os.urandom(8).hex())
