"""The peer tier's pure parts (moed/kvcache/tiers/peer.py): which peer a prompt's digest points
at, the lease messages (malformed ones refused), the lender's lease table (each lease unpinned
exactly once: released, expired or drained), the KV manager's pin/reserve/adopt pairs, and
`tiers.peer_reuse` refused where it cannot work."""
from __future__ import annotations

from pathlib import Path

import pytest

from moed import config
from moed.cluster.state import digest_key
from moed.config import ConfigError
from moed.kvcache.manager import KVCacheManager
from moed.kvcache.tiers.peer import (LeaseGrant, LeaseRequest, LeaseTable, best_peer,
                                     digest_depth, prompt_hashes)

BS = 4
PROMPT = list(range(100, 137))          # 37 tokens: 9 full blocks a prefix hit may cover


def test_prompt_hashes_match_the_kv_managers_chain() -> None:
    kv = KVCacheManager(32, BS)
    hs = prompt_hashes(PROMPT, BS)
    assert len(hs) == 9
    kv.allocate_prompt("r", PROMPT, kv.prefix_hit(PROMPT), len(PROMPT))
    kv.commit("r", PROMPT, len(PROMPT))
    assert kv.prefix_hit(PROMPT).hashes == tuple(hs)


def test_best_peer_is_the_deepest_digest_match() -> None:
    hs = prompt_hashes(PROMPT, BS)
    shallow = [digest_key(hs[0]), digest_key(hs[1])]           # depths 1, 2
    deep = [digest_key(hs[0]), digest_key(hs[1]), digest_key(hs[3]), digest_key(hs[7])]
    other = [digest_key(h) for h in prompt_hashes(list(range(37)), BS)]
    assert digest_depth(hs, shallow) == 2 and digest_depth(hs, deep) == 8
    assert digest_depth(hs, other) == 0
    got = best_peer(hs, [("a", "http://a", shallow), ("b", "http://b", deep),
                         ("c", "http://c", other)])
    assert got is not None and (got.name, got.url, got.depth) == ("b", "http://b", 8)
    assert best_peer(hs, [("c", "http://c", other)]) is None


def test_lease_messages_round_trip_and_refuse_bad_input() -> None:
    req = LeaseRequest((1, 2 ** 127 + 5), "lay", "mod")
    assert LeaseRequest.from_json(req.to_json(), 8) == req
    for bad in ({}, {"hashes": [], "layout_id": "", "model_id": ""},
                {"hashes": ["zz" * 16], "layout_id": "", "model_id": ""},
                {"hashes": ["00" * 16], "layout_id": 1, "model_id": ""},
                {**req.to_json(), "extra": 1}, [1, 2]):
        with pytest.raises(ValueError):
            LeaseRequest.from_json(bad, 8)
    with pytest.raises(ValueError, match="1 to 1"):
        LeaseRequest.from_json(req.to_json(), 1)
    g = LeaseGrant("L", (4, 9), "bWQ=", 7, 10.0)
    assert LeaseGrant.from_json(g.to_json(), 2) == g
    with pytest.raises(ValueError, match="do not match"):
        LeaseGrant.from_json(g.to_json(), 1)            # more blocks than hashes asked
    with pytest.raises(ValueError, match="do not match"):
        LeaseGrant.from_json({**g.to_json(), "block_ids": [3, 3]}, 2)
    with pytest.raises(ValueError, match="malformed"):
        LeaseGrant.from_json({"lease": "L"}, 2)


def test_lease_table_hands_each_lease_back_once() -> None:
    t = LeaseTable(max_leases=2)
    t.add("a", "B", [1, 2], expires=10.0)
    t.add("b", "C", [3], expires=20.0)
    assert not t.can_add() and t.pinned() == 3
    with pytest.raises(ValueError):
        t.add("c", "B", [4], expires=1.0)
    assert t.release("a", "C") is None                   # another reader's lease
    assert t.release("a", "B") == (1, 2)
    assert t.release("a", "B") is None                   # released once
    t.add("c", "B", [5], expires=5.0)
    assert t.expired(6.0) == [("c", (5,))]
    assert t.expired(6.0) == [] and t.release("c", "B") is None
    assert t.drain() == [(3,)] and len(t) == 0 and t.pinned() == 0


def test_manager_pins_reserves_and_adopts_without_leaking() -> None:
    kv = KVCacheManager(16, BS)
    hs = prompt_hashes(PROMPT, BS)
    kv.allocate_prompt("r", PROMPT, kv.prefix_hit(PROMPT), len(PROMPT))
    kv.commit("r", PROMPT, len(PROMPT))
    kv.free("r")
    assert kv.num_used_blocks == 0
    lent = kv.pin_cached(hs[:3] + [12345] + hs[3:])          # the leading run only
    assert len(lent) == 3 and kv.num_used_blocks == 3
    kv.unpin(lent)
    assert kv.num_used_blocks == 0

    reader = KVCacheManager(16, BS)
    assert reader.reserve(17) is None
    mine = reader.reserve(4)
    assert mine is not None and reader.num_used_blocks == 4
    assert reader.adopt(mine, hs[:4]) == 4
    assert reader.num_used_blocks == 0
    assert len(reader.prefix_hit(PROMPT).block_ids) == 4      # a prefix hit finds them now
    mine = reader.reserve(2)
    assert mine is not None
    reader.unpin(mine)                                      # a failed read: just released
    assert reader.num_used_blocks == 0


def _load(tmp_path: Path, text: str, role: str = "colocated") -> config.Config:
    p = tmp_path / "moed.toml"
    p.write_text(f'[server]\nrole = "{role}"\n' + text)
    return config.load(p, environ={}, overrides={"model": {"path": "m"}})


def test_peer_reuse_is_refused_where_it_cannot_work(tmp_path: Path) -> None:
    c = _load(tmp_path, "[cluster]\nenabled = true\n[tiers]\npeer_reuse = true\n")
    assert c.tiers.peer_reuse and not c.tiers.enabled
    with pytest.raises(ConfigError, match="needs cluster.enabled"):
        _load(tmp_path, "[tiers]\npeer_reuse = true\n")
    p = _load(tmp_path, "[cluster]\nenabled = true\n[tiers]\npeer_reuse = true\n", "prefill")
    assert p.tiers.peer_reuse and p.server.role == "prefill"
    # a decode node's prompt KV comes from prefill nodes (which reuse peers themselves)
    with pytest.raises(ConfigError, match="for colocated and prefill nodes.*from prefill nodes"):
        _load(tmp_path, "[cluster]\nenabled = true\n[tiers]\npeer_reuse = true\n", "decode")
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        _load(tmp_path, "[cluster]\nenabled = true\n[engine]\nenable_prefix_caching = false\n"
                        "[tiers]\npeer_reuse = true\n")
    with pytest.raises(ConfigError, match="peer_reus"):
        _load(tmp_path, "[cluster]\nenabled = true\n[tiers]\npeer_reus = true\n")
