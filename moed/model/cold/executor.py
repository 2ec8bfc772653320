"""ColdExecutor: a MoE layer's executor when one process serves every expert with cold experts
on: its routed rows grouped by expert through the layer's ColdExperts (store.py), each token's k
outputs combined as the all-resident path combines them (executor.combine_sorted: from the
expert order the rows come back in, no unsort)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moed.model.executor import ExpertExecutor, MoEMode, Routing, combine_sorted
from moed.model.kernels import rows as kernel_rows

if TYPE_CHECKING:
    from moed.model.cold.store import ColdExperts


GROUP_IN_C = 1 << 21     # elements of the gathered rows up to which kernel_rows.group_rows groups them


class ColdExecutor(ExpertExecutor):
    """One MoE layer's executor with cold experts, in one process (the module docstring)."""

    def __init__(self, layer: ColdExperts) -> None:
        self.layer = layer

    def __call__(self, x: torch.Tensor, routing: Routing, mode: MoEMode = MoEMode.TORCH) -> torch.Tensor:
        t, k = routing.physical.shape
        h = x.shape[1]
        if t == 0:
            return x.new_empty((0, h))
        if self.layer.store.prefetch is not None:     # the next MoE layer's, from this input
            self.layer.store.prefetch.predict(self.layer.pos + 1, x)
        kern = self.layer.local.kernels
        # decode-sized calls in C (one thread: a prefill's gather is left to torch's team)
        if kern is not None and x.dtype == torch.bfloat16 and x.is_contiguous() and t * k * h <= GROUP_IN_C:
            order, per_unit, xs = kernel_rows.group_rows(kern, routing.physical, x, self.layer.num_physical)
        else:
            phys = routing.physical.reshape(-1)
            order = torch.argsort(phys, stable=True)                 # by expert, flat order within
            per_unit = torch.bincount(phys, minlength=self.layer.num_physical)
            xs = x.index_select(0, order // k)
        ys = self.layer.run_grouped(xs, per_unit, mode)
        if kern is not None and (mode == MoEMode.FUSED or t > 1) and kernel_rows.serves_combine(ys, routing.weights):
            return kernel_rows.combine_rows(kern, ys, order, routing.weights)      # combine_sorted, in C
        return combine_sorted(ys, order, routing.weights, routing.physical, mode)   # ids: logical
