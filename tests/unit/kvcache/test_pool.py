"""BlockPool: integers only — allocation pairs, ref counts, prefix index, LRU eviction."""
from __future__ import annotations

import pytest

from moed.kvcache.pool import BlockPool, hash_block


def test_allocate_free_counts():
    p = BlockPool(4)
    assert p.can_allocate(4) and not p.can_allocate(5)
    a = p.allocate(3)
    assert len(set(a)) == 3 and p.num_used == 3 and p.num_free == 1
    with pytest.raises(RuntimeError):
        p.allocate(2)
    assert p.num_used == 3                     # a refused allocate changes nothing
    p.free(a)
    assert p.num_used == 0 and p.num_free == 4
    with pytest.raises(RuntimeError, match="double free"):
        p.free([a[0]])


def test_ref_counts_shared_block():
    p = BlockPool(2)
    (b,) = p.allocate(1)
    p.cache(b, 111)
    p.touch([b])
    assert p.ref_count(b) == 2
    p.free([b])
    assert p.num_used == 1 and p.lookup(111) == b
    p.free([b])
    assert p.num_used == 0
    assert p.lookup(111) == b                  # freed but still findable
    p.touch([b])                               # revived from the free queue
    assert p.num_free == 1 and p.ref_count(b) == 1


def test_lru_eviction_of_cached_blocks():
    p = BlockPool(3)
    a, b, c = p.allocate(3)
    for blk, h in ((a, 1), (b, 2), (c, 3)):
        p.cache(blk, h)
    p.free([b, a, c])                          # free order = eviction order
    assert p.stats().cached == 3
    (x,) = p.allocate(1)
    assert x == b and p.lookup(2) is None and p.lookup(1) == a and p.lookup(3) == c
    p.touch([a])                               # a prefix hit protects a from eviction
    (y,) = p.allocate(1)
    assert y == c and p.lookup(3) is None and p.lookup(1) == a
    assert p.stats().cached == 1


def test_fresh_blocks_used_before_cached_ones():
    p = BlockPool(3)
    (a,) = p.allocate(1)
    p.cache(a, 9)
    p.free([a])
    got = p.allocate(2)
    assert a not in got and p.lookup(9) == a


def test_a_truncated_tail_is_reused_before_a_cached_prefix_is_evicted():
    """free(first=True) (KVCacheManager.truncate: a rejected draft's blocks): those without a
    cached prefix go to the head of the free queue, the last given first; cached ones still
    join the tail."""
    p = BlockPool(4)
    a = p.allocate(4)
    p.cache(a[0], 7)
    p.free([a[0]])                          # cached, free: evicted only when nothing else is
    p.free([a[3], a[2]], first=True)       # a table's tail, reversed
    assert p.allocate(2) == [a[2], a[3]] and p.lookup(7) == a[0]
    p.free([a[1]], first=True)
    assert p.allocate(1) == [a[1]] and p.lookup(7) == a[0]
    assert p.allocate(1) == [a[0]] and p.lookup(7) is None


def test_duplicate_prefix_keeps_first_block():
    p = BlockPool(2)
    a, b = p.allocate(2)
    assert p.cache(a, 5) is True
    assert p.cache(b, 5) is False
    assert p.lookup(5) == a and p.block_hash(b) is None
    with pytest.raises(RuntimeError):
        p.cache(a, 6)


def test_hash_chain_depends_on_parent_and_tokens():
    h1 = hash_block(None, [1, 2])
    assert h1 == hash_block(None, [1, 2])
    assert h1 != hash_block(None, [2, 1])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])


def test_prefix_counters_and_reset():
    p = BlockPool(2)
    (a,) = p.allocate(1)
    p.cache(a, 1)
    p.record_prefix_query(10, 4)
    p.record_prefix_query(6, 0)
    st = p.stats()
    assert (st.prefix_query_tokens, st.prefix_hit_tokens, st.cached) == (16, 4, 1)
    assert p.reset_prefix_cache() == 1 and p.lookup(1) is None
