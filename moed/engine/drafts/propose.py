"""When a request drafts, and how many tokens: the pure half the scheduler runs (no torch).

A running request drafts in a step when it is decoding (one known token left to compute, its
first output token out) and the node speculates. A request with a grammar drafts too: its draft
is cut to the prefix its grammar accepts from the matcher's state now (`valid_prefix`: a token
the grammar refuses could never be emitted, nor anything after it), and the step masks each
verified position (moed.engine.masks) so verification draws from the masked distribution plain
decoding draws from.

Adaptive: a request whose drafts keep being rejected stops drafting for a while (`observe`,
below): each verification updates an exponential moving average of its acceptance rate
(accepted / drafted, weight EMA_WEIGHT, starting at 1); when it falls below MIN_ACCEPTANCE the
request skips its next `backoff` drafting chances (16 at first, doubling up to 256 while retries
keep failing; a retry that is accepted resets it), then retries with the average at the
threshold, so one more rejected draft pauses it again. The figures are stated, not fitted: a
rejected draft costs one verified position (a prompt token's cost in the step), an accepted
one saves a whole step for its request; below one acceptance in ten, drafting buys nothing but
positions. Requests whose n-grams never match do not draft at all and are not counted.

The draft never makes the request emit more than its limits allow: after a step with d drafts
the request has at most d + 1 new tokens, so d <= max_tokens - output - 1 and
d <= max_model_len - tokens - 1 (the positions verified stay inside the context). A policy's
budget may shorten it further (`room`); the KV pool may too (moed.engine.scheduler).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from moed.engine.drafts.ngram import NgramIndex
from moed.engine.request import Request
from moed.types import RequestState

if TYPE_CHECKING:
    from moed.config import SpeculativeConfig


@dataclass(frozen=True)
class SpecSettings:
    """[speculative] as the engine runs it (moed.config.SpeculativeConfig, method != "")."""
    method: str
    k: int                  # num_speculative_tokens
    n_min: int              # prompt_lookup_min
    n_max: int              # prompt_lookup_max
    adaptive: bool = True   # the measured per-step switch (moed.engine.drafts.gate)

    @classmethod
    def from_config(cls, c: SpeculativeConfig) -> SpecSettings | None:
        """None when speculation is off."""
        if not c.enabled:
            return None
        if c.method not in ("ngram", "mtp"):
            raise ValueError(f"speculative.method {c.method!r} is not served by the engine")
        return cls(c.method, c.num_speculative_tokens, c.prompt_lookup_min,
                   c.prompt_lookup_max, c.adaptive)


EMA_WEIGHT = 0.3
MIN_ACCEPTANCE = 0.1
BACKOFF_MIN, BACKOFF_MAX = 16, 256


@dataclass(frozen=True)
class Acceptance:
    """A request's measured acceptance (see the module docstring)."""
    ema: float = 1.0                # accepted / drafted, smoothed
    skip: int = 0                   # drafting chances left to skip
    backoff: int = BACKOFF_MIN      # the next pause, in drafting chances


def observe(a: Acceptance | None, drafted: int, accepted: int) -> Acceptance:
    """The acceptance after one verification of `drafted` tokens, `accepted` of them kept."""
    a = a or Acceptance()
    ema = (1 - EMA_WEIGHT) * a.ema + EMA_WEIGHT * accepted / max(drafted, 1)
    if ema >= MIN_ACCEPTANCE:
        return Acceptance(ema, 0, BACKOFF_MIN if accepted else a.backoff)
    # pause, then retry at the threshold: one more rejection pauses twice as long
    return Acceptance(MIN_ACCEPTANCE, a.backoff, min(2 * a.backoff, BACKOFF_MAX))


def draft_room(req: Request, k: int) -> int:
    """How many draft tokens `req` may verify this step (0: it decodes one token)."""
    if req.state is not RequestState.RUNNING or req.prefill_only \
            or req.replaying:      # a decode replay forces its next tokens (engine.resume)
        return 0
    if req.num_tokens - req.num_computed_tokens != 1 or req.num_output_tokens == 0:
        return 0
    left_out = req.params.max_tokens - req.num_output_tokens - 1
    left_ctx = req.max_model_len - req.num_tokens - 1
    return max(0, min(k, left_out, left_ctx))


def propose(s: SpecSettings, req: Request, room: int) -> tuple[int, ...]:
    """Up to `room` draft tokens for `req`: ngram, from its n-gram index (built on its first
    draft, then extended with whatever tokens it has gained since: the index sees exactly the
    request's prompt + emitted tokens, never a rejected draft); mtp, the one token the MTP
    layer drafted in the last step for the request's current length (moed.engine.speculate).
    Nothing while its acceptance has it paused (`observe`)."""
    if room <= 0:
        return ()
    acc = req.acceptance
    if acc is not None and acc.skip:    # paused: its drafts were a loss (`observe`)
        req.acceptance = replace(acc, skip=acc.skip - 1)
        return ()
    if s.method == "mtp":   # the MTP layer's draft from the last step, for this very length
        d = req.drafter
        return _valid(req, (d[1],) if d is not None and d[0] == req.num_tokens else ())
    idx = req.drafter
    if idx is None:
        idx = req.drafter = NgramIndex(s.n_min, s.n_max)
    if len(idx) < req.num_tokens:
        idx.extend(req.token_ids[len(idx):])
    return _valid(req, tuple(idx.propose(room)))


def _valid(req: Request, draft: tuple[int, ...]) -> tuple[int, ...]:
    """The draft cut to what the request's grammar accepts in a row (the loop thread owns the
    matcher while scheduling; validating leaves it as it was)."""
    if req.grammar is None or not draft:
        return draft
    return draft[:req.grammar.valid_prefix(draft)]
