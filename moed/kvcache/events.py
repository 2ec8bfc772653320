"""KV events: the blocks this node holds, per tier, as vLLM's KV-events stream describes them.

Routers that score nodes by the KV blocks they hold (llm-d's precise prefix-cache scorer,
Dynamo's KV router) keep a per-node block index from vLLM's events: `BlockStored` (a run of
chained blocks with their tokens), `BlockRemoved`, `AllBlocksCleared`, each naming its tier
(`medium`). `KVEventRecorder` turns moed's hooks (the block pool's cache/evict, the tiers'
store/evict) into those events; the engine drains them once per step and hands them to the
publisher (moed/kvcache/publisher.py), which encodes them (`encode_batch`) off the loop.

One writer: every method here runs on the engine's loop thread (the pool and the tiers call
it from there). Nothing here imports zmq or msgspec until a batch is encoded.

Hashes: moed's prefix hashes are 128-bit chained blake2b digests (moed/kvcache/pool.py), too
wide for a msgpack integer; the events carry their low 64 bits as an unsigned integer (vLLM's
integer form of its own hashes). `token_ids` lets a consumer compute its own hashes instead.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# vLLM's medium names (vllm/distributed/kv_events.py): L1 is the KV tensor the attention reads
# (named GPU, as the tier a request uses without a load, whatever the device), L2 host memory,
# L3 local disk
MEDIUM_L1, MEDIUM_HOST, MEDIUM_DISK = "GPU", "CPU", "STORAGE"
TIER_MEDIUM = {"host": MEDIUM_HOST, "disk": MEDIUM_DISK}
U64 = (1 << 64) - 1
# tokens kept for blocks no tier holds: a block evicted from host memory is written to disk on
# the writer thread and announced when the write lands, after it left every tier
RECENT_INFO = 4096


def wire_hash(h: int) -> int:
    """A moed prefix hash as the events carry it: its low 64 bits, unsigned."""
    return h & U64


@dataclass(frozen=True)
class Stored:
    hashes: tuple[int, ...]          # a chain: each block's parent is the one before it
    parent: int | None               # the first block's parent (None: the prompt's start)
    token_ids: tuple[int, ...]       # len(hashes) * block_size tokens, or () when unknown
    medium: str


@dataclass(frozen=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass
class _Run:
    """The event being extended (a chain grows one block at a time: appending to lists, not
    rebuilding tuples, keeps a long prompt's commit linear); frozen when drained."""
    stored: bool
    medium: str
    parent: int | None
    hashes: list[int]
    tokens: list[int]

    def freeze(self) -> Event:
        if self.stored:
            return Stored(tuple(self.hashes), self.parent, tuple(self.tokens), self.medium)
        return Removed(tuple(self.hashes), self.medium)


class KVEventRecorder:
    """Collects the events of one engine step; `drain` hands them over in order.

    It remembers, for each block some tier holds, its parent and tokens (learnt when L1
    caches it), so a block moving down to host or disk is announced with them too; a block
    no tier holds any more is forgotten. Blocks found on disk at start (a restart) were cached
    by an earlier process: their tokens are unknown and they are announced without them.
    A block no tier holds keeps its tokens a while (RECENT_INFO), for a write still landing."""

    def __init__(self, block_size: int, keep_tokens: bool = True) -> None:
        """keep_tokens: remember each held block's tokens for the tiers' events (a node
        without tiers below L1 never needs them again)."""
        self.block_size = block_size
        self.keep_tokens = keep_tokens
        self._events: list[Event | _Run] = []
        self._info: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self._where: dict[int, set[str]] = {}
        self._recent: OrderedDict[int, tuple[int | None, tuple[int, ...]]] = OrderedDict()

    @property
    def pending(self) -> int:
        return len(self._events)

    def drain(self) -> list[Event]:
        out, self._events = self._events, []
        return [e.freeze() if isinstance(e, _Run) else e for e in out]

    def held(self, medium: str) -> set[int]:
        """The hashes a medium holds (as announced): tests and debugging."""
        return {h for h, where in self._where.items() if medium in where}

    # ---- hooks ---------------------------------------------------------------------------
    def cleared(self) -> None:
        """This node holds nothing (a fresh start): a subscriber drops what it knew of it."""
        self._events.append(Cleared())
        self._info.clear()
        self._where.clear()
        self._recent.clear()

    def stored(self, medium: str, block_hash: int, parent: int | None,
               tokens: Sequence[int] | None = None) -> None:
        """`medium` now holds the block `block_hash` (child of `parent`). Consecutive blocks
        of one chain on one medium join one BlockStored, as vLLM sends a request's blocks."""
        where = self._where.setdefault(block_hash, set())
        if medium in where:
            return
        where.add(medium)
        if tokens is not None:
            toks = tuple(tokens)
            if self.keep_tokens:
                self._info[block_hash] = (parent, toks)
        else:
            if block_hash not in self._info and block_hash in self._recent:
                self._info[block_hash] = self._recent.pop(block_hash)
            parent, toks = self._info.get(block_hash, (parent, ()))
        last = self._events[-1] if self._events else None
        if (isinstance(last, _Run) and last.stored and last.medium == medium
                and last.hashes[-1] == parent and bool(last.tokens) == bool(toks)):
            last.hashes.append(block_hash)
            last.tokens.extend(toks)
        else:
            self._events.append(_Run(True, medium, parent, [block_hash], list(toks)))

    def removed(self, medium: str, block_hash: int) -> None:
        where = self._where.get(block_hash)
        if where is None or medium not in where:
            return
        where.discard(medium)
        if not where:
            del self._where[block_hash]
            info = self._info.pop(block_hash, None)
            if info is not None:
                self._recent[block_hash] = info
                if len(self._recent) > RECENT_INFO:
                    self._recent.popitem(last=False)
        last = self._events[-1] if self._events else None
        if isinstance(last, _Run) and not last.stored and last.medium == medium:
            last.hashes.append(block_hash)
        else:
            self._events.append(_Run(False, medium, None, [block_hash], []))

    def tier_changed(self, tier: str, block_hash: int, stored: bool) -> None:
        """The tiers' hook (moed.kvcache.tiers.TieredCache.on_change): tier is host or disk."""
        medium = TIER_MEDIUM[tier]
        if stored:
            info = self._info.get(block_hash) or self._recent.get(block_hash)
            self.stored(medium, block_hash, None if info is None else info[0])
        else:
            self.removed(medium, block_hash)


# ---- the wire format (vLLM's KVEventBatch, msgpack) ----------------------------------------

def _event_obj(e: Event, block_size: int) -> dict:
    """One event as vLLM's msgspec encodes it: a map tagged by `type` (the class name), the
    required fields always present (None as nil), defaults left out (omit_defaults)."""
    if isinstance(e, Stored):
        return {"type": "BlockStored",
                "block_hashes": [wire_hash(h) for h in e.hashes],
                "parent_block_hash": None if e.parent is None else wire_hash(e.parent),
                "token_ids": list(e.token_ids),
                "block_size": block_size,
                "lora_id": None,
                "medium": e.medium,
                "lora_name": None,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention"}
    if isinstance(e, Removed):
        return {"type": "BlockRemoved", "block_hashes": [wire_hash(h) for h in e.hashes],
                "medium": e.medium, "group_idx": 0}
    return {"type": "AllBlocksCleared"}


def _event_array(e: Event, block_size: int) -> list:
    """The layout vLLM sent before its map encoding (msgspec array_like): the tag, then every
    field in declaration order up to the last one not at its default."""
    if isinstance(e, Stored):
        return ["BlockStored", [wire_hash(h) for h in e.hashes],
                None if e.parent is None else wire_hash(e.parent), list(e.token_ids),
                block_size, None, e.medium, None]
    if isinstance(e, Removed):
        return ["BlockRemoved", [wire_hash(h) for h in e.hashes], e.medium]
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: Sequence[Event], block_size: int,
                 data_parallel_rank: int = 0, event_format: str = "map") -> bytes:
    """vLLM's KVEventBatch: the array [ts, [event, ...], data_parallel_rank] in msgpack, each
    event a tagged map (vLLM today) or, with event_format "array", a tagged array."""
    import msgspec

    one = _event_array if event_format == "array" else _event_obj
    return msgspec.msgpack.encode([ts, [one(e, block_size) for e in events],
                                   data_parallel_rank])
