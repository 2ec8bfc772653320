"""Speculative verification (moed.model.spec_verify): greedy rows equal plain greedy decoding;
sampled rows give exactly the target distribution — the first emitted token and the (first,
second) pair, against an independent float64 reference of the sampler's processing, by
chi-square at a fixed seed — for point-mass and sampled (q) drafts, always-wrong and
always-right drafts; seeded draws reproducible; a grammar row never leaves its grammar, and
with the grammar's mask at each position follows the masked target by chi-square."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from moed.model.grammar import GrammarCompiler, fill_bitmask
from moed.model.sampler import SampleRow, make_generator, probabilities, process_logits, sample
from moed.model.spec_verify import DraftRow, Verified, position_rows, verify
from moed.model.tokenizer import Tokenizer
from moed.types import GrammarSpec, SamplingParams

torch.set_num_threads(1)

V = 6
PROMPT = [0, 3, 1]
EOS = (5,)
W = torch.randn(V, V, generator=torch.Generator().manual_seed(15)) * 0.8   # logits = W[last]
Q = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(12)) * 1.5, -1)
MARGIN = 1e-4      # how far from its threshold a top-p or min-p cut must be
P_MIN = 1e-3        # chi-square p-value below which a test fails (fixed seeds: deterministic)


def step_row(p: SamplingParams, ctx: list[int], gen: torch.Generator | None = None,
             num_prompt: int = len(PROMPT), eos: tuple[int, ...] = EOS) -> SampleRow:
    """The SampleRow the engine's step builds for the next token (StepCore._sample_row)."""
    banned = p.stop_token_ids + (() if p.ignore_eos else eos) \
        if len(ctx) - num_prompt < p.min_tokens else ()
    if not p.penalized:
        return SampleRow(p, gen, banned)
    return SampleRow(p, gen, banned, list(ctx), num_prompt)


def ref_probs(ctx: list[int], p: SamplingParams) -> list[float]:
    """The target distribution at `ctx`, written from the definitions in float64 (vLLM's order:
    logit_bias, repetition over prompt + output, frequency/presence over output, banned ids;
    then temperature, top-k, top-p over the top-k survivors, min-p, softmax). A cut within
    MARGIN of its threshold is refused: float32 could decide it the other way."""
    x = [float(v) for v in W[ctx[-1]].double()]
    out = ctx[len(PROMPT):]
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(ctx):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    if len(out) < p.min_tokens:
        for t in EOS:
            x[t] = -math.inf
    x = [v / p.temperature for v in x]
    order = sorted(range(V), key=lambda t: -x[t])
    keep = set(order[:p.top_k] if p.top_k > 0 else order)
    if p.top_p < 1.0:
        z = sum(math.exp(x[t]) for t in keep)
        above = 0.0
        for t in order:
            if t not in keep:
                continue
            assert abs(above - p.top_p) > MARGIN, "top-p cut too close to call"
            if above >= p.top_p:
                keep.discard(t)
            else:
                above += math.exp(x[t]) / z
    z = sum(math.exp(x[t]) for t in keep)
    probs = [math.exp(x[t]) / z if t in keep else 0.0 for t in range(V)]
    if p.min_p > 0:
        top = max(probs)
        assert all(abs(q - p.min_p * top) > MARGIN for q in probs), "min-p cut too close"
        probs = [q if q >= p.min_p * top else 0.0 for q in probs]
    s = sum(probs)
    return [q / s for q in probs]


