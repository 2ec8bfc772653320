"""The scheduler's side of the KV tiers (no model: a dict stands in for the KV tensor): a
prompt whose next blocks sit below L1 parks in WAITING_TIER_KV when loading is predicted
faster, resumes as a prefix hit when the load is collected, is counted and logged once while it
waits for room, and an abort during its load frees its blocks and drops the late result."""
from __future__ import annotations

from structlog.testing import capture_logs

from moed.engine.request import Request
from moed.engine.scheduler import Scheduler
from moed.kvcache.manager import KVCacheManager
from moed.kvcache.tiers import TieredCache, TierSettings
from moed.types import RequestState, SamplingParams

BS = 2
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


class DictIO:
    block_bytes = 8

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}

    def read(self, block_id: int) -> bytes:
        return self.blocks.get(block_id, bytes(8))

    def write(self, block_id: int, data: bytes) -> None:
        self.blocks[block_id] = data


def setup(num_blocks: int, per_token_s: float) -> tuple[Scheduler, TieredCache]:
    kv = KVCacheManager(num_blocks, BS)
    t = TieredCache(TierSettings(host_bytes=1 << 16), DictIO(), "gqa-t")
    kv.set_tier_hooks(t.offer, t.on_cached)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, tiers=t,
                  recompute_s_per_token=per_token_s)
    return s, t


def put_below(s: Scheduler, t: TieredCache, prompt: list[int]) -> None:
    """Cache the prompt's full blocks below L1 (as if L1 had evicted them)."""
    from moed.kvcache.manager import NO_HIT
    for i, h in enumerate(s.kv.hashes_after(prompt, NO_HIT)):
        t.io.blocks[1000 + i] = bytes([i]) * 8
        t.offer(1000 + i, h)


def req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, list(prompt), GREEDY, eos_token_ids=(63,))


def test_load_parks_then_resumes_as_a_prefix_hit() -> None:
    s, t = setup(16, per_token_s=1.0)       # recompute predicted slow: load
    prompt = list(range(10, 19))            # 4 full blocks below L1, 1 token to compute
    put_below(s, t, prompt)
    r = req("a", prompt)
    s.add(r)
    with capture_logs() as logs:
        plan, _ = s.schedule()
    assert plan.empty and r.state is RequestState.WAITING_TIER_KV and s.loading == {"a": r}
    (d,) = [e for e in logs if e["event"] == "kv_tier_decision"]
    assert d["decision"] == "load" and d["blocks_loaded"] == 4 and d["request_id"] == "a"
    assert d["predicted_recompute_s"] > d["predicted_load_s"] >= 0
    assert t.wait(5.0)
    (res,) = t.collect()
    assert s.tier_load_target("a", res.block_ids)
    for bid, data in zip(res.block_ids, res.payloads):
        t.io.write(bid, data)
    assert s.complete_tier_load("a", len(res.payloads))
    assert r.state is RequestState.RUNNING and r.num_computed_tokens == 8 == r.num_cached_tokens
    plan, _ = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in plan.chunks] == [("a", 1)]
    assert all(e.pins == 0 for e in t._index.values())


def test_abort_during_a_load_frees_blocks_and_drops_the_result() -> None:
    s, t = setup(16, per_token_s=1.0)
    prompt = list(range(20, 29))
    put_below(s, t, prompt)
    s.add(req("b", prompt))
    s.schedule()
    assert s.kv.num_used_blocks == 4       # the loaded blocks; the last token's comes later
    s.abort("b")
    assert s.kv.num_used_blocks == 0 and not s.loading
    assert t.wait(5.0)
    (res,) = t.collect()
    assert not s.tier_load_target("b", res.block_ids) and not s.complete_tier_load("b", 4)
    assert all(e.pins == 0 for e in t._index.values())


def test_recompute_is_counted_once_while_the_request_waits_for_room() -> None:
    s, t = setup(6, per_token_s=1e-15)      # recompute predicted ~free: no load
    s.add(req("big", list(range(1, 11))))   # 5 blocks of the 6
    s.schedule()
    prompt = list(range(30, 35))
    put_below(s, t, prompt)
    s.add(req("c", prompt))
    with capture_logs() as logs:
        for _ in range(3):
            s.schedule()
    assert s.requests["c"].state is RequestState.WAITING
    assert [e["decision"] for e in logs if e["event"] == "kv_tier_decision"] == ["recompute"]
    assert t.decisions == {"load": 0, "recompute": 1}


def test_a_request_still_to_be_admitted_makes_the_step_busy() -> None:
    """A load is collected only after the step in flight: a waiting request behind this one
    will run in that step, so the load pays it (recompute here), as when one already runs."""
    prompt = list(range(10, 19))            # 4 full blocks below L1
    for behind, want in ((False, "load"), (True, "recompute")):
        s, t = setup(32, per_token_s=0.01)  # the 4 blocks: 80 ms to recompute
        t.observe_step(1.0)                 # a step of others: 1 s
        put_below(s, t, prompt)
        s.add(req("a", prompt))
        if behind:
            s.add(req("b", list(range(40, 45))))
        with capture_logs() as logs:
            s.schedule()
        (d,) = [e for e in logs if e["event"] == "kv_tier_decision"]
        assert d["decision"] == want and d["request_id"] == "a"
