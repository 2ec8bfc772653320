"""Structured outputs: a GrammarSpec compiled by llguidance, and its token mask in torch.

Why llguidance (vLLM's "guidance" backend): a 3 MB abi3 wheel with no required dependencies,
an Earley parser over a lazily built lexer (no per-schema ahead-of-time automaton: a JSON
schema compiles in about a millisecond), JSON schema, regex, Lark (with `%json {...}` embedding,
which tool calling uses) and GBNF. xgrammar would pull triton and apache-tvm-ffi onto CPU hosts.

Glossary: a *compiled* grammar is an llguidance LLMatcher built for this tokenizer and never
advanced; each request gets a deep copy of it, its *matcher*, advanced by every token the request
accepts. The *bitmask* is int32 [rows, ceil(V/32)], bit j of word w allowing token 32*w + j.

Life of a constraint: the API handler compiles the request's spec in its offload pool
(`GrammarCompiler.compile`, cached by (kind, source) in a bounded LRU) so a bad grammar is a 400
before any engine work → the engine's `_new_request` takes a matcher from the cache (a hit) →
each step, in the executor thread, the sampler asks each grammar row for its bitmask and masks
its logits → `Request.append_token` feeds the sampled token to the matcher; once the matcher is
stopped (only EOS could follow) the request finishes with "stop".
"""
from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from moed.types import GrammarSpec

if TYPE_CHECKING:       # torch only where the mask is built: the API's parser imports this file
    import torch

CACHE_ENTRIES = 128     # compiled grammars kept per tokenizer (128 8-field schemas: 12.6 MB)
# Whitespace allowed between JSON tokens: one optional line break and up to 48 spaces/tabs —
# enough for any pretty-printing (2-space indent to 24 levels), but bounded: with unbounded
# whitespace (llguidance's and vLLM's default) a model can loop on blanks and never close the
# object (a 2-field object drawn uniformly from the allowed tokens of the test tokenizer: 188
# tokens unbounded, ~30 with this, ~13 compact).
JSON_WHITESPACE = r"(\r?\n)?[\x20\x09]{0,48}"


class GrammarError(ValueError):
    """The grammar engine cannot compile the spec; the text is llguidance's reason."""


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


def validate(spec: GrammarSpec) -> None:
    """Raise GrammarError with llguidance's reason if `spec` cannot compile (no tokenizer
    needed: the API's parser calls it)."""
    err = _llg().LLMatcher.validate_grammar(grammar_text(spec))
    if err:
        raise GrammarError(err)


class GrammarMatcher:
    """One request's grammar state: advanced with each accepted token (engine loop thread),
    asked for the next-token bitmask (executor thread; never at the same time: the loop waits
    for the step)."""

    __slots__ = ("_m", "words")

    def __init__(self, matcher: Any, words: int) -> None:
        self._m = matcher
        self.words = words          # bitmask width in int32 words

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32, contiguous, on the CPU)."""
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

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

    @property
    def error(self) -> str:
        return str(self._m.get_error())


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer; thread-safe (the API's offload threads and the
    engine loop both call it). Compilation runs outside the lock; llguidance drops the GIL."""

    def __init__(self, tokenizer_json: str, eos_token_ids: Sequence[int],
                 max_entries: int = CACHE_ENTRIES) -> None:
        llg = _llg()
        eos = [int(t) for t in eos_token_ids]
        self._tok = llg.LLTokenizer(tokenizer_json, eos_token=eos or None)
        self.vocab_size = int(self._tok.vocab_size)
        self.words = (self.vocab_size + 31) // 32      # bitmask width in int32 words
        self.max_entries = max_entries
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled (never advanced) matcher for `spec`, from the cache when it is there."""
        with self._lock:
            m = self._cache.get(spec)
            if m is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return m
            self.misses += 1
        m = _llg().LLMatcher(self._tok, grammar_text(spec), log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        with self._lock:
            self._cache[spec] = m
            self._cache.move_to_end(spec)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return m

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for one request (a deep copy of the compiled one: ~2 us)."""
        return GrammarMatcher(self.compile(spec).deep_copy(), self.words)

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache


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
    c = GrammarCompiler(tokenizer.to_json(), getattr(tokenizer, "eos_token_ids", ()))
    with _COMPILERS_LOCK:
        return _COMPILERS.setdefault(tokenizer, c)


async def compile_async(tokenizer: Any, spec: GrammarSpec) -> None:
    """Compile `spec` into the tokenizer's cache in a worker thread (raises GrammarError)."""
    await asyncio.to_thread(lambda: compiler_for(tokenizer).compile(spec))


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
                matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
    """A copy of logits [B, V] with every token the grammar forbids at -inf in `rows` (one
    matcher each); the other rows are untouched. The bitmask is filled on the CPU (llguidance),
    and turned into an additive 0/-inf bias by a byte lookup table on the logits' device: an
    `embedding` gather of 8 values per byte is 2-8x faster than shifting every bit out
    (32k vocabulary: ~60-100 us a row on this CPU, against 250-480; token i's bit is byte i//8
    of the little-endian int32 words, bit i%8)."""
    import torch

    bm = fill_bitmask(matchers)
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
