"""The grammar engine (moed.model.grammar): compile and cache, the token mask against a brute
force over the vocabulary, the sampler obeying it, the request finishing on a complete grammar,
and a preempted request's matcher not advanced twice."""
from __future__ import annotations

import json

import pytest
import torch

from moed.engine.request import Request
from moed.model.grammar import (GrammarCompiler, GrammarError, GrammarLimits, GrammarTooComplex,
                                allowed_tokens, compiler_for, fill_bitmask, mask_logits,
                                validate)
from moed.model.sampler import SampleRow, sample
from moed.model.tokenizer import Tokenizer
from moed.roles.protocol import first_token_params, sampling_fields
from moed.types import FinishReason, GrammarSpec, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tiny_qwen3) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen3)


@pytest.fixture
def comp(tok) -> GrammarCompiler:
    return GrammarCompiler(tok.to_json(), tok.eos_token_ids, max_entries=2)


def _allowed(m, vocab: int) -> set[int]:
    return set(allowed_tokens(fill_bitmask([m]), vocab)[0].nonzero().flatten().tolist())


def test_compile_caches_by_kind_and_source_with_a_bounded_lru(comp) -> None:
    a, b = GrammarSpec("regex", "a+"), GrammarSpec("regex", "b+")
    c = GrammarSpec("choice", '["x"]')
    first = comp.compile(a)
    assert comp.compile(a) is first and (comp.hits, comp.misses) == (1, 1)
    comp.compile(b)
    comp.compile(a)           # a is now the most recent: c evicts b
    comp.compile(c)
    assert comp.cached(a) and comp.cached(c) and not comp.cached(b)
    m1, m2 = comp.matcher(a), comp.matcher(a)       # each request its own state
    assert m1.accept(comp_tok_id(comp, "a")) and not m1.stopped
    assert _allowed(m2, comp.vocab_size) == _allowed(comp.matcher(a), comp.vocab_size)


def comp_tok_id(comp: GrammarCompiler, text: str) -> int:
    return comp._tok.tokenize_str(text)[0]


def test_compiler_for_builds_once_per_tokenizer(tok) -> None:
    assert compiler_for(tok) is compiler_for(tok)
    with pytest.raises(GrammarError, match="tokenizer"):
        compiler_for(None)


def test_mask_matches_a_brute_force_over_the_vocabulary(tok, comp) -> None:
    """regex [ab]{1,3}c: at the start exactly the tokens spelling a non-empty prefix of a
    match are allowed (no EOS, no special token); after 'abc' the grammar is complete."""
    import re
    m = comp.matcher(GrammarSpec("regex", "[ab]{1,3}c"))
    prefix = re.compile(r"[ab]{1,3}c?")     # the non-empty prefixes of a match
    want = {t for t in range(tok.vocab_size)
            if prefix.fullmatch(tok.decode([t], skip_special_tokens=False))}
    got = _allowed(m, tok.vocab_size)
    assert got == want and len(want) >= 3
    assert not set(tok.eos_token_ids) & got
    for t in tok.encode("abc", add_special_tokens=False):
        assert m.accept(t)
    assert m.stopped and m.accepting
    assert not m.accept(tok.encode("a", add_special_tokens=False)[0]) and m.error


def test_bad_grammars_raise_the_engines_reason(comp) -> None:
    for spec, reason in ((GrammarSpec("json_schema", '{"type": "nope"}'), "nope"),
                         (GrammarSpec("json_schema", "{not json"), "line 1"),
                         (GrammarSpec("regex", "(("), "unclosed group"),
                         (GrammarSpec("lark", "start: foo"), "foo"),
                         (GrammarSpec("choice", "[]"), "non-empty")):
        with pytest.raises(GrammarError, match=reason):
            validate(spec)
        with pytest.raises(GrammarError) as first:
            comp.compile(spec)
        assert comp.cached(spec) and not isinstance(first.value, GrammarTooComplex)
        with pytest.raises(GrammarError, match=reason):     # the refusal, from the cache
            comp.compile(spec)


def test_allowed_tokens_pads_logits_wider_than_the_tokenizer() -> None:
    bm = torch.tensor([[0b101, -1]], dtype=torch.int32)   # tokens 0, 2 and 32..63
    ok = allowed_tokens(bm, 80)
    assert ok.shape == (1, 80)
    assert ok[0].nonzero().flatten().tolist() == [0, 2] + list(range(32, 64))
    assert allowed_tokens(bm, 40)[0].nonzero().flatten().tolist() == [0, 2] + list(range(32, 40))


