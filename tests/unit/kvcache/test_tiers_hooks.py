"""The block pool's hooks for the tiers: on_evict fires once per cached block L1 hands out again
(before its hash is dropped), never for an uncached one; on_cached on a first registration
only; KVCacheManager.hashes_after continues the prefix hit's chain."""
from __future__ import annotations

from moed.kvcache.manager import KVCacheManager
from moed.kvcache.pool import BlockPool, hash_block


def test_pool_hooks() -> None:
    p = BlockPool(3)
    evicted, cached = [], []
    p.on_evict = lambda b, h: evicted.append((b, h, p.block_hash(b)))
    p.on_cached = lambda b, h: cached.append((b, h))
    a, b, c = p.allocate(3)
    assert p.cache(a, 11) and p.cache(a, 11) and not p.cache(b, 11)
    assert cached == [(a, 11)] and evicted == []
    p.free([a, b, c])
    p.allocate(3)
    assert evicted == [(a, 11, 11)]         # the hash was still readable when told


def test_hashes_after_continues_the_hit() -> None:
    m = KVCacheManager(8, 2)
    toks = [1, 2, 3, 4, 5, 6, 7]
    alloc = m.allocate_prompt("r", toks, m.prefix_hit(toks), len(toks))
    m.commit("r", toks, 4)                  # blocks 0 and 1 cached
    hit = m.prefix_hit(toks)
    assert len(hit.block_ids) == 2 and alloc.num_cached_blocks == 0
    h2 = hash_block(hit.hashes[-1], toks[4:6])
    assert m.hashes_after(toks, hit) == [h2]           # block 3 would hold the last token
    other = [9] + toks[1:]                  # no hit: the chain starts at block 0
    assert m.hashes_after(other, m.prefix_hit(other))[0] == hash_block(None, [9, 2])