def chi2_pvalue(counts: dict, expected: dict, n: int) -> float:
    """Pearson's chi-square over the cells with an expected probability; a count in a cell of
    probability 0 is an outright failure."""
    assert all(expected.get(c, 0.0) > 0 for c in counts), \
        f"emitted with probability 0: {[c for c in counts if expected.get(c, 0.0) == 0]}"
    cells = [c for c, e in expected.items() if e > 0]
    stat = sum((counts.get(c, 0) - n * expected[c]) ** 2 / (n * expected[c]) for c in cells)
    df = max(len(cells) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def drafts(ctx_last: torch.Tensor, k: int, kind: str, gen: torch.Generator):
    """Drafts of length k for trials whose contexts end in `ctx_last` [N]: "point" follows the
    raw target's argmax (no q: often right), "q" samples from Q (q rows given), "wrong" proposes a token of target
    probability 0 (top-k keeps 3 of 6: the least likely under W of its row)."""
    prev, toks, qs = ctx_last, [], []
    for _ in range(k):
        if kind == "point":
            d = W[prev].argmax(-1)
        elif kind == "q":
            qs.append(Q[prev])
            d = torch.multinomial(Q[prev], 1, generator=gen).squeeze(1)
        else:
            d = W[prev].argmin(-1)
        toks.append(d)
        prev = d
    toks_t = torch.stack(toks, 1) if k else torch.empty(len(ctx_last), 0, dtype=torch.long)
    return toks_t, (torch.stack(qs, 1) if kind == "q" else None)


def spec_step(ctxs: list[list[int]], p: SamplingParams, k: int, kind: str,
              gen: torch.Generator) -> list[Verified]:
    """One speculative step for every context: draft, the target logits of the k + 1
    positions, verify."""
    last = torch.tensor([c[-1] for c in ctxs])
    toks, q = drafts(last, k, kind, gen)
    logits = W[torch.cat([last.unsqueeze(1), toks], 1)].reshape(-1, V)
    tl = toks.tolist()
    reqs = [DraftRow(step_row(p, c), tuple(tl[j]), len(c) - len(PROMPT),
                     None if q is None else q[j]) for j, c in enumerate(ctxs)]
    return verify(logits, reqs)


def first_two(p: SamplingParams, kind: str, n: int, k: int = 2, seed: int = 0):
    """n trials of speculative decoding from PROMPT until two tokens are out: the first
    step's results and the (first, second) pairs."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    res = spec_step([PROMPT] * n, p, k, kind, gen)
    pairs: list[tuple[int, int] | None] = [v.token_ids[:2] if len(v.token_ids) > 1 else None
                                           for v in res]
    short = [j for j, pr in enumerate(pairs) if pr is None]
    if short:
        more = spec_step([PROMPT + [res[j].token_ids[0]] for j in short], p, k, kind, gen)
        for j, v in zip(short, more):
            pairs[j] = (res[j].token_ids[0], v.token_ids[0])
    return res, pairs


def exact_pairs(p: SamplingParams) -> dict[tuple[int, int], float]:
    p0 = ref_probs(PROMPT, p)
    return {(a, b): p0[a] * pb for a in range(V) if p0[a] > 0
            for b, pb in enumerate(ref_probs(PROMPT + [a], p))}


def _counts(items) -> dict:
    out: dict = {}
    for it in items:
        out[it] = out.get(it, 0) + 1
    return out


CONFIGS = {
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "top_k": SamplingParams(temperature=1.3, top_k=3),
    "min_p": SamplingParams(temperature=1.0, min_p=0.15),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.7,
                                presence_penalty=0.5, logit_bias=((2, 1.0),)),
    "min_tokens": SamplingParams(temperature=1.0, min_tokens=1),    # EOS banned at 0 only
    "everything": SamplingParams(temperature=0.9, top_k=5, top_p=0.95, min_p=0.05,
                                 repetition_penalty=1.2, frequency_penalty=0.5, min_tokens=2),
}
N = 20000


@pytest.mark.parametrize("kind", ["point", "q"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_first_token_and_pair_follow_the_target_distribution(name: str, kind: str) -> None:
    p = CONFIGS[name]
    res, pairs = first_two(p, kind, N)
    p0 = ref_probs(PROMPT, p)
    assert chi2_pvalue(_counts(v.token_ids[0] for v in res), dict(enumerate(p0)), N) > P_MIN
    assert chi2_pvalue(_counts(pairs), exact_pairs(p), N) > P_MIN
    acc = _counts(v.accepted for v in res)
    assert set(acc) <= {0, 1, 2} and acc.get(0, 0) < N      # some drafts do get accepted


def test_an_always_wrong_draft_still_gives_the_target_distribution() -> None:
    """Drafts of target probability 0 (outside top-k) are never accepted; what comes out is p."""
    p = SamplingParams(temperature=1.0, top_k=3)
    res, pairs = first_two(p, "wrong", N, k=3)
    assert all(v.accepted == 0 for v in res)
    assert chi2_pvalue(_counts(v.token_ids[0] for v in res), dict(enumerate(ref_probs(PROMPT, p))),
                       N) > P_MIN
    assert chi2_pvalue(_counts(pairs), exact_pairs(p), N) > P_MIN


def test_a_point_draft_is_accepted_with_the_target_probability() -> None:
    """d_0 is accepted with probability p_0(d_0), d_0 and d_1 with p_0(d_0) p_1(d_1 | d_0)."""
    p = SamplingParams(temperature=1.0)
    d0 = int(W[PROMPT[-1]].argmax())
    d1 = int(W[d0].argmax())
    torch.manual_seed(3)
    logits = W[torch.tensor([PROMPT[-1], d0, d1])].repeat(N, 1)
    res = verify(logits, [DraftRow(step_row(p, PROMPT), (d0, d1), 0)] * N)
    a = ref_probs(PROMPT, p)[d0]
    b = a * ref_probs(PROMPT + [d0], p)[d1]
    got = _counts(min(v.accepted, 2) for v in res)
    exact = {0: 1 - a, 1: a - b, 2: b}
    assert chi2_pvalue(got, exact, N) > P_MIN


def test_a_draft_drawn_from_the_target_itself_is_always_accepted() -> None:
    """q = p (the sampler's own p at each position): p/q = 1 > u, every draft accepted."""
    p = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.3)
    gen = torch.Generator().manual_seed(5)
    reqs, rows = [], []
    for _ in range(200):
        d, ctx = [], list(PROMPT)
        for _ in range(3):          # draft from p itself, position by position
            lg = W[ctx[-1]].unsqueeze(0)
            row = step_row(p, ctx)
            q = probabilities(process_logits(lg, [row]), [row])[0]
            d.append(int(torch.multinomial(q, 1, generator=gen)))
            ctx.append(d[-1])
        dr = DraftRow(step_row(p, PROMPT), tuple(d), 0)
        lg = W[torch.tensor(PROMPT[-1:] + d)]
        pr = position_rows(dr)
        qs = probabilities(process_logits(lg, pr), pr)[:3]
        reqs.append(DraftRow(dr.row, dr.draft, 0, qs))
        rows.append(lg)
    res = verify(torch.cat(rows), reqs)
    assert all(v.accepted == 3 and v.token_ids[:3] == r.draft for v, r in zip(res, reqs))


# --- greedy ---------------------------------------------------------------------------------

def _model(ctx: list[int], vocab: int) -> torch.Tensor:
    """A toy target over a larger vocabulary: logits from the last two tokens."""
    g = torch.Generator().manual_seed(ctx[-1] * 1000 + ctx[-2] * 7 + vocab)
    return torch.randn(vocab, generator=g) * 2


GREEDY = [SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.9, top_k=1),
          SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0,
                         presence_penalty=0.5, logit_bias=((4, 2.0),)),
          # EOS (3) the favourite once allowed: a ban held too long or lifted too early shows
          SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=(9,),
                         logit_bias=((3, 4.0),)),
          # bans only: processed rows while short, verify's bare argmax once min_tokens is met
          SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=(9,))]


