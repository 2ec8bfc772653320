"""Parse and validate OpenAI request bodies into frozen dataclasses (pure: no I/O, no engine).

The fields the parser reads are declared once, per endpoint (COMPLETION_FIELDS, CHAT_FIELDS):
the parser reads the body only through a view that refuses an undeclared name (a bug, caught by
any test that sends the field), and tests/unit/api/test_request_fields.py proves every declared
field applied or refused. A field not declared is unknown and ignored (load generators send
extras a server may not know); a known field of the wrong type or out of range is an
APIError(400) naming the field in `param` (the field readers: moed.api.readers). A field moed
knows but does not implement is refused with a 400 naming it, never silently dropped
(`_refuse_unsupported`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moed.api.errors import APIError, bad_request
# check_text, parse_messages, parse_token_ids: the same rules for the same fields on the
# utility endpoints (moed.api.tokens)
from moed.api.readers import (TOKEN_ID_LIMIT, Prompt, check_text, parse_messages,
                              parse_token_ids, read_bool, read_float, read_int,
                              read_logit_bias, read_prompts, read_stop)
from moed.api.salt import MAX_CLIENT_SALT, effective_salt
from moed.api.structured import parse_structured
from moed.config import PRIORITY_MAX, PRIORITY_MIN
from moed.api.tools import TemplateArgs, ToolRequest, parse_template, parse_tools, spaces_refused
from moed.types import ContextRule, GrammarSpec, SamplingParams

MAX_N = 16               # choices per request: bounded so one request cannot flood the engine
MAX_LOGPROBS = 20
MAX_TOKENS = 1 << 24     # token counts: no context is longer (model.max_model_len's bound)
# vLLM's seed range (torch.long). torch.Generator.manual_seed maps it one-to-one onto its 64-bit
# seed space (-1 is 2**64-1), so distinct seeds never share a stream.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1

# ---- the accepted fields: every body key the parser reads, per endpoint -----------------------
# One list (not one per reader): `parse_request` reads the body through `_Body`, which refuses
# a name not listed here, so a field cannot be read without being declared, and the walker
# (tests/unit/api/test_request_fields.py) needs evidence for each: a test that shows it applied
# or refused. "a.b" names key b of the object in field a.
_COMMON_FIELDS = (
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "min_tokens", "seed", "stop", "stop_token_ids", "n", "stream", "stream_options",
    "stream_options.include_usage", "stream_options.continuous_usage_stats", "ignore_eos",
    "return_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "logprobs", "echo", "prompt_logprobs",
    # vLLM's: only requests with the same salt share cached prefix blocks (moed.api.salt)
    "cache_salt",
    # vLLM's: lower runs first; capped by the API key's class (moed.api.priority)
    "priority",
    # refused or (being) implemented by structured outputs and tool calling
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend", "tools",
    "tool_choice", "functions", "function_call",
    "chat_template_kwargs",
    # vLLM's decoding fields (special tokens in the output text)
    "skip_special_tokens", "spaces_between_special_tokens")
COMPLETION_FIELDS: frozenset[str] = frozenset(_COMMON_FIELDS + ("prompt", "suffix", "best_of"))
CHAT_FIELDS: frozenset[str] = frozenset(_COMMON_FIELDS + (
    "messages", "top_logprobs", "continue_final_message", "add_generation_prompt",
    "parallel_tool_calls"))


class UndeclaredField(AssertionError):
    """The parser read a field missing from COMPLETION_FIELDS / CHAT_FIELDS (a bug in moed)."""


class _Body(dict):
    """A request body (or a nested object of it) that only answers for declared fields."""

    def __init__(self, d: dict[str, Any], declared: frozenset[str], prefix: str = "") -> None:
        super().__init__(d)
        self.declared, self.prefix = declared, prefix

    def _check(self, key: str) -> None:
        if self.prefix + key not in self.declared:
            raise UndeclaredField(f"the parser reads {self.prefix + key!r}, which is not in "
                                  f"moed.api.protocol's declared fields")

    def get(self, key: str, default: Any = None) -> Any:
        self._check(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self._check(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._check(str(key))
        return super().__contains__(key)

    def sub(self, key: str) -> Any:
        """Field `key`; an object there answers for "key.<name>" fields only."""
        v = self.get(key)
        return _Body(v, self.declared, f"{self.prefix}{key}.") if isinstance(v, dict) else v


@dataclass(frozen=True)
class GenerationRequest:
    """One /v1/completions or /v1/chat/completions call, validated."""

    chat: bool
    model: str | None
    prompts: tuple[Prompt, ...] = ()           # completions: each is text or token ids
    messages: tuple[dict[str, Any], ...] = ()  # chat: {"role", "content": text} + tool fields
    max_tokens: int | None = None              # None: the endpoint's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    logprobs: int | None = None                # completions: int; chat: 0 when logprobs=true
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False             # stream_options.continuous_usage_stats
    ignore_eos: bool = False
    return_token_ids: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None         # completions (vLLM): top-N per prompt token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    grammar: GrammarSpec | None = None         # structured outputs / forced tool calls
    tools: ToolRequest | None = None           # chat: tools + tool_choice (moed.api.tools)
    template: TemplateArgs = TemplateArgs()    # chat: the template fields (moed.api.tools)
    # None: not sent (true, unless the tools' markers are special tokens: moed.api.tools.bind)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True   # false: only where special tokens are skipped
    cache_salt: str = ""                       # the client's (vLLM's field)
    tenant: str = ""                           # the key's tag under API-key isolation (moed.api.salt)
    # vLLM's `priority` as sent (None: not sent); the handler resolves it against the key's
    # class (moed.api.priority.resolve) before the engine sees it
    priority: int | None = None

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """Engine parameters for choice `choice`: seed + choice, wrapped within the seed range,
        so the n choices of a request get n distinct streams and never an out-of-range seed."""
        seed = None if self.seed is None else \
            (self.seed + choice - SEED_MIN) % (1 << 64) + SEED_MIN
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=seed, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              logprobs=self.logprobs is not None, min_tokens=self.min_tokens,
                              top_logprobs=self.logprobs or 0,
                              presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty,
                              logit_bias=self.logit_bias, min_p=self.min_p,
                              grammar=self.grammar,
                              prompt_logprobs=self.engine_prompt_logprobs,
                              skip_special_tokens=self.skip_special_tokens is not False,
                              cache_salt=effective_salt(self.tenant, self.cache_salt),
                              priority=self.priority or 0)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Top-N the engine computes per prompt token: for `prompt_logprobs`, and for echo with
        logprobs (the prompt's tokens head the legacy logprobs); None: not computed."""
        asks = [v for v in (self.prompt_logprobs,
                            self.logprobs if self.echo and not self.chat else None)
                if v is not None]
        return max(asks) if asks else None


