"""Qwen3-MoE (config.json model_type "qwen3_moe").

Particular to it: per-head RMSNorm on q and k before rotary; a softmax top-k router whose
weights are renormalised only when norm_topk_prob says; dense-MLP layers where mlp_only_layers
or decoder_sparse_step put them (then `intermediate_size` is the dense MLP's width, and
`moe_intermediate_size` each expert's); checkpoint names under `mlp.` (`mlp.gate` is the router).
"""
from __future__ import annotations

from typing import Any

import torch

from moed.model.archs import Arch, InitRecipe, register
from moed.model.archs._hf import DECODER_WEIGHTS, INIT_NAMES, gqa_kv_layout
from moed.model.context import ComputeContext
from moed.model.decoder import DecoderLayer, Weights, decoder_layer, dense_block, moe_block
from moed.model.spec import ModelSpec, SpecError, required


def spec_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window"):
        raise SpecError("sliding-window attention is not supported")
    experts = int(required(cfg, "num_experts", "num_local_experts"))
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    return dict(
        num_experts=experts, moe_intermediate_size=int(required(cfg, "moe_intermediate_size")),
        dense_intermediate_size=int(cfg.get("intermediate_size") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), qk_norm=True,
        dense_layers=tuple(i for i in range(num_layers)
                           if i in only or experts == 0 or (i + 1) % step != 0))


WEIGHTS = DECODER_WEIGHTS + (
    (r"self_attn\.q_norm\.weight", "q_norm"),
    (r"self_attn\.k_norm\.weight", "k_norm"),
    (r"mlp\.gate\.weight", "router"),
    (r"mlp\.experts\.(\d+)\.gate_proj\.weight", "expert.gate"),
    (r"mlp\.experts\.(\d+)\.up_proj\.weight", "expert.up"),
    (r"mlp\.experts\.(\d+)\.down_proj\.weight", "expert.down"),
    (r"mlp\.experts\.gate_up_proj(?:\.weight)?", "fused.gate_up"),    # transformers 5.x in memory
    (r"mlp\.experts\.down_proj(?:\.weight)?", "fused.down"),
    (r"mlp\.gate_proj\.weight", "dense.gate"),
    (r"mlp\.up_proj\.weight", "dense.up"),
    (r"mlp\.down_proj\.weight", "dense.down"),
)


def build_layer(spec: ModelSpec, i: int, w: Weights, load_row: torch.Tensor, ctx: ComputeContext) -> DecoderLayer:
    mlp = dense_block(i, w, ctx) if i in spec.dense_layers else moe_block(spec, i, w, load_row, ctx)
    return decoder_layer(spec, i, w, mlp, ctx)


def _config_kwargs(ids: dict[str, int], kw: dict[str, Any]) -> dict[str, Any]:
    return {"intermediate_size": 4 * kw["moe_intermediate_size"],      # dense layers only
            "norm_topk_prob": True, **kw, "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}


INIT = InitRecipe(
    config_class="Qwen3MoeConfig", model_class="Qwen3MoeForCausalLM", chat_style="chatml",
    names={**INIT_NAMES, "num_experts": "num_experts", "moe_intermediate_size": "moe_intermediate_size",
           "dense_intermediate_size": "intermediate_size", "norm_topk_prob": "norm_topk_prob",
           "mlp_only_layers": "mlp_only_layers", "decoder_sparse_step": "decoder_sparse_step"},
    config_kwargs=_config_kwargs,
    eos_ids=lambda ids: [ids["<|im_end|>"], ids["<|endoftext|>"]])

register(Arch("qwen3_moe", spec_fields, WEIGHTS, build_layer, gqa_kv_layout, INIT))
