"""MoE layer: softmax top-k router, experts computed grouped by physical expert.

Routing goes logical expert -> physical slot through `logical_to_physical` ([E, R] table,
`num_replicas` [E]); today every expert has one replica (identity), but expert parallelism
and EPLB replicas change only the table, never this code. Tokens are sorted by physical
expert, each touched expert runs one gate_up and one down matmul on its contiguous slice, and
results are scattered back with index_add_ (no per-token Python loop).

On CPU bf16, batches of up to FUSED_MAX_TOKENS tokens (decode, short prefill) take the native kernel
(moed/model/kernels): the same router, map and expert math in one call that reads each touched
expert once, instead of ~60 small torch ops per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moed.model.kernels import CpuKernels
from moed.model.layers import Linear
from moed.model.spec import ModelSpec

# Up to this many tokens the fused CPU kernel beats the grouped path below (on the same kernel
# matmuls): 1.2-1.6x from 8 to 1024 tokens per layer of the bench preset (16 experts, top-2),
# but 2x slower at 2048, where its per-call scratch (inputs regrouped, fp32 intermediates) no
# longer fits in cache.
FUSED_MAX_TOKENS = 512


class MoELayer:
    def __init__(self, spec: ModelSpec, router: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, load: torch.Tensor, pack: bool = False,
                 kernels: CpuKernels | None = None) -> None:
        """router [E, H]; gate_up [P, 2I, H] (gate half first); down [P, H, I]; load [E] int64
        (this layer's row of the runner's expert-load counter, updated in place). Experts are
        slices of the fused tensors; pack: plus oneDNN copies per expert (CPU bf16); kernels:
        the native CPU kernels (bf16 only), used for batches up to FUSED_MAX_TOKENS."""
        h, i = router.shape[1], down.shape[2]
        self.kernels = kernels if kernels is not None and h % 2 == 0 and i % 2 == 0 else None
        if self.kernels is not None:
            # The kernels' packed copies serve the fused path and the experts' skinny matmuls;
            # the plain tensors are then held by nothing and freed (see Linear).
            self.router_p, self.gate_up_p, self.down_p = (self.kernels.pack(w) for w in (router, gate_up, down))
            self.router = Linear(router, pack=pack, kernels=kernels, kpacked=self.router_p)
            self.experts = [(Linear(gate_up[e], pack=pack, kernels=kernels, kpacked=self.gate_up_p[e]),
                             Linear(down[e], pack=pack, kernels=kernels, kpacked=self.down_p[e]))
                            for e in range(gate_up.shape[0])]
        else:
            self.router = Linear(router, pack=pack)
            self.experts = [(Linear(gate_up[e], pack=pack), Linear(down[e], pack=pack))
                            for e in range(gate_up.shape[0])]
        self.intermediate = i
        self.top_k, self.norm_topk = spec.top_k, spec.norm_topk_prob
        self.num_experts = spec.num_experts
        self.num_physical = gate_up.shape[0]
        dev = gate_up.device
        self.logical_to_physical = torch.arange(self.num_experts, device=dev).unsqueeze(1)  # [E, R]
        self.num_replicas = torch.ones(self.num_experts, dtype=torch.long, device=dev)
        self.load = load

    def set_expert_map(self, logical_to_physical: torch.Tensor, num_replicas: torch.Tensor) -> None:
        """Install a new map at a step boundary (EPLB); physical weights must already match."""
        if logical_to_physical.shape[0] != self.num_experts or int(logical_to_physical.max()) >= self.num_physical:
            raise ValueError("expert map does not fit this layer's experts")
        # int64 and contiguous: the CPU kernel reads them as raw int64 arrays
        self.logical_to_physical = logical_to_physical.to(torch.long).contiguous()
        self.num_replicas = num_replicas.to(torch.long).contiguous()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k weights [T, k] (x's dtype) and logical expert ids [T, k], as transformers does."""
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if self.kernels is not None and t <= FUSED_MAX_TOKENS:
            return self.kernels.moe_bf16(x, self.router_p, self.num_experts, self.top_k, self.norm_topk,
                                         self.logical_to_physical, self.num_replicas, self.load,
                                         self.gate_up_p, self.down_p, self.intermediate)
        weights, logical = self.route(x)
        if t == 1 and self.logical_to_physical.shape[1] == 1:
            return self._single_token(x, weights, logical[0])
        flat = logical.reshape(-1)
        if self.logical_to_physical.shape[1] == 1:
            phys = self.logical_to_physical[flat, 0]
        else:   # spread a replicated expert's tokens over its replicas
            slot = torch.arange(flat.numel(), device=x.device) % self.num_replicas[flat]
            phys = self.logical_to_physical[flat, slot]
        self.load += torch.bincount(flat, minlength=self.num_experts)
        order = torch.argsort(phys, stable=True)
        counts = torch.bincount(phys, minlength=self.num_physical).tolist()   # one host sync
        token = order // self.top_k
        xs = x.index_select(0, token)
        ys, start = [], 0
        for e, n in enumerate(counts):           # one pass per touched expert, never per token
            if n == 0:
                continue
            gate_up, down = self.experts[e]
            g, u = gate_up(xs[start:start + n]).chunk(2, dim=-1)
            ys.append(down(F.silu(g) * u))
            start += n
        ws = weights.reshape(-1).index_select(0, order).unsqueeze(1)
        out = torch.zeros((t, x.shape[1]), dtype=x.dtype, device=x.device)
        return out.index_add_(0, token, torch.cat(ys) * ws)

    def _single_token(self, x: torch.Tensor, weights: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
        """Batch-1 decode: no sort/scatter, just the k experts in turn (~10% less MoE time)."""
        self.load.index_add_(0, logical, torch.ones_like(logical))
        phys = self.logical_to_physical[logical, 0].tolist()
        out = None
        for j, e in enumerate(phys):
            gate_up, down = self.experts[e]
            g, u = gate_up(x).chunk(2, dim=-1)
            y = down(F.silu(g) * u) * weights[:, j:j + 1]
            out = y if out is None else out + y
        return out