@pytest.mark.parametrize("seed", range(8))
def test_greedy_equals_plain_greedy_decoding(seed: int) -> None:
    rng = random.Random(seed)
    vocab, eos = 40, (3,)
    p = GREEDY[seed % len(GREEDY)]
    prompt = [rng.randrange(vocab) for _ in range(5)]
    ctx = list(prompt)
    for _ in range(24):             # plain decoding: one sample() a token
        row = step_row(p, ctx, num_prompt=5, eos=eos)
        ctx.append(sample(_model(ctx, vocab).unsqueeze(0), [row]).token_ids[0])
    want = ctx[5:]
    out: list[int] = []
    while len(out) < len(want):     # speculative: drafts right at random, then wrong
        ctx = prompt + out
        k = rng.randint(0, 4)
        d = [t if rng.random() < 0.75 else rng.randrange(vocab) for t in want[len(out):][:k]]
        d += [rng.randrange(vocab) for _ in range(k - len(d))]
        logits = torch.stack([_model(ctx + d[:i], vocab) for i in range(len(d) + 1)])
        row = step_row(p, ctx, num_prompt=5, eos=eos)
        v = verify(logits, [DraftRow(row, tuple(d), len(out))])[0]
        assert v.accepted == len(v.token_ids) - 1 and list(v.token_ids[:-1]) == d[:v.accepted]
        out += v.token_ids
    assert out[:len(want)] == want


