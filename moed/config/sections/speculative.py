"""[speculative]: speculative decoding (moed/engine/speculate.py, docs/speculative.md). The
field names and meanings are vLLM's `--speculative-config` keys; that flag takes the same JSON.
Restart-only: a request's draft index is built from its prompt when it first decodes."""
from __future__ import annotations

from dataclasses import dataclass

from moed.config.schema import _check_bounds, _choice, _f

# "" = off
SPEC_METHODS = ("", "ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = _f("", doc="'' = off | ngram (prompt lookup: drafts copied from the "
                     "request's own prompt and output) | mtp (DeepSeek-V3's MTP layer, chained for k > 1, k <= 4)")
    # 8: verifying k + 1 positions costs a prefill-like step; past ~8 the rejected tail of a
    # guess costs more than the rare long accepted run earns (vLLM's ngram examples use 3-5)
    num_speculative_tokens: int = _f(3, bounds=(1, 8), doc="k: draft tokens verified per "
                                     "request per step (1..8)")
    prompt_lookup_min: int = _f(5, bounds=(1, 64), doc="ngram: the shortest suffix n-gram "
                                "that may match (vLLM's default 5)")
    prompt_lookup_max: int = _f(5, bounds=(1, 64), doc="ngram: the longest suffix n-gram "
                                "tried first (vLLM's default 5)")
    # moed's one key beyond vLLM's: the measured per-step switch (moed/engine/drafts/gate.py)
    adaptive: bool = _f(True, doc="per decoding row count, draft only in the steps where drafting "
                        "measured more tokens per second than not drafting (false: every step "
                        "may draft)")

    def __post_init__(self) -> None:
        _check_bounds("speculative", self)
        _choice("speculative.method", self.method, SPEC_METHODS)
        # prompt_lookup_min <= prompt_lookup_max: moed/config/rules.py speculative (each
        # field loads alone at its bounds)

    @property
    def enabled(self) -> bool:
        return self.method != ""
