"""Priority in the scheduler (vLLM's `priority`, lower first): waiting requests are seated most
urgent first (FCFS within a priority), the running order follows, and under KV pressure the
least urgent running request is preempted, whatever the seating order."""
from __future__ import annotations

import dataclasses

import pytest

from moed.engine.request import Request
from moed.engine.scheduler import Scheduler
from moed.engine.seating import insert_by_priority
from moed.kvcache.manager import KVCacheManager
from moed.types import FinishReason, RequestState, SamplingParams

from engine_fakes import FakeRunner, next_token

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _req(rid, prompt, priority=0, max_tokens=8):
    p = dataclasses.replace(GREEDY, priority=priority, max_tokens=max_tokens)
    return Request(rid, list(prompt), p, eos_token_ids=(63,))


def _sched(num_blocks=32, bs=4, seqs=8, budget=64, prefix=False):
    kv = KVCacheManager(num_blocks, bs, prefix)
    return Scheduler(kv, max_num_seqs=seqs, max_num_batched_tokens=budget), FakeRunner(num_blocks, bs)


def _ids(reqs):
    return [r.request_id for r in reqs]


def test_insert_keeps_priority_then_arrival_order_and_preempted_go_first_in_their_class():
    q: list[Request] = []
    for rid, p in [("a", 10), ("b", 0), ("c", 10), ("d", 5), ("e", 0)]:
        insert_by_priority(q, _req(rid, [1], p), front=False)
    assert _ids(q) == ["b", "e", "d", "a", "c"]
    insert_by_priority(q, _req("x", [1], 10), front=True)     # a preempted batch request
    insert_by_priority(q, _req("y", [1], 0), front=True)
    assert _ids(q) == ["y", "b", "e", "d", "x", "a", "c"]
    insert_by_priority(q, _req("z", [1], 99), front=True)      # a priority nobody else has
    assert _ids(q)[-1] == "z"


def test_urgent_arrival_is_seated_before_earlier_batch_requests():
    s, r = _sched(seqs=2)
    for i in range(3):
        s.add(_req(f"batch{i}", [i + 1, 2, 3], priority=10))
    s.add(_req("inter", [9, 9, 9], priority=0))
    assert _ids(s.waiting) == ["inter", "batch0", "batch1", "batch2"]
    plan, _ = s.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["inter", "batch0"]   # 2 seats
    assert _ids(s.running) == ["inter", "batch0"]


def test_running_order_follows_priority_so_the_urgent_request_catches_up_first():
    s, r = _sched(budget=64)
    s.add(_req("batch", range(1, 9), priority=10))
    plan, _ = s.schedule()                                    # batch seated and decoding
    s.update(plan, r.greedy(plan.batch))
    s.add(_req("inter", range(20, 24), priority=0))
    plan, _ = s.schedule()                                    # inter seated behind it this step
    s.update(plan, r.greedy(plan.batch))
    assert _ids(s.running) == ["inter", "batch"]              # ... and in front of it after
    plan, _ = s.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["inter", "batch"]


def test_kv_pressure_preempts_the_least_urgent_not_the_newest():
    # 4 blocks of 2: two 4-token prompts fill the pool; each then needs a third block.
    s, r = _sched(num_blocks=4, bs=2, budget=32)
    batch, inter = _req("batch", [1, 2, 3, 4], priority=10), _req("inter", [4, 5, 6, 7], priority=0)
    s.add(batch)                                              # batch arrived (and sits) first
    s.add(inter)
    plan, _ = s.schedule()
    assert _ids(s.running) == ["inter", "batch"]
    s.update(plan, [7, 8])
    plan, _ = s.schedule()
    # plain LIFO would preempt "inter" (seated last in arrival terms); priority picks batch
    assert plan.preempted == ("batch",) and batch.state is RequestState.WAITING
    assert [c.request.request_id for c in plan.chunks] == ["inter"]
    assert batch.num_computed_tokens == 0 and s.waiting[0] is batch


def test_a_more_urgent_arrival_takes_the_seat_of_the_least_urgent_running_request():
    s, r = _sched(seqs=2)
    b0, b1 = _req("b0", [1, 2, 3], priority=10), _req("b1", [4, 5, 6], priority=10)
    s.add(b0)
    s.add(b1)
    plan, _ = s.schedule()
    s.update(plan, r.greedy(plan.batch))                      # both batch requests decode
    s.add(_req("twin", [7, 8, 9], priority=10))               # same priority: waits its turn
    plan, _ = s.schedule()
    assert plan.preempted == () and _ids(s.waiting) == ["twin"]
    s.update(plan, r.greedy(plan.batch))
    s.add(_req("inter", [9, 9, 9], priority=0))
    plan, _ = s.schedule()                                    # b1: the last seated batch one
    assert plan.preempted == ("b1",) and b1.state is RequestState.WAITING
    assert [c.request.request_id for c in plan.chunks] == ["b0"]
    assert _ids(s.waiting) == ["inter", "b1", "twin"]         # b1 first in its priority
    s.update(plan, r.greedy(plan.batch))
    plan, _ = s.schedule()                                    # the freed seat: inter's
    assert plan.preempted == () and _ids(s.running) == ["inter", "b0"]
    for _ in range(200):
        if not s.has_unfinished():
            break
        s.update(plan, [t for c, t in zip(plan.chunks, r.greedy(plan.batch)) if c.sample])
        plan, _ = s.schedule()
    assert not s.has_unfinished() and s.kv.num_used_blocks == 0
    assert b1.output_token_ids == _expected_of(b1, 8) and b1.num_preemptions == 1


