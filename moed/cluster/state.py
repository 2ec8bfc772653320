"""Member states, node metadata and the immutable cluster view the rest of the daemon reads.

Member lifecycle (transitions live only in `next_state`):

    (unknown) --alive--> ALIVE --suspect--> SUSPECT --timeout/dead--> DEAD
                           ^                   |                        |
                           +----alive(inc+)----+------alive(inc+)-------+
    ALIVE/SUSPECT --leave--> LEFT --alive(inc+)--> ALIVE   (a restarted node)

Which message wins is decided by incarnation numbers in the handlers (swim.py); this table
only says which state an accepted message leads to.
"""
from __future__ import annotations

import base64
import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence


class MemberState(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


class Event(enum.Enum):
    ALIVE = "alive"        # an alive message with a newer incarnation
    SUSPECT = "suspect"    # a failed probe or a suspect message
    DEAD = "dead"          # suspicion timed out, or a dead message
    LEAVE = "leave"        # the member announced its own departure


_TRANSITIONS: dict[tuple[MemberState | None, Event], MemberState] = {
    (None, Event.ALIVE): MemberState.ALIVE,
    (MemberState.ALIVE, Event.ALIVE): MemberState.ALIVE,
    (MemberState.SUSPECT, Event.ALIVE): MemberState.ALIVE,
    (MemberState.DEAD, Event.ALIVE): MemberState.ALIVE,
    (MemberState.LEFT, Event.ALIVE): MemberState.ALIVE,
    (MemberState.ALIVE, Event.SUSPECT): MemberState.SUSPECT,
    (MemberState.SUSPECT, Event.SUSPECT): MemberState.SUSPECT,
    (MemberState.ALIVE, Event.DEAD): MemberState.DEAD,
    (MemberState.SUSPECT, Event.DEAD): MemberState.DEAD,
    (MemberState.ALIVE, Event.LEAVE): MemberState.LEFT,
    (MemberState.SUSPECT, Event.LEAVE): MemberState.LEFT,
}


def next_state(current: MemberState | None, event: Event) -> MemberState | None:
    """The state an accepted event leads to, or None when the event does not apply
    (a dead member cannot become suspect; only a newer alive brings it back)."""
    return _TRANSITIONS.get((current, event))


# Bounds on the load vector's newer fields (wire.py refuses more): an Alive carries the load,
# and an Alive must fit one UDP packet (wire.MAX_PACKET, 1400 bytes) beside the metadata.
MAX_BUCKETS = 8             # length buckets advertised (balance.bucket_edges + 1)
MAX_DIGEST = 32             # prefix digest entries; 32 x 8 bytes = 344 base64 characters
MAX_QUEUED = (1 << 32) - 1  # a queued-tokens or -requests value is advertised at most this
# waiting requests by priority: two (priority, count) pairs fit the packet's last ~48 bytes
# (interactive and batch exactly; more priorities folded into the second, see fold_priorities)
MAX_PRIORITY_PAIRS = 2
MAX_PRIORITY_COUNT = (1 << 20) - 1
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)   # vLLM's priority as moed takes it (int32)
DIGEST_BYTES = 8            # each entry: the low 8 bytes of a block's chained prefix hash


def digest_depths(num_blocks: int) -> list[int]:
    """The leading-block depths a digest samples for a prompt of `num_blocks` full blocks:
    1, 2, 4, 8, ... (a block hash chains its whole prefix, so depth d stands for the first
    d blocks; powers of two cover a long shared prefix with log2 entries)."""
    out, d = [], 1
    while d <= num_blocks:
        out.append(d)
        d *= 2
    return out


def digest_key(block_hash: int) -> int:
    """The digest entry of one chained block hash (moed.kvcache.pool.hash_block)."""
    return block_hash & ((1 << (8 * DIGEST_BYTES)) - 1)


