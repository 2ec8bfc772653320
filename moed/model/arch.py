"""The decoder stack shared by Qwen3-MoE and Mixtral: embed -> N x (attention, MoE/MLP) -> norm -> lm_head.

The two architectures differ only in data the spec carries (q/k norm, router renormalisation,
dense layers), so one class serves both. Weights are plain tensors in canonical names (see
loader); no nn.Module machinery in the hot path.
"""
from __future__ import annotations

import torch

from moed.model.attention.base import AttentionBackend
from moed.model.kernels import CpuKernels, cpu_kernels
from moed.model.layers import AttentionBlock, DenseMLP, Linear, Rotary, add_rms_norm, can_pack
from moed.model.moe import MoELayer
from moed.model.spec import ModelSpec


class DecoderLayer:
    def __init__(self, spec: ModelSpec, i: int, w: dict[str, torch.Tensor], load_row: torch.Tensor,
                 pack: bool, kernels: CpuKernels | None = None) -> None:
        p = f"layers.{i}."
        self.input_norm, self.post_norm, self.eps = w[p + "input_norm"], w[p + "post_norm"], spec.rms_norm_eps
        self.kernels = kernels
        self.attn = AttentionBlock(spec, i, w, pack, kernels)
        self.mlp: MoELayer | DenseMLP
        if i in spec.dense_layers:
            self.mlp = DenseMLP(w[p + "mlp.gate_up"], w[p + "mlp.down"], pack, kernels)
        else:
            self.mlp = MoELayer(spec, w[p + "router"], w[p + "experts.gate_up"], w[p + "experts.down"],
                                load_row, pack, kernels)

    def __call__(self, h: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 backend: AttentionBackend, kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h plus the previous layer's not-yet-added output delta -> the same
        pair for the next layer (each add is folded into the norm that follows it)."""
        x, h = add_rms_norm(h, delta, self.input_norm, self.eps, self.kernels)
        a = self.attn(x, cos, sin, backend, kv_layer)
        x, h = add_rms_norm(h, a, self.post_norm, self.eps, self.kernels)
        return h, self.mlp(x)


class MoEDecoder:
    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 consume: bool = False) -> None:
        """consume: drop each layer's entries from `w` once built (the layers hold what they
        keep), so nothing outlives the build that the model does not use."""
        self.spec = spec
        pack = can_pack(device, dtype)
        # Native CPU kernels (bf16 on AVX512-BF16 x86): matmuls, fused MoE, norms, rotary, decode
        # attention (moed/model/kernels); None elsewhere, and every layer keeps the torch path.
        self.kernels = cpu_kernels() if pack else None
        self.embed, self.norm = w["embed"], w["norm"]
        self.lm_head = Linear(w["lm_head"], pack=pack, kernels=self.kernels)
        # Tokens routed per logical expert since the last read ([layers, experts], int64).
        self.expert_load = torch.zeros((spec.num_layers, max(spec.num_experts, 1)), dtype=torch.long, device=device)
        self.layers = []
        for i in range(spec.num_layers):
            self.layers.append(DecoderLayer(spec, i, w, self.expert_load[i], pack, self.kernels))
            if consume:
                for name in [n for n in w if n.startswith(f"layers.{i}.")]:
                    del w[name]
        self.rotary = Rotary(spec.head_dim, spec.rope_theta, spec.max_position_embeddings, dtype, device)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, max_pos: int,
                 last_rows: torch.Tensor, backend: AttentionBackend, kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T] -> fp32 logits [B, vocab] of the rows in last_rows."""
        h = self.embed.index_select(0, input_ids)
        cos, sin = self.rotary.tables(positions, max_pos)
        delta = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, cos, sin, backend, kv_cache[i])
        x, _ = add_rms_norm(h.index_select(0, last_rows),
                            None if delta is None else delta.index_select(0, last_rows),
                            self.norm, self.spec.rms_norm_eps, self.kernels)
        return self.lm_head(x).float()
