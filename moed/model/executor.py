"""The MoE/EP seam: what an MoE layer and an expert-parallel executor say to each other.

These types import nothing of moed, so the layer (moed/model/moe.py), the context that carries
a rank's placement (moed/model/context.py) and the EP executor (moed/parallel/dispatch.py) all
import them without importing one another.

  MoEMode       which path EP=1 would run for a batch; it travels in the EP header, since the
                rank that computes serves several sources
  Routing       the router's decision for a batch: physical experts and weights
  ExpertExecutor  runs routed tokens through their experts and combines the results
  SlotExperts   what an EP executor needs of this rank's local experts: rows grouped by slot
                in, their expert outputs out (moe.LocalExperts gives it)
  combine       each token's k expert outputs weighted and summed in EP=1's order (the EP
                executor and the cold-expert store, moed/model/cold, both end with it)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import torch


class MoEMode(IntEnum):
    """An int (IntEnum) because it is sent as int64 in the expert exchange's header."""
    TORCH = 0     # the router + LocalExperts torch path
    FUSED = 1     # the native CPU bf16 kernel path (moed.model.moe.fused_serves)
    QFUSED = 2    # quantized experts in one native call (moed_moe_q; LocalExperts.qfused_serves)


@dataclass(frozen=True)
class Routing:
    """The router's decision for T tokens: choice j of token t goes to physical expert
    physical[t, j] with weight weights[t, j] (x's dtype); j runs in top-k order."""
    weights: torch.Tensor     # [T, k]
    physical: torch.Tensor    # [T, k] int64
    replicated: bool          # some expert has several replicas (tokens were spread over them)


class ExpertExecutor(ABC):
    """Runs routed tokens through their physical experts and combines the results."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, routing: Routing, mode: MoEMode = MoEMode.TORCH) -> torch.Tensor:
        """x [T, H] -> [T, H]: row t = sum_j routing.weights[t, j] * expert_{physical[t, j]}(x[t]).
        mode: the path EP=1 runs for this batch (an executor with one path ignores it)."""


class SlotExperts(Protocol):
    """This rank's expert slots, as an expert-parallel executor uses them."""
    num_physical: int         # slots held here

    def run_grouped(self, xs: torch.Tensor, per_slot: torch.Tensor, mode: MoEMode) -> torch.Tensor:
        """Rows grouped by local slot (per_slot [S] rows each, in slot order) -> their expert
        outputs, unweighted, in the same order, computed as EP=1's path for `mode` does."""
        ...


def combine(y: torch.Tensor, weights: torch.Tensor, logical: torch.Tensor, mode: MoEMode) -> torch.Tensor:
    """Each token's k expert outputs y [T, k, H] weighted (in y's dtype) and summed as EP=1
    sums them: TORCH (and QFUSED, moed_moe_q's sum) with one token in top-k order in y's dtype
    (LocalExperts._single_token); else by ascending expert in fp32, rounded once (moed_moe_bf16's scatter; torch's CPU
    index_add_ also accumulates bf16 in fp32, measured bitwise equal)."""
    t, k, h = y.shape
    c = y * weights.unsqueeze(-1)
    if mode != MoEMode.FUSED and t == 1:
        out = c[:, 0]
        for j in range(1, k):
            out = out + c[:, j]
        return out
    idx = torch.argsort(logical, dim=1, stable=True)
    cs = c.gather(1, idx.unsqueeze(-1).expand(t, k, h))
    acc = torch.zeros((t, h), dtype=torch.float32, device=y.device)
    for j in range(k):
        acc += cs[:, j].float()
    return acc.to(y.dtype)


def combine_sorted(ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   mode: MoEMode) -> torch.Tensor:
    """combine() of expert outputs still in expert order: ys [T * k, H] holds flat row order[i]
    of y [T, k, H] at row i, order a stable sort of experts [T, k] (the logical ids, or ids that
    ascend with them). The same bits as combine: each token's weighted outputs summed from a zero
    in fp32 in ascending expert order (index_add_ adds source rows in index order), rounded
    once; one token on the torch path keeps combine's top-k order. It skips combine's unsort,
    sort and gather (~145 us of a decode layer call on a 2-core EPYC)."""
    t, k = experts.shape
    if mode != MoEMode.FUSED and t == 1:
        y = torch.empty_like(ys)
        y[order] = ys
        return combine(y.view(t, k, -1), weights, experts, mode)
    c = ys * weights.reshape(-1).index_select(0, order).unsqueeze(1)
    acc = torch.zeros((t, ys.shape[1]), dtype=torch.float32, device=ys.device)
    return acc.index_add_(0, order // k, c.float()).to(ys.dtype)