@dataclass(frozen=True)
class LoadVector:
    """A node's load, refreshed about once a second (see MembershipConfig.load_interval_s).

    The first four fields are wire version 1's; the rest were added at the end (a node of the
    release before sends none of them: they read as "not advertised"):
      bucket_edges, queued_tokens, queued_requests
                    prompt work queued per length bucket (moed.balance.cost.AdvertisedCost)
      cost          the fitted cost coefficients, seconds per feature in
                    moed.balance.cost.FEATURES order; () = no fitted model (not advertised)
      prefill_share share of a step's time prefill gets; chunk_tokens its typical chunk
      block_size    tokens per KV block of the node (the digest's unit)
      prefix_digest the low DIGEST_BYTES of the chained hashes of the node's cached leading
                    blocks (depths 1, 2, 4, 8, ... of its recent prompts, still cached), most
                    recent first, at most MAX_DIGEST: what prefix affinity scores against
      prefill_tps, decode_step_s, queue_s, compute_s, predicted_ttft_s, capacity_tokens
                    the capacity signals (moed.balance.capacity: measured prefill tokens/s,
                    decode step time, queue vs compute time of recent requests, predicted
                    TTFT of a new reference prompt, prompt tokens left under the TTFT SLO);
                    -1 (0 for capacity_tokens) = not measured or not advertised
      waiting_by_priority
                    the waiting requests by priority (vLLM's, lower first) as pairs
                    (priority, requests), most urgent first, at most MAX_PRIORITY_PAIRS (the
                    rest counted in the last pair): what a router weighs for a request of a
                    given priority (`waiting_ahead`); () = not advertised
    """
    waiting: int = 0
    running: int = 0
    free_kv_blocks: int = 0
    queued_prefill_tokens: int = 0
    bucket_edges: tuple[int, ...] = ()
    queued_tokens: tuple[int, ...] = ()
    queued_requests: tuple[int, ...] = ()
    cost: tuple[float, ...] = ()
    prefill_share: float = 1.0
    chunk_tokens: int = 0
    block_size: int = 0
    prefix_digest: tuple[int, ...] = ()
    prefill_tps: float = -1.0
    decode_step_s: float = -1.0
    queue_s: float = -1.0
    compute_s: float = -1.0
    predicted_ttft_s: float = -1.0
    capacity_tokens: int = 0
    waiting_by_priority: tuple[tuple[int, int], ...] = ()

    def waiting_ahead(self, priority: int | None) -> int:
        """The waiting requests a new one of `priority` queues behind: those no less urgent
        (all of them when the node does not advertise priorities or `priority` is None)."""
        if priority is None or not self.waiting_by_priority:
            return self.waiting
        return sum(n for p, n in self.waiting_by_priority if p <= priority)

    def to_list(self) -> list[Any]:
        return [self.waiting, self.running, self.free_kv_blocks, self.queued_prefill_tokens,
                list(self.bucket_edges), list(self.queued_tokens), list(self.queued_requests),
                list(self.cost), self.prefill_share, self.chunk_tokens, self.block_size,
                digest_text(self.prefix_digest), self.prefill_tps, self.decode_step_s,
                self.queue_s, self.compute_s, self.predicted_ttft_s, self.capacity_tokens,
                [x for pair in self.waiting_by_priority for x in pair]]

    def to_dict(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "running": self.running,
                "free_kv_blocks": self.free_kv_blocks,
                "queued_prefill_tokens": self.queued_prefill_tokens,
                "bucket_edges": list(self.bucket_edges),
                "queued_tokens": list(self.queued_tokens),
                "queued_requests": list(self.queued_requests), "cost": list(self.cost),
                "prefill_share": self.prefill_share, "chunk_tokens": self.chunk_tokens,
                "block_size": self.block_size, "prefix_digest": len(self.prefix_digest),
                "prefill_tps": self.prefill_tps, "decode_step_s": self.decode_step_s,
                "queue_s": self.queue_s, "compute_s": self.compute_s,
                "predicted_ttft_s": self.predicted_ttft_s,
                "capacity_tokens": self.capacity_tokens,
                "waiting_by_priority": [list(p) for p in self.waiting_by_priority]}