def test_logprobs_are_the_raw_ones_sample_reports_at_each_position() -> None:
    vocab = 30
    p = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3, repetition_penalty=1.3)
    ctx = [1, 2, 3]
    plain = []
    for _ in range(4):
        r = sample(_model(ctx, vocab).unsqueeze(0), [step_row(p, ctx, num_prompt=3)])
        plain.append(r)
        ctx.append(r.token_ids[0])
    d = tuple(ctx[3:6])
    logits = torch.stack([_model(ctx[:3 + i], vocab) for i in range(4)])
    mate = DraftRow(SampleRow(SamplingParams(temperature=0.0)), (0,), 0)     # asks nothing
    v, m = verify(torch.cat([logits, logits[:2]]),
                  [DraftRow(step_row(p, ctx[:3], num_prompt=3), d, 0), mate])
    assert v.token_ids == tuple(ctx[3:7]) and v.accepted == 3
    assert v.logprobs == tuple(r.logprobs[0] for r in plain)
    assert v.top_logprobs == tuple(tuple(r.top_logprobs[0]) for r in plain)
    assert m.logprobs is None and m.top_logprobs is None


def test_position_rows_keep_every_field_but_the_ones_a_position_sets() -> None:
    """position_rows builds each position's row with SampleRow's constructor: every field not
    set per position (banned ids, history, mask, no generator) is the row's own."""
    from dataclasses import fields, replace
    p = SamplingParams(temperature=1.0, min_tokens=2, repetition_penalty=1.2, seed=3)
    gen, mask = make_generator(3), torch.ones(1, dtype=torch.int32)
    row = SampleRow(p, gen, (5,), [0, 3, 1], 3, None, mask)
    assert {f.name for f in fields(SampleRow)} == {
        "params", "generator", "banned_ids", "token_ids", "num_prompt", "grammar", "mask"}
    got = position_rows(DraftRow(row, (2, 4), 1))       # 1 out: EOS banned at position 0 only
    want = [replace(row, generator=None, banned_ids=banned, token_ids=hist)
            for banned, hist in (((5,), [0, 3, 1]), ((), [0, 3, 1, 2]), ((), [0, 3, 1, 2, 4]))]
    assert got == want


# --- seeds ----------------------------------------------------------------------------------

SEEDED = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, top_p=0.8),
          SamplingParams(temperature=1.2, top_k=4, min_p=0.1, presence_penalty=0.8)]


@pytest.mark.parametrize("p", SEEDED)
def test_an_empty_draft_gives_the_token_sample_gives_with_the_same_seed(p) -> None:
    for s in range(30):
        ctx = PROMPT + [s % V]
        lg = W[ctx[-1]].unsqueeze(0)
        a = verify(lg, [DraftRow(step_row(p, ctx, make_generator(s)), (), 1)])[0]
        b = sample(lg, [step_row(p, ctx, make_generator(s))])
        assert a.token_ids == (b.token_ids[0],) and a.accepted == 0


