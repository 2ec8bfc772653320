"""Structured outputs: a GrammarSpec compiled by llguidance, and its token mask in torch.

Why llguidance (vLLM's "guidance" backend): a 3 MB abi3 wheel with no required dependencies,
an Earley parser over a lazily built lexer (no per-schema ahead-of-time automaton: a JSON
schema compiles in about a millisecond), JSON schema, regex, Lark (with `%json {...}` embedding,
which tool calling uses) and GBNF. xgrammar would pull triton and apache-tvm-ffi onto CPU hosts.

Glossary: a *compiled* grammar is an llguidance LLMatcher built for this tokenizer and never
advanced; each request gets a deep copy of it, its *matcher*, advanced by every token the request
accepts. The *bitmask* is int32 [rows, ceil(V/32)], bit j of word w allowing token 32*w + j.

Life of a constraint: the API compiles the spec in the grammar pool (moed.api.grammar_pool;
`GrammarCompiler.compile`, an LRU by (kind, source), refusals too) under a budget (llguidance's
`GrammarLimits` and a wall-clock time) and probes the first steps (`_probe`): a bad grammar is
a 400, one past the budget a 400 `grammar_too_complex`, before any engine work → the engine
takes a matcher from the cache → each step the masks are computed beside the forward pass
(moed.engine.masks; a drafting row's one per verified position, on a `copy` advanced by its
grammar-valid drafts, `valid_prefix`), a late mask or a limit fails its request alone →
`Request.append_token` feeds each emitted token to the matcher; once it is stopped (only EOS
could follow) the request finishes with "stop".

Why a probe: llguidance builds its lexer and Earley rows lazily, so a valid grammar can still
blow a limit at the first mask or token (`a{1000}{1000}`: ~1 s for the first mask, "too many
expressions constructed" at the second token; 500+ optional properties: "Current row has 2007
items; max is 2000" after `{`). Walking a few tokens at compile time makes those a 400 at
admission. Deep copies share the lexer's state table, so every request's first masks reuse
what the probe built.
"""
from __future__ import annotations

import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moed.types import GrammarSpec

if TYPE_CHECKING:       # torch only where the mask is built: the API's parser imports this file
    import torch

CACHE_ENTRIES = 128     # compiled grammars kept per tokenizer (128 8-field schemas: 12.6 MB)
# Whitespace between JSON tokens: an optional line break and up to 48 spaces/tabs (any
# pretty-printing, 2-space indent to 24 levels), bounded: with llguidance's and vLLM's unbounded
# default a model can loop on blanks (a 2-field object drawn uniformly from the test
# tokenizer's allowed tokens: 188 tokens unbounded, ~30 with this, ~13 compact).
JSON_WHITESPACE = r"(\r?\n)?[\x20\x09]{0,48}"


class GrammarError(ValueError):
    """The grammar engine cannot compile the spec; the text is llguidance's reason."""


class GrammarTooComplex(GrammarError):
    """The spec compiles, but not within the budget (time, or one of llguidance's limits)."""

    def __init__(self, msg: str, timed_out: bool = False) -> None:
        super().__init__(msg)
        self.timed_out = timed_out      # over compile_timeout_s (load-dependent: not cached)


# llguidance's resource-limit errors (its LexerTooComplex / ParserTooComplex and the fuel and
# size checks): "too many expressions constructed", "too many states: N >= N", "Current row
# has N items; max is N", "... fuel ...", "schema too large", "grammar too large".
_LIMIT = re.compile(r"too many|max is|fuel|too large|too complex|limit", re.I)


def is_limit_error(msg: str) -> bool:
    return bool(_LIMIT.search(msg))


def _bare(msg: str) -> str:
    """llguidance's message without its parser-state dump (for developers, not clients)."""
    return msg.split("\n<state>")[0].replace("<non-verbose/>", "").strip()


def _classify(msg: str) -> GrammarError:
    msg = _bare(msg)
    return GrammarTooComplex(msg) if is_limit_error(msg) else GrammarError(msg)