def fold_priorities(counts: Sequence[tuple[int, int]], limit: int = MAX_PRIORITY_PAIRS
                    ) -> tuple[tuple[int, int], ...]:
    """(priority, requests) pairs, most urgent first, at most `limit`, counts clamped: the
    least urgent ones beyond it are counted in the last pair (under its priority: a router
    then counts them ahead of a request of that priority, never behind it)."""
    pairs = sorted((p, n) for p, n in counts if n > 0)
    if len(pairs) > limit:
        pairs = [*pairs[:limit - 1], (pairs[limit - 1][0], sum(n for _, n in pairs[limit - 1:]))]
    return tuple((p, min(n, MAX_PRIORITY_COUNT)) for p, n in pairs)


def digest_text(digest: tuple[int, ...]) -> str:
    """The digest on the wire: its entries' bytes (little-endian) concatenated, base64 (11
    characters an entry where a JSON list of integers would take 20)."""
    return base64.b64encode(b"".join(d.to_bytes(DIGEST_BYTES, "little")
                                     for d in digest)).decode("ascii")


def digest_of_text(text: str) -> tuple[int, ...]:
    """digest_text's inverse; ValueError for anything it did not write."""
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) % DIGEST_BYTES or len(raw) // DIGEST_BYTES > MAX_DIGEST:
        raise ValueError(f"digest of {len(raw)} bytes")
    return tuple(int.from_bytes(raw[i:i + DIGEST_BYTES], "little")
                 for i in range(0, len(raw), DIGEST_BYTES))


# The node-to-node HTTP protocols this build speaks (prefill job RPC, transfer metadata, the
# router's proxying), as an inclusive range of versions: a release that adds to them raises the
# top, one that drops the oldest raises the bottom; two nodes work together when their ranges
# overlap (protocol_compatible below). Gossip's own version is wire.VERSION.
# Versions: 1 the first release; 2 prefill jobs may carry a grammar (structured outputs) that
# the prefill node applies to token one — a version-1 prefill node would ignore it.
PROTOCOL_MIN, PROTOCOL_MAX = 1, 2
GRAMMAR_JOBS = 2
PROTOCOL = f"{PROTOCOL_MIN}-{PROTOCOL_MAX}"


@dataclass(frozen=True)
class NodeMeta:
    """What a node says about itself; versioned by its incarnation. `layout` is a hash of
    the model's KV layout so a decode node never pairs with an incompatible prefill node.

    Release fields (added after the first five, so they go last on the wire; a node of the
    release before sends none of them and they read as ""):
      version   moed's version (the build)
      label     the version label canaries are routed by (release.version_label, default
                `version`)
      model_id  hash of the checkpoint (config.json, weight index/files: moed.model.identity)
      config    hash of the running config (Config.digest(); changes on reload)
      protocol  node-to-node protocol versions spoken, "min-max" (PROTOCOL)

    Expert-parallel fields (after the release fields; "" on a node without EP): each rank of
    a group is its own node, so routers and decode nodes balance over ranks as over any node.
      ep_group  the group's rendezvous address (parallel.ep_init)
      ep_rank   this rank, decimal
      ep_size   the group's size, decimal
    """
    role: str = ""
    http: str = ""
    model: str = ""
    layout: str = ""
    transfer: str = ""
    version: str = ""
    label: str = ""
    model_id: str = ""
    config: str = ""
    protocol: str = ""
    ep_group: str = ""
    ep_rank: str = ""
    ep_size: str = ""

    def to_list(self) -> list[str]:
        return [self.role, self.http, self.model, self.layout, self.transfer, self.version,
                self.label, self.model_id, self.config, self.protocol, self.ep_group,
                self.ep_rank, self.ep_size]

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "http": self.http, "model": self.model,
                "layout": self.layout, "transfer": self.transfer, "version": self.version,
                "label": self.label, "model_id": self.model_id, "config": self.config,
                "protocol": self.protocol, "ep_group": self.ep_group,
                "ep_rank": int(self.ep_rank) if self.ep_rank.isdigit() else None,
                "ep_size": int(self.ep_size) if self.ep_size.isdigit() else None}


