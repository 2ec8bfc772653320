"""Cold experts: routed-expert weights kept resident by measured heat, the rest read from the
checkpoint's safetensors files when a step routes to them (docs/cold-experts.md).

  policy.py   the decisions, pure: slots per layer from the byte budget, rounds of a layer
              call, the victim slot, which experts to read ahead
  reader.py   the disk tier: (layer, expert) -> its matrices' byte ranges; pread into buffers
  packread.py a round's misses (and the mover's installs) read from the page cache and packed
              into their slots by the kernels' team, in one call
  direct.py   a layer call's few-row misses run straight from the page cache (no slot; the
              hotter installed into one as they are read)
  store.py    ExpertStore (the model's ExpertPlacement) and ColdExperts (a layer's slots):
              misses, heat
  mover.py    Mover: the between-steps installs of the hottest non-resident experts
  executor.py ColdExecutor, a layer's executor in one process (rows grouped, outputs combined)
  stats.py    the counters since start, and the metrics they advance
  prefetch.py Prefetcher: layer-ahead prediction (the next MoE layer's router on the hidden
              state at hand) and the reads of the predicted experts, staged in a bounded budget

`cold_store` is the one entry: the runner calls it with `[experts]`'s settings.
"""
from __future__ import annotations

from pathlib import Path

import structlog
import torch

from moed.model.cold.reader import ExpertIndex, ExpertReadError
from moed.model.cold.stats import ColdStats
from moed.model.cold.store import ColdSettings, ExpertStore
from moed.model.context import ExpertPlacement
from moed.model.quant.formats import Plan
from moed.model.spec import ModelSpec

log = structlog.get_logger(__name__)

__all__ = ["ColdSettings", "ColdStats", "ExpertIndex", "ExpertReadError", "ExpertStore", "cold_store"]


def quantized_expert_bytes(spec: ModelSpec, plan: Plan) -> int:
    """One expert's bytes quantized online (data, scales), groups as the loader chooses them."""
    from moed.model.quant.quantize import quantize
    i, h = spec.moe_intermediate_size, spec.hidden_size

    def size(rows: int, cols: int) -> int:
        group = 128 if plan.online == "fp8" else cols if plan.online == "int8" else plan.group_size
        return quantize(torch.zeros((rows, cols)), plan.online, group).nbytes
    return 2 * size(i, h) + size(h, i)


def cold_store(model_dir: str | Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
               settings: ColdSettings, placement: ExpertPlacement | None, mtp_layers: int,
               plan: Plan) -> ExpertStore | None:
    """The store for a resident budget, or None when the budget holds every expert this process
    serves (today's path, untouched); ValueError for what is not built yet, or a budget under
    the minimum. placement: expert parallelism's for this rank (the budget is this rank's, over
    its own slots), or None."""
    if settings.resident_bytes <= 0:
        return None
    what = (f"device {device}" if device.type != "cpu" else
            "the MTP layer" if mtp_layers else
            f"a quantized checkpoint ({plan.fmt})" if plan.checkpoint is not None else
            f"model type {spec.arch} without routed experts" if spec.num_experts < 2 else None)
    if what is not None:
        raise ValueError(f"experts.resident_bytes with {what} is not built yet (the cold-expert "
                         f"store tiers a CPU node's own experts, plain or quantized at load)")
    if plan.online:     # slots hold what the loader makes: each matrix quantized from the file's dtype
        index = ExpertIndex(model_dir, spec, None)
        store = ExpertStore(spec, index, settings, quantized_expert_bytes(spec, plan), placement)
    else:
        store = ExpertStore(spec, ExpertIndex(model_dir, spec, dtype), settings, None, placement)
    if store.slots >= len(store.units):
        log.info("cold_experts_off", reason="experts.resident_bytes holds every expert this "
                 "process serves", resident_bytes=settings.resident_bytes,
                 expert_bytes_total=store.expert_bytes * len(store.units) * len(store.moe_layers))
        store.close()
        return None
    log.info("cold_experts_on", **store.describe())
    return store
