"""A KV-events subscriber as vLLM's consumers write one: msgspec structs declared as vLLM
declares them (vllm/distributed/kv_events.py: the batch an array, each event a map tagged by
its class name under "type", required fields present, defaults omitted) decoded with a typed
msgspec Decoder, so a field moed names, orders or types differently fails to decode. Plus the
replay client (DEALER, since REQ takes one reply: send the start sequence, read
[topic, seq, payload] until seq -1) and the
test double of llm-d's precise prefix-cache scorer: a per-node block index kept from the events.

Written for moed's tests from vLLM's published struct definitions; not vLLM's code."""
from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The layout vLLM sent before its PR #42892 (kv_events.event_format = "array"): the same
# structs with array_like=True; the oldest consumers' BlockStored stops at medium.
class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class LegacyCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyBatch(EventBatch):
    events: list[LegacyStored | LegacyRemoved | LegacyCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = -1


def decode(payload: bytes) -> KVEventBatch:
    return DECODER.decode(payload)


class Subscriber:
    """SUB on `endpoint` (and REQ on `replay` when given); `recv` -> (topic, seq, batch)."""

    def __init__(self, endpoint: str, topic: str = "", replay: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay

    def recv(self, timeout: float = 10.0) -> tuple[bytes, int, KVEventBatch] | None:
        if not self.sub.poll(int(timeout * 1000)):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(seq, "big"), decode(payload)

    def replay(self, start: int, timeout: float = 10.0) -> list[tuple[bytes, int, KVEventBatch]]:
        """Every buffered batch from `start`, as vLLM's replay answers it."""
        assert self.replay_endpoint is not None
        req = self.ctx.socket(zmq.DEALER)   # many replies to one request: DEALER, not REQ
        req.connect(self.replay_endpoint)
        try:
            req.send_multipart((b"", start.to_bytes(8, "big")))
            out = []
            end = time.monotonic() + timeout
            while True:
                if not req.poll(max(1, int((end - time.monotonic()) * 1000))):
                    raise TimeoutError("replay did not end")
                frames = req.recv_multipart()
                assert frames[0] == b"", frames        # the delimiter REQ/DEALER strips
                topic, seq_b, payload = frames[1:]
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ:
                    assert payload == b"" and topic == b""
                    return out
                out.append((topic, seq, decode(payload)))
        finally:
            req.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


class PrefixIndex:
    """The llm-d-style scorer's double: per node, the engine block hashes each medium holds,
    and for each hash the token chunk it stands for (from BlockStored's token_ids), so a new
    prompt's blocks are matched by tokens, never by recomputing moed's hash."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[str, set[int]]] = {}     # node -> medium -> hashes
        self.by_tokens: dict[str, dict[tuple[tuple[int, ...], ...], int]] = {}

    def apply(self, node: str, batch: KVEventBatch) -> None:
        """One batch of `node`'s stream, in sequence order (the caller fills gaps by replay)."""
        media = self.blocks.setdefault(node, {})
        chains = self.by_tokens.setdefault(node, {})
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                media.clear()
                chains.clear()
            elif isinstance(e, BlockStored):
                media.setdefault(e.medium or "GPU", set()).update(e.block_hashes)
                if e.token_ids:
                    bs = e.block_size
                    parent = self._chain_of(chains, e.parent_block_hash)
                    for i, h in enumerate(e.block_hashes):
                        parent = parent + (tuple(e.token_ids[i * bs:(i + 1) * bs]),)
                        chains[parent] = h
            elif isinstance(e, BlockRemoved):
                media.get(e.medium or "GPU", set()).difference_update(e.block_hashes)

    @staticmethod
    def _chain_of(chains: dict, h: Any) -> tuple:
        if h is None:
            return ()
        for k, v in chains.items():
            if v == h:
                return k
        return ("?",)       # parent unknown: its chain cannot be matched from the start

    def score(self, node: str, tokens: list[int], block_size: int,
              medium: str = "GPU") -> int:
        """Leading full blocks of `tokens` the node holds on `medium`."""
        held = self.blocks.get(node, {}).get(medium, set())
        chains = self.by_tokens.get(node, {})
        n, chain = 0, ()
        for i in range(len(tokens) // block_size):
            chain = chain + (tuple(tokens[i * block_size:(i + 1) * block_size]),)
            h = chains.get(chain)
            if h is None or h not in held:
                break
            n += 1
        return n

    def pick(self, nodes: list[str], tokens: list[int], block_size: int) -> str:
        return max(nodes, key=lambda n: self.score(n, tokens, block_size))
