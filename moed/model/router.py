"""The MoE router: a layer's top-k experts per token (softmax over the router's logits, as
transformers does), mapped to physical slots (EPLB replicas split evenly), its expert-load
counter updated in place. DeepSeek-V3's grouped sigmoid router subclasses it (archs/deepseek_v3.py)."""
from __future__ import annotations

import torch

from moed.model.executor import Routing
from moed.model.experts_route import split_over_replicas
from moed.model.layers import Linear
from moed.model.spec import ModelSpec


class Router:
    def __init__(self, weight: torch.Tensor, spec: ModelSpec, num_physical: int, load: torch.Tensor,
                 linear: Linear) -> None:
        """weight [E, H]; load [E] int64 (this layer's row of the runner's counter, updated in
        place); linear: the matmul over weight (plain, oneDNN-packed or kernel-packed)."""
        self.linear = linear
        self.top_k, self.norm_topk, self.num_experts = spec.top_k, spec.norm_topk_prob, spec.num_experts
        self.num_physical = num_physical
        dev = weight.device
        self.logical_to_physical = torch.arange(self.num_experts, device=dev).unsqueeze(1)  # [E, R]
        self.num_replicas = torch.ones(self.num_experts, dtype=torch.long, device=dev)
        self.load = load
        self.calls = 0      # the replica split's offset (rotates who takes an expert's extra token)

    def next_offset(self) -> int:
        self.calls += 1
        return self.calls - 1

    def set_expert_map(self, logical_to_physical: torch.Tensor, num_replicas: torch.Tensor) -> None:
        """Install a new map at a step boundary (EPLB); physical weights must already match."""
        if logical_to_physical.shape[0] != self.num_experts or int(logical_to_physical.max()) >= self.num_physical:
            raise ValueError("expert map does not fit this layer's experts")
        # int64 and contiguous: the CPU kernel reads them as raw int64 arrays
        self.logical_to_physical = logical_to_physical.to(torch.long).contiguous()
        self.num_replicas = num_replicas.to(torch.long).contiguous()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k weights [T, k] (x's dtype) and logical expert ids [T, k], as transformers does."""
        logits = self.linear(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx

    def choice_scores(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E] fp32 scores whose order is the order route() chooses experts in (the logits:
        softmax keeps their order); for ranking past top-k (the cold store's prefetch)."""
        return self.linear(x).float()

    def __call__(self, x: torch.Tensor) -> Routing:
        """Route x [T, H], map to physical experts and count the load."""
        weights, logical = self.route(x)
        replicated = self.logical_to_physical.shape[1] > 1
        if x.shape[0] == 1 and not replicated:
            self.load.index_add_(0, logical[0], torch.ones_like(logical[0]))
            return Routing(weights, self.logical_to_physical[logical, 0], False)
        flat = logical.reshape(-1)
        if not replicated:
            phys = self.logical_to_physical[flat, 0]
        else:   # each expert's own tokens numbered, modulo its replicas (an even split)
            phys = split_over_replicas(logical, self.logical_to_physical, self.num_replicas,
                                       self.next_offset()).reshape(-1)
        self.load += torch.bincount(flat, minlength=self.num_experts)
        return Routing(weights, phys.view(logical.shape), replicated)
