"""Mixtral (config.json model_type "mixtral").

Particular to it: every layer is MoE (no dense layers) and `intermediate_size` is each expert's
width; the router's top-k weights are always renormalised; no q/k norm; no sliding window (any
`sliding_window` is refused); checkpoint names under `block_sparse_moe.` with experts' w1 (gate),
w3 (up) and w2 (down), or transformers 5.x's in-memory `mlp.` names.
"""
from __future__ import annotations

from typing import Any

import torch

from moed.model.archs import Arch, InitRecipe, register
from moed.model.archs._hf import DECODER_WEIGHTS, INIT_NAMES, gqa_kv_layout
from moed.model.context import ComputeContext
from moed.model.decoder import DecoderLayer, Weights, decoder_layer, moe_block
from moed.model.spec import ModelSpec, SpecError, required


def spec_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    if cfg.get("sliding_window") is not None:
        raise SpecError("sliding-window attention is not supported")
    return dict(num_experts=int(required(cfg, "num_experts", "num_local_experts")),
                moe_intermediate_size=int(required(cfg, "intermediate_size")),
                dense_intermediate_size=0, norm_topk_prob=True, qk_norm=False, dense_layers=())


_MOE = r"(?:block_sparse_moe|mlp)\."
WEIGHTS = DECODER_WEIGHTS + (
    (_MOE + r"gate\.weight", "router"),
    (_MOE + r"experts\.(\d+)\.w1\.weight", "expert.gate"),
    (_MOE + r"experts\.(\d+)\.w3\.weight", "expert.up"),
    (_MOE + r"experts\.(\d+)\.w2\.weight", "expert.down"),
    (_MOE + r"experts\.gate_up_proj(?:\.weight)?", "fused.gate_up"),
    (_MOE + r"experts\.down_proj(?:\.weight)?", "fused.down"),
)


def build_layer(spec: ModelSpec, i: int, w: Weights, load_row: torch.Tensor, ctx: ComputeContext) -> DecoderLayer:
    return decoder_layer(spec, i, w, moe_block(spec, i, w, load_row, ctx), ctx)


INIT = InitRecipe(
    config_class="MixtralConfig", model_class="MixtralForCausalLM", chat_style="mistral",
    names={**INIT_NAMES, "num_experts": "num_local_experts", "moe_intermediate_size": "intermediate_size"},
    config_kwargs=lambda ids, kw: {**kw, "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]},
    eos_ids=lambda ids: ids["</s>"])

register(Arch("mixtral", spec_fields, WEIGHTS, build_layer, gqa_kv_layout, INIT))
