"""Request: the one object the scheduler, the step loop and the stream share (no torch here).

Tokens: `token_ids` = prompt + output so far (*known*); the first `num_computed_tokens` of them
have K/V in the cache. Text: each new token goes through an incremental detokenizer, then a
stop-string filter that holds back text that could still become a stop string (OpenAI
semantics: the stop string itself never reaches the client).

Structured outputs: `grammar` (a moed.model.grammar.GrammarMatcher, None without one) is fed
every token appended here, and only here: the first token too (sampled here or, on a decode
node, by the prefill node), never again on a preemption's recompute (that recomputes K/V, it
appends nothing). Once the grammar is complete (only EOS could follow) the request finishes
with "stop"; a token the grammar refuses (a bug, or a prefill node that ignored the grammar)
finishes it with an error.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from moed.kvcache.pool import salt_root
from moed.types import (ErrorKind, FinishReason, RequestState, RequestTimings, SamplingParams,
                         check_transition)


class Detokenizer(Protocol):
    """moed.model.tokenizer.IncrementalDetokenizer's shape."""

    def add(self, token_ids: int) -> str:
        """Feed one token; return the newly printable text (may be empty)."""

    def flush(self) -> str:
        """At the end: whatever text is still held back."""


class StopStrings:
    """Finds stop strings across token boundaries; holds back text that may start one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """-> (text safe to emit now, whether a stop string was hit)."""
        if not self.stops:
            return delta, False
        buf = self.held + delta
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    detokenizer: Detokenizer | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    remote_kv: bool = False          # decode role: the prompt's KV is written by a prefill node
    prefill_only: bool = False       # prefill role: stop after the first token, keep the blocks
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None   # time.monotonic(), like arrival_time
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None     # with error: GRAMMAR when the grammar overran
    rng: Any = None                  # sampler state (a torch.Generator for seeded requests)
    grammar: Any = None              # structured outputs: this request's GrammarMatcher
    # speculative decoding (engine.drafts): its NgramIndex, or (length, token) the MTP layer
    # drafted for the position after `length` known tokens
    drafter: Any = None
    acceptance: Any = None           # and its drafts' Acceptance (engine.drafts.propose)
    # the first position whose MTP-layer KV entry is deferred (engine.drafts.mtp_kv), None when
    # none is: the prefix cache takes blocks only below it (num_cacheable_tokens)
    mtp_pending_from: int | None = None
    # a migrated stream's decode replay (engine.resume) still forces its sent tokens: no drafts
    replaying: bool = False
    # params.prompt_logprobs: prompt tokens 1.. so far (moed.types.PromptLogprob), and whether
    # they went out (on the first token's event)
    prompt_logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    token_ids: list[int] = field(init=False)
    stop_strings: StopStrings = field(init=False)
    # the parent hash of the prompt's first block: its cache salt's (None = unsalted)
    cache_root: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.stop_strings = StopStrings(self.params.stop)
        self.cache_root = salt_root(self.params.cache_salt)

    # ---- views -----------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Asks for prompt logprobs and some are not computed yet: the prompt must be computed
        here, so no prefix-cache hit may skip it (vLLM does the same)."""
        return self.params.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_cacheable_tokens(self) -> int:
        """Computed tokens whose K/V is complete in every layer: what the prefix cache may
        take (the MTP layer's deferred entries are still missing past mtp_pending_from)."""
        if self.mtp_pending_from is None:
            return self.num_computed_tokens
        return min(self.num_computed_tokens, self.mtp_pending_from)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def set_state(self, new: RequestState) -> None:
        check_transition(self.state, new)
        self.state = new

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.set_state(RequestState.FINISHED)
        self.finish_reason = reason
        self.error = error

    def timings(self, now: float | None = None) -> RequestTimings:
        """Queue / prefill / decode time so far (at the finish: the request's whole life)."""
        now = time.monotonic() if now is None else now
        sched, first = self.first_scheduled_time, self.first_token_time
        return RequestTimings(
            queue_s=None if sched is None else sched - self.arrival_time,
            prefill_s=None if sched is None or first is None else first - sched,
            decode_s=None if first is None else now - first)

    # ---- one new token ---------------------------------------------------------------------
    def append_token(self, token_id: int) -> tuple[str, FinishReason | None]:
        """Record a sampled token; -> (text to emit, finish reason or None). Does not change
        `state` (the scheduler does, since finishing also frees blocks)."""
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        p = self.params
        n_out = self.num_output_tokens
        done = False                 # the grammar is complete: nothing but EOS may follow
        if self.grammar is not None:
            if not self.grammar.accept(token_id):
                self.error = f"structured output: token {token_id} refused ({self.grammar.error})"
                if self.grammar.too_complex:    # a limit, not a bad token: the request's own 400
                    self.error = f"a grammar engine limit was hit: {self.grammar.error}"
                    self.error_kind = ErrorKind.GRAMMAR
                return self._drain()[0], FinishReason.ERROR
            done = self.grammar.stopped
        past_min = n_out > p.min_tokens
        if past_min and ((not p.ignore_eos and token_id in self.eos_token_ids)
                         or token_id in p.stop_token_ids):
            return self._drain()[0], FinishReason.STOP   # the stop token's own text is not shown
        delta = self.detokenizer.add(token_id) if self.detokenizer is not None else ""
        if n_out >= p.min_tokens:
            text, hit = self.stop_strings.feed(delta)
        else:   # stop strings only count once min_tokens are out
            text, hit = self.stop_strings.held + delta, False
            self.stop_strings.held = ""
        if hit:
            return text, FinishReason.STOP
        if done or n_out >= p.max_tokens or self.num_tokens >= self.max_model_len:
            rest, hit = self._drain()
            return text + rest, FinishReason.STOP if hit or done else FinishReason.LENGTH
        return text, None

    def _drain(self) -> tuple[str, bool]:
        """Final text: the detokenizer's held bytes, through the stop filter, then its hold."""
        tail = self.detokenizer.flush() if self.detokenizer is not None else ""
        text, hit = self.stop_strings.feed(tail)
        return (text, True) if hit else (text + self.stop_strings.flush(), False)
