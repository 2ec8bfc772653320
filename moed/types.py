"""Plain data shared by the engine, the API and the roles. No torch here.

Glossary: a *request* is one sequence to generate (the API turns `n=3` into three requests);
*computed* tokens have K/V in the cache, *known* tokens are prompt + generated so far. Each step
lets computed catch up with known (vLLM v1's model: prefill is just a large catch-up).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the model's context
    ABORT = "abort"      # client went away, timeout or shutdown
    ERROR = "error"      # the engine could not serve it (e.g. prompt can never fit in KV)


class ErrorKind(str, enum.Enum):
    """Why a request finished with FinishReason.ERROR (the API's status depends on it)."""

    INTERNAL = "internal"        # a bug or a failed step: 500
    UNAVAILABLE = "unavailable"  # no capacity here now (e.g. remote prefill failed): 503, retry
    GRAMMAR = "grammar"          # the request's own grammar overran its budget: 400


class RequestState(str, enum.Enum):
    """A request's life in the engine. Allowed moves are in REQUEST_TRANSITIONS.

    The two *waiting for KV* states (KV_WAIT_STATES) are one shape: the request holds fresh
    blocks for the part of its prompt whose K/V arrive from elsewhere, is not scheduled, and
    moves to RUNNING when they have landed (the scheduler learns at the next step) or ends."""

    WAITING = "waiting"                  # queued, no KV yet (or preempted and freed)
    WAITING_REMOTE_KV = "waiting_remote_kv"  # decode role: blocks allocated, prefill node writing them
    WAITING_TIER_KV = "waiting_tier_kv"  # blocks allocated, being loaded from host/disk tiers
    RUNNING = "running"                  # holds KV blocks, scheduled every step
    FINISHED = "finished"


KV_WAIT_STATES = frozenset({RequestState.WAITING_REMOTE_KV, RequestState.WAITING_TIER_KV})

REQUEST_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset(
        {RequestState.RUNNING, RequestState.FINISHED, *KV_WAIT_STATES}),
    **{s: frozenset({RequestState.RUNNING, RequestState.FINISHED}) for s in KV_WAIT_STATES},
    RequestState.RUNNING: frozenset({RequestState.WAITING, RequestState.FINISHED}),  # WAITING = preempted
    RequestState.FINISHED: frozenset(),
}


def check_transition(old: RequestState, new: RequestState) -> None:
    if new not in REQUEST_TRANSITIONS[old]:
        raise RuntimeError(f"illegal request transition {old.value} -> {new.value}")


MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT = 1024             # a salt is an id or a secret, not a document

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the generated text (structured outputs), as data: the grammar engine
    (moed.model.grammar) compiles it. `source` is the JSON schema text (json_schema), unused
    (json_object: any JSON object), a regular expression (regex), a JSON list of strings
    (choice) or a Lark grammar (lark; also what tool calling builds). `param` names the
    request field it came from, for error messages; it is not part of its identity (the
    grammar cache's key is (kind, source)) and does not travel to other nodes."""

    kind: str
    source: str = ""
    param: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False              # logprob of each chosen token
    min_tokens: int = 0
    top_logprobs: int = 0               # also the N most likely tokens' logprobs (0..20)
    # logits processing (moed.model.sampler; vLLM's definitions and order)
    presence_penalty: float = 0.0       # OpenAI: -= p * (count in the output > 0)
    frequency_penalty: float = 0.0      # OpenAI: -= f * count in the output
    repetition_penalty: float = 1.0     # vLLM: over prompt + output; > 0 divided, < 0 multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) added to the logits
    min_p: float = 0.0                  # vLLM: drop p < min_p * p(top token)
    grammar: GrammarSpec | None = None  # structured outputs: the token mask's source
    # logprob of every prompt token after the first (+ this many top tokens): the runner then
    # returns the logits of every prompt position and the prefix cache is not used; None = off
    prompt_logprobs: int | None = None
    # vLLM's: special tokens (added tokens marked special) are left out of the output text;
    # false for tool calling whose markers are special tokens (Mistral's [TOOL_CALLS])
    skip_special_tokens: bool = True
    # the prefix cache's salt (vLLM's cache_salt, and the tenant's key under
    # server.prefix_cache_isolation = "api_key", both folded in by moed.api): only requests with
    # the same salt share cached blocks (moed.kvcache.pool.salt_root); "" = no salt
    cache_salt: str = ""
    # vLLM's: lower runs first (the scheduler seats by it and preempts the largest first)
    priority: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError("temperature must be in [0, 100]")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.prompt_logprobs is not None and \
                not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_TOP_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError("repetition_penalty must be in (0, 2]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if len(self.cache_salt) > MAX_CACHE_SALT:
            raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT} characters")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise ValueError("logit_bias: token ids must be >= 0 and biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling (penalties or logit_bias): such rows
        need the token history, the others skip that path entirely."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias))


@dataclass(frozen=True)
class RequestTimings:
    """Where a finished request's time went in the engine, in seconds (on its finish event;
    None: it never got that far, e.g. aborted while queued)."""

    queue_s: float | None = None     # arrival (add_request) -> first scheduled (KV allocated)
    prefill_s: float | None = None   # first scheduled -> first token (decode role: remote prefill)
    decode_s: float | None = None    # first token -> finish


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's logprob given the tokens before it (log_softmax of the raw logits, as
    for sampled tokens), its rank in the vocabulary (1 = the likeliest) and the top-N
    (token id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """What the engine publishes per request per step (one new token, or the finish)."""

    request_id: str
    token_ids: tuple[int, ...]          # new tokens this step (usually one; empty on a bare finish)
    text: str                           # newly decodable text (stop strings already cut)
    logprobs: tuple[float, ...] = ()    # one per token in token_ids when asked for
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    error: str | None = None            # set with FinishReason.ERROR
    # per token in token_ids, when params.top_logprobs > 0: ((token_id, logprob), ...) best first
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    error_kind: ErrorKind | None = None  # with ERROR; None is treated as INTERNAL
    timings: RequestTimings | None = None  # on the engine's finish event
    # with params.prompt_logprobs, on the request's first token: prompt tokens 1.. (token 0
    # has no logprob: nothing precedes it)
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    # a prefill-only request's token with the MTP layer: its draft for the position after it
    # (a prefill node sends it to the decode node with the token: moed.roles.prefill)
    draft: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def finish(cls, request_id: str, reason: FinishReason, *, prompt_tokens: int = 0,
               cached_tokens: int = 0, error: str | None = None,
               error_kind: ErrorKind | None = None) -> "TokenEvent":
        """A bare finish (no new token): abort, error, shutdown."""
        return cls(request_id, (), "", (), reason, prompt_tokens, cached_tokens, error,
                   error_kind=error_kind)


@dataclass(frozen=True)
class ContextRule:
    """The context-length rule, in one place (the API, the engine and the scheduler all ask
    it): a request holds at most `limit` tokens, prompt and output together — the model's
    context, and never more than this node's whole KV cache. A prompt must leave room for one
    generated token."""

    max_model_len: int
    kv_capacity_tokens: int = 1 << 62

    @property
    def limit(self) -> int:
        return min(self.max_model_len, self.kv_capacity_tokens)

    def room(self, prompt_len: int) -> int:
        """Tokens a prompt of `prompt_len` leaves to generate (< 1: it does not fit)."""
        return self.limit - prompt_len

    def prompt_error(self, prompt_len: int) -> str | None:
        """Why a prompt of `prompt_len` tokens cannot be served, or None."""
        if self.room(prompt_len) >= 1:
            return None
        if self.kv_capacity_tokens < self.max_model_len:
            return (f"The prompt has {prompt_len} tokens but this node's whole KV cache holds "
                    f"{self.kv_capacity_tokens} tokens.")
        return (f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len} tokens, which leaves no room to generate. Shorten "
                f"the prompt.")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for gauges, admission and gossip load. Cheap to build every step."""

    running: int = 0
    waiting: int = 0
    waiting_remote_kv: int = 0
    queued_prompt_tokens: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_cache_queries: int = 0       # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0          # cumulative prompt tokens found
    steps: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    # (priority, requests) of the waiting ones (incl. remote KV), most urgent first
    waiting_by_priority: tuple[tuple[int, int], ...] = ()


# How a migrated request's already-sent tokens are recomputed on its new node
# (moed.engine.resume; the router's router.migration_replay): one forced decode step each, or
# one prefill.
REPLAYS = ("decode", "prefill")
