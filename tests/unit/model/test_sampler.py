"""Sampler: greedy, seeds independent of batch mates, top-k/top-p support, logprobs, masking."""
from __future__ import annotations

import math

import torch

from moed.model.sampler import SampleRow, argmax_rows, make_generator, sample, skip_one_token
from moed.types import SamplingParams

torch.set_num_threads(1)


def _logits(b, v=50, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    lg = _logits(5)
    rows = [SampleRow(SamplingParams(temperature=0.0))] * 5
    assert sample(lg, rows).token_ids == lg.argmax(-1).tolist()
    rows = [SampleRow(SamplingParams(temperature=0.7, top_k=1))] * 5      # top_k=1 is greedy too
    assert sample(lg, rows).token_ids == lg.argmax(-1).tolist()


def test_argmax_rows_is_torch_argmax():
    """The sampler's argmax (the native kernel on CPU fp32 where it loads, else torch): torch's
    answer on ties (first index), NaN, -inf rows, strided and bf16 input alike."""
    ties = torch.round(_logits(9, 4099))
    ties[0] = float("-inf")
    ties[1, 100] = ties[1, 200] = float("nan")
    for x in (ties, ties[:, 1::3], ties.bfloat16(), _logits(40, 32000)):
        assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_a_given_argmax_serves_only_untouched_greedy_rows():
    """sample(..., argmax=): the decode step's own argmax is taken for all-greedy rows whose
    logits nothing changes; a banned id (min_tokens) changes them, and then it is not."""
    lg = _logits(3)
    planted = torch.tensor([7, 8, 9])           # not the argmax: shows which one was taken
    greedy = [SampleRow(SamplingParams(temperature=0.0))] * 3
    assert sample(lg, greedy, planted).token_ids == [7, 8, 9]
    banned = [SampleRow(SamplingParams(temperature=0.0), banned_ids=(1,))] * 3
    assert sample(lg, banned, planted).token_ids == lg.argmax(-1).tolist()
    mixed = [SampleRow(SamplingParams(temperature=0.0)), SampleRow(SamplingParams(temperature=1.0, seed=1))] * 1
    assert sample(lg[:2], mixed, planted[:2]).token_ids[0] == int(lg[0].argmax())


def test_mixed_batch_greedy_rows_stay_argmax():
    lg = _logits(6)
    rows = [SampleRow(SamplingParams(temperature=0.0 if i % 2 else 1.5)) for i in range(6)]
    out = sample(lg, rows).token_ids
    assert [out[i] for i in (1, 3, 5)] == [int(lg[i].argmax()) for i in (1, 3, 5)]


def test_seed_is_independent_of_batch_mates():
    p = SamplingParams(temperature=1.0, seed=42, top_p=0.9)

    def run(mates: int) -> list[int]:
        g = make_generator(42)
        toks = []
        for step in range(6):
            lg = _logits(1 + mates, seed=step)
            lg[mates] = _logits(1, seed=100 + step)[0]            # our row, same every run
            rows = [SampleRow(SamplingParams(temperature=1.0, seed=None if i % 2 else i),
                              None if i % 2 else make_generator(i)) for i in range(mates)]
            rows.append(SampleRow(p, g))
            toks.append(sample(lg, rows).token_ids[mates])
        return toks

    alone = run(0)
    assert alone == run(3) == run(7)
    g2 = make_generator(43)
    other = [sample(_logits(1, seed=100 + s), [SampleRow(p, g2)]).token_ids[0] for s in range(6)]
    assert other != alone


def test_distribution_matches_softmax():
    torch.manual_seed(0)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 4000
    out = sample(base.repeat(n, 1), [SampleRow(SamplingParams(temperature=1.0))] * n).token_ids
    freq = torch.bincount(torch.tensor(out), minlength=5).float() / n
    assert torch.allclose(freq, torch.softmax(base, -1), atol=0.03)


def test_top_k_and_top_p_support():
    torch.manual_seed(1)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    lg = probs.log().repeat(2000, 1)
    topp = sample(lg, [SampleRow(SamplingParams(temperature=1.0, top_p=0.7))] * 2000).token_ids
    assert set(topp) == {0, 1}
    topk = sample(lg, [SampleRow(SamplingParams(temperature=1.0, top_k=3))] * 2000).token_ids
    assert set(topk) == {0, 1, 2}
    tiny = sample(lg[:50], [SampleRow(SamplingParams(temperature=1.0, top_p=0.01))] * 50).token_ids
    assert set(tiny) == {0}                                        # always keeps the best token


def test_logprobs_are_raw_log_softmax():
    lg = _logits(4)
    rows = [SampleRow(SamplingParams(temperature=t, logprobs=True)) for t in (0.0, 0.5, 2.0, 1.0)]
    res = sample(lg, rows)
    ref = torch.log_softmax(lg, -1)
    for i, t in enumerate(res.token_ids):
        assert math.isclose(res.logprobs[i], float(ref[i, t]), abs_tol=1e-6)
    assert sample(lg, [SampleRow(SamplingParams(temperature=0.0))] * 4).logprobs is None


def test_banned_ids_are_never_sampled():
    lg = torch.zeros(300, 4)
    lg[:, 3] = 10.0
    rows = [SampleRow(SamplingParams(temperature=1.0), banned_ids=(3,))] * 300
    assert 3 not in sample(lg, rows).token_ids
    assert sample(lg[:1], [SampleRow(SamplingParams(temperature=0.0), banned_ids=(3,))]).token_ids[0] != 3


def test_mixed_top_k_rows_in_one_batch():
    torch.manual_seed(2)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    lg = probs.log().repeat(3000, 1)
    rows = [SampleRow(SamplingParams(temperature=1.0, top_k=k)) for k in (2, 0, 3)] * 1000
    out = torch.tensor(sample(lg, rows).token_ids).view(1000, 3)
    assert set(out[:, 0].tolist()) == {0, 1}
    assert set(out[:, 1].tolist()) == {0, 1, 2, 3}
    assert set(out[:, 2].tolist()) == {0, 1, 2}


def test_skip_one_token_replays_exactly_one_draw():
    """A decode node whose token one was sampled elsewhere skips that draw: token two onward
    match a run that sampled every token locally (and a greedy request draws nothing)."""
    p = SamplingParams(temperature=1.3, seed=9, top_k=20)
    lgs = [_logits(1, seed=200 + s) for s in range(5)]
    local = make_generator(9)
    want = [sample(lg, [SampleRow(p, local)]).token_ids[0] for lg in lgs]
    remote = make_generator(9)
    skip_one_token(remote, p, 50)
    got = [sample(lg, [SampleRow(p, remote)]).token_ids[0] for lg in lgs[1:]]
    assert got == want[1:]
    unskipped = make_generator(9)
    assert [sample(lg, [SampleRow(p, unskipped)]).token_ids[0] for lg in lgs[1:]] != want[1:]
    g = make_generator(9)
    skip_one_token(g, SamplingParams(temperature=0.0, seed=9), 50)
    assert torch.equal(g.get_state(), make_generator(9).get_state())


def test_top_logprobs_only_when_asked_and_per_row_n():
    lg = _logits(3)
    rows = [SampleRow(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)),
            SampleRow(SamplingParams(temperature=0.0)),
            SampleRow(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=1))]
    res = sample(lg, rows)
    lsm = torch.log_softmax(lg, dim=-1)
    vals, idx = lsm.topk(3, dim=-1)
    assert [t for t, _ in res.top_logprobs[0]] == idx[0].tolist()
    assert [v for _, v in res.top_logprobs[0]] == vals[0].tolist()
    assert res.top_logprobs[1] == []
    assert res.top_logprobs[2] == [(int(idx[2, 0]), float(vals[2, 0]))]
    assert res.top_logprobs[0][0][0] == res.token_ids[0]           # greedy: the best one
    assert sample(lg, [SampleRow(SamplingParams(logprobs=True))] * 3).top_logprobs is None