def test_mask_logits_agrees_with_the_bitmask_in_every_batch_shape(comp) -> None:
    """The lookup-table mask equals the bit-by-bit reference: whole batch, mixed batch (rows
    without a grammar bit-identical), logits wider than the tokenizer (the rest forbidden)."""
    specs = [GrammarSpec("regex", "[0-9]+"), GrammarSpec("json_object")]
    ms = [comp.matcher(s) for s in specs]
    V = comp.vocab_size
    ref = allowed_tokens(fill_bitmask(ms), V)
    torch.manual_seed(1)
    logits = torch.randn(3, V + 40)
    whole = mask_logits(logits[:2], [0, 1], ms)
    mixed = mask_logits(logits, [0, 2], ms)
    for got in (whole[0], mixed[0]):
        assert torch.equal(torch.isfinite(got[:V]), ref[0]) and torch.isneginf(got[V:]).all()
    assert torch.equal(torch.isfinite(mixed[2][:V]), ref[1])
    assert torch.equal(mixed[1], logits[1])
    assert torch.equal(whole[0][:V][ref[0]], logits[0][:V][ref[0]])     # allowed: unchanged


def test_sampler_obeys_the_mask_greedy_and_sampled_rows_without_touching_others(comp) -> None:
    spec = GrammarSpec("choice", '["yes", "no"]')
    V = comp.vocab_size
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    allowed = _allowed(comp.matcher(spec), V)
    forbidden_best = max(set(range(V)) - allowed, key=lambda t: logits[0, t].item())
    logits[:, forbidden_best] = 50.0         # every row's argmax is forbidden
    rows = [SampleRow(SamplingParams(temperature=0.0, logprobs=True), grammar=comp.matcher(spec)),
            SampleRow(SamplingParams(temperature=1.0, logprobs=True), grammar=comp.matcher(spec)),
            SampleRow(SamplingParams(temperature=0.0, logprobs=True)),
            SampleRow(SamplingParams(temperature=1.0, top_k=5, logprobs=True),
                      grammar=comp.matcher(spec))]
    for _ in range(20):
        res = sample(logits, rows)
        assert res.token_ids[0] in allowed and res.token_ids[1] in allowed
        assert res.token_ids[3] in allowed
        assert res.token_ids[2] == forbidden_best       # no grammar: untouched
    # logprobs stay raw (before the mask), as documented
    raw = torch.log_softmax(logits, dim=-1)
    assert res.logprobs[0] == pytest.approx(raw[0, res.token_ids[0]].item(), abs=1e-5)
    masked = mask_logits(logits, [1], [comp.matcher(spec)])
    assert torch.equal(masked[0], logits[0]) and torch.isinf(masked[1]).sum() == V - len(allowed)


def test_banned_ids_yield_to_the_grammar(comp, tok) -> None:
    """min_tokens bans EOS; a grammar that allows only EOS-free tokens is unaffected, and a row
    whose grammar allows only banned ids keeps the grammar's mask."""
    spec = GrammarSpec("regex", "a")
    m = comp.matcher(spec)
    a = tok.encode("a", add_special_tokens=False)[0]
    row = SampleRow(SamplingParams(temperature=0.0), banned_ids=(a,), grammar=m)
    assert sample(torch.randn(1, comp.vocab_size), [row]).token_ids == [a]


def test_request_finishes_with_stop_when_the_grammar_is_complete(comp, tok) -> None:
    ids = tok.encode("yes", add_special_tokens=False)
    spec = GrammarSpec("choice", '["yes", "no"]')
    r = Request("r", [5, 6], SamplingParams(max_tokens=50, grammar=spec), tok.eos_token_ids,
                grammar=comp.matcher(spec))
    for t in ids[:-1]:
        assert r.append_token(t)[1] is None
    assert r.append_token(ids[-1])[1] is FinishReason.STOP
    # a token the grammar refuses fails the request, with the reason
    r = Request("r2", [5], SamplingParams(max_tokens=50), tok.eos_token_ids,
                grammar=comp.matcher(spec))
    assert r.append_token(tok.encode("zzz", add_special_tokens=False)[0])[1] is FinishReason.ERROR
    assert "refused" in r.error


def test_first_token_params_carry_the_grammar() -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    p = first_token_params(json.loads(json.dumps(sampling_fields(SamplingParams(grammar=spec)))))
    assert p.grammar == spec
    assert first_token_params(sampling_fields(SamplingParams())).grammar is None


