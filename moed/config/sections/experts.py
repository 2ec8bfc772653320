"""[experts]: routed-expert weights kept resident by heat, the rest read from the checkpoint
on demand (moed/model/cold, docs/cold-experts.md)."""
from __future__ import annotations

from dataclasses import dataclass

from moed.config.schema import _check_bounds, _f


@dataclass(frozen=True)
class ExpertsConfig:
    resident_bytes: int = _f(0, bounds=(0, 1 << 60),
                             doc="bytes of routed-expert weights this node keeps resident, "
                             "split evenly over the MoE layers; the others are read from the "
                             "checkpoint's safetensors files when routed to (0 = all resident; "
                             "more than the model's expert bytes = all)")
    move_bytes_per_step: int = _f(16 << 20, bounds=(0, 1 << 50),
                                  doc="bytes of hot experts promoted from disk between two "
                                  "steps (read ahead on a background thread; at least one "
                                  "expert; 0 = only misses load experts)")
    heat_half_life_steps: float = _f(8.0, bounds=(1.0, 1e6),
                                     doc="steps over which an expert's routed-token count "
                                     "(its heat) halves")
    prefetch_experts: int = _f(-1, bounds=(-1, 1 << 20),
                               doc="experts read ahead of use by layer-ahead prediction (the "
                               "next MoE layer's router on the current hidden state), staged "
                               "at most this many at a time; their bytes come out of "
                               "resident_bytes. -1 = auto: 16, at most an eighth of the "
                               "budget's experts, in one process; off under expert "
                               "parallelism (not built there); 0 = off")

    def __post_init__(self) -> None:
        _check_bounds("experts", self)

    @property
    def tiered(self) -> bool:
        """Whether some experts may live off the resident tier (a budget is set)."""
        return self.resident_bytes > 0
