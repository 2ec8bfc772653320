"""Step policies: what decides how many tokens of which requests a step holds.

`balance.policy` chooses one (`from_config`): "tokens" → TokenPolicy (tokens.py), "cost" →
CostPolicy under the config's StepTimeBudget (cost.py; the token policy while its model is
unfitted). The seam is moed.engine.policies.base: a policy reads a read-only SchedulerView
and takes tokens through a StepDraft; the scheduler makes every state change. A new policy is
one module here with a `fill(view, step)` plus its test (tests/unit/engine/
test_scheduler_policies.py runs every policy it lists through the scheduler's invariants).
"""
from __future__ import annotations

from moed.config import BalanceConfig
from moed.engine.policies.base import KVView, SchedulerView, StepDraft, StepPolicy
from moed.engine.policies.cost import CostPolicy, StepTimeBudget
from moed.engine.policies.tokens import TokenPolicy

__all__ = ["CostPolicy", "KVView", "SchedulerView", "StepDraft", "StepPolicy", "StepTimeBudget",
           "TokenPolicy", "from_config"]


def from_config(cfg: BalanceConfig | None) -> StepPolicy:
    """The policy `balance.policy` names (None, engines built by hand: the token policy)."""
    budget = StepTimeBudget.from_config(cfg) if cfg is not None else None
    return TokenPolicy() if budget is None else CostPolicy(budget)