def _expected_of(req, n):
    seq = list(req.prompt_token_ids)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(req.prompt_token_ids):]


def test_same_priority_keeps_the_lifo_victim():
    s, r = _sched(num_blocks=4, bs=2, budget=32)
    a, b = _req("a", [1, 2, 3, 4], 3), _req("b", [4, 5, 6, 7], 3)
    s.add(a)
    s.add(b)
    plan, _ = s.schedule()
    s.update(plan, [7, 8])
    plan, _ = s.schedule()
    assert plan.preempted == ("b",)


@pytest.mark.parametrize("prefix", [False, True])
def test_mixed_priorities_all_finish_with_the_models_tokens_and_free_every_block(prefix):
    s, r = _sched(num_blocks=8, bs=2, seqs=4, budget=16, prefix=prefix)
    reqs = [_req(f"r{i}", [i + 1, i + 2, i + 3], priority=(i % 3) * 5, max_tokens=6)
            for i in range(9)]
    for q in reqs:
        s.add(q)
    order = []
    for _ in range(500):
        if not s.has_unfinished():
            break
        plan, _ = s.schedule()
        nxt = r.greedy(plan.batch)
        s.update(plan, [nxt[i] for i, c in enumerate(plan.chunks) if c.sample])
        order += [q.request_id for q in reqs if q.finished and q.request_id not in order]
    assert not s.has_unfinished() and s.kv.num_used_blocks == 0
    for q in reqs:
        seq = list(q.prompt_token_ids)
        for _ in range(6):
            seq.append(next_token(seq))
        assert q.output_token_ids == seq[3:] and q.finish_reason is FinishReason.LENGTH
    # urgent ones finish no later than less urgent ones that arrived with them
    rank = {rid: i for i, rid in enumerate(order)}
    assert max(rank[f"r{i}"] for i in (0, 3, 6)) < min(rank[f"r{i}"] for i in (2, 5, 8))


# ---- the cost policy (balance.policy = "cost", the default): prompts by priority level -------

def _cost_sched():
    from moed.balance.cost import Coefficients, CostModel
    from moed.balance.step_time import Buckets
    from moed.engine.policies import CostPolicy, StepTimeBudget

    # 1 ms a step + 1 ms a prompt token: the 10 ms budget holds ~9 prompt tokens
    coef = Coefficients(overhead_s=0.001, per_token_s=0.001, per_decode_s=0.0001)
    tb = StepTimeBudget(Buckets((8, 64), (0.05, 1.0, 10.0)), itl_target_s=0.01,
                        prefill_step_s=0.01, max_partial=2)
    kv = KVCacheManager(64, 4, False)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=4096, policy=CostPolicy(tb),
                     cost=CostModel(min_samples=0, prior=coef)), FakeRunner(64, 4)


def test_cost_policy_gives_the_urgent_prompt_the_step_before_shorter_batch_prompts():
    s, r = _cost_sched()
    batch = [_req(f"b{i}", [i + 1, 2, 3], priority=10) for i in range(3)]   # short: 3 tokens
    for q in batch:
        s.add(q)
    inter = _req("inter", range(10, 30), priority=0)       # 20 tokens: a longer bucket
    s.add(inter)
    plan, _ = s.schedule()
    # by slack alone the short batch prompts (the shortest bucket, 50 ms target) go first;
    # by priority the interactive prompt takes the step's ~9 tokens and nothing is left
    assert [c.request.request_id for c in plan.chunks] == ["inter"]
    assert 4 <= plan.chunks[0].num_new_tokens < 20
    s.update(plan, [t for c, t in zip(plan.chunks, r.greedy(plan.batch)) if c.sample])
    for _ in range(200):
        if not s.has_unfinished():
            break
        plan, _ = s.schedule()
        s.update(plan, [t for c, t in zip(plan.chunks, r.greedy(plan.batch)) if c.sample])
    assert not s.has_unfinished() and s.kv.num_used_blocks == 0
    assert all(q.finish_reason is FinishReason.LENGTH for q in [*batch, inter])


# ---- what the engine reports (the gossiped load's per-priority queue) -----------------------

def test_engine_stats_count_waiting_requests_by_priority():
    import dataclasses as dc

    from moed.config import EngineConfig
    from moed.engine.engine import Engine

    eng = Engine(FakeRunner(64, 4), None, EngineConfig(max_num_batched_tokens=16, max_num_seqs=1,
                                                       block_size=4), max_model_len=256)
    params = [dc.replace(GREEDY, priority=p) for p in (10, 10, 0, 10)]
    for i, p in enumerate(params):     # not started: the adds wait in the inbox
        eng.add_request(f"r{i}", [1, 2, 3], p)
    assert eng.stats().waiting_by_priority == ((0, 1), (10, 3))


def test_the_last_running_request_keeps_its_seat_so_no_step_is_empty():
    s, r = _sched(seqs=1)
    s.add(_req("batch", [1, 2, 3], priority=10))
    plan, _ = s.schedule()
    s.update(plan, r.greedy(plan.batch))
    s.add(_req("inter", [9, 9, 9], priority=0))
    plan, _ = s.schedule()
    assert plan.preempted == () and [c.request.request_id for c in plan.chunks] == ["batch"]
