"""The peer tier (L4: another node's L1): which peer to ask, the lease messages, the lease table.

Pure (no I/O, no torch); the node-to-node calls and the NIXL READ are in moed/roles/kvshare.py.

    a prompt misses locally ──best_peer (the gossip digests)──▶ plan (policy.plan_load) ──▶
    POST /internal/kv/lease {hashes} ──▶ the peer pins the leading run it holds (LeaseTable),
    answers block ids + transfer metadata + expiry ──▶ NIXL READ into fresh local blocks ──▶
    adopted as cached L1 blocks ──▶ DELETE the lease (or it expires: nothing pinned past it)

Glossary
- *digest depth*: a peer's gossip digest (moed.cluster.state.LoadVector.prefix_digest) holds
  the low bytes of chained block hashes at depths 1, 2, 4, ...: the deepest depth of our prompt
  found there is a lower bound on the leading blocks the peer still caches (it may hold more,
  or have evicted them since: the lease says what it holds now).
- *lease*: blocks a peer pinned for a reader, released by DELETE or at `expires` (monotonic).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from moed.cluster.state import digest_depths, digest_key
from moed.kvcache.pool import hash_block

FAILURE_REASONS = ("lease_refused", "lease_unreachable", "nothing_held", "no_room",
                   "read_failed", "read_timeout", "mismatch", "engine_busy")


def prompt_hashes(tokens: Sequence[int], block_size: int, root: int | None = None) -> list[int]:
    """The chained hashes of the prompt's full blocks that a prefix hit may cover (never the
    last token: moed.kvcache.manager.prefix_hit); root: the prompt's salt (pool.salt_root)."""
    out: list[int] = []
    parent: int | None = root
    for i in range((len(tokens) - 1) // block_size):
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def digest_depth(hashes: Sequence[int], digest: Iterable[int]) -> int:
    """The deepest of the digest's depths (1, 2, 4, ...) at which our chained hash is in the
    peer's digest; 0 when none is."""
    have = set(digest)
    best = 0
    for d in digest_depths(len(hashes)):
        if digest_key(hashes[d - 1]) in have:
            best = d
    return best


@dataclass(frozen=True)
class PeerOffer:
    name: str           # membership name (also the transfer peer name)
    url: str            # its HTTP base URL
    depth: int          # leading blocks its digest shows


def best_peer(hashes: Sequence[int], peers: Iterable[tuple[str, str, Iterable[int]]]
              ) -> PeerOffer | None:
    """The peer whose digest shows the deepest run of our prompt; ties: the first given.
    peers: (name, url, digest) of live, compatible peers with our block size."""
    best: PeerOffer | None = None
    for name, url, digest in peers:
        d = digest_depth(hashes, digest)
        if d and (best is None or d > best.depth):
            best = PeerOffer(name, url, d)
    return best


# ---- the lease messages (JSON bodies of /internal/kv/lease) ----------------------------------

@dataclass(frozen=True)
class LeaseRequest:
    hashes: tuple[int, ...]         # the prompt's chained block hashes, from block 0
    layout_id: str                  # the reader's KV layout id: the peer refuses another
    model_id: str                   # the reader's checkpoint id: the peer refuses another

    def to_json(self) -> dict:
        return {"hashes": [f"{h:032x}" for h in self.hashes], "layout_id": self.layout_id,
                "model_id": self.model_id}

    @classmethod
    def from_json(cls, d: object, max_hashes: int) -> "LeaseRequest":
        """ValueError with a client-fit message for anything malformed."""
        if not isinstance(d, dict) or set(d) != {"hashes", "layout_id", "model_id"}:
            raise ValueError("a lease request has exactly hashes, layout_id and model_id")
        hs = d["hashes"]
        if not isinstance(hs, list) or not 0 < len(hs) <= max_hashes:
            raise ValueError(f"hashes: a list of 1 to {max_hashes} block hashes")
        if not all(isinstance(h, str) and len(h) == 32 for h in hs):
            raise ValueError("hashes: 32 hex digits each")
        if not isinstance(d["layout_id"], str) or not isinstance(d["model_id"], str):
            raise ValueError("layout_id and model_id are strings")
        try:
            return cls(tuple(int(h, 16) for h in hs), d["layout_id"], d["model_id"])
        except ValueError:
            raise ValueError("hashes: 32 hex digits each") from None


@dataclass(frozen=True)
class LeaseGrant:
    lease: str                      # id for DELETE /internal/kv/lease/{lease}
    block_ids: tuple[int, ...]      # the peer's blocks holding hashes[:len(block_ids)]
    metadata: str                   # the peer's transfer metadata, base64
    incarnation: int                # the peer's transfer incarnation (add_peer)
    ttl_s: float                    # the blocks stay pinned this long at most

    def to_json(self) -> dict:
        return {"lease": self.lease, "block_ids": list(self.block_ids), "metadata": self.metadata,
                "incarnation": self.incarnation, "ttl_s": self.ttl_s}

    @classmethod
    def from_json(cls, d: object, num_hashes: int) -> "LeaseGrant":
        if not isinstance(d, dict):
            raise ValueError("lease grant is not an object")
        try:
            ids = tuple(int(b) for b in d["block_ids"])
            g = cls(str(d["lease"]), ids, str(d["metadata"]), int(d["incarnation"]),
                    float(d["ttl_s"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"lease grant is malformed: {e}") from None
        if len(ids) > num_hashes or any(b < 0 for b in ids) or len(set(ids)) != len(ids):
            raise ValueError("lease grant block ids do not match the request")
        return g


# ---- the serving side: what is pinned for whom, until when ------------------------------------

@dataclass
class _Lease:
    reader: str
    block_ids: tuple[int, ...]
    expires: float


@dataclass
class LeaseTable:
    """Leases a node granted. Integers and clocks only: the caller pins the blocks before `add`
    and unpins whatever `release` / `expired` / `drain` hand back (each lease exactly once)."""

    max_leases: int = 64
    _leases: dict[str, _Lease] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._leases)

    def can_add(self) -> bool:
        return len(self._leases) < self.max_leases

    def add(self, lease: str, reader: str, block_ids: Sequence[int], expires: float) -> None:
        if lease in self._leases or not self.can_add():
            raise ValueError(f"lease {lease}: a duplicate, or the table is full")
        self._leases[lease] = _Lease(reader, tuple(block_ids), expires)

    def release(self, lease: str, reader: str) -> tuple[int, ...] | None:
        """The blocks to unpin; None when no such lease of that reader is held (gone, expired,
        or another node's: a reader releases only its own)."""
        le = self._leases.get(lease)
        if le is None or le.reader != reader:
            return None
        del self._leases[lease]
        return le.block_ids

    def expired(self, now: float) -> list[tuple[str, tuple[int, ...]]]:
        out = [(k, le.block_ids) for k, le in self._leases.items() if le.expires <= now]
        for k, _ in out:
            del self._leases[k]
        return out

    def drain(self) -> list[tuple[int, ...]]:
        out = [le.block_ids for le in self._leases.values()]
        self._leases.clear()
        return out

    def pinned(self) -> int:
        return sum(len(le.block_ids) for le in self._leases.values())
