"""Scheduler policy with the fake runner: budget, chunking, prefix hits, preemption, errors."""
from __future__ import annotations

from moed.engine.request import Request
from moed.engine.scheduler import Scheduler
from moed.kvcache.manager import KVCacheManager
from moed.types import FinishReason, RequestState, SamplingParams

from engine_fakes import FakeRunner, next_token

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _sched(num_blocks=32, bs=4, seqs=8, budget=16, prefix=True):
    kv = KVCacheManager(num_blocks, bs, prefix)
    return Scheduler(kv, max_num_seqs=seqs, max_num_batched_tokens=budget), FakeRunner(num_blocks, bs)


def _run(s: Scheduler, runner: FakeRunner, max_steps=500):
    """Drive schedule/forward/update greedily (FakeRunner.greedy, no torch); return the plans."""
    plans = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return plans
        plan, _ = s.schedule()
        assert not plan.empty, "no progress with requests pending"
        plans.append(plan)
        nxt = runner.greedy(plan.batch)
        s.update(plan, [nxt[i] for i, c in enumerate(plan.chunks) if c.sample])
    raise AssertionError("did not finish")


def _req(rid, prompt, params=GREEDY):
    return Request(rid, list(prompt), params, eos_token_ids=(63,))


def _expected(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def test_budget_and_chunked_prefill():
    s, r = _sched(budget=8)
    reqs = [_req("a", range(1, 21)), _req("b", range(30, 33))]
    for q in reqs:
        s.add(q)
    plans = _run(s, r)
    assert all(p.batch.num_tokens <= 8 for p in plans)
    first = plans[0]
    assert [len(t) for t in first.batch.token_ids] == [8]          # a gets the whole budget
    assert not first.chunks[0].sample                               # mid-prompt: no token
    for q in reqs:
        assert q.output_token_ids == _expected(q.prompt_token_ids, 8)
        assert q.finish_reason is FinishReason.LENGTH
    assert s.kv.num_used_blocks == 0


def test_running_decodes_first_then_waiting():
    s, r = _sched(budget=6)
    s.add(_req("a", [1, 2, 3]))
    plan, _ = s.schedule()
    s.update(plan, [5])
    s.add(_req("b", range(10, 20)))
    plan, _ = s.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["a", "b"]
    assert [c.num_new_tokens for c in plan.chunks] == [1, 5]
    assert plan.num_decode_tokens == 1 and plan.num_prefill_tokens == 5


def test_max_num_seqs():
    s, r = _sched(seqs=2, budget=64)
    for i in range(4):
        s.add(_req(str(i), [i + 1, 2, 3]))
    plan, _ = s.schedule()
    assert len(plan.chunks) == 2 and len(s.waiting) == 2
    _run(s, r)
    assert s.kv.num_used_blocks == 0


def test_prefix_cache_hit_skips_blocks_and_matches():
    s, r = _sched(budget=64)
    shared = list(range(1, 13))                                    # 3 full blocks
    a = _req("a", shared + [40, 41])
    s.add(a)
    _run(s, r)
    b = _req("b", shared + [50])
    s.add(b)
    plan, _ = s.schedule()
    assert b.num_cached_tokens == 12 and plan.batch.start_pos == [12]
    assert plan.batch.token_ids == [[50]]
    s.update(plan, [r.greedy(plan.batch)[0]])
    _run(s, r)
    assert b.output_token_ids == _expected(b.prompt_token_ids, 8)  # read back through cached blocks
    st = s.kv.stats()
    assert st.prefix_hit_tokens == 12 and st.used == 0


def test_preemption_recomputes_and_never_deadlocks():
    # 6 blocks of 4 = 24 tokens for 3 requests that each grow to 4 + 12 = 16 tokens.
    s, r = _sched(num_blocks=6, bs=4, budget=32)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    reqs = [_req(str(i), [i + 1, i + 2, i + 3, i + 4], params) for i in range(3)]
    for q in reqs:
        s.add(q)
    plans = _run(s, r)
    assert s.num_preemptions > 0 and any(p.preempted for p in plans)
    for q in reqs:
        assert q.output_token_ids == _expected(q.prompt_token_ids, 12)
        assert q.finish_reason is FinishReason.LENGTH
    assert s.kv.num_used_blocks == 0


def test_lifo_victim():
    s, r = _sched(num_blocks=4, bs=2, budget=32, prefix=False)
    a, b = _req("a", [1, 2, 3, 4]), _req("b", [4, 5, 6, 7])
    s.add(a)
    s.add(b)
    plan, _ = s.schedule()                                         # 2 blocks each: pool full
    s.update(plan, [7, 8])                                         # both now need a 3rd block
    plan, _ = s.schedule()
    assert plan.preempted == ("b",) and b.state is RequestState.WAITING
    assert b.num_computed_tokens == 0 and s.waiting[0] is b
    assert [c.request.request_id for c in plan.chunks] == ["a"]


def test_prompt_that_never_fits_is_an_error():
    s, r = _sched(num_blocks=4, bs=4)
    big, ok = _req("big", range(1, 18)), _req("ok", [1, 2])
    s.add(big)
    s.add(ok)
    plan, events = s.schedule()
    assert [e.request_id for e in events] == ["big"]
    assert events[0].finish_reason is FinishReason.ERROR and "16 tokens" in events[0].error
    assert [c.request.request_id for c in plan.chunks] == ["ok"]
    _run(s, r)


def test_lone_request_stops_at_pool_capacity():
    s, r = _sched(num_blocks=3, bs=4)
    q = _req("a", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0))
    s.add(q)
    _run(s, r)
    assert q.finish_reason is FinishReason.LENGTH and q.num_tokens == 12


