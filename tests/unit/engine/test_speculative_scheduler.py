"""The scheduler's half of speculative decoding, without torch (moed.engine.drafts.propose,
Scheduler._Draft.speculate, Scheduler._apply_verified): on random workloads under the token
and cost policies, with drafts from an oracle that is right for a while then wrong, every
request's tokens equal the fake model's greedy ones (read back through the block tables, so a
wrong rollback shows), the step's tokens (drafts included) stay within the budget, drafts
never exceed k nor make a request outgrow max_tokens, and every block returns."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moed.engine.scheduler as scheduler_mod
from engine_fakes import FakeRunner, assert_followed_the_model, next_token
from moed.balance.cost import Coefficients, CostModel
from moed.balance.step_time import Buckets
from moed.engine.drafts.propose import SpecSettings, draft_room, propose
from moed.engine.policies import CostPolicy, StepTimeBudget, TokenPolicy
from moed.engine.request import Request
from moed.engine.scheduler import Scheduler
from moed.kvcache.manager import KVCacheManager
from moed.types import RequestState, SamplingParams


@dataclass(frozen=True)
class Verified:             # moed.model.spec_verify.Verified's fields (no torch here)
    accepted: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: None = None


COEF = Coefficients(overhead_s=0.001, per_token_s=0.001, per_decode_s=0.0001)
TB = StepTimeBudget(Buckets((8, 64), (0.05, 1.0, 10.0)), itl_target_s=0.02,
                    prefill_step_s=0.01, max_partial=2)
POLICIES = {"tokens": TokenPolicy(), "cost": CostPolicy(TB)}
K = 3


def _oracle(rng: random.Random):
    """A drafter that proposes the fake model's own continuation, wrong from a random point."""
    def propose(s: SpecSettings, req: Request, room: int) -> tuple[int, ...]:
        seq, out = list(req.token_ids), []
        wrong_at = rng.randrange(0, room + 2)
        for i in range(room):
            t = next_token(seq) if i < wrong_at else (next_token(seq) + 1) % 50
            out.append(t)
            seq.append(t)
        return tuple(out)
    return propose


