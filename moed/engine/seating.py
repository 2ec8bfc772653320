"""A waiting request takes its KV blocks: the one step that seating, remote-KV parking and
tier loads share (moed.engine.scheduler, parking, tier_admission)."""
from __future__ import annotations

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
