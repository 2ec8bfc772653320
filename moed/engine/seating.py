"""A waiting request takes its KV blocks: the one step that seating, remote-KV parking and
tier loads share (moed.engine.scheduler, parking, tier_admission); and the priority order the
scheduler keeps its queues in."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from moed.engine.request import Request
from moed.kvcache.manager import Allocation, KVCacheManager, PrefixHit
from moed.types import RequestState


def take_blocks(kv: KVCacheManager, req: Request, hit: PrefixHit, num_tokens: int,
                state: RequestState, *, count_cached: bool) -> Allocation:
    """Allocate blocks for the prefix `hit` plus up to `num_tokens` and move `req` to `state`
    (the caller checked can_allocate_prompt, takes it off WAITING and ends its queue time).
    Cached tokens count as computed and, with `count_cached` (before any preemption), as the
    request's cached tokens."""
    alloc = kv.allocate_prompt(req.request_id, req.token_ids, hit, num_tokens, req.cache_root)
    if count_cached:
        req.num_cached_tokens = alloc.num_cached_tokens
    req.num_computed_tokens = alloc.num_cached_tokens
    req.set_state(state)
    return alloc


def insert_by_priority(queue: deque[Request] | list[Request], req: Request, *,
                       front: bool) -> None:
    """Put `req` into WAITING or RUNNING in priority order (lower first): after every request
    of its priority, or with `front` (a preempted request) before them. O(queue); the common
    case, one priority, appends in O(1)."""
    p = req.params.priority
    if not front and (not queue or queue[-1].params.priority <= p):
        queue.append(req)
        return
    for i, other in enumerate(queue):
        if other.params.priority > p or (front and other.params.priority == p):
            queue.insert(i, req)
            return
    queue.append(req)


def seat_victim(waiting: Sequence[Request], running: Sequence[Request], seated: int,
                max_num_seqs: int) -> Request | None:
    """The running request to preempt so the most urgent waiting one gets a seat: RUNNING's
    last (the least urgent, most recently seated) when every seat is taken and the head of
    WAITING is strictly more urgent; else None. One a step: the freed seat is taken the next
    step (the policies admit nothing in a step that preempted), so a burst of urgent requests
    takes two steps each, and an equal priority never preempts (no churn). Never the last
    running request: the step would be empty and the loop would idle with work waiting (with
    one seat, `max_num_seqs` 1, an urgent request waits for the seat to free)."""
    if seated < max_num_seqs or not waiting or len(running) < 2:
        return None
    victim = running[-1]
    return victim if waiting[0].params.priority < victim.params.priority else None