def _verify(runner: FakeRunner, batch, i: int, draft: tuple[int, ...]) -> Verified:
    """Greedy verification of sequence i from what its block table holds now."""
    bs, table, start = runner.block_size, batch.block_tables[i], batch.start_pos[i]
    seq = [runner.slots.get((table[p // bs], p % bs), -1) for p in range(start + 1 + len(draft))]
    a = 0
    while a < len(draft) and draft[a] == next_token(seq[:start + 1 + a]):
        a += 1
    return Verified(a, tuple(draft[:a]) + (next_token(seq[:start + 1 + a]),))


workload = st.fixed_dictionaries({
    "num_blocks": st.integers(6, 24), "block_size": st.sampled_from([1, 2, 4]),
    "budget": st.integers(2, 24), "seqs": st.integers(1, 5), "prefix": st.booleans(),
    "seed": st.integers(0, 1000),
    "reqs": st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=5),
})


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=40, deadline=None)
@given(w=workload)
def test_drafts_keep_the_invariants(name: str, w: dict) -> None:
    _run(name, w)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_drafts_are_taken_accepted_and_rejected(name: str) -> None:
    w = {"num_blocks": 64, "block_size": 4, "budget": 24, "seqs": 4, "prefix": True,
         "seed": 1, "reqs": [(5, 12), (9, 12), (3, 12), (12, 12)]}
    drafted, accepted, rejected = _run(name, w)
    assert drafted > 0 and accepted > 0 and rejected > 0


def _run(name: str, w: dict) -> tuple[int, int, int]:
    """The workload to its end, checking every step; -> (drafts, accepted, rejected)."""
    kv = KVCacheManager(w["num_blocks"], w["block_size"], w["prefix"])
    s = Scheduler(kv, max_num_seqs=w["seqs"], max_num_batched_tokens=w["budget"],
                  policy=POLICIES[name], cost=CostModel(min_samples=0, prior=COEF))
    s.set_speculation(SpecSettings("ngram", K, 1, 3))
    runner = FakeRunner(w["num_blocks"], w["block_size"])
    reqs = [Request(str(i), [(i * 7 + j) % 40 + 1 for j in range(n)],
                    SamplingParams(max_tokens=m, temperature=0.0))
            for i, (n, m) in enumerate(w["reqs"])]
    for r in reqs:
        s.add(r)
    drafted = accepted = rejected = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler_mod, "propose", _oracle(random.Random(w["seed"])))
        for _ in range(3000):
            if not s.has_unfinished():
                break
            plan, _ = s.schedule()
            if plan.empty:
                assert not s.has_work(), "no progress with requests pending"
                continue
            assert plan.batch.num_tokens <= w["budget"] and plan.batch.num_seqs <= w["seqs"]
            nxt = runner.greedy(plan.batch)
            ver = {}
            for i, c in enumerate(plan.chunks):
                if c.draft:
                    r = c.request
                    assert len(c.draft) <= K and c.num_new_tokens == 1
                    assert r.num_output_tokens + len(c.draft) < r.params.max_tokens
                    v = ver[r.request_id] = _verify(runner, plan.batch, i, c.draft)
                    drafted += 1
                    accepted += v.accepted
                    rejected += len(c.draft) - v.accepted
            s.update(plan, [nxt[i] for i, c in enumerate(plan.chunks)
                            if c.sample and not c.draft], verified=ver)
        else:
            raise AssertionError("did not finish")
    cap = w["num_blocks"] * w["block_size"]
    assert_followed_the_model(reqs, cap)
    for r in reqs:
        if r.num_prompt_tokens <= cap:
            assert r.num_output_tokens == r.params.max_tokens or r.num_tokens >= r.max_model_len
    assert kv.num_used_blocks == 0
    return drafted, accepted, rejected


def test_draft_room_follows_the_request_and_its_limits() -> None:
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0))
    assert draft_room(r, 4) == 0                    # waiting
    r.set_state(RequestState.RUNNING)
    assert draft_room(r, 4) == 0                    # the prompt is not computed
    r.num_computed_tokens = 3
    r.append_token(7)
    assert draft_room(r, 4) == 3                    # 1 + 3 tokens fill max_tokens 5
    assert draft_room(r, 2) == 2
    r.max_model_len = 6
    assert draft_room(r, 4) == 1                    # the context ends at 6
    r.max_model_len = 100

    class Grammar:      # accepts 2 tokens in a row from here, whatever they are
        def valid_prefix(self, tokens) -> int:
            return min(2, len(tokens))
    r.grammar = Grammar()
    assert draft_room(r, 4) == 3                    # grammar rows speculate too
    r.drafter = (r.num_tokens, 9)                   # an MTP draft: one token, valid
    assert propose(SpecSettings("mtp", 1, 1, 1), r, 1) == (9,)
    r.drafter = None
    r.token_ids[:] = [1, 2, 3, 1, 2, 3, 1]          # prompt lookup would draft 2, 3, 1
    assert propose(SpecSettings("ngram", 3, 1, 3), r, 3) == (2, 3)     # cut by the grammar


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_drafts_never_push_a_decode_out_of_the_step(name: str) -> None:
    """Budget 6, four decoding requests, k = 3: every request decodes each step, the drafts
    take only the 2 tokens left over."""
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=6, policy=POLICIES[name],
                  cost=CostModel(min_samples=0, prior=COEF))
    s.set_speculation(SpecSettings("ngram", K, 1, 3))
    runner = FakeRunner(64, 4)
    for i in range(4):
        s.add(Request(str(i), [i + 1, 2, 3], SamplingParams(max_tokens=12, temperature=0.0)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler_mod, "propose", _oracle(random.Random(0)))
        seen = 0
        for _ in range(40):
            plan, _ = s.schedule()
            if plan.empty:
                break
            if all(r.num_output_tokens > 0 for r in s.running) and len(s.running) == 4:
                assert len(plan.chunks) == 4
                assert sum(len(c.draft) for c in plan.chunks) <= 2
                seen += any(c.draft for c in plan.chunks)
            nxt = runner.greedy(plan.batch)
            ver = {c.request.request_id: _verify(runner, plan.batch, i, c.draft)
                   for i, c in enumerate(plan.chunks) if c.draft}
            s.update(plan, [nxt[i] for i, c in enumerate(plan.chunks)
                            if c.sample and not c.draft], verified=ver)
    assert seen > 0 and kv.num_used_blocks == 0


def test_acceptance_pauses_a_losing_drafter_and_retries_rarely() -> None:
    from moed.engine.drafts.propose import (BACKOFF_MAX, BACKOFF_MIN, MIN_ACCEPTANCE,
                                            Acceptance, observe)
    a = observe(None, 3, 3)
    assert a.ema == 1.0 and a.skip == 0
    n = 0
    while a.skip == 0:                      # always rejected: pauses after a few drafts
        a = observe(a, 3, 0)
        n += 1
    assert 3 <= n <= 8 and a.skip == BACKOFF_MIN and a.ema == MIN_ACCEPTANCE
    b = observe(Acceptance(a.ema, 0, a.backoff), 3, 0)     # the retry fails: twice as long
    assert b.skip == 2 * BACKOFF_MIN
    for _ in range(10):
        b = observe(Acceptance(b.ema, 0, b.backoff), 3, 0)
    assert b.skip == BACKOFF_MAX
    c = observe(Acceptance(b.ema, 0, b.backoff), 3, 1)     # a retry accepted: back to normal
    assert c.skip == 0 and c.backoff == BACKOFF_MIN and c.ema > MIN_ACCEPTANCE


def test_a_request_whose_drafts_are_rejected_stops_drafting() -> None:
    """Real prompt lookup against the fake model, which never repeats its context: drafts are
    rejected, so after the first few the request drafts only on its rare retries."""
    kv = KVCacheManager(256, 4)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64)
    s.set_speculation(SpecSettings("ngram", K, 1, 1))
    runner = FakeRunner(256, 4)
    req = Request("a", [3, 4, 3, 4, 3, 4], SamplingParams(max_tokens=200, temperature=0.0))
    s.add(req)
    drafts = steps = 0
    while not req.finished:
        plan, _ = s.schedule()
        nxt = runner.greedy(plan.batch)
        ver = {c.request.request_id: _verify(runner, plan.batch, i, c.draft)
               for i, c in enumerate(plan.chunks) if c.draft}
        drafts += bool(ver)
        steps += 1
        s.update(plan, [nxt[i] for i, c in enumerate(plan.chunks)
                        if c.sample and not c.draft], verified=ver)
    seq = list(req.prompt_token_ids)
    for _ in range(req.num_output_tokens):
        seq.append(next_token(seq))
    assert req.token_ids == seq
    assert 0 < drafts <= 16, (drafts, steps)     # ~200 chances without the pause


