"""StepRunner: what the engine asks of a model runner (moed.model.runner.ModelRunner is the
real one; tests bring fakes). Every member is required, so the engine never probes a runner;
`RunnerDefaults` gives a fake the optional capabilities' "not here" answers."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from moed.model.kv_layout import KVLayout
    from moed.model.batch import ForwardBatch
    from moed.transfer import KVRegion


class StepRunner(Protocol):
    spec: Any                   # moed.model.spec.ModelSpec (a fake's namespace in tests)
    num_blocks: int
    block_size: int
    kv_layout: KVLayout | None  # None: no real KV tensor (fakes); no tiers, no transfer
    kv_cache: Any

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...
    def forward_mtp(self, batch: ForwardBatch, hidden: torch.Tensor,
                    kv_only: bool = False) -> torch.Tensor | None: ...
    def draft_mtp(self, batch: ForwardBatch, hidden: torch.Tensor, depth: Sequence[int],
                  passes: int = 0, kept: Sequence[int] | None = None) -> list[list[int]]: ...
    def mtp_exchanges(self, passes: int) -> None: ...
    def forward_empty(self, mtp: int = 0) -> None: ...
    def argmax_of(self, logits: torch.Tensor) -> torch.Tensor | None: ...
    def expert_load(self) -> torch.Tensor | None: ...
    def describe(self) -> dict[str, str]: ...
    def kv_region(self) -> KVRegion: ...
    def resident_expert_bytes(self) -> int: ...


class RunnerDefaults:
    """A runner without the optional capabilities: no step argmax (the sampler computes
    it), no expert-load counts, no KV layout, no expert-parallel group."""
    kv_layout: KVLayout | None = None
    kv_cache: Any = None

    def argmax_of(self, logits: torch.Tensor) -> torch.Tensor | None:
        return None

    def expert_load(self) -> torch.Tensor | None:
        return None

    def describe(self) -> dict[str, str]:
        return {}

    def resident_expert_bytes(self) -> int:
        return 0

    def forward_empty(self, mtp: int = 0) -> None:
        raise RuntimeError("this runner is not part of an expert-parallel group")

    def forward_mtp(self, batch: ForwardBatch, hidden: torch.Tensor,
                    kv_only: bool = False) -> torch.Tensor | None:
        raise RuntimeError("this runner has no MTP layer")

    def draft_mtp(self, batch: ForwardBatch, hidden: torch.Tensor, depth: Sequence[int],
                  passes: int = 0, kept: Sequence[int] | None = None) -> list[list[int]]:
        raise RuntimeError("this runner has no MTP layer")

    def mtp_exchanges(self, passes: int) -> None:
        raise RuntimeError("this runner has no MTP layer")

    def kv_region(self) -> KVRegion:
        raise RuntimeError("this runner has no KV tensor to register")
