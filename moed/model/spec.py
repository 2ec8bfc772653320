"""ModelSpec: the architecture facts the runner needs, and the helpers that parse them.

The types only: every layer imports this module, and it imports nothing of moed, so the
architecture modules (moed/model/archs/) can use it without a circle. Parsing a checkpoint's
`config.json` into a ModelSpec is moed/model/hf_config.py (`load_spec`), which sits above the
architectures because `model_type` picks one of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class SpecError(ValueError):
    """config.json describes a model this runner cannot serve (or is malformed)."""


@dataclass(frozen=True)
class ModelSpec:
    arch: str                           # config.json's model_type: "qwen3_moe", "mixtral", ...
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    moe_intermediate_size: int          # per expert
    dense_intermediate_size: int        # MLP of dense (non-MoE) layers; 0 if none
    num_experts: int
    top_k: int
    norm_topk_prob: bool                # renormalise the top-k router probabilities
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool                       # per-head RMSNorm on q and k (Qwen3)
    attention_bias: bool
    dense_layers: tuple[int, ...]       # layer indices with a dense MLP instead of MoE
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str                    # the checkpoint's dtype name, e.g. "bfloat16"
    # DeepSeek-V3 (archs/deepseek_v3.py); the defaults are what the GQA architectures mean.
    attention_kind: str = "gqa"                 # "gqa" | "mla" (latent KV cache)
    shared_expert_intermediate_size: int = 0    # all shared experts as one MLP; 0: none
    q_lora_rank: int = 0                        # MLA: q through a low-rank bottleneck; 0: direct q_proj
    kv_lora_rank: int = 0                       # MLA: the cached latent c_kv's width
    qk_nope_head_dim: int = 0                   # MLA: per-head q/k part without rotary
    qk_rope_head_dim: int = 0                   # MLA: rotary part (one key head shared by all)
    v_head_dim: int = 0                         # MLA: per-head value width
    rope_interleave: bool = False               # rotary pairs (x0, x1), (x2, x3) instead of halves
    # YaRN rotary scaling as sorted (key, value) pairs: factor, original_max_position_embeddings,
    # beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate; () = plain RoPE
    rope_yarn: tuple[tuple[str, float], ...] = ()
    router_scoring: str = "softmax"             # "softmax" | "sigmoid" (bias-corrected, grouped)
    n_group: int = 1                            # expert groups (grouped routing)
    topk_group: int = 1                         # groups kept per token
    routed_scaling_factor: float = 1.0          # routed experts' weights scaled by this
    # DeepSeek-V3's num_nextn_predict_layers: multi-token-prediction layers the checkpoint stores
    # past the last decoder layer (read only when a runner asks for them, moed/model/mtp.py)
    num_mtp_layers: int = 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.torch_dtype)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise SpecError(f"unsupported dtype {name!r}; expected bfloat16, float32 or float16") from None


def required(cfg: dict[str, Any], *keys: str) -> Any:
    """The first of keys that config.json sets (not null), else SpecError."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    raise SpecError(f"config.json lacks {' / '.join(keys)}")