def test_the_cost_policy_gives_drafts_what_the_itl_target_leaves() -> None:
    """Verified positions are their own cost term: 2 decodes at 1 ms each + 1 ms overhead
    leave 17 ms of the 20 ms ITL target; at 4 ms a verified position, 4 drafts fit (the
    first request takes k = 3, the second 1), at 20 ms none. Priced as prompt tokens of the
    old model they would cost nothing here (per_token_s 0)."""
    for per_verified, want in ((0.004, 4), (0.02, 0)):
        coef = Coefficients(overhead_s=0.001, per_decode_s=0.001, per_verified_s=per_verified)
        kv = KVCacheManager(64, 4)
        s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64, policy=CostPolicy(TB),
                      cost=CostModel(min_samples=0, prior=coef))
        s.set_speculation(SpecSettings("ngram", K, 1, 3))
        runner = FakeRunner(64, 4)
        for i in range(2):
            s.add(Request(str(i), [i + 1, 2, 3], SamplingParams(max_tokens=12, temperature=0.0)))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(scheduler_mod, "propose", lambda sp, req, room: (5,) * room)
            for _ in range(3):          # the prompts, then both decoding
                plan, _ = s.schedule()
                nxt = runner.greedy(plan.batch)
                if any(c.draft for c in plan.chunks) or want == 0 and plan.num_prefill_tokens == 0:
                    break
                s.update(plan, [nxt[i] for i, c in enumerate(plan.chunks) if c.sample])
        assert plan.num_prefill_tokens == 0 and len(plan.chunks) == 2
        assert [len(c.draft) for c in plan.chunks] == ([3, 1] if want else [0, 0])
