"""Penalties, logit_bias and min_p: the sampler against the definitions applied by hand.

Each case builds logits, applies OpenAI's / vLLM's definition directly, and checks the sampler
picks exactly what that computation predicts (greedy: its argmax; seeded: the same draw).
"""
from __future__ import annotations

import json

import pytest
import torch

from moed.model.sampler import SampleRow, make_generator, sample
from moed.roles.protocol import first_token_params, sampling_fields
from moed.types import SamplingParams

torch.set_num_threads(1)
V = 40


def _logits(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def _counts(ids: list[int]) -> torch.Tensor:
    c = torch.zeros(V)
    for t in ids:
        c[t] += 1
    return c


def _by_hand(lg: torch.Tensor, p: SamplingParams, prompt: list[int],
             out: list[int]) -> torch.Tensor:
    """vLLM's order: logit_bias, repetition (prompt + output), frequency + presence (output)."""
    x = lg.clone()
    for t, b in p.logit_bias:
        x[t] += b
    seen = _counts(prompt + out) > 0
    x = torch.where(seen & (x > 0), x / p.repetition_penalty,
                    torch.where(seen, x * p.repetition_penalty, x))
    c = _counts(out)
    return x - p.frequency_penalty * c - p.presence_penalty * (c > 0).float()


def _row(p: SamplingParams, prompt: list[int], out: list[int], g=None) -> SampleRow:
    return SampleRow(p, g, (), prompt + out, len(prompt))


def test_frequency_penalty_moves_the_greedy_token_as_defined() -> None:
    lg = torch.zeros(1, V)
    lg[0, 3], lg[0, 7] = 5.0, 4.0
    out = [3, 3, 9]                               # 3 said twice: 5 - 2*0.6 = 3.8 < 4
    p = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    assert sample(lg, [_row(p, [1, 2], out)]).token_ids == [7]
    assert int(_by_hand(lg[0], p, [1, 2], out).argmax()) == 7
    # the prompt does not count: 3 only in the prompt keeps it on top
    assert sample(lg, [_row(p, [3, 3, 3], [9])]).token_ids == [3]


def test_presence_penalty_counts_once() -> None:
    lg = torch.zeros(1, V)
    lg[0, 3], lg[0, 7] = 5.0, 4.0
    p = SamplingParams(temperature=0.0, presence_penalty=0.9)     # 5 - 0.9 = 4.1 > 4
    assert sample(lg, [_row(p, [], [3, 3, 3, 3])]).token_ids == [3]
    p = SamplingParams(temperature=0.0, presence_penalty=1.1)     # 3.9 < 4
    assert sample(lg, [_row(p, [], [3, 3, 3, 3])]).token_ids == [7]
    neg = SamplingParams(temperature=0.0, presence_penalty=-2.0)  # negative: favours repeats
    assert sample(lg, [_row(neg, [], [7])]).token_ids == [7]


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output() -> None:
    lg = torch.full((1, V), -10.0)
    lg[0, 3], lg[0, 7], lg[0, 8], lg[0, 9] = 4.0, 3.0, -1.0, -1.5
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert sample(lg, [_row(p, [3], [])]).token_ids == [7]        # 4/1.5 = 2.67 < 3 (prompt)
    assert sample(lg, [_row(p, [], [3])]).token_ids == [7]        # and output
    lg2 = torch.full((1, V), -10.0)
    lg2[0, 8], lg2[0, 9] = -1.0, -1.4
    assert sample(lg2, [_row(p, [8], [])]).token_ids == [9]       # -1 * 1.5 = -1.5 < -1.4
    for prompt, out in (([3], [7, 7]), ([8, 9, 1], [3])):
        assert sample(lg, [_row(p, prompt, out)]).token_ids == \
            [int(_by_hand(lg[0], p, prompt, out).argmax())]


def test_logit_bias_adds_to_the_logits_for_greedy_and_random_rows() -> None:
    lg = _logits(1)
    top = int(lg[0].argmax())
    other = (top + 1) % V
    for temp in (0.0, 0.8):
        assert sample(lg, [SampleRow(SamplingParams(temperature=temp,
                                                    logit_bias=((other, 100.0),)))]) \
            .token_ids == [other]
    p = SamplingParams(temperature=0.0, logit_bias=((top, -100.0),))
    got = sample(lg, [SampleRow(p)]).token_ids[0]
    assert got != top and got == int(_by_hand(lg[0], p, [], []).argmax())


def test_seeded_draw_equals_the_draw_from_hand_processed_logits() -> None:
    """Random rows: same seed, the sampler on raw logits + penalties == on logits penalised by
    hand with no penalties (so the processing is exactly the definition, not just close)."""
    prompt, out = [1, 2, 3, 4], [5, 5, 6, 1, 30]
    p = SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=7, frequency_penalty=0.7,
                       presence_penalty=-0.4, repetition_penalty=1.3,
                       logit_bias=((6, 2.5), (11, -3.0)))
    plain = SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=7)
    g1, g2 = make_generator(7), make_generator(7)
    for step in range(20):
        lg = _logits(1, seed=step)
        a = sample(lg, [_row(p, prompt, out, g1)]).token_ids
        b = sample(_by_hand(lg[0], p, prompt, out).unsqueeze(0), [SampleRow(plain, g2)]).token_ids
        assert a == b


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    lg = _logits(1, seed=3) / 3                   # flat enough that several tokens survive
    p = SamplingParams(temperature=0.7, min_p=0.2, seed=1)
    probs = torch.softmax(lg[0] / 0.7, -1)
    keep = probs >= 0.2 * probs.max()
    masked = (lg[0] / 0.7).masked_fill(~keep, float("-inf"))
    g1, g2 = make_generator(1), make_generator(1)
    seen = set()
    for _ in range(200):
        a = sample(lg, [SampleRow(p, g1)]).token_ids[0]
        # by hand: softmax over the kept tokens, the same exponential race
        b = sample(masked.unsqueeze(0), [SampleRow(SamplingParams(seed=1), g2)]).token_ids[0]
        assert a == b and keep[a]
        seen.add(a)
    assert len(seen) > 1 and keep.sum() < V
    assert sample(lg, [SampleRow(SamplingParams(temperature=1.0, min_p=1.0))]).token_ids == \
        [int(lg[0].argmax())]                     # min_p = 1: only the top token survives