def test_same_seed_and_drafts_give_the_same_tokens_whatever_the_batch_mates() -> None:
    p = SamplingParams(temperature=1.0, seed=7)
    q = Q[torch.tensor([1, 2, 0])]
    lg = W[torch.tensor([1, 2, 0, 4])]

    def run(mates: int, kind: str) -> list[Verified]:
        mate = DraftRow(step_row(SamplingParams(temperature=1.0), PROMPT), (3,), 0)
        me = [DraftRow(step_row(p, PROMPT, make_generator(s)), (2, 0, 4), 0,
                       q if kind == "q" else None) for s in range(40)]
        reqs = [mate] * mates + me + [mate] * mates
        logits = torch.cat([W[torch.tensor([1, 3])]] * mates + [lg] * 40
                           + [W[torch.tensor([1, 3])]] * mates)
        return verify(logits, reqs)[mates:mates + 40]

    for kind in ("point", "q"):
        a, b = run(0, kind), run(3, kind)
        assert [v.token_ids for v in a] == [v.token_ids for v in b]
        assert len({v.token_ids for v in a}) > 1           # the seeds do differ


def test_a_seeded_call_consumes_its_generator_the_same_whatever_is_accepted() -> None:
    """k uniforms, then one race over the vocabulary: the generator's next draw after verify
    is the same for a draft that is accepted and one that is not."""
    p = SamplingParams(temperature=1.0, seed=1)
    lg = W[torch.tensor([1, 2, 0])]
    after = []
    for d in ((int(W[1].argmax()), int(W[2].argmax())), (int(W[1].argmin()), 0)):
        g = make_generator(5)
        verify(lg, [DraftRow(step_row(p, PROMPT, g), d, 0)])
        after.append(torch.rand(1, generator=g).item())
    ref = make_generator(5)
    torch.rand(2, generator=ref)
    torch.empty(V).exponential_(generator=ref)
    assert after[0] == after[1] == torch.rand(1, generator=ref).item()


# --- grammar and bad input -----------------------------------------------------------------

@pytest.fixture(scope="module")
def comp(tiny_qwen3) -> GrammarCompiler:
    tok = Tokenizer.from_dir(tiny_qwen3)
    return GrammarCompiler(tok.to_json(), tok.eos_token_ids, max_entries=2)


def test_a_grammar_row_never_leaves_its_grammar(comp: GrammarCompiler) -> None:
    """Drafts through a choice grammar, the masks from a matcher advanced along each draft (as
    the engine will); logits that favour forbidden tokens; every emitted sequence is one the
    grammar accepts, greedy and sampled, point mass and q."""
    spec = GrammarSpec("choice", json.dumps(["yes", "no", "yellow"]))
    vocab = comp.vocab_size
    tok = comp._tok
    words = [tok.tokenize_str(w) for w in ("yes", "no", "yellow")]
    torch.manual_seed(0)
    rng = random.Random(0)
    for trial in range(40):
        p = SamplingParams(temperature=0.0 if trial % 4 == 0 else 1.5, top_k=trial % 3 * 20)
        d = list(rng.choice(words)) + [rng.randrange(vocab)]
        d = d[:rng.randint(0, len(d))]
        masks, m, cut = [], comp.matcher(spec), []
        for t in d + [None]:
            masks.append(fill_bitmask([m])[0])
            if t is None or not m.accept(t):
                break
            cut.append(t)
        logits = torch.randn(len(cut) + 1, vocab) * 3
        logits[:, rng.sample(range(vocab), 50)] += 20.0          # mostly forbidden favourites
        q = torch.softmax(torch.randn(len(cut), vocab), -1) if trial % 2 else None
        row = SampleRow(p, grammar=comp.matcher(spec))
        v = verify(logits, [DraftRow(row, tuple(cut), 0, q, torch.stack(masks))])[0]
        check = comp.matcher(spec)
        assert all(check.accept(t) for t in v.token_ids), (cut, v)
    with pytest.raises(ValueError, match="mask"):
        verify(torch.zeros(2, vocab), [DraftRow(SampleRow(SamplingParams(), grammar=m), (1,), 0)])


# a grammar over the 6-token vocabulary: the tokens allowed after each token
ALLOW = [{1, 2, 4}, {0, 3, 5}, {1, 2, 3, 4}, {0, 2, 5}, {1, 3, 4, 5}, {0, 1, 2}]
GRAMMAR = object()      # the masks are given: the matcher itself is never asked


