"""Random workloads against the fake runner: whatever the pool size, budget, prompt lengths,
prefix sharing and aborts, every request finishes with the reference tokens (or is aborted),
no step is empty while work is pending, and every block returns to the pool."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_fakes import FakeRunner, next_token
from moed.engine.request import Request
from moed.engine.scheduler import Scheduler
from moed.kvcache.manager import KVCacheManager
from moed.types import FinishReason, SamplingParams

workload = st.fixed_dictionaries({
    "num_blocks": st.integers(4, 24),
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "budget": st.integers(1, 40),
    "seqs": st.integers(1, 6),
    "prefix": st.booleans(),
    "reqs": st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10), st.integers(0, 3),
                               st.booleans()), min_size=1, max_size=8),
    "abort_at": st.lists(st.integers(0, 40), max_size=3),
})


@settings(max_examples=60, deadline=None)
@given(workload)
def test_random_workloads(w):
    kv = KVCacheManager(w["num_blocks"], w["block_size"], w["prefix"])
    s = Scheduler(kv, max_num_seqs=w["seqs"], max_num_batched_tokens=w["budget"])
    runner = FakeRunner(w["num_blocks"], w["block_size"])
    shared = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7]
    reqs = []
    for i, (plen, max_tokens, shared_len, late) in enumerate(w["reqs"]):
        prompt = shared[:shared_len * 4] + [(i * 7 + j) % 60 + 1 for j in range(plen)]
        reqs.append((Request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)), late))
    for r, late in reqs:
        if not late:
            s.add(r)
    aborted = set()
    for step in range(2000):
        if step == 3:
            for r, late in reqs:
                if late:
                    s.add(r)
        if step in w["abort_at"] and s.running:
            victim = s.running[0]
            s.abort(victim.request_id)
            aborted.add(victim.request_id)
        if not s.has_unfinished() and step > 3:
            break
        plan, _ = s.schedule()
        if plan.empty:
            assert not s.has_work(), "no progress with requests pending"
            continue
        assert plan.batch.num_tokens <= w["budget"] and plan.batch.num_seqs <= w["seqs"]
        nxt = runner.greedy(plan.batch)
        s.update(plan, [nxt[i] for i, c in enumerate(plan.chunks) if c.sample])
    else:
        raise AssertionError("did not finish")
    cap = w["num_blocks"] * w["block_size"]
    for r, _ in reqs:
        assert r.finished
        if r.request_id in aborted:
            continue
        if r.num_prompt_tokens > cap:
            assert r.finish_reason is FinishReason.ERROR
            continue
        seq = list(r.prompt_token_ids)
        for _ in range(r.num_output_tokens):
            seq.append(next_token(seq))
        assert r.token_ids == seq
        assert r.finish_reason is FinishReason.LENGTH
        assert r.num_output_tokens == r.params.max_tokens or r.num_tokens == max(cap, r.num_prompt_tokens + 1)
    assert kv.num_used_blocks == 0