def test_plain_rows_are_bit_identical_beside_penalised_mates() -> None:
    lg = _logits(4, seed=5)
    plain = [SamplingParams(temperature=0.8, seed=11, logprobs=True, top_logprobs=3),
             SamplingParams(temperature=0.0, logprobs=True)]
    pen = SamplingParams(temperature=0.8, frequency_penalty=2.0, logit_bias=((0, 50.0),),
                         min_p=0.1, seed=3)
    alone = sample(lg[[0, 2]], [SampleRow(plain[0], make_generator(11)), SampleRow(plain[1])])
    mixed = sample(lg, [SampleRow(plain[0], make_generator(11)), _row(pen, [1], [2, 2]),
                        SampleRow(plain[1]), _row(pen, [], [0], make_generator(3))])
    assert [mixed.token_ids[i] for i in (0, 2)] == alone.token_ids
    assert [mixed.logprobs[i] for i in (0, 2)] == alone.logprobs        # bit for bit
    assert mixed.top_logprobs[0] == alone.top_logprobs[0]


def test_logprobs_stay_the_raw_model_distribution() -> None:
    lg = _logits(1)
    p = SamplingParams(temperature=0.0, logprobs=True, logit_bias=((5, 100.0),),
                       frequency_penalty=1.0)
    res = sample(lg, [_row(p, [], [5])])
    assert res.token_ids == [5]
    assert res.logprobs[0] == pytest.approx(float(torch.log_softmax(lg[0], -1)[5]))


def test_sampling_params_ranges() -> None:
    for kw in ({"presence_penalty": 2.5}, {"frequency_penalty": -2.1},
               {"repetition_penalty": 0.0}, {"repetition_penalty": 2.5}, {"min_p": 1.5},
               {"logit_bias": ((1, 101.0),)}, {"logit_bias": ((-1, 1.0),)}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
    assert not SamplingParams(min_p=0.5).penalized      # min_p needs no history
    assert SamplingParams(repetition_penalty=1.1).penalized


def test_prefill_node_samples_token_one_with_the_same_rules() -> None:
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=-1.0,
                       repetition_penalty=1.7, min_p=0.3, logit_bias=((4, -100.0), (9, 3.5)))
    q = first_token_params(json.loads(json.dumps(sampling_fields(p))))   # over the wire
    for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
              "logit_bias", "temperature"):
        assert getattr(q, k) == getattr(p, k)
    lg = _logits(1, seed=9)
    prompt = [int(lg[0].argmax()), 2]
    assert sample(lg, [_row(p, prompt, [])]).token_ids == \
        sample(lg, [_row(q, prompt, [])]).token_ids == \
        [int(_by_hand(lg[0], p, prompt, []).argmax())]