def _bits(prev: int) -> torch.Tensor:
    return torch.tensor([sum(1 << t for t in ALLOW[prev])], dtype=torch.int32)


def masked_ref(prev: int, p: SamplingParams) -> list[float]:
    """The target after `prev` in float64: the grammar's mask first, then temperature, top-k."""
    x = [float(W[prev, t]) / p.temperature if t in ALLOW[prev] else -math.inf for t in range(V)]
    if p.top_k > 0:
        keep = sorted(range(V), key=lambda t: -x[t])[:p.top_k]
        x = [v if t in keep else -math.inf for t, v in enumerate(x)]
    z = sum(math.exp(v) for v in x if v > -math.inf)
    return [math.exp(v) / z if v > -math.inf else 0.0 for v in x]


def grammar_step(prevs: list[int], p: SamplingParams, kind: str, gen: torch.Generator,
                 k: int = 2) -> list[Verified]:
    """One step per trial: grammar-valid drafts (the engine cuts drafts to the valid prefix),
    a mask per position after the drafts before it, verify."""
    reqs, logits = [], []
    for prev in prevs:
        toks, qs, masks = [], [], []
        for _ in range(k):
            masks.append(_bits(prev))
            allowed = sorted(ALLOW[prev])
            if kind == "point":
                d = max(allowed, key=lambda t: float(W[prev, t]))
            else:
                q = torch.zeros(V)
                q[allowed] = Q[prev, allowed] / Q[prev, allowed].sum()
                qs.append(q)
                d = int(torch.multinomial(q, 1, generator=gen))
            logits.append(W[prev])
            toks.append(d)
            prev = d
        masks.append(_bits(prev))
        logits.append(W[prev])
        reqs.append(DraftRow(SampleRow(p, grammar=GRAMMAR), tuple(toks), 0,
                             torch.stack(qs) if qs else None, torch.cat(masks).unsqueeze(1)))
    return verify(torch.stack(logits), reqs)


@pytest.mark.parametrize("kind", ["point", "q"])
@pytest.mark.parametrize("name", ["temperature", "top_k"])
def test_masked_rejection_sampling_follows_the_masked_target(name: str, kind: str) -> None:
    """A grammar row's drafts verified with the mask at each position: the first token and the
    (first, second) pair follow plain decoding's masked distribution (chi-square), and drafts
    are accepted (the masks after accepted drafts are used)."""
    p, n = CONFIGS[name], 6000
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(4)
    res = grammar_step([PROMPT[-1]] * n, p, kind, gen)
    short = [j for j, v in enumerate(res) if len(v.token_ids) < 2]
    more = dict(zip(short, grammar_step([res[j].token_ids[0] for j in short], p, kind, gen)))
    pairs = [v.token_ids[:2] if j not in more else (v.token_ids[0], more[j].token_ids[0])
             for j, v in enumerate(res)]
    p0 = masked_ref(PROMPT[-1], p)
    exact = {(a, b): p0[a] * pb for a in range(V) if p0[a] > 0
             for b, pb in enumerate(masked_ref(a, p))}
    assert chi2_pvalue(_counts(v.token_ids[0] for v in res), dict(enumerate(p0)), n) > P_MIN
    assert chi2_pvalue(_counts(pairs), exact, n) > P_MIN
    assert sum(v.accepted for v in res) > n // 4


def test_bad_input_is_refused() -> None:
    row = step_row(SamplingParams(), PROMPT)
    with pytest.raises(ValueError, match="rows"):
        verify(torch.zeros(2, V), [DraftRow(row, (1, 2), 0)])
    with pytest.raises(ValueError, match="vocabulary"):
        verify(torch.zeros(2, V), [DraftRow(row, (V,), 0)])
    with pytest.raises(ValueError, match="draft_probs"):
        verify(torch.zeros(2, V), [DraftRow(row, (1,), 0, torch.ones(2, V) / V)])
    with pytest.raises(ValueError, match="without a grammar"):
        verify(torch.zeros(1, V), [DraftRow(row, (), 0, None, torch.zeros(1, 1, dtype=torch.int32))])
    assert verify(torch.zeros(0, V), []) == []