# ---- compatibility: the rule every placement policy applies (moed.balance.candidate) -------
# A field a node does not advertise (a static peer, a node of the release before) is given the
# benefit of the doubt: a rolling upgrade must not cut every pair.

def layout_compatible(ours: str, theirs: str) -> bool:
    """KV written under one layout can be read under the other. An unknown side (a static
    peer, a node that does not advertise) is given the benefit of the doubt: the transfer
    handshake still refuses a real mismatch."""
    return not ours or not theirs or ours == theirs


def protocol_range(text: str) -> tuple[int, int] | None:
    """"min-max" (or one number) as (min, max); None for "" (not advertised) or a malformed
    range (a later release may say more than we parse: we do not guess)."""
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        return None
    return (a, b) if 0 <= a <= b else None


def protocol_compatible(ours: str, theirs: str) -> bool:
    """The two ranges overlap. Not advertised = the release before, which spoke version 1."""
    a = protocol_range(ours) if ours else (1, 1)
    b = protocol_range(theirs) if theirs else (1, 1)
    if a is None or b is None:
        return False
    return a[0] <= b[1] and b[0] <= a[1]


PD_ROLES = frozenset({"prefill", "decode"})


def incompatibility(ours: NodeMeta, theirs: NodeMeta) -> str:
    """Why these two nodes must not work together ("protocol", "model", "layout"), or ""
    when they may. Only a prefill/decode pair shares KV, so only it compares checkpoints."""
    if not protocol_compatible(ours.protocol, theirs.protocol):
        return "protocol"
    if {ours.role, theirs.role} == PD_ROLES:
        if ours.model_id and theirs.model_id and ours.model_id != theirs.model_id:
            return "model"
        if not layout_compatible(ours.layout, theirs.layout):
            return "layout"
    return ""


def incompatible_counts(ours: NodeMeta, members: Iterable[NodeMeta]) -> dict[str, int]:
    """How many of `members` this node cannot work with, by reason (every reason present)."""
    out = {"protocol": 0, "model": 0, "layout": 0}
    for m in members:
        why = incompatibility(ours, m)
        if why:
            out[why] += 1
    return out


@dataclass(frozen=True)
class MemberInfo:
    name: str
    state: MemberState
    incarnation: int
    addr: str                      # gossip address host:port
    meta: NodeMeta
    load: LoadVector
    load_seq: int
    state_since: float             # wall-clock seconds of the last state change

    @property
    def role(self) -> str:
        return self.meta.role

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value, "incarnation": self.incarnation,
                "addr": self.addr, **self.meta.to_dict(), "load": self.load.to_dict(),
                "state_since": round(self.state_since, 3)}


@dataclass(frozen=True)
class MemberEvent:
    """A membership change: old is None for a member seen for the first time."""
    name: str
    old: MemberState | None
    new: MemberState
    incarnation: int
    at: float


@dataclass(frozen=True)
class ClusterView:
    """An immutable snapshot; cheap to hold, never changes under the reader."""
    self_name: str
    members: tuple[MemberInfo, ...] = ()
    version: int = 0
    _by_name: dict[str, MemberInfo] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, self_name: str, members: Iterable[MemberInfo], version: int) -> ClusterView:
        ms = tuple(sorted(members, key=lambda m: m.name))
        return cls(self_name, ms, version, {m.name: m for m in ms})

    def get(self, name: str) -> MemberInfo | None:
        return self._by_name.get(name)

    def select(self, role: str | None = None,
               states: tuple[MemberState, ...] = (MemberState.ALIVE,)) -> list[MemberInfo]:
        """Members with this role (any when None) in one of these states."""
        return [m for m in self.members
                if m.state in states and (role is None or m.meta.role == role)]

    def alive(self, role: str | None = None) -> list[MemberInfo]:
        return self.select(role)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in MemberState}
        for m in self.members:
            out[m.state.value] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"self": self.self_name, "version": self.version, "counts": self.counts(),
                "members": [m.to_dict() for m in self.members]}