def _unsupported(name: str, why: str = "is not supported by this server") -> APIError:
    return bad_request(f"'{name}' {why}", name)


# fields whose mere presence (non-null) asks for something moed does not do
_UNSUPPORTED_ANY: tuple[str, ...] = ()


def _refuse_unsupported(body: dict[str, Any], chat: bool, n: int) -> None:
    """OpenAI / vLLM fields moed does not implement: a 400 naming the field rather than a
    silently different answer. Their neutral values (the defaults) pass."""
    for name in _UNSUPPORTED_ANY:
        if body.get(name) is not None:
            raise _unsupported(name)
    if not chat:
        if body.get("suffix") not in (None, ""):
            raise _unsupported("suffix")
        best_of = read_int(body, "best_of", lo=1, hi=MAX_N)
        if best_of is not None and best_of != n:
            raise _unsupported("best_of", f"other than n ({n}) is not supported by this server")
    if not chat:       # chat reads these in moed.api.tools
        for name in ("tools", "tool_choice", "functions", "function_call",
                     "chat_template_kwargs"):
            if body.get(name) not in (None, "none", [], {}):
                raise _unsupported(name, "applies to /v1/chat/completions only")


def _skip_special(body: dict[str, Any]) -> bool | None:
    """skip_special_tokens (None: not sent); spaces_between_special_tokens false only where
    special tokens are skipped (moed.api.tools.spaces_refused says why)."""
    skip = read_bool(body, "skip_special_tokens")
    if read_bool(body, "spaces_between_special_tokens") is False and skip is False:
        raise spaces_refused()
    return skip


# ---- entry point ---------------------------------------------------------------------------