def test_engine_outputs_validate_and_preemption_does_not_readvance(tiny_qwen3, tok) -> None:
    """8 seeded requests at temperature 1 on a KV pool too small for all: some are preempted
    and recomputed, and every output is still valid for the schema (a matcher advanced twice
    by the recompute would refuse tokens or accept invalid text)."""
    from moed.config import EngineConfig
    from moed.engine.engine import Engine
    from moed.model.runner import ModelRunner

    runner = ModelRunner(tiny_qwen3, dtype="float32", device="cpu", num_blocks=24, block_size=4)
    eng = Engine(runner, tok, EngineConfig(max_num_seqs=8, max_num_batched_tokens=64))
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompt = tok.encode("give me a json object")
    outs = eng.generate([prompt] * 8, [SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                      grammar=spec) for i in range(8)])
    assert eng.scheduler.num_preemptions > 0
    for o in outs:
        obj = json.loads(tok.decode(o))
        assert set(obj) == {"name", "n"} and isinstance(obj["n"], int) and len(obj["name"]) <= 6


# ---- the compile budget (issue 27: grammars that passed validation failed at token one) -----

def _optional_props(n: int) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}))


@pytest.mark.parametrize("spec, says", [
    (GrammarSpec("regex", "a{1000}{1000}"), "too many"),     # LexerTooComplex at token two
    (_optional_props(600), "max is 2000"),                    # ParserTooComplex after "{"
])
def test_grammars_past_a_limit_are_too_complex_at_compile_time(comp, spec, says) -> None:
    validate(spec)      # llguidance's validation passes them: only walking them finds out
    with pytest.raises(GrammarTooComplex, match=says) as e:
        comp.compile(spec)
    assert "<state>" not in str(e.value) and "non-verbose" not in str(e.value)
    with pytest.raises(GrammarTooComplex):      # cached: the second refusal costs nothing
        comp.compile(spec)
    assert comp.hits == 1


def test_the_limits_are_the_budget(tok) -> None:
    spec = _optional_props(50)
    GrammarCompiler(tok.to_json(), tok.eos_token_ids).compile(spec)       # fits the defaults
    tight = GrammarCompiler(tok.to_json(), tok.eos_token_ids,
                            limits=GrammarLimits(max_items_in_row=20))
    with pytest.raises(GrammarTooComplex, match="max is 20"):
        tight.compile(spec)
    slow = GrammarCompiler(tok.to_json(), tok.eos_token_ids,
                           limits=GrammarLimits(compile_timeout_s=0.0))
    with pytest.raises(GrammarTooComplex, match="budget of 0 s") as e:
        slow.compile(GrammarSpec("regex", "[a-z]{3}"))
    assert e.value.timed_out and not slow.cached(GrammarSpec("regex", "[a-z]{3}"))   # load


def test_set_limits_drops_what_the_old_budget_judged(tok) -> None:
    c = GrammarCompiler(tok.to_json(), tok.eos_token_ids, limits=GrammarLimits(max_items_in_row=20))
    spec = _optional_props(50)
    with pytest.raises(GrammarTooComplex):
        c.compile(spec)
    c.set_limits(GrammarLimits())
    c.compile(spec)


def test_a_matcher_past_a_limit_says_so(comp, tok) -> None:
    """At step time a limit puts the matcher in error: `too_complex` (the engine fails the
    request alone, ErrorKind.GRAMMAR) rather than a refused token (a 500)."""
    import llguidance

    from moed.model.grammar import GrammarMatcher, grammar_text
    m = llguidance.LLMatcher(comp._tok, grammar_text(_optional_props(600)), log_level=0)
    gm = GrammarMatcher(m, comp.words)
    assert not gm.accept(tok.encode("{", add_special_tokens=False)[0])
    assert gm.failed and gm.too_complex and "<state>" not in gm.error
    ok = comp.matcher(GrammarSpec("regex", "ab"))
    assert not ok.accept(tok.encode("z", add_special_tokens=False)[0])
    assert ok.failed and not ok.too_complex         # a refused token is no limit


def test_forget_drops_a_compiled_grammar(comp) -> None:
    """The engine forgets a grammar one of whose requests hit a limit while generating: its
    copies share one lexer state table, which may be what is full."""
    spec = GrammarSpec("regex", "[a-c]{2,5}")
    comp.compile(spec)
    assert comp.peek(spec) is not None
    comp.forget(spec)
    assert comp.peek(spec) is None and not comp.cached(spec)
