"""The step-policy seam (moed.engine.policies): every policy listed in POLICIES keeps the
scheduler's invariants on random workloads (the reference tokens, no empty step while work is
pending, the token and seat limits, every block back in the pool). A policy written here, in
the test, plugs in with nothing but the read-only view and the step's draft; the scheduler's
state cannot be set from outside, and nothing in moed/ tries."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_fakes import FakeRunner, assert_followed_the_model
from moed.balance.step_time import Buckets
from moed.balance.cost import Coefficients, CostModel
from moed.config import BalanceConfig
from moed.engine.policies import (CostPolicy, SchedulerView, StepDraft, StepPolicy,
                                  StepTimeBudget, TokenPolicy, from_config)
from moed.engine.request import Request
from moed.engine.scheduler import Scheduler
from moed.kvcache.manager import KVCacheManager
from moed.types import SamplingParams

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class OnePromptAtATime:
    """Running requests catch up (as the token policy does); a waiting prompt is admitted only
    when no prompt is under way. Local prompts only (no remote KV, no tiers): a test policy."""

    def fill(self, view: SchedulerView, step: StepDraft) -> None:
        budget, prompting = view.max_num_batched_tokens, False
        running, i = view.running, 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            prompting |= n > 1
            if not step.extend(req, n, preempt=True):
                break
            budget -= n
            i += 1
        if step.preempted or prompting or budget <= 0 or view.seated >= view.max_num_seqs:
            return
        while view.waiting:
            req = view.waiting[0]
            if not step.refuse_too_long(req):
                hit = view.prefix_hit(req)
                step.admit(req, hit, min(req.num_tokens - hit.num_tokens, budget))
                return


# 1 ms per step + 1 ms per prompt token (the cost policy's tests' model)
COEF = Coefficients(overhead_s=0.001, per_token_s=0.001, per_decode_s=0.0001)
TB = StepTimeBudget(Buckets((8, 64), (0.05, 1.0, 10.0)), itl_target_s=0.01, prefill_step_s=0.01,
                    max_partial=2)
POLICIES: dict[str, StepPolicy] = {"tokens": TokenPolicy(), "cost": CostPolicy(TB),
                                   "one-prompt": OnePromptAtATime()}

workload = st.fixed_dictionaries({
    "num_blocks": st.integers(4, 24),
    "block_size": st.sampled_from([1, 2, 4]),
    "budget": st.integers(1, 40),
    "seqs": st.integers(1, 6),
    "prefix": st.booleans(),
    "reqs": st.lists(st.tuples(st.integers(1, 30), st.integers(1, 6), st.integers(0, 3)),
                     min_size=1, max_size=6),
})


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=25, deadline=None)
@given(w=workload)
def test_every_policy_keeps_the_invariants(name: str, w: dict) -> None:
    kv = KVCacheManager(w["num_blocks"], w["block_size"], w["prefix"])
    s = Scheduler(kv, max_num_seqs=w["seqs"], max_num_batched_tokens=w["budget"],
                  policy=POLICIES[name], cost=CostModel(min_samples=0, prior=COEF))
    runner = FakeRunner(w["num_blocks"], w["block_size"])
    shared = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7]
    reqs = [Request(str(i), shared[:k * 4] + [(i * 7 + j) % 60 + 1 for j in range(n)],
                    SamplingParams(max_tokens=m, temperature=0.0))
            for i, (n, m, k) in enumerate(w["reqs"])]
    for r in reqs:
        s.add(r)
    for _ in range(3000):
        if not s.has_unfinished():
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
    assert_followed_the_model(reqs, w["num_blocks"] * w["block_size"])
    assert kv.num_used_blocks == 0


def test_balance_policy_chooses_the_policy() -> None:
    assert from_config(None) == TokenPolicy()
    assert from_config(BalanceConfig(policy="tokens")) == TokenPolicy()
    cost = from_config(BalanceConfig(policy="cost", itl_target_ms=40.0))
    assert isinstance(cost, CostPolicy) and cost.budget.itl_target_s == pytest.approx(0.04)
    s = Scheduler(KVCacheManager(8, 4), max_num_seqs=2, max_num_batched_tokens=8, policy=cost)
    assert s.time_budget == cost.budget
    s.set_policy(TokenPolicy())
    assert s.time_budget is None and s.advertised() is None


def test_the_scheduler_state_is_read_only_from_outside() -> None:
    s = Scheduler(KVCacheManager(8, 4), max_num_seqs=2, max_num_batched_tokens=8)
    for name in ("kv", "waiting", "running", "requests", "held", "remote", "loading", "tiers",
                 "cost", "experts", "policy", "time_budget", "max_num_seqs",
                 "max_num_batched_tokens", "num_preemptions"):
        with pytest.raises(AttributeError):
            setattr(s, name, None)
    with pytest.raises(TypeError):
        s.requests["x"] = None      # type: ignore[index]   (a read-only mapping)


def _sets_scheduler_attribute(node: ast.AST) -> bool:
    """`<...>.scheduler.X = ...` / `scheduler.X = ...` / `sched.X = ...` (a target)."""
    if not isinstance(node, ast.Attribute):
        return False
    owner = node.value
    name = owner.attr if isinstance(owner, ast.Attribute) else \
        owner.id if isinstance(owner, ast.Name) else ""
    return name in ("scheduler", "sched")


def test_nothing_in_moed_sets_a_scheduler_attribute() -> None:
    found = []
    for path in (ROOT / "moed").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[ast.AST] = []
            if isinstance(node, ast.Assign):
                targets = [t for tgt in node.targets
                           for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            found += [f"{path.relative_to(ROOT)}:{t.lineno}" for t in targets
                      if _sets_scheduler_attribute(t)]
    assert not found, found
