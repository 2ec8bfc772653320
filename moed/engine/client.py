"""EngineClient: the one contract the API, the roles and ops hold an engine by.

`Engine` implements it, on every node: where a prompt's KV comes from (computed here, a
prefill node, a peer's cache) is the node's PromptSource (moed.engine.prompts), given to the
engine once when the node is built, not a wrapper around it. Everything is called from the
event loop's thread; `kv` and `tiers` are read there and changed only inside an
`at_step_boundary` function. Events go to subscribers (any number each; `subscribe_*` returns the function
that unsubscribes):

    step              StepStats after every step (metrics)
    prefill_progress  (request_id, block_ids, num_computed_tokens) for prefill-only requests
                      after each step that computed some of their prompt (the prefill role)
    expert_load       the runner's expert load [layers, experts] about once a second and when
                      the loop goes idle (metrics, the expert balancer)
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

import structlog

from moed.config import BalanceConfig, EngineConfig
from moed.engine.stream import RequestStream, StepStats
from moed.types import ContextRule, EngineStats, SamplingParams

if TYPE_CHECKING:
    from moed.balance.cost import AdvertisedCost
    from moed.engine.prompts import PromptSource
    from moed.kvcache.manager import KVCacheManager
    from moed.kvcache.tiers import TieredCache
    from moed.transfer import KVRegion

log = structlog.get_logger(__name__)

F = TypeVar("F", bound=Callable[..., None])
Unsubscribe = Callable[[], None]


class Listeners(Generic[F]):
    """Subscribers to one kind of event; one failing never stops the others (it is logged)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._fns: list[F] = []

    def add(self, fn: F) -> Unsubscribe:
        self._fns.append(fn)
        return lambda: self._fns.remove(fn) if fn in self._fns else None

    def __bool__(self) -> bool:
        return bool(self._fns)

    def emit(self, *args: Any) -> None:
        for fn in list(self._fns):
            try:
                fn(*args)
            except Exception:
                log.exception("engine_listener_failed", kind=self.name,
                              listener=getattr(fn, "__qualname__", repr(fn)))


@runtime_checkable
class EngineClient(Protocol):
    # ---- what the API reads ----
    @property
    def tokenizer(self) -> Any: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def context(self) -> ContextRule: ...
    @property
    def block_size(self) -> int: ...
    @property
    def alive(self) -> bool: ...
    @property
    def kv_layout_id(self) -> str: ...
    def stats(self) -> EngineStats: ...
    def model_info(self) -> dict[str, str]: ...
    def limits(self) -> dict[str, int]: ...

    # ---- requests ----
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, *, remote_kv: bool = False,
                    prefill_only: bool = False, resume: Sequence[int] = ()
                    ) -> RequestStream: ...
    def abort(self, request_id: str) -> None: ...

    # ---- disaggregation (the roles) ----
    def complete_remote_prefill(self, request_id: str, first_token_id: int,
                                logprob: float | None = None,
                                top_logprobs: Sequence[tuple[int, float]] | None = None,
                                draft: int | None = None) -> None: ...
    def release_kv(self, request_id: str) -> None: ...
    def kv_block_table(self, request_id: str) -> list[int]: ...
    def kv_region(self) -> KVRegion: ...
    def use_prompt_source(self, source: PromptSource) -> None: ...

    # ---- the KV cache and the cost model (peer reuse, gossip, capacity) ----
    @property
    def kv(self) -> KVCacheManager: ...
    @property
    def tiers(self) -> TieredCache | None: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    def predict_prefill_s(self, tokens: int, start: int) -> float: ...
    def advertised(self) -> AdvertisedCost | None: ...
    def ttft_over_deadline(self, prompt_tokens: int, timeout_s: float | None
                           ) -> tuple[float, float] | None: ...

    # ---- ops ----
    def apply_config(self, cfg: EngineConfig) -> None: ...
    def apply_balance(self, cfg: BalanceConfig) -> None: ...
    def expect_group_end(self) -> None: ...
    def at_step_boundary(self, fn: Callable[[], Any]) -> asyncio.Future: ...
    def subscribe_step(self, fn: Callable[[StepStats], None]) -> Unsubscribe: ...
    def subscribe_prefill_progress(self, fn: Callable[[str, list[int], int], None]
                                   ) -> Unsubscribe: ...
    def subscribe_expert_load(self, fn: Callable[[Any], None]) -> Unsubscribe: ...
    async def start(self) -> None: ...
    async def shutdown(self) -> None: ...