def parse_request(body: Any, *, chat: bool, vocab_size: int | None = None) -> GenerationRequest:
    """`vocab_size`, when the caller knows it, bounds token ids (prompt, stop_token_ids)."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    body = _Body(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if model is not None:
        check_text(model, "model")

    n = read_int(body, "n", lo=1, hi=MAX_N) or 1
    _refuse_unsupported(body, chat, n)
    max_tokens = read_int(body, "max_tokens", lo=1, hi=MAX_TOKENS)
    mct = read_int(body, "max_completion_tokens", lo=1, hi=MAX_TOKENS)
    if mct is not None:
        max_tokens = mct                 # the newer name wins when both are sent

    if chat:
        want_lp = read_bool(body, "logprobs")
        top = read_int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
        if top is not None and not want_lp:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if want_lp else None
    else:
        logprobs = read_int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)

    top_k = read_int(body, "top_k", lo=-1, hi=TOKEN_ID_LIMIT)
    stream = bool(read_bool(body, "stream"))
    so = body.sub("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = bool(read_bool(so, "include_usage")) if so else False
    continuous_usage = bool(read_bool(so, "continuous_usage_stats")) if so else False
    if (include_usage or continuous_usage) and not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true",
                          "stream_options")
    prompt_logprobs = read_int(body, "prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
    if prompt_logprobs is not None and (chat or stream):   # as vLLM: not with stream
        where = "chat completions" if chat else "'stream': true"
        raise bad_request(f"'prompt_logprobs' is not supported with {where}; use "
                          f"/v1/completions without stream", "prompt_logprobs")
    stop_ids = body.get("stop_token_ids")
    temperature = read_float(body, "temperature", 0.0, 2.0)
    top_p = read_float(body, "top_p", 0.0, 1.0, lo_open=True)
    rep = read_float(body, "repetition_penalty", 0.0, 2.0, lo_open=True)

    return GenerationRequest(
        chat=chat,
        model=model,
        prompts=() if chat else read_prompts(body, vocab_size),
        messages=parse_messages(body) if chat else (),
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k in (None, -1) else top_k,
        min_tokens=read_int(body, "min_tokens", lo=0, hi=MAX_TOKENS) or 0,
        seed=read_int(body, "seed", lo=SEED_MIN, hi=SEED_MAX),
        stop=read_stop(body),
        stop_token_ids=() if stop_ids is None else parse_token_ids(stop_ids, "stop_token_ids",
                                                             vocab_size),
        n=n,
        logprobs=logprobs,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        ignore_eos=bool(read_bool(body, "ignore_eos")),
        return_token_ids=bool(read_bool(body, "return_token_ids")),
        echo=bool(read_bool(body, "echo")),
        prompt_logprobs=prompt_logprobs,
        presence_penalty=read_float(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=read_float(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        repetition_penalty=1.0 if rep is None else rep,
        logit_bias=read_logit_bias(body, vocab_size),
        min_p=read_float(body, "min_p", 0.0, 1.0) or 0.0,
        grammar=parse_structured(body),     # structured outputs (moed.api.structured)
        tools=parse_tools(body) if chat else None,
        template=parse_template(body) if chat else TemplateArgs(),
        skip_special_tokens=_skip_special(body),
        spaces_between_special_tokens=read_bool(body, "spaces_between_special_tokens") is not False,
        cache_salt=_cache_salt(body),
        priority=read_int(body, "priority", lo=PRIORITY_MIN, hi=PRIORITY_MAX),
    )


def _cache_salt(body: _Body) -> str:
    """vLLM's rule: when sent, a non-empty string."""
    v = body.get("cache_salt")
    if v is None:
        return ""
    if not isinstance(v, str) or not v:
        raise bad_request("'cache_salt' must be a non-empty string", "cache_salt")
    if len(v) > MAX_CLIENT_SALT:
        raise bad_request(f"'cache_salt' is longer than {MAX_CLIENT_SALT} characters",
                          "cache_salt")
    return v


def resolve_max_tokens(req: GenerationRequest, prompt_len: int, context: ContextRule) -> int:
    """The max_tokens to use for one prompt, or APIError(400) if the context cannot hold it.
    max_tokens is held to the model's context; this node's KV capacity, when smaller, ends the
    generation early ("length") rather than refusing it."""
    err = context.prompt_error(prompt_len)
    if err is not None:
        raise APIError(400, err, param="messages" if req.chat else "prompt",
                       code="context_length_exceeded")
    max_model_len = context.max_model_len
    room = ContextRule(max_model_len).room(prompt_len)
    if req.max_tokens is None:
        # OpenAI's legacy completions default is 16; chat runs to EOS or the context end.
        return room if req.chat else min(16, room)
    if req.max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                            f"However, you requested {prompt_len + req.max_tokens} tokens "
                            f"({prompt_len} in the prompt, {req.max_tokens} for the completion). "
                            f"Reduce the prompt or max_tokens.",
                       param="max_tokens", code="context_length_exceeded")
    return req.max_tokens
