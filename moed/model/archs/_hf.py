"""What the Hugging Face llama-family MoE decoders (Qwen3-MoE, Mixtral) share: checkpoint names
of the embedding, norms and attention, their GQA KV layout, and config keys `moed model init`
writes the same way. Not an architecture itself (the leading "_" keeps the registry out).
"""
from __future__ import annotations

import torch

from moed.model.kv_layout import KVLayout
from moed.model.spec import ModelSpec

# (regex, kind) as loader.py reads them; per-layer regexes follow `[model.]layers.{i}.`.
DECODER_WEIGHTS: tuple[tuple[str, str], ...] = (
    (r"(?:model\.)?embed_tokens\.weight", "embed"),
    (r"(?:model\.)?norm\.weight", "norm"),
    (r"lm_head\.weight", "lm_head"),
    (r"input_layernorm\.weight", "input_norm"),
    (r"post_attention_layernorm\.weight", "post_norm"),
    (r"self_attn\.([qkv])_proj\.(weight|bias)", "qkv"),
    (r"self_attn\.o_proj\.(weight|bias)", "o_proj"),
)

# moed's override names -> config.json keys both architectures spell alike.
INIT_NAMES: dict[str, str] = {
    "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "top_k": "num_experts_per_tok", "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings", "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings",
    "init_std": "initializer_range", "dtype": "dtype",
}


def gqa_kv_layout(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> KVLayout:
    return KVLayout.gqa(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, dtype)