def test_abort_frees_blocks():
    s, r = _sched()
    s.add(_req("a", range(1, 10)))
    plan, _ = s.schedule()
    assert s.kv.num_used_blocks > 0
    ev = s.abort("a")
    assert ev.finish_reason is FinishReason.ABORT and s.kv.num_used_blocks == 0
    assert s.abort("a") is None and not s.has_work()


def test_remote_kv_then_decode():
    got = {}
    kv = KVCacheManager(16, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16,
                  on_remote_allocated=lambda req, ids: got.setdefault(req.request_id, ids))
    r = FakeRunner(16, 4)
    q = Request("d", list(range(1, 11)), GREEDY, remote_kv=True)
    s.add(q)
    plan, _ = s.schedule()
    assert plan.empty and q.state is RequestState.WAITING_REMOTE_KV and len(got["d"]) == 3
    # The "prefill node" writes the prompt into the given blocks.
    for p, t in enumerate(q.prompt_token_ids):
        r.slots[(got["d"][p // 4], p % 4)] = t
    ev = s.complete_remote_prefill("d", next_token(q.prompt_token_ids))
    assert ev.token_ids == (next_token(q.prompt_token_ids),) and q.state is RequestState.RUNNING
    _run(s, r)
    assert q.output_token_ids == _expected(q.prompt_token_ids, 8)
    assert kv.num_used_blocks == 0


def test_prefill_only_holds_blocks_until_release():
    s, r = _sched()
    q = Request("p", list(range(1, 10)), GREEDY, prefill_only=True)
    s.add(q)
    _run(s, r)
    assert q.finish_reason is FinishReason.STOP and q.output_token_ids == _expected(range(1, 10), 1)
    assert s.kv.num_used_blocks == 3 and "p" in s.held
    assert s.release("p") and s.kv.num_used_blocks == 0


def test_prefill_only_at_context_limit_still_holds_blocks():
    """A prompt of max_model_len - 1 tokens finishes "length" with its first token; the KV must
    stay for the transfer (freed by release, or by abort)."""
    s, r = _sched()
    for rid in ("p", "q"):
        s.add(Request(rid, list(range(1, 12)), GREEDY, max_model_len=12, prefill_only=True))
    _run(s, r)
    assert s.held["p"].finish_reason is FinishReason.LENGTH and s.kv.num_used_blocks == 6
    assert s.release("p") and s.kv.num_used_blocks == 3
    assert s.abort("q") is None and s.kv.num_used_blocks == 0 and not s.held


def test_scheduler_and_kv_manager_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, moed.engine.scheduler, moed.kvcache.manager; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_batch_flags_prompt_chunks_so_a_one_token_one_is_not_decoded():
    """A prompt's one-token chunk (a budget cut, a prefix hit's remainder) takes the prefill
    attention path as the whole prompt does (moed.model.batch); decode steps are unflagged."""
    s, r = _sched(budget=4)
    a = _req("a", list(range(1, 10)))                  # 9 tokens: chunks 4, 4, then 1
    s.add(a)
    plans = _run(s, r)
    flags = [(len(p.batch.token_ids[0]), p.batch.prompt[0]) for p in plans]
    assert flags[:3] == [(4, True), (4, True), (1, True)]
    assert flags[3:] and all(f == (1, False) for f in flags[3:])
    assert plans[2].batch.decode_seqs == [] and plans[3].batch.is_decode_only
