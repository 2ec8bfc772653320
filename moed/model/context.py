"""ComputeContext: where the model computes and which CPU fast paths serve, decided once; and
ExpertPlacement, the expert-parallel placement the context carries to every MoE layer.

The runner builds one per model and hands it to every layer and to the attention backend, so
the whole model takes the same path: either the native CPU kernels (moed/model/kernels, bf16 on
x86-64 with AVX512(-BF16) or AVX2 + FMA) everywhere they apply, or the torch path everywhere. `cpu_kernels()` logs
`cpu_kernels_on` / `cpu_kernels_off` (with the reason) once per process; the runner's
describe() reports the answer as moed_model_info{cpu_kernels=...}.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from moed.model.executor import ExpertExecutor, SlotExperts
from moed.model.kernels import CpuKernels, cpu_kernels
from moed.model.kernels.choice import native_only
from moed.model.kernels.quant import with_act
from moed.model.quant.weight import QuantWeight


class ExpertPlacement(Protocol):
    """Expert parallelism as the model sees it (moed.parallel.dispatch.RankPlacement): this rank
    holds `local_slots` (the logical expert of each local slot, what the loader loads) of
    `num_physical` slots in the group; `executor` wraps the local experts into the one that
    dispatches tokens to the ranks of their slots and combines the results. The cold-expert
    store (moed/model/cold) is the other placement: all experts, `local_slots` resident, the
    rest read from disk by its executor. `name` says which (logs: what the native step lacks)."""
    num_physical: int
    name: str

    @property
    def local_slots(self) -> tuple[int, ...]: ...
    def expert_map(self) -> tuple[torch.Tensor, torch.Tensor]: ...
    def executor(self, local: SlotExperts) -> ExpertExecutor: ...


@dataclass(frozen=True)
class ComputeContext:
    device: torch.device
    dtype: torch.dtype
    pack: bool = False                  # CPU bf16: weights repacked for oneDNN (see layers.Linear)
    kernels: CpuKernels | None = None   # the native CPU kernels; None = the torch path
    placement: ExpertPlacement | None = None   # expert parallelism: this rank's experts
    batch_invariant: bool = False       # model.batch_invariant (for_weight pins the native kernel)
    quant_act: str = "none"             # model.quantization_activations (for_weight's quantized kernels)

    @classmethod
    def build(cls, device: torch.device | str, dtype: torch.dtype,
              placement: ExpertPlacement | None = None,
              batch_invariant: bool = False, quant_act: str = "none") -> ComputeContext:
        """The one decision: packing where oneDNN's bf16 works, the kernels where they load.
        batch_invariant (model.batch_invariant): the native kernel at every row count; a
        ValueError where a row's result would still depend on its batch (bf16 without the
        native kernels: oneDNN then serves every matmul of more than 2 rows)."""
        device = torch.device(device)
        pack = can_pack(device, dtype)
        # The native kernels do not need oneDNN: where its bf16 does not run (an AVX2 CPU without
        # AVX2-VNNI-2, or ONEDNN_MAX_CPU_ISA=AVX2) they serve every row count (Linear, no race).
        kernels = cpu_kernels() if device.type == "cpu" and dtype == torch.bfloat16 else None
        if batch_invariant:
            if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
                raise ValueError(f"model.batch_invariant: measured for bf16 and float32 on CPU "
                                 f"only, not {dtype} on {device}")
            if dtype == torch.bfloat16 and kernels is None:
                raise ValueError("model.batch_invariant in bf16 needs the native CPU kernels "
                                 "(an AVX512 or AVX2 x86-64 CPU, MOED_CPU_KERNELS not 0; "
                                 "cpu_kernels_off says why they are off), or model.dtype "
                                 "float32")
            kernels = native_only(kernels) if kernels is not None else None
        return cls(device, dtype, pack, kernels, placement, batch_invariant, quant_act)

    def for_weight(self, w: object) -> CpuKernels | None:
        """The kernels a Linear of weight w takes: `kernels`; for a quantized weight on CPU the
        loaded kernels in float32 too (the quantized matmul takes fp32 activations; loaded on
        the first such weight, so a plain fp32 model never builds them), tagged with quant_act
        (kernels/quant.py with_act). None: the torch path."""
        if not isinstance(w, QuantWeight):
            return self.kernels
        return with_act(self._quant_kernels(), self.quant_act)

    def _quant_kernels(self) -> CpuKernels | None:
        if self.device.type != "cpu" or self.dtype not in (torch.bfloat16, torch.float32):
            return None
        if self.kernels is not None:
            return self.kernels
        if self.dtype == torch.bfloat16 and self.batch_invariant:
            return None         # build() refused this already; kept for a context made by hand
        k = cpu_kernels()
        return native_only(k) if k is not None and self.batch_invariant else k


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN-packed bf16 weights: 1.5-2.5x faster skinny GEMMs (decode) on CPU, same numerics."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _onednn_bf16_works()


@functools.cache
def _onednn_bf16_works() -> bool:
    # Older CPUs (no AVX-512) may lack oneDNN's bf16 kernels: probe once, else use F.linear.
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(4, 8, dtype=torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=torch.bfloat16),
                                               torch.ops.mkldnn._reorder_linear_weight(w, 1), None, "none", [], "")
        return bool((y == 8).all())
    except RuntimeError:
        return False
