"""DeepSeek-V3's grouped, bias-corrected routing against a direct transcription of the formula.

The transcription is plain Python over lists (no torch ops shared with the implementation):
group score = sum of the group's two best biased scores; keep the topk_group best groups;
top-k experts by biased score among them; weights = unbiased scores, normalised, times the
scaling factor; ties to the lower index. The adversarial cases are the ones engines have
shipped wrong: a group with the single best expert but a lower top-2 sum (max instead of sum),
all biased scores negative (masking with 0 instead of -inf), ties across groups, and a bias that
must change the choice but not the weights.
"""
from __future__ import annotations

import pytest
import torch

from moed.model.archs.deepseek_v3 import grouped_topk


def transcription(scores, bias, n_group, topk_group, top_k, normalise, scale):
    out_w, out_i = [], []
    for s in scores:
        e = len(s)
        per = e // n_group
        choice = [s[j] + bias[j] for j in range(e)]
        if n_group > 1:
            gs = []
            for g in range(n_group):
                best = sorted(choice[g * per:(g + 1) * per], reverse=True)
                gs.append((-(best[0] + best[1]), g))
            kept = {g for _, g in sorted(gs)[:topk_group]}
        else:
            kept = {0}
            per = e
        cand = sorted((-choice[j], j) for j in range(e) if j // per in kept)
        idx = [j for _, j in cand[:top_k]]
        w = [s[j] for j in idx]
        if normalise:
            tot = sum(w) + 1e-20
            w = [x / tot for x in w]
        out_w.append([x * scale for x in w])
        out_i.append(idx)
    return out_w, out_i


def _run(scores, bias, n_group, topk_group, top_k, normalise=True, scale=2.5):
    s, b = torch.tensor(scores, dtype=torch.float32), torch.tensor(bias, dtype=torch.float32)
    w, i = grouped_topk(s, b, n_group, topk_group, top_k, normalise, scale)
    ew, ei = transcription(s.tolist(), b.tolist(), n_group, topk_group, top_k, normalise, scale)
    assert i.tolist() == ei
    assert torch.allclose(w, torch.tensor(ew), atol=1e-6, rtol=0)
    return w, i


def test_top2_sum_not_max():
    # group 0 holds the single best expert (0.99) but its top-2 sum is 1.0 < group 1's 1.75
    scores = [[0.99, 0.01, 0.0, 0.9, 0.85, 0.0]]
    _, i = _run(scores, [0.0] * 6, n_group=2, topk_group=1, top_k=2)
    assert sorted(i[0].tolist()) == [3, 4]          # a max-per-group router would pick 0 and 1


def test_negative_biased_scores_are_masked_with_minus_inf():
    # every biased score < 0: a router that masks dropped groups with 0 picks a dropped expert
    scores = [[0.2, 0.1, 0.05, 0.3, 0.25, 0.2]]
    bias = [-1.0] * 6
    _, i = _run(scores, bias, n_group=2, topk_group=1, top_k=3)
    assert sorted(i[0].tolist()) == [3, 4, 5]


def test_ties_across_groups_go_to_the_lower_group():
    scores = [[0.5, 0.4, 0.1, 0.5, 0.4, 0.1, 0.5, 0.4, 0.1]]       # three equal groups of 3 (odd)
    _, i = _run(scores, [0.0] * 9, n_group=3, topk_group=2, top_k=3)
    assert set(i[0].tolist()) <= {0, 1, 2, 3, 4, 5}


def test_bias_chooses_but_does_not_weigh():
    scores = [[0.9, 0.1, 0.2, 0.8]]
    bias = [0.0, 1.0, 0.0, 0.0]                 # expert 1 is chosen for its bias ...
    w, i = _run(scores, bias, n_group=1, topk_group=1, top_k=2, scale=1.0)
    assert i[0].tolist() == [1, 0]
    assert torch.allclose(w[0], torch.tensor([0.1, 0.9]))    # ... weighed by its own 0.1


def test_unnormalised_and_scaled():
    scores = [[0.3, 0.6, 0.2, 0.8]]
    w, _ = _run(scores, [0.0] * 4, n_group=2, topk_group=1, top_k=2, normalise=False, scale=2.0)
    assert torch.allclose(w[0], torch.tensor([1.6, 0.4]))


@pytest.mark.parametrize("e,g,kg,k", [(12, 4, 2, 3), (15, 5, 2, 4), (8, 1, 1, 2), (10, 2, 1, 2)])
def test_random_and_quantised_scores(e, g, kg, k):
    gen = torch.Generator().manual_seed(e * 100 + g)
    scores = torch.rand((64, e), generator=gen)
    scores[32:] = (scores[32:] * 4).round() / 4          # coarse values: many ties
    bias = (torch.rand(e, generator=gen) - 0.5) * 0.5
    _run(scores.tolist(), bias.tolist(), g, kg, k)


def test_matches_transformers_router():
    transformers = pytest.importorskip("transformers")   # the init extra; parity tests need it too
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=12, n_group=4, topk_group=2,
                                        num_experts_per_tok=3, routed_scaling_factor=2.5)
    ref = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(ref.weight.shape, generator=gen))
        ref.e_score_correction_bias.copy_(torch.randn(12, generator=gen) * 0.1)
    x = torch.randn((40, 32), generator=gen)
    _, rw, ri = ref(x)
    scores = (x @ ref.weight.detach().T).sigmoid()
    w, i = grouped_topk(scores, ref.e_score_correction_bias, 4, 2, 3, True, 2.5)
    for t in range(40):     # transformers' order within the top-k is unspecified: compare as maps
        ours = dict(zip(i[t].tolist(), w[t].tolist()))
        theirs = dict(zip(ri[t].tolist(), rw[t].detach().tolist()))
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[j] - theirs[j]) < 1e-6 for j in ours)
