"""The attention cost model: features, the RLS fit, inversion, predictions from advertised state."""
import math
import random

import pytest

from moed.balance.cost import (AdvertisedCost, Coefficients, CostModel, ExpertShape, StepShape,
                               add_chunk, chunk_pairs, huber_weight, max_chunk, predict_ttft, queued_seconds,
                               shape_of)

TRUE = Coefficients(overhead_s=0.004, per_token_s=4.5e-4, per_pair_s=2.9e-7,
                    per_decode_s=1.5e-3, per_expert_s=0.003, per_context_s=4e-5,
                    per_verified_s=2e-4)
EXPERTS = ExpertShape(16, 2)


def _random_step(rng: random.Random) -> StepShape:
    chunks = [(rng.randrange(0, 2000), 1 + rng.choice((0, 0, rng.randrange(1, 5))), True)
              for _ in range(rng.randrange(0, 24))]        # some decodes verify drafts
    for _ in range(rng.randrange(0, 3)):
        chunks.append((rng.randrange(0, 4000), rng.randrange(2, 2048), False))
    if not chunks:
        chunks = [(0, 16, False)]
    return shape_of(chunks, EXPERTS)


def test_chunk_pairs_are_causal_attention_pairs():
    assert chunk_pairs(0, 1) == 1
    assert chunk_pairs(0, 4) == 1 + 2 + 3 + 4
    assert chunk_pairs(10, 2) == 11 + 12
    # chunking does not change the pairs of a whole prompt
    assert chunk_pairs(0, 300) == chunk_pairs(0, 100) + chunk_pairs(100, 100) + chunk_pairs(200, 100)


def test_a_decode_with_drafts_is_a_decode_plus_verified_positions():
    s = shape_of([(100, 4, True), (50, 1, True), (0, 8, False)], EXPERTS)
    assert (s.decode_seqs, s.verified_positions, s.prefill_tokens, s.prefill_context) == (2, 3, 8, 0)
    assert s.attention_pairs == chunk_pairs(100, 4) + chunk_pairs(50, 1) + chunk_pairs(0, 8)
    assert s.experts_touched == EXPERTS.touched(2 + 3 + 8)


def test_experts_touched_saturates():
    assert EXPERTS.touched(0) == 0
    assert 0.1 < EXPERTS.touched(1) < 0.2            # 2 of 16
    assert EXPERTS.touched(200) == pytest.approx(1.0, abs=1e-6)
    assert ExpertShape().touched(100) == 0           # dense


def test_fit_recovers_known_coefficients_with_noise():
    rng = random.Random(1)
    model = CostModel(forgetting=1.0)
    for _ in range(600):
        shape = _random_step(rng)
        model.observe(shape, TRUE.predict(shape) * (1 + rng.gauss(0, 0.03)))
    got = model.coefficients
    for name in ("overhead_s", "per_token_s", "per_pair_s", "per_decode_s", "per_context_s",
                 "per_verified_s"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=0.15), name
    med, p90 = model.error_quantiles()
    assert med < 0.05 and p90 < 0.1                  # about the noise


def test_forgetting_follows_a_change():
    rng = random.Random(2)
    model = CostModel(forgetting=0.98)
    slower = Coefficients(*(2 * c for c in TRUE.as_tuple()))
    for truth in (TRUE, slower):
        for _ in range(400):
            shape = _random_step(rng)
            model.observe(shape, truth.predict(shape))
    probe = shape_of([(1000, 512, False)], EXPERTS)
    assert model.predict(probe) == pytest.approx(slower.predict(probe), rel=0.05)


def test_unexcited_features_do_not_wind_up():
    rng = random.Random(3)
    model = CostModel(forgetting=0.95)
    for _ in range(300):
        shape = _random_step(rng)
        model.observe(shape, TRUE.predict(shape))
    decode = shape_of([(100, 1, True)] * 8, EXPERTS)
    for _ in range(5000):                            # decodes only: no prefill for a long time
        model.observe(decode, TRUE.predict(decode) * (1 + rng.gauss(0, 0.02)))
    assert all(math.isfinite(c) for c in model.coefficients.as_tuple())
    assert model.predict(decode) == pytest.approx(TRUE.predict(decode), rel=0.05)
    prefill = shape_of([(0, 1024, False)], EXPERTS)     # not forgotten into nonsense either
    assert model.predict(prefill) == pytest.approx(TRUE.predict(prefill), rel=0.5)
    for _ in range(30):                                  # and relearnt within a few steps
        shape = _random_step(rng)
        model.observe(shape, TRUE.predict(shape))
    assert model.predict(prefill) == pytest.approx(TRUE.predict(prefill), rel=0.1)


def test_not_ready_before_min_samples_and_bad_times_ignored():
    model = CostModel(min_samples=3)
    for t in (0.0, -1.0, float("nan"), float("inf")):
        model.observe(StepShape(10, 55.0), t)
    assert model.samples == 0 and not model.ready
    for _ in range(3):
        model.observe(StepShape(10, 55.0), 0.01)
    assert model.ready


