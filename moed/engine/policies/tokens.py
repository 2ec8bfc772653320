"""balance.policy = "tokens": vLLM's shape under a token budget (also the cost policy's
fallback while its model is unfitted).

Running requests in (priority, admission) order get their catch-up (a decode's one token, a
prompt's next chunk), preempting the last of them (least urgent, most recently admitted) when
the KV pool runs out; then, if nothing was preempted, waiting requests in (priority, arrival)
order while `max_num_batched_tokens`, `max_num_seqs`
and the KV pool allow (cached prefix blocks count as computed). Last, speculative decoding's
drafts take what the budget has left, decoding requests in admission order, at most k each:
a guess never pushes a decode or a prompt chunk out of the step.
"""
from __future__ import annotations

from dataclasses import dataclass

from moed.engine.policies.base import SchedulerView, StepDraft


@dataclass(frozen=True)
class TokenPolicy:
    def fill(self, view: SchedulerView, step: StepDraft) -> None:
        budget = view.max_num_batched_tokens
        running = view.running
        i = 0       # by index: preemption removes requests from the end of `running`
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not step.extend(req, n, preempt=True):
                break
            budget -= n
            i += 1

        waiting = view.waiting
        while not step.preempted and waiting and budget > 0 and view.seated < view.max_num_seqs:
            req = waiting[0]
            if step.refuse_too_long(req):
                continue
            if req.remote_kv:
                if not step.park_remote(req):
                    break
                continue
            hit = view.prefix_hit(req)
            if step.load_from_tiers(req, hit):
                continue
            n = min(req.num_tokens - hit.num_tokens, budget)
            if not step.admit(req, hit, n):
                break
            budget -= n

        for req in running[:i] if view.num_speculative_tokens else ():
            if budget <= 0:
                break
            budget -= step.speculate(req, budget)
