"""KVCacheManager: per-request block tables on top of the BlockPool (integers only, no torch).

The scheduler talks to this class only; the pool stays hidden. A request's life here:

    hit = mgr.prefix_hit(tokens, root)                 # pure: which full blocks are cached
    if mgr.can_allocate_prompt(hit, n):                # n = tokens the table must hold now
        alloc = mgr.allocate_prompt(req_id, tokens, hit, n, root)   # -> Allocation
    ... each step:  mgr.can_append(req_id, n) / mgr.append_slots(req_id, n)
    ... after the step wrote K/V:  mgr.commit(req_id, tokens, num_computed)
    mgr.free(req_id)

A decode node whose prompt KV is WRITTEN by a prefill node allocates the whole prompt up front
(`allocate_prompt(..., num_tokens=len(prompt))`), sends `alloc.block_ids[alloc.num_cached_blocks:]`
to the writer, and calls `commit` once the data has landed.

The prefix hit never covers the last prompt token: the model must compute at least one token
to produce the logits of the first output token. `root` is the request's salt
(moed.kvcache.pool.salt_root; None = unsalted): the parent hash of its first block.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from moed.kvcache.events import MEDIUM_L1, KVEventRecorder
from moed.kvcache.pool import BlockPool, PoolStats, hash_block


@dataclass(frozen=True)
class PrefixHit:
    block_ids: tuple[int, ...]     # cached full blocks covering the prompt's start
    hashes: tuple[int, ...]        # their chained hashes
    num_tokens: int                # len(block_ids) * block_size


@dataclass(frozen=True)
class Allocation:
    block_ids: tuple[int, ...]     # the request's whole table after allocation
    num_cached_tokens: int         # prompt tokens whose K/V came from the prefix cache
    num_cached_blocks: int


NO_HIT = PrefixHit((), (), 0)


def leading(hashes: Sequence[int]) -> tuple[int, ...]:
    """The hashes at depths 1, 2, 4, 8, ... of a chain (depth d = the first d blocks; the
    digest's sampling, moed.cluster.state.digest_depths)."""
    out, d = [], 1
    while d <= len(hashes):
        out.append(hashes[d - 1])
        d *= 2
    return tuple(out)


@dataclass
class _Table:
    blocks: list[int]
    hashes: list[int]              # hashes of blocks[:len(hashes)] (committed full blocks)
    root: int | None = None        # the salt's parent hash of block 0 (pool.salt_root)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_blocks)
        self._tables: dict[str, _Table] = {}
        # leading hashes of recently freed tables (the prefix digest reads them once a second)
        self._freed: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=256)
        self._freed_seq = 0
        self.events: KVEventRecorder | None = None     # set_events

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self._pool.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_used

    def stats(self) -> PoolStats:
        return self._pool.stats()

    def has(self, req_id: str) -> bool:
        return req_id in self._tables

    def block_table(self, req_id: str) -> list[int]:
        return self._tables[req_id].blocks

    def leading_hashes(self) -> Iterator[tuple[int, ...]]:
        """The chained hashes at depths 1, 2, 4, 8, ... (`leading`) of every live table's
        committed blocks (a read, for the gossiped prefix digest: moed.cluster.service)."""
        return (leading(t.hashes) for t in self._tables.values())

    def freed_since(self, seq: int) -> tuple[int, list[tuple[int, ...]]]:
        """(the newest sequence number, the leading hashes of the tables freed after `seq`):
        a request that started and ended between two gossip ticks still counts."""
        return self._freed_seq, [h for n, h in self._freed if n > seq]

    def is_cached(self, block_hash: int) -> bool:
        """A block is still findable under this prefix hash (changes nothing)."""
        return self._pool.lookup(block_hash) is not None

    def set_tier_hooks(self, on_evict: Callable[[int, int], None] | None,
                       on_cached: Callable[[int, int], None] | None) -> None:
        """The tiers below L1 (moed.kvcache.tiers): (block id, prefix hash) of a cached block
        about to be reused, and of a block first cached."""
        self._pool.on_evict, self._pool.on_cached = on_evict, on_cached

    def set_events(self, rec: KVEventRecorder | None) -> None:
        """KV events (moed.kvcache.events): L1's cached blocks as they come and go."""
        self.events = rec
        self._pool.on_uncached = None if rec is None else (lambda h: rec.removed(MEDIUM_L1, h))

    def hashes_after(self, tokens: Sequence[int], hit: PrefixHit,
                     root: int | None = None) -> list[int]:
        """The chained hashes of the prompt's full blocks after `hit` that still leave >= 1
        token to compute (what the tiers below L1 are asked for)."""
        bs = self.block_size
        out: list[int] = []
        parent: int | None = hit.hashes[-1] if hit.hashes else root
        for i in range(len(hit.block_ids), (len(tokens) - 1) // bs):
            parent = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prefix_hit(self, tokens: Sequence[int], root: int | None = None) -> PrefixHit:
        """The longest cached run of full blocks at the start of `tokens`, leaving >= 1 token."""
        if not self.enable_prefix_caching:
            return NO_HIT
        bs = self.block_size
        ids: list[int] = []
        hashes: list[int] = []
        parent: int | None = root
        for i in range((len(tokens) - 1) // bs):
            h = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            bid = self._pool.lookup(h)
            if bid is None:
                break
            ids.append(bid)
            hashes.append(h)
            parent = h
        return PrefixHit(tuple(ids), tuple(hashes), len(ids) * bs)

    # ---- allocation ------------------------------------------------------------------------
    def _new_blocks_needed(self, hit: PrefixHit, num_tokens: int) -> int:
        need = max(0, self.blocks_for(num_tokens) - len(hit.block_ids))
        # Hit blocks that sit in the free queue leave it when we take a reference.
        revived = sum(1 for b in hit.block_ids if self._pool.ref_count(b) == 0)
        return need + revived

    def can_allocate_prompt(self, hit: PrefixHit, num_tokens: int) -> bool:
        return self._pool.can_allocate(self._new_blocks_needed(hit, num_tokens))

    def allocate_prompt(self, req_id: str, tokens: Sequence[int], hit: PrefixHit,
                        num_tokens: int, root: int | None = None) -> Allocation:
        """Start a table holding `num_tokens` tokens: the hit's blocks, then fresh ones.
        `hit` must come from `prefix_hit(tokens, root)` with no pool change in between."""
        if req_id in self._tables:
            raise RuntimeError(f"request {req_id} already holds KV blocks")
        if not self.can_allocate_prompt(hit, num_tokens):
            raise RuntimeError(f"allocate_prompt({req_id}) does not fit; check can_allocate_prompt")
        if num_tokens < hit.num_tokens:
            raise ValueError("num_tokens must cover the prefix hit")
        self._pool.touch(hit.block_ids)
        fresh = self._pool.allocate(max(0, self.blocks_for(num_tokens) - len(hit.block_ids)))
        self._tables[req_id] = _Table(list(hit.block_ids) + fresh, list(hit.hashes), root)
        if self.enable_prefix_caching:
            self._pool.record_prefix_query(len(tokens), hit.num_tokens)
        return Allocation(tuple(self._tables[req_id].blocks), hit.num_tokens, len(hit.block_ids))

    def can_append(self, req_id: str, num_tokens: int) -> bool:
        """Can the table grow to hold `num_tokens` tokens in total?"""
        t = self._tables[req_id]
        return self._pool.can_allocate(max(0, self.blocks_for(num_tokens) - len(t.blocks)))

    def append_slots(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow the table to hold `num_tokens` tokens; returns the new block ids."""
        t = self._tables[req_id]
        new = self._pool.allocate(max(0, self.blocks_for(num_tokens) - len(t.blocks)))
        t.blocks.extend(new)
        return new

    def truncate(self, req_id: str, num_tokens: int) -> int:
        """Shrink the table to the blocks `num_tokens` tokens need (speculative decoding: the
        K/V of rejected draft tokens past them is dropped); -> blocks freed. Only blocks past
        every committed (hashed) block may go: a cached block holds accepted tokens only."""
        t = self._tables[req_id]
        keep = self.blocks_for(num_tokens)
        if keep < len(t.hashes):
            raise RuntimeError(f"truncate({req_id}, {num_tokens}) would drop committed blocks")
        tail = t.blocks[keep:]
        if tail:
            del t.blocks[keep:]
            self._pool.free(reversed(tail), first=True)     # reused before a cached prefix
        return len(tail)

    def commit(self, req_id: str, tokens: Sequence[int], num_computed: int) -> None:
        """Register the request's full blocks whose K/V are now written (first `num_computed`
        of `tokens`) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        t = self._tables[req_id]
        bs = self.block_size
        full = min(num_computed // bs, len(t.blocks))
        parent = t.hashes[-1] if t.hashes else t.root
        ev = self.events
        for i in range(len(t.hashes), full):
            # a salted chain's first block has no parent block (its root is no block)
            prev, parent = parent if i else None, hash_block(parent, tokens[i * bs:(i + 1) * bs])
            t.hashes.append(parent)
            if ev is not None and self._pool.lookup(parent) is None:   # cache() registers it
                ev.stored(MEDIUM_L1, parent, prev, tokens[i * bs:(i + 1) * bs])
            self._pool.cache(t.blocks[i], parent)

    def free(self, req_id: str) -> None:
        """Release the request's blocks (tail first, so a shared prefix outlives its tail)."""
        t = self._tables.pop(req_id, None)
        if t is not None:
            self._pool.free(reversed(t.blocks))
            if t.hashes:
                self._freed_seq += 1
                self._freed.append((self._freed_seq, leading(t.hashes)))

    def reset_prefix_cache(self) -> int:
        return self._pool.reset_prefix_cache()

    # ---- blocks outside any request: a peer reads ours, or we read a peer's ------------------
    # (moed/roles/kvshare.py, on the engine loop between steps)
    def pin_cached(self, hashes: Sequence[int]) -> list[int]:
        """A reference on each block cached under the leading run of `hashes` (a peer is
        reading them); -> their ids, released with `unpin`."""
        ids: list[int] = []
        for h in hashes:
            bid = self._pool.lookup(h)
            if bid is None:
                break
            ids.append(bid)
        self._pool.touch(ids)
        return ids

    def unpin(self, ids: Sequence[int]) -> None:
        self._pool.free(reversed(ids))

    def reserve(self, n: int) -> list[int] | None:
        """n fresh blocks held outside any request (a peer's payloads land there), or None
        when there is no room; released with `unpin` or `adopt`."""
        return self._pool.allocate(n) if self._pool.can_allocate(n) else None

    def adopt(self, ids: Sequence[int], hashes: Sequence[int]) -> int:
        """Reserved blocks now hold the prefix blocks `hashes`: cache them and drop our
        reference, so the next prefix hit finds them. -> how many were registered."""
        ev, prev, n = self.events, None, 0
        for b, h in zip(ids, hashes):
            if ev is not None and self._pool.lookup(h) is None:   # tokens: unknown here
                ev.stored(MEDIUM_L1, h, prev)
            n += self._pool.cache(b, h)
            prev = h
        self._pool.free(reversed(ids))
        return n
