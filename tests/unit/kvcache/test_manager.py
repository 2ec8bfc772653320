"""KVCacheManager: block tables, prefix hits that leave the last token, commit, free."""
from __future__ import annotations

import pytest

from moed.kvcache.manager import KVCacheManager


def _alloc(m: KVCacheManager, rid: str, toks: list[int], n: int | None = None):
    hit = m.prefix_hit(toks)
    n = len(toks) if n is None else n
    assert m.can_allocate_prompt(hit, n)
    return m.allocate_prompt(rid, toks, hit, n)


def test_table_grows_with_tokens():
    m = KVCacheManager(8, 4)
    a = _alloc(m, "r", list(range(6)), 5)
    assert len(a.block_ids) == 2 and a.num_cached_tokens == 0
    assert m.can_append("r", 8) and m.append_slots("r", 8) == []
    new = m.append_slots("r", 9)
    assert len(new) == 1 and m.block_table("r")[-1] == new[0]
    assert not m.can_append("r", 33) and m.num_used_blocks == 3
    m.free("r")
    assert m.num_used_blocks == 0 and not m.has("r")


def test_prefix_hit_after_commit_and_free():
    m = KVCacheManager(8, 4)
    toks = list(range(10))                     # 2 full blocks + 2 tokens
    _alloc(m, "a", toks)
    assert m.prefix_hit(toks).num_tokens == 0  # nothing committed yet
    m.commit("a", toks, 10)
    assert m.stats().cached == 2
    m.free("a")
    assert m.num_used_blocks == 0
    a2 = _alloc(m, "b", toks + [99])
    assert a2.num_cached_tokens == 8 and a2.num_cached_blocks == 2
    assert m.stats().prefix_hit_tokens == 8 and m.stats().prefix_query_tokens == 10 + 11


def test_hit_always_leaves_last_token():
    m = KVCacheManager(8, 4)
    toks = list(range(8))                      # exactly 2 full blocks
    _alloc(m, "a", toks)
    m.commit("a", toks, 8)
    assert m.prefix_hit(toks).num_tokens == 4  # the second block must be recomputed
    assert m.prefix_hit(toks + [1]).num_tokens == 8


def test_shared_prefix_ref_counts():
    m = KVCacheManager(8, 4)
    p = [5, 6, 7, 8]
    _alloc(m, "a", p + [1, 2])
    m.commit("a", p + [1, 2], 6)
    b = _alloc(m, "b", p + [3])
    assert b.block_ids[0] == m.block_table("a")[0]
    assert m.num_used_blocks == 3
    m.free("a")
    assert m.num_used_blocks == 2              # shared block still held by b
    m.free("b")
    assert m.num_used_blocks == 0


def test_can_allocate_counts_revived_hit_blocks():
    m = KVCacheManager(3, 2)
    t = [1, 2, 3, 4, 5]
    _alloc(m, "a", t)
    m.commit("a", t, 5)
    m.free("a")                                 # 3 free, 2 of them cached
    hit = m.prefix_hit(t + [6])
    assert hit.num_tokens == 4
    assert m.can_allocate_prompt(hit, 6)        # 2 revived + 1 fresh = 3
    assert not m.can_allocate_prompt(hit, 7)    # would need a 4th
    with pytest.raises(RuntimeError):
        m.allocate_prompt("x", t + [6], hit, 7)
    assert m.num_used_blocks == 0


def test_remote_write_allocation_exposes_blocks():
    """Decode role: the whole prompt is allocated; only the non-cached tail is to be written."""
    m = KVCacheManager(16, 4)
    prefix = list(range(8))
    _alloc(m, "warm", prefix + [0])
    m.commit("warm", prefix + [0], 9)
    prompt = prefix + list(range(100, 106))
    a = _alloc(m, "remote", prompt)
    assert len(a.block_ids) == 4 and a.num_cached_blocks == 2
    to_write = a.block_ids[a.num_cached_blocks:]
    assert not set(to_write) & set(m.block_table("warm"))
    m.commit("remote", prompt, len(prompt))    # data landed
    assert m.prefix_hit(prompt + [1]).num_tokens == 12


def test_prefix_caching_disabled():
    m = KVCacheManager(8, 4, enable_prefix_caching=False)
    t = list(range(9))
    _alloc(m, "a", t)
    m.commit("a", t, 9)
    assert m.prefix_hit(t).num_tokens == 0 and m.stats().cached == 0


def test_a_salted_prompt_hits_only_blocks_cached_with_its_salt():
    from moed.kvcache.pool import salt_root
    from moed.kvcache.tiers.peer import prompt_hashes

    m = KVCacheManager(32, 4)
    toks = list(range(17))
    one, two = salt_root("tenant-one"), salt_root("tenant-two")
    assert salt_root("") is None and one != two
    hit = m.prefix_hit(toks, one)
    m.allocate_prompt("a", toks, hit, len(toks), one)
    m.commit("a", toks, len(toks))
    m.free("a")
    assert m.prefix_hit(toks, one).num_tokens == 16        # its own salt: the 4 full blocks
    assert m.prefix_hit(toks, two).num_tokens == 0         # another salt: nothing
    assert m.prefix_hit(toks).num_tokens == 0              # unsalted: nothing
    # what the tiers and peers are asked for is chained from the same root
    assert list(m.prefix_hit(toks, one).hashes) == prompt_hashes(toks, 4, one)
    assert m.hashes_after(toks, m.prefix_hit(toks, two), two) == prompt_hashes(toks, 4, two)
