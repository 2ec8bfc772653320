"""The shared decoder stack: embed -> N x (attention, MoE or dense MLP) -> norm -> lm_head.

What differs between architectures lives in moed/model/archs/ (one module each): how config.json
maps to the spec, checkpoint names, and which blocks each layer is built from (`Arch.build_layer`,
usually from the helpers below). Weights are plain tensors in canonical names (see loader); no
nn.Module machinery in the hot path. Every layer gets the model's one ComputeContext.
"""
from __future__ import annotations

from typing import Callable

import torch

from moed.model.attention.base import AttentionBackend
from moed.model.context import ComputeContext
from moed.model.kernels import CpuKernels
from moed.model.quant.weight import QuantWeight
from moed.model.layers import AttentionBlock, DenseMLP, Linear, Rotary, add_rms_norm
from moed.model.moe import MoELayer
from moed.model.spec import ModelSpec

Weights = dict[str, torch.Tensor]


class DecoderLayer:
    """Pre-norm residual layer: h + attn(norm(h)), then + mlp(norm(.))."""

    def __init__(self, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                 attn: AttentionBlock, mlp: MoELayer | DenseMLP, kernels: CpuKernels | None) -> None:
        self.input_norm, self.post_norm, self.eps = input_norm, post_norm, eps
        self.attn, self.mlp, self.kernels = attn, mlp, kernels

    def __call__(self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 backend: AttentionBackend, kv_layer: torch.Tensor,
                 rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h plus the previous layer's not-yet-added output delta -> the same
        pair for the next layer (each add is folded into the norm that follows it). rows: the
        attention runs (and writes K/V) on every row, the rest of the layer on these only."""
        x, h = add_rms_norm(h, delta, self.input_norm, self.eps, self.kernels)
        a = self.attn(x, cos, sin, backend, kv_layer)
        if rows is not None:
            h, a = h.index_select(0, rows), a.index_select(0, rows)
        x, h = add_rms_norm(h, a, self.post_norm, self.eps, self.kernels)
        return h, self.mlp(x)


def moe_block(spec: ModelSpec, i: int, w: Weights, load_row: torch.Tensor, ctx: ComputeContext) -> MoELayer:
    p = f"layers.{i}."
    return MoELayer(spec, w[p + "router"], w[p + "experts.gate_up"], w[p + "experts.down"], load_row, ctx,
                    ctx.placement)


def dense_block(i: int, w: Weights, ctx: ComputeContext) -> DenseMLP:
    return DenseMLP(w[f"layers.{i}.mlp.gate_up"], w[f"layers.{i}.mlp.down"], ctx)


def decoder_layer(spec: ModelSpec, i: int, w: Weights, mlp: MoELayer | DenseMLP,
                  ctx: ComputeContext) -> DecoderLayer:
    """Layer i with GQA attention (q/k norms when the weights have them) and the given MLP."""
    p = f"layers.{i}."
    return DecoderLayer(w[p + "input_norm"], w[p + "post_norm"], spec.rms_norm_eps,
                        AttentionBlock(spec, i, w, ctx), mlp, ctx.kernels)


# (spec, layer index, weights, this layer's expert-load row, context) -> the layer
BuildLayer = Callable[[ModelSpec, int, Weights, torch.Tensor, ComputeContext], DecoderLayer]


class MoEDecoder:
    def __init__(self, spec: ModelSpec, w: Weights, build_layer: BuildLayer, ctx: ComputeContext,
                 consume: bool = False) -> None:
        """consume: drop each layer's entries from `w` once built (the layers hold what they
        keep), so nothing outlives the build that the model does not use."""
        self.spec, self.ctx = spec, ctx
        self.kernels = ctx.kernels        # None: the torch path throughout (see ComputeContext)
        # formats of the quantized weights (moed/model/quant): they take the reference path
        self.quantized = tuple(sorted({x.fmt for x in w.values() if isinstance(x, QuantWeight)}))
        self.embed, self.norm = w["embed"], w["norm"]
        self.lm_head = Linear(w["lm_head"], pack=ctx.pack, kernels=ctx.for_weight(w["lm_head"]))
        # Tokens routed per logical expert since the last read ([layers, experts], int64).
        self.expert_load = torch.zeros((spec.num_layers, max(spec.num_experts, 1)), dtype=torch.long,
                                       device=ctx.device)
        # called with the step's embeddings before the layers run: the cold-expert store's
        # first-layer prefetch (moed/model/cold/prefetch.py); None without it
        self.before_layers: Callable[[torch.Tensor], None] | None = None
        self.layers = []
        for i in range(spec.num_layers):
            self.layers.append(build_layer(spec, i, w, self.expert_load[i], ctx))
            if consume:
                for name in [n for n in w if n.startswith(f"layers.{i}.")]:
                    del w[name]
        if spec.attention_kind == "mla":     # rotary over the rope dims, YaRN-scaled when configured
            from moed.model.attention.mla import mla_rotary
            self.rotary = mla_rotary(spec, ctx)
        else:
            self.rotary = Rotary(spec.head_dim, spec.rope_theta, spec.max_position_embeddings, ctx.dtype, ctx.device)

    def empty_step(self) -> None:
        """Expert parallelism, a rank with no tokens this step: every MoE layer's exchange, in
        layer order, so the ranks that have tokens get their experts run."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoELayer):
                layer.mlp.empty_step(self.ctx.dtype)

    def resident_expert_bytes(self) -> int:
        return sum(layer.mlp.resident_bytes() for layer in self.layers if isinstance(layer.mlp, MoELayer))

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, max_pos: int,
                backend: AttentionBackend, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream after the last layer and that layer's not-yet-added output."""
        h = self.embed.index_select(0, input_ids)
        if self.before_layers is not None:
            self.before_layers(h)
        cos, sin = self.rotary.tables(positions, max_pos)
        delta = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, cos, sin, backend, kv_cache[i])
        return h, delta

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, max_pos: int,
                 last_rows: torch.Tensor, backend: AttentionBackend, kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T] -> fp32 logits [B, vocab] of the rows in last_rows."""
        h, delta = self._layers(input_ids, positions, max_pos, backend, kv_cache)
        x, _ = add_rms_norm(h.index_select(0, last_rows),
                            None if delta is None else delta.index_select(0, last_rows),
                            self.norm, self.spec.rms_norm_eps, self.kernels)
        return self.lm_head(x).float()

    def with_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, max_pos: int,
                    last_rows: torch.Tensor, backend: AttentionBackend,
                    kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """__call__'s logits, and every row's hidden state after the final norm [T, H] (the
        model dtype): what DeepSeek-V3's MTP layer takes (moed/model/mtp.py). The norm runs on
        all T rows instead of B, row by row, so the logits are __call__'s."""
        h, delta = self._layers(input_ids, positions, max_pos, backend, kv_cache)
        x, _ = add_rms_norm(h, delta, self.norm, self.spec.rms_norm_eps, self.kernels)
        return self.lm_head(x.index_select(0, last_rows)).float(), x