def test_negative_terms_never_predict_less_for_more_work():
    coef = Coefficients(0.01, -1e-4, 1e-7, 0.0, 0.0)
    a, b = StepShape(100, 5050.0), StepShape(200, 20100.0)
    assert coef.predict(b) >= coef.predict(a) >= 0.01


def test_max_chunk_is_the_largest_that_fits():
    base = shape_of([(500, 1, True)] * 8, EXPERTS)
    for start, budget in ((0, 0.1), (3000, 0.25), (0, 1.0), (50_000, 3.0)):
        n = max_chunk(TRUE, base, start, 100_000, budget, EXPERTS)
        assert n > 0
        assert TRUE.predict(add_chunk(base, start, n, EXPERTS)) <= budget
        assert TRUE.predict(add_chunk(base, start, n + 1, EXPERTS)) > budget
    # a longer context leaves room for fewer tokens
    assert max_chunk(TRUE, base, 3000, 10**5, 0.25, EXPERTS) < max_chunk(TRUE, base, 0, 10**5,
                                                                          0.25, EXPERTS)
    # the cached context a chunk reads alone can outgrow the budget: nothing fits
    assert max_chunk(TRUE, base, 50_000, 10**5, 0.5, EXPERTS) == 0
    assert max_chunk(TRUE, base, 0, 7, 10.0, EXPERTS) == 7            # capped by what is left
    assert max_chunk(TRUE, base, 0, 100, TRUE.predict(base) / 2, EXPERTS) == 0


def test_prefill_seconds_matches_summed_steps():
    chunk, total = 256, 1000
    steps = [(s, min(chunk, total - s)) for s in range(0, total, chunk)]
    summed = sum(TRUE.predict(shape_of([(s, n, False)], EXPERTS)) for s, n in steps)
    # (a chunk of hundreds of tokens touches every expert: prefill_seconds assumes so)
    assert TRUE.prefill_seconds(total, 0, chunk) == pytest.approx(summed, rel=1e-6)


def test_predicted_ttft_counts_shorter_buckets_only():
    edges = (512, 4096, 32768)
    idle = AdvertisedCost(TRUE, edges, (0, 0, 0, 0), (0, 0, 0, 0))
    flood = AdvertisedCost(TRUE, edges, (0, 0, 0, 100_000), (0, 0, 0, 1))
    shorts = AdvertisedCost(TRUE, edges, (2000, 0, 0, 0), (10, 0, 0, 0))
    assert predict_ttft(flood, 200) == pytest.approx(predict_ttft(idle, 200))
    assert predict_ttft(flood, 50_000) > predict_ttft(idle, 50_000) + 10
    assert predict_ttft(shorts, 200) > predict_ttft(idle, 200)
    assert queued_seconds(shorts, 0) == pytest.approx(10 * TRUE.prefill_seconds(200))
    half = AdvertisedCost(TRUE, edges, (2000, 0, 0, 0), (10, 0, 0, 0), prefill_share=0.5)
    assert predict_ttft(half, 200) == pytest.approx(2 * predict_ttft(shorts, 200))


def test_a_few_contended_steps_barely_move_the_fit():
    """Steps slowed 4x by another process on the cores get a Huber weight (k / error): the
    fit stays near the truth, and a lasting change is still followed (test above)."""
    rng = random.Random(3)
    model = CostModel(forgetting=0.98)
    for _ in range(300):
        shape = _random_step(rng)
        model.observe(shape, TRUE.predict(shape))
    probe = shape_of([(1000, 512, False)], EXPERTS)
    for _ in range(5):
        shape = _random_step(rng)
        model.observe(shape, 4 * TRUE.predict(shape))
    assert model.predict(probe) == pytest.approx(TRUE.predict(probe), rel=0.15)
    assert huber_weight(0.2) == 1.0 and huber_weight(2.0) == pytest.approx(0.25)


def test_the_fit_read_includes_every_step_however_rarely_solved():
    """observe refits every SOLVE_EVERY steps; a read in between solves first, so a scheduler
    that reads the fit each step sees the last step in it, and one that never reads it gets the
    same fit (up to the ridge's pull toward the previous solve) at any read."""
    from moed.balance.cost import SOLVE_EVERY

    rng = random.Random(4)
    steps = [_random_step(rng) for _ in range(SOLVE_EVERY * 25)]
    every, rare = CostModel(forgetting=0.99), CostModel(forgetting=0.99)
    for i, shape in enumerate(steps):
        t = TRUE.predict(shape) * (1 + rng.gauss(0, 0.03))
        every.observe(shape, t)
        rare.observe(shape, t)
        every.coefficients                                  # a reader each step
        if i > 50 and rare._unsolved == SOLVE_EVERY - 1:    # stop with steps not solved yet
            break
    for a, b in zip(every.coefficients.as_tuple(), rare.coefficients.as_tuple()):
        assert b == pytest.approx(a, rel=1e-2, abs=1e-12)
    assert rare._unsolved == 0 and i > 50
    changed = CostModel(forgetting=0.99)                    # a read sees the step just observed
    for shape in steps[:40]:
        changed.observe(shape, TRUE.predict(shape))
    before = changed.coefficients
    changed.observe(steps[40], 10 * TRUE.predict(steps[40]))
    assert changed.coefficients != before
