"""The scheduler's cost policy (balance.policy = "cost") with a fixed cost model and the fake
runner: the model's tokens, steps in budget, short prompts first, remote-KV parking, errors,
preemption when KV runs out, seats, the advertised queue."""
from __future__ import annotations

from moed.balance.step_time import Buckets, whole_budget
from moed.balance.cost import Coefficients, CostModel
from moed.engine.request import Request
from moed.engine.policies import CostPolicy, StepTimeBudget, TokenPolicy
from moed.engine.scheduler import Scheduler
from moed.kvcache.manager import KVCacheManager
from moed.types import FinishReason, RequestState, SamplingParams

from engine_fakes import FakeRunner, next_token

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# 1 ms per step + 1 ms per prompt token: a 10 ms budget holds ~9 prompt tokens
COEF = Coefficients(overhead_s=0.001, per_token_s=0.001, per_decode_s=0.0001)
TB = StepTimeBudget(Buckets((8, 64), (0.05, 1.0, 10.0)), itl_target_s=0.01, prefill_step_s=0.01,
                    max_partial=2)


def _sched(num_blocks=64, bs=4, seqs=8, cap=4096, tb=TB):
    kv = KVCacheManager(num_blocks, bs, False)
    s = Scheduler(kv, max_num_seqs=seqs, max_num_batched_tokens=cap, policy=CostPolicy(tb),
                  cost=CostModel(min_samples=0, prior=COEF))
    return s, FakeRunner(num_blocks, bs)


def _step(s: Scheduler, runner: FakeRunner):
    plan, events = s.schedule()
    if not plan.empty:
        nxt = runner.greedy(plan.batch)
        s.update(plan, [nxt[i] for i, c in enumerate(plan.chunks) if c.sample])
    return plan, events


