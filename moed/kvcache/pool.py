"""BlockPool: the physical KV blocks as integers — free list, ref counts, prefix-hash index.

No torch here: the tensors live in the model runner; this file only decides which block ids
are in use. Every check is paired with the change it guards (`can_allocate` / `allocate`).

Glossary
- *free* block: ref count 0. It may still hold a cached prefix (it stays findable through
  `lookup` until its id is handed out again — then its hash is evicted).
- *cached* block: a full block registered under its prefix hash.
- Free blocks are reused least-recently-freed first (an ordered dict used as an LRU queue), so
  a freed cached prefix survives as long as possible.

Prefix hashes chain: hash(block i) = H(hash(block i-1), tokens of block i). They are stable across
processes (blake2b, not Python's salted hash), so a prefill node and a decode node agree.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


def hash_block(parent: int | None, tokens: Sequence[int]) -> int:
    """Chained content hash of one full block (128-bit, so collisions are not a concern)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\x00" * 16 if parent is None else parent.to_bytes(16, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def salt_root(salt: str) -> int | None:
    """The parent hash of a salted prompt's first block (vLLM's `cache_salt`; moed.api adds the
    tenant's key under server.prefix_cache_isolation): blocks of prompts with different salts
    never share a hash, so one tenant cannot hit, or time, another's cached prefix. '' = None,
    the unsalted chain every node computes alike."""
    if not salt:
        return None
    h = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16,
                        person=b"moed-cache-salt")
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class PoolStats:
    total: int
    used: int            # ref count > 0
    free: int            # ref count 0 (includes cached-but-unreferenced blocks)
    cached: int          # blocks registered under a prefix hash (used or free)
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_queries: int = 0    # prompts looked up (what moed.obs.coarse batches the above by)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.prefix_queries = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        # the KV tiers below (moed.kvcache.tiers): told (block id, hash) when a cached block is
        # about to be reused (its data is still intact) and when a block is first cached
        self.on_evict: Callable[[int, int], None] | None = None
        self.on_cached: Callable[[int, int], None] | None = None
        # KV events (moed.kvcache.events): the prefix hash of a block that stops being cached
        self.on_uncached: Callable[[int], None] | None = None

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def lookup(self, block_hash: int) -> int | None:
        """The block holding this prefix, or None. Changes nothing."""
        return self._by_hash.get(block_hash)

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.num_used, self.num_free, len(self._by_hash),
                         self.prefix_query_tokens, self.prefix_hit_tokens,
                         self.prefix_queries)

    # ---- changes ---------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref 1), least recently freed first; their old prefixes are evicted."""
        if not self.can_allocate(n):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            h = self._hash[bid]
            if h is not None and self.on_evict is not None:
                self.on_evict(bid, h)
            self._evict(bid)
            self._ref[bid] = 1
            out.append(bid)
        return out

    def touch(self, ids: Iterable[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit); revives free ones."""
        for bid in ids:
            if self._ref[bid] == 0:
                del self._free[bid]
            self._ref[bid] += 1

    def free(self, ids: Iterable[int], first: bool = False) -> None:
        """Drop one reference per id. Blocks reaching 0 join the tail of the LRU free queue,
        in the order given (pass a table reversed so its tail is evicted first). first: those
        that hold no cached prefix join its head instead, the last given first (a truncated
        draft tail: the next allocation takes it back rather than evicting a cached prefix,
        which speculation would otherwise do about every step)."""
        for bid in ids:
            if self._ref[bid] <= 0:
                raise RuntimeError(f"double free of block {bid}")
            self._ref[bid] -= 1
            if self._ref[bid] == 0:
                self._free[bid] = None
                if first and self._hash[bid] is None:
                    self._free.move_to_end(bid, last=False)

    def cache(self, block_id: int, block_hash: int) -> bool:
        """Register a full, computed block under its prefix hash. If another block already holds
        the same prefix (computed twice concurrently), keep that one; return False."""
        if self._ref[block_id] <= 0:
            raise RuntimeError(f"cache() on unreferenced block {block_id}")
        old = self._hash[block_id]
        if old is not None:
            if old != block_hash:
                raise RuntimeError(f"block {block_id} is already cached under another prefix")
            return True
        if block_hash in self._by_hash:
            return False
        self._hash[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        if self.on_cached is not None:
            self.on_cached(block_id, block_hash)
        return True

    def record_prefix_query(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += 1
        self.prefix_query_tokens += queried_tokens
        self.prefix_hit_tokens += hit_tokens

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (e.g. after new weights). Returns how many were dropped."""
        n = len(self._by_hash)
        if self.on_uncached is not None:
            for h in self._by_hash:
                self.on_uncached(h)
        self._by_hash.clear()
        self._hash = [None] * self.num_blocks
        return n

    def _evict(self, bid: int) -> None:
        h = self._hash[bid]
        if h is not None:
            self._hash[bid] = None
            if self._by_hash.get(h) == bid:
                del self._by_hash[h]
                if self.on_uncached is not None:
                    self.on_uncached(h)
