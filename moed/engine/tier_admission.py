"""Tier admission: a waiting prompt whose next blocks sit below L1 (host memory or disk,
moed.kvcache.tiers) either loads them or recomputes, whichever is predicted faster.

A load allocates fresh blocks and parks the request in WAITING_TIER_KV; the engine collects
finished loads at a step boundary (`target`, `complete`) and the request resumes RUNNING as a
prefix hit. The decision and both predictions are counted and logged once per wait.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import structlog

from moed.engine.request import Request
from moed.engine.seating import take_blocks
from moed.kvcache.manager import KVCacheManager, PrefixHit
from moed.kvcache.tiers import TieredCache, admission
from moed.types import RequestState

log = structlog.get_logger(__name__)


class TierAdmission:
    def __init__(self, kv: KVCacheManager) -> None:
        self._kv = kv
        self.tiers: TieredCache | None = None       # the engine's (attach)
        self._loading: dict[str, Request] = {}
        self.loading: Mapping[str, Request] = MappingProxyType(self._loading)
        self._noted: set[str] = set()               # decision counted and logged (once per wait)

    def attach(self, tiers: TieredCache) -> None:
        self.tiers = tiers

    def try_load(self, view: admission.AdmissionView, req: Request, hit: PrefixHit,
                 busy: bool) -> bool:
        """If loading (some of) the prompt's next blocks is predicted faster than recomputing
        them: allocate, start the load, park (True; the caller takes `req` off WAITING).
        busy: a step runs before the load can be collected (others run, or wait behind)."""
        t, kv = self.tiers, self._kv
        if t is None or req.remote_kv or req.prompt_logprobs_pending \
                or not kv.enable_prefix_caching:
            return False
        got = admission.plan_for(view, req, hit, busy)
        if got is None:
            return False
        m, plan = got
        bs, start = kv.block_size, hit.num_tokens
        rest = req.num_tokens - start
        n_tok = start + plan.num_load * bs
        if plan.num_load and not kv.can_allocate_prompt(hit, n_tok):
            return False            # no room now: admission tries again next step
        if req.request_id in self._noted and not plan.num_load:
            return False            # a recompute already counted; the request waits for room
        self._noted.add(req.request_id)
        t.record_lookup(m, plan)
        log.info("kv_tier_decision", request_id=req.request_id, decision=plan.decision,
                 predicted_load_s=round(plan.load_s, 6),
                 predicted_recompute_s=round(plan.recompute_s, 6),
                 blocks_below_l1=len(m.keys), blocks_loaded=plan.num_load,
                 from_host=m.tiers[:plan.num_load].count("host"),
                 from_disk=m.tiers[:plan.num_load].count("disk"))
        if not plan.num_load:
            return False
        self._noted.discard(req.request_id)
        t.pin(m.keys[:plan.num_load])     # the allocation below may evict into the tiers
        alloc = take_blocks(kv, req, hit, n_tok, RequestState.WAITING_TIER_KV,
                            count_cached=req.num_preemptions == 0)
        self._loading[req.request_id] = req
        first = alloc.num_cached_blocks
        t.start_load(req.request_id, m.keys[:plan.num_load],
                     alloc.block_ids[first:first + plan.num_load],
                     plan.recompute_s - view.predict_prefill_s(rest - plan.num_load * bs, n_tok),
                     plan.load_s)
        return True

    def target(self, request_id: str, block_ids: Sequence[int]) -> bool:
        """A finished load may be copied into L1: its request still waits for exactly these
        blocks (it was not aborted, its blocks not handed to another request)."""
        req = self._loading.get(request_id)
        if req is None:
            return False
        first = req.num_computed_tokens // self._kv.block_size
        return list(self._kv.block_table(request_id)[first:first + len(block_ids)]) == \
            list(block_ids)

    def complete(self, request_id: str, num_blocks: int) -> Request | None:
        """The first `num_blocks` loaded blocks hold their K/V now: they count as computed
        (cached); -> the request, to run (computing the rest). None: it no longer waits."""
        req = self._loading.pop(request_id, None)
        if req is None:
            return None
        req.num_computed_tokens += num_blocks * self._kv.block_size
        self._kv.commit(request_id, req.token_ids, req.num_computed_tokens)
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens
        return req

    def forget(self, req: Request) -> None:
        """It ended or was preempted: a load's late result is dropped, and re-admission
        decides (and logs) afresh."""
        self._loading.pop(req.request_id, None)
        self._noted.discard(req.request_id)