def _expected(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def _req(rid, prompt, params=GREEDY, **kw):
    return Request(rid, list(prompt), params, eos_token_ids=(63,), **kw)


def test_same_tokens_as_the_model_and_every_step_in_budget():
    s, r = _sched()
    reqs = [_req("long", range(1, 41)), _req("a", [5, 6, 7]), _req("b", [9, 8])]
    for q in reqs:
        s.add(q)
    for _ in range(200):
        if not s.has_unfinished():
            break
        plan, _ = _step(s, r)
        prefill = sum(c.num_new_tokens for c in plan.chunks if c.num_new_tokens > 1)
        decodes = any(c.num_new_tokens == 1 for c in plan.chunks)
        # a step without decodes may grow to half the smallest TTFT target for whole prompts
        limit = whole_budget(decodes, TB.itl_target_s, min(TB.buckets.ttft_targets_s))
        assert COEF.overhead_s + COEF.per_token_s * prefill <= limit + 1e-12 \
            or prefill <= s.kv.block_size           # the min_tokens progress rule
    assert not s.has_unfinished()
    for q in reqs:
        assert q.output_token_ids == _expected(q.prompt_token_ids, 4)
    assert s.kv.stats().used == 0


def test_a_short_prompt_goes_before_a_long_one_under_way():
    s, r = _sched()
    s.add(_req("long", range(1, 41)))
    _step(s, r)                                  # the long prompt's first chunk
    assert s.requests["long"].num_computed_tokens > 0
    s.add(_req("short", [3, 4, 5]))
    plan, _ = _step(s, r)
    assert plan.chunks[0].request.request_id == "short" and plan.chunks[0].sample
    # the step that gives the short its first token takes no chunk of the long one (which
    # has slack to spare); the long one progresses in the next
    assert all(c.request.request_id != "long" for c in plan.chunks)
    plan, _ = _step(s, r)
    assert any(c.request.request_id == "long" for c in plan.chunks)


def test_remote_kv_requests_park_without_budget_and_too_long_prompts_fail():
    s, r = _sched(num_blocks=16)
    remote = _req("remote", range(1, 30), remote_kv=True)
    huge = _req("huge", range(1, 100))
    s.add(remote)
    s.add(huge)
    plan, events = _step(s, r)
    assert remote.state is RequestState.WAITING_REMOTE_KV
    assert [e.request_id for e in events] == ["huge"]
    assert events[0].finish_reason is FinishReason.ERROR and "KV blocks" in events[0].error


def test_kv_running_out_preempts_and_everything_finishes():
    # 10 blocks of 4: "a" (24 tokens) and the start of "b" fill the pool; a's first decode
    # needs a block: b is preempted (recompute) and both still finish with the right tokens
    big = StepTimeBudget(TB.buckets, itl_target_s=10.0, prefill_step_s=10.0, max_partial=4)
    s, r = _sched(num_blocks=10, cap=40, tb=big)
    a, b = _req("a", range(1, 25)), _req("b", range(30, 54))
    s.add(a)
    s.add(b)
    plan, _ = _step(s, r)
    assert [c.num_new_tokens for c in plan.chunks] == [24, 16] and s.kv.stats().free == 0
    for _ in range(300):
        if not s.has_unfinished():
            break
        plan, _ = _step(s, r)
        assert not plan.empty
    assert a.output_token_ids == _expected(a.prompt_token_ids, 4)
    assert b.output_token_ids == _expected(b.prompt_token_ids, 4)
    assert s.num_preemptions >= 1 and s.kv.stats().used == 0


def test_seats_bound_new_prompts():
    s, r = _sched(seqs=2)
    for i in range(4):
        s.add(_req(f"r{i}", [i + 1, i + 2]))
    plan, _ = _step(s, r)
    assert len(plan.chunks) == 2 and len(s.running) == 2


def test_advertised_queue_per_bucket():
    s, r = _sched()
    s.add(_req("short", [1, 2, 3]))
    s.add(_req("mid", range(1, 30)))
    adv = s.advertised()
    assert adv is not None
    assert adv.queued_tokens == (3, 29, 0) and adv.queued_requests == (1, 1, 0)
    s.set_policy(TokenPolicy())
    assert s.advertised() is None                # the token policy predicts nothing


def test_a_late_short_prompt_finishes_whole_beside_decodes_that_fill_the_itl_target():
    """Decodes take most of the ITL target: an on-time short prompt gets a chunk of what they
    leave; one already past its TTFT target finishes whole in one step (step_time.late_budget),
    with the model's tokens either way."""
    coef = Coefficients(overhead_s=0.001, per_token_s=0.001, per_decode_s=0.001)
    tb = StepTimeBudget(Buckets((64,), (0.05, 1.0)), itl_target_s=0.03, prefill_step_s=0.03,
                        max_partial=2)

    def first_chunk(age_s: float) -> tuple[int, Request, Scheduler, FakeRunner]:
        s = Scheduler(KVCacheManager(64, 4, False), max_num_seqs=16, max_num_batched_tokens=4096,
                      policy=CostPolicy(tb), cost=CostModel(min_samples=0, prior=coef))
        r = FakeRunner(64, 4)
        for i in range(7):
            s.add(_req(f"d{i}", [i + 1], SamplingParams(max_tokens=20, temperature=0.0,
                                                        ignore_eos=True)))
        _step(s, r)                                 # their one-token prompts: 7 decoding now
        q = _req("short", range(1, 41))             # 40 tokens: 41 ms beside 8 ms of decodes
        q.arrival_time -= age_s
        s.add(q)
        plan, _ = _step(s, r)
        assert sum(c.num_new_tokens == 1 for c in plan.chunks) == 7
        return next(c.num_new_tokens for c in plan.chunks if c.request is q), q, s, r

    on_time, _, _, _ = first_chunk(0.0)
    assert on_time < 40
    late, q, s, r = first_chunk(0.2)
    assert late == 40 and q.num_output_tokens == 1
    while s.has_unfinished():
        _step(s, r)
    assert q.output_token_ids == _expected(q.prompt_token_ids, 4)