@dataclass(frozen=True)
class GrammarLimits:
    """The compile budget and llguidance's limits (config `[structured]`, docs/config.md).
    llguidance's own defaults are in brackets."""

    compile_timeout_s: float = 2.0       # wall clock of compile + probe, on a grammar worker
    probe_tokens: int = 8                # first-step tokens the probe walks (breadth)
    probe_depth: int = 3                 # steps the probe walks (depth)
    max_grammar_size: int = 500_000      # symbols in the grammar's productions [500k]
    initial_lexer_fuel: int = 1_000_000  # lexer construction (~50k/ms) [1M]
    step_lexer_fuel: int = 200_000       # one mask's lexer work (~14k/ms) [200k]
    step_max_items: int = 50_000         # Earley items per mask (~20k/ms) [50k]
    max_items_in_row: int = 2_000        # one Earley row's items [2000]
    max_lexer_states: int = 250_000      # lexer states, shared by all copies (~1-2 kB each)

    def llg(self) -> Any:
        return _llg().LLParserLimits(
            max_items_in_row=self.max_items_in_row, initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states, max_grammar_size=self.max_grammar_size,
            verbose_errors=False)       # no grammar or parser state in a client's message


def _llg() -> Any:
    import llguidance
    return llguidance


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON form) for `spec`. Pure; does not check the grammar
    (`validate` and the matcher do)."""
    M = _llg().LLMatcher
    defaults = {"whitespace_pattern": JSON_WHITESPACE}
    try:
        if spec.kind == "json_schema":
            return M.grammar_from_json_schema(spec.source, defaults=defaults)
        if spec.kind == "json_object":
            return M.grammar_from_json_schema('{"type": "object"}', defaults=defaults)
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            items = json.loads(spec.source)
            if not isinstance(items, list) or not items or \
                    not all(isinstance(s, str) for s in items):
                raise GrammarError("choice must be a non-empty list of strings")
            # a Lark alternation of string literals (llguidance's grammar_from("choice"))
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in items))
        # lark: Lark (llguidance's dialect, %json included) or GBNF, converted to Lark
        return _llg().grammar_from("grammar", spec.source)
    except GrammarError:
        raise
    except (ValueError, TypeError, RecursionError) as e:
        raise GrammarError(str(e) or type(e).__name__) from None


def validate(spec: GrammarSpec, limits: GrammarLimits | None = None) -> None:
    """Raise GrammarError with llguidance's reason if `spec` cannot compile (no tokenizer
    needed). O(grammar): the API compiles on its grammar pool instead (`compile`)."""
    lim = (limits or GrammarLimits()).llg()
    err = _llg().LLMatcher.validate_grammar(grammar_text(spec), limits=lim)
    if err:
        raise _classify(err)


class GrammarMatcher:
    """One request's grammar state: advanced by each emitted token (engine loop thread), asked
    for masks (mask/executor threads; never at once: the loop waits for the step)."""

    __slots__ = ("_m", "words")

    def __init__(self, matcher: Any, words: int) -> None:
        self._m, self.words = matcher, words        # words: bitmask width in int32 words

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32, contiguous, CPU); a matcher
        that hit a limit is in error (`failed`) and allows only EOS."""
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    @property
    def failed(self) -> bool:
        return bool(self._m.is_error())

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (see `error`)."""
        return bool(self._m.consume_token(int(token_id)))

    @property
    def stopped(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete, or in error)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in a row from here, the grammar accepts (state unchanged)."""
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    def copy(self) -> GrammarMatcher:
        """An independent matcher in this state (speculation's masks advance it by drafts)."""
        return GrammarMatcher(self._m.deep_copy(), self.words)

    @property
    def error(self) -> str:
        """llguidance's reason, without its parser-state dump."""
        return _bare(str(self._m.get_error()))

    @property
    def too_complex(self) -> bool:
        """In error because a limit was hit (not because a token was refused)."""
        return self.failed and is_limit_error(self.error)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer under a budget (`GrammarLimits`); thread-safe
    (the API's grammar pool and the engine loop both call it). Compilation runs outside the
    lock; llguidance drops the GIL. Refusals are cached too: a flood of one bad grammar costs
    one compile."""

    def __init__(self, tokenizer_json: str, eos_token_ids: Sequence[int],
                 max_entries: int = CACHE_ENTRIES, limits: GrammarLimits | None = None) -> None:
        llg = _llg()
        eos = [int(t) for t in eos_token_ids]
        self._tok = llg.LLTokenizer(tokenizer_json, eos_token=eos or None)
        self.vocab_size = int(self._tok.vocab_size)
        self.words = (self.vocab_size + 31) // 32      # bitmask width in int32 words
        self.max_entries = max_entries
        self.limits = limits or GrammarLimits()
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()   # matcher or GrammarError
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def set_limits(self, limits: GrammarLimits) -> None:
        """A new budget (start-up, from config): cached results were judged by the old one."""
        with self._lock:
            if limits != self.limits:
                self.limits = limits
                self._cache.clear()

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled (never advanced) matcher for `spec`, from the cache when it is there.
        Raises GrammarError (GrammarTooComplex past the budget)."""
        with self._lock:
            m = self._cache.get(spec)
            if m is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                if isinstance(m, GrammarError):
                    raise m
                return m
            self.misses += 1
            limits = self.limits
        try:
            m = self._build(spec, limits)
        except GrammarError as e:
            m = e
        with self._lock:
            # a refusal for time depends on the host's load now: the next try may fit
            if limits == self.limits and not getattr(m, "timed_out", False):
                self._cache[spec] = m
                self._cache.move_to_end(spec)
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
        if isinstance(m, GrammarError):
            raise m
        return m

    def _build(self, spec: GrammarSpec, lim: GrammarLimits) -> Any:
        t0 = time.monotonic()
        m = _llg().LLMatcher(self._tok, grammar_text(spec), log_level=0, limits=lim.llg())
        if m.is_error():
            raise _classify(m.get_error())
        _probe(m, lim, t0 + lim.compile_timeout_s)
        took = time.monotonic() - t0
        if took > lim.compile_timeout_s:
            raise GrammarTooComplex(f"compiling it took {took:.2f} s, over the budget of "
                                    f"{lim.compile_timeout_s:g} s", timed_out=True)
        return m

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for one request (a deep copy of the compiled one: ~2 us)."""
        return GrammarMatcher(self.compile(spec).deep_copy(), self.words)

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def forget(self, spec: GrammarSpec) -> None:
        """Drop `spec`'s compiled matcher: a request of it hit a limit while generating, and
        the lexer states its copies share may be what is full (the next request compiles
        afresh, on the grammar pool)."""
        with self._lock:
            self._cache.pop(spec, None)

    def peek(self, spec: GrammarSpec) -> Any:
        """The cache's entry for `spec` (a compiled matcher or the GrammarError it was refused
        with), None if absent; never compiles (the event loop may call it)."""
        with self._lock:
            m = self._cache.get(spec)
            if m is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
            return m


def _probe(m: Any, lim: GrammarLimits, deadline: float) -> None:
    """Walk the grammar's first steps on copies of `m`, `probe_depth` steps deep: at each, every
    branch kept (the first step: `m` alone; later: two, the first and last) is masked and up
    to `probe_tokens` of its allowed tokens, spread over the allowed ids, are consumed on copies.
    Raises GrammarTooComplex for a limit hit or the deadline passed. Cost: about 2 x depth
    masks and 2 x depth x probe_tokens tokens. What it builds (lexer states, the first mask)
    stays in `m`'s shared state, so the first mask of every request is cheap."""
    def mask(x: Any) -> list[int] | None:
        bm = x.compute_bitmask()        # bytes, little-endian: token i is bit i%8 of byte i//8
        if x.is_error():
            err = _classify(x.get_error())
            if isinstance(err, GrammarTooComplex):
                raise err
            return None
        bits = np.unpackbits(np.frombuffer(bytes(bm), dtype=np.uint8), bitorder="little")
        return np.flatnonzero(bits).tolist()

    def late() -> None:
        if time.monotonic() > deadline:
            raise GrammarTooComplex(f"compiling it took over the budget of "
                                    f"{lim.compile_timeout_s:g} s", timed_out=True)

    frontier = [m]
    for _ in range(max(1, lim.probe_depth)):
        nxt = []
        for x in frontier:
            allowed = mask(x)
            late()
            if not allowed:
                continue
            k = min(len(allowed), max(1, lim.probe_tokens))
            picks = [allowed[(i * (len(allowed) - 1)) // max(1, k - 1)] for i in range(k)]
            for tok in dict.fromkeys(picks):
                c = x.deep_copy()
                c.consume_token(int(tok))
                if c.is_error():
                    err = _classify(c.get_error())
                    if isinstance(err, GrammarTooComplex):
                        raise err
                    continue
                nxt.append(c)
                late()
        # go on along two branches, not all (the cost stays linear in the depth)
        frontier = nxt[:1] + nxt[-1:] if len(nxt) > 1 else nxt
        if not frontier:
            return
    for x in frontier:
        mask(x)


_COMPILERS: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any) -> GrammarCompiler:
    """The one GrammarCompiler of a moed Tokenizer (built on first use: the LLTokenizer costs
    ~18 ms for a 4k vocabulary, ~0.6 s for 32k — call this off the event loop the first time)."""
    if tokenizer is None or not hasattr(tokenizer, "to_json"):
        raise GrammarError("structured outputs need the model's tokenizer")
    with _COMPILERS_LOCK:
        c = _COMPILERS.get(tokenizer)
    if c is not None:
        return c
    c = GrammarCompiler(tokenizer.to_json(), getattr(tokenizer, "eos_token_ids", ()),
                        limits=_DEFAULT_LIMITS)
    with _COMPILERS_LOCK:
        return _COMPILERS.setdefault(tokenizer, c)


def built_compiler(tokenizer: Any) -> GrammarCompiler | None:
    """The tokenizer's GrammarCompiler if it exists already (None: `compiler_for` would build
    it, which is not for the event loop)."""
    with _COMPILERS_LOCK:
        return _COMPILERS.get(tokenizer) if tokenizer is not None else None


_DEFAULT_LIMITS = GrammarLimits()


def set_default_limits(limits: GrammarLimits) -> None:
    """The budget every compiler uses (the app sets it from `[structured]` at start-up)."""
    global _DEFAULT_LIMITS
    _DEFAULT_LIMITS = limits
    with _COMPILERS_LOCK:
        compilers = list(_COMPILERS.values())
    for c in compilers:
        c.set_limits(limits)


# ---- the mask in torch ---------------------------------------------------------------------


def fill_bitmask(matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
    """int32 [len(matchers), words]: each matcher's allowed next tokens."""
    import torch

    bm = torch.empty((len(matchers), max(m.words for m in matchers)), dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill(bm, i)
    return bm


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab] from an int32 bitmask [rows, words] (on the bitmask's device); tokens
    past the bitmask's width (logits wider than the tokenizer's vocabulary) are not allowed."""
    import torch

    rows, words = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    flat = bits.reshape(rows, words * 32).bool()
    if flat.shape[1] >= vocab:
        return flat[:, :vocab]
    pad = torch.zeros((rows, vocab - flat.shape[1]), dtype=torch.bool, device=flat.device)
    return torch.cat([flat, pad], dim=1)


_LUTS: dict[Any, Any] = {}


def _lut(device: Any) -> torch.Tensor:
    """float32 [256, 8]: 0 where bit j of byte b is set (allowed), -inf where not."""
    t = _LUTS.get(device)
    if t is None:
        import torch

        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        t = _LUTS[device] = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
    return t


def mask_logits(logits: torch.Tensor, rows: Sequence[int],
                matchers: Sequence[GrammarMatcher],
                bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of logits [B, V] with every token the grammar forbids at -inf in `rows` (one
    matcher each); the other rows are untouched. The bitmask is filled on the CPU (llguidance),
    and turned into an additive 0/-inf bias by a byte lookup table on the logits' device: an
    `embedding` gather of 8 values per byte is 2-8x faster than shifting every bit out
    (32k vocabulary: ~60-100 us a row on this CPU, against 250-480; token i's bit is byte i//8
    of the little-endian int32 words, bit i%8). `bitmask`: the rows' masks, already
    computed (moed.engine.masks); None: filled here."""
    import torch

    bm = fill_bitmask(matchers) if bitmask is None else bitmask
    n, words = bm.shape
    vocab = logits.shape[1]
    idx = bm.view(torch.uint8).reshape(n, words * 4).to(logits.device).int()
    bias = torch.nn.functional.embedding(idx, _lut(logits.device)).reshape(n, words * 32)
    if bias.shape[1] >= vocab:
        bias = bias[:, :vocab]
    else:       # logits wider than the tokenizer's vocabulary: the rest is never allowed
        pad = torch.full((n, vocab - bias.shape[1]), float("-inf"), device=logits.device)
        bias = torch.cat([bias, pad], dim=1)
    if n == logits.shape[0]:
        return logits + bias
    return logits.index_add(0, torch.tensor(list(rows), device=logits.device), bias)
