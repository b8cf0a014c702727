"""Write a small Llama (config.json + model.safetensors) with seeded random weights to OUTDIR.

Nothing is downloaded: the model is built from a config by transformers. vLLM's
``--load-format dummy`` weights are all near zero, so every token ties and greedy
outputs cannot tell a right KV cache from a wrong one; these weights are scaled so
that greedy tokens depend on the whole context with clear margins.

    python examples/vllm_pd/make_model.py OUTDIR [--layers 4] [--hidden 256] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def make_model(
    outdir: str | Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    vocab: int = 1024,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        # Wider than the default 0.02: logits then differ by whole units, so greedy
        # picks are stable under the last-bit differences of batched CPU kernels.
        initializer_range=0.08,
        torch_dtype="float32",
    )
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out = make_model(
        a.outdir,
        layers=a.layers,
        hidden=a.hidden,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        vocab=a.vocab,
        max_positions=a.max_positions,
        seed=a.seed,
    )
    print(out)


if __name__ == "__main__":
    main()
