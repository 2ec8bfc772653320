"""Remote-KV parking (moed.engine.parking), the one module both step policies park through:
the whole prompt's blocks after its prefix hit, the engine told the block ids, no room leaves
the request waiting, and unpark / drop end the wait."""
from __future__ import annotations

import pytest

from moed.engine.parking import RemoteKVParking
from moed.engine.request import Request
from moed.kvcache.manager import NO_HIT, KVCacheManager
from moed.types import RequestState, SamplingParams

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


def _remote(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, GREEDY, remote_kv=True)


def test_park_takes_the_whole_prompt_after_its_prefix_hit_and_tells_the_engine() -> None:
    kv = KVCacheManager(8, 4)
    prompt = list(range(1, 11))                  # 10 tokens: 3 blocks
    kv.allocate_prompt("old", prompt, NO_HIT, len(prompt))
    kv.commit("old", prompt, len(prompt))        # its 2 full blocks cached
    told: dict[str, list[int]] = {}
    p = RemoteKVParking(kv, lambda r, ids: told.setdefault(r.request_id, ids))
    r = _remote("d", prompt)
    assert p.park(r, kv.prefix_hit(prompt))
    assert r.state is RequestState.WAITING_REMOTE_KV and p.view == {"d": r} and len(p) == 1
    assert r.num_cached_tokens == r.num_computed_tokens == 8
    assert told["d"] == kv.block_table("d") and len(told["d"]) == 3
    back = p.unpark("d")
    assert back is r and r.num_computed_tokens == 10 and not p.view
    with pytest.raises(KeyError, match="waiting for remote KV"):
        p.unpark("d")


def test_no_room_leaves_it_waiting_and_drop_ends_the_wait() -> None:
    kv = KVCacheManager(2, 4)
    p = RemoteKVParking(kv)
    big = _remote("big", list(range(1, 12)))     # 3 blocks of a 2-block pool
    assert not p.park(big, NO_HIT)
    assert big.state is RequestState.WAITING and not kv.has("big") and not p.view
    small = _remote("s", [1, 2, 3])
    assert p.park(small, NO_HIT)
    p.drop("s")                                  # the scheduler frees its blocks
    assert not p.view and len(p) == 0
