"""Decode placement with prefix affinity (moed.balance.router.place), the router's prompt
hashing agreeing with a node's digest, and the decode node's prefill choice by cost
(moed.roles.decode.DecodeComponent.choose over gossiped loads)."""
from __future__ import annotations

from collections import Counter

from moed.api.affinity import prompt_ids, prompt_prefix
from moed.balance.breaker import PeerHealth, PeerState
from moed.balance.candidate import Candidate
from moed.balance.prefill import advertised_of
from moed.balance.router import PlacementLimits, place
from moed.cluster.service import PrefixDigest
from moed.cluster.state import LoadVector
from moed.config import Config, ModelConfig, ServerConfig
from moed.kvcache.manager import KVCacheManager

BS = 4
PROMPT = list(range(100, 164))            # 16 blocks of 4


def _digest_of(prompts: list[list[int]]) -> tuple[int, ...]:
    """What a node that served these prompts gossips (the real KV manager and digest)."""
    kv = KVCacheManager(256, BS)
    for i, p in enumerate(prompts):
        kv.allocate_prompt(f"r{i}", p, kv.prefix_hit(p), len(p))
        kv.commit(f"r{i}", p, len(p))
    return PrefixDigest().update(kv, 16)


def _node(name: str, waiting: int = 0, running: int = 0, digest: tuple[int, ...] = (),
          free: int = 1000, inflight: int = 0) -> Candidate:
    return Candidate(name, f"http://{name}", "decode",
                     load=LoadVector(waiting, running, free, 0, block_size=BS,
                                     prefix_digest=digest), inflight=inflight)


LIMITS = PlacementLimits(affinity_weight=2.0, max_waiting=0)


def test_router_hashes_match_the_node_digest() -> None:
    holder = _node("holder", digest=_digest_of([PROMPT]))
    prefix = prompt_prefix(PROMPT + [1, 2, 3], {BS})
    got = place([_node("a"), holder, _node("b")], prefix, len(PROMPT) + 3, LIMITS)
    assert got.node.name == "holder" and got.reason == "affinity" and got.overlap_blocks == 16
    # a different prompt shares nothing: placement by load, round-robin among equals
    other = prompt_prefix(list(range(500, 564)), {BS})
    names = {place([_node("a"), holder, _node("b")], other, 64, LIMITS, turn=t).node.name
             for t in range(6)}
    assert names == {"a", "b", "holder"}
    # a shared first half: overlap 8 blocks (the deepest sampled depth the node holds)
    half = prompt_prefix(PROMPT[:32] + list(range(900, 932)), {BS})
    assert place([_node("a"), holder], half, 64, LIMITS).overlap_blocks == 8


def test_repeated_prefix_sticks_to_its_node_unless_it_is_overloaded() -> None:
    digest = _digest_of([PROMPT])
    prefix = prompt_prefix(PROMPT, {BS})
    for waiting in (0, 1):               # a little busier than the others: still the holder
        got = place([_node("idle"), _node("h", waiting=waiting, digest=digest)], prefix,
                    len(PROMPT), LIMITS)
        assert got.node.name == "h", waiting
    # affinity_weight (2) more queued than the idle node: the prefix spreads
    got = place([_node("idle"), _node("h", waiting=2, inflight=1, digest=digest)], prefix,
                len(PROMPT), LIMITS)
    assert got.node.name == "idle" and got.reason == "overloaded"
    # affinity off: load alone
    off = place([_node("idle"), _node("h", digest=digest, running=3)], prefix, len(PROMPT),
                PlacementLimits(affinity_weight=0.0))
    assert off.node.name == "idle" and off.reason == "load"
    # no tokenizer on the router (no prefix): load, then running
    assert place([_node("a", running=4), _node("b", running=1)], {}, 0, LIMITS).node.name == "b"


def test_saturated_nodes_are_skipped_and_all_saturated_is_admission() -> None:
    limits = PlacementLimits(affinity_weight=2.0, max_waiting=4)
    digest = _digest_of([PROMPT])
    prefix = prompt_prefix(PROMPT, {BS})
    full = _node("full", waiting=3, inflight=1, digest=digest)           # 4 = the limit
    assert place([full, _node("ok", waiting=3)], prefix, 64, limits).node.name == "ok"
    # KV headroom: 16 blocks needed, 10 free; a holder needs only what its overlap (8 of the
    # 15 full blocks a hit may cover: the deepest sampled depth) leaves
    assert place([_node("tight", free=10), _node("roomy", waiting=1)], {}, 64,
                 limits).node.name == "roomy"
    assert place([_node("tight", free=8, digest=digest)], prefix, 64, limits).node.name == "tight"
    assert place([_node("tight", free=7, digest=digest)], prefix, 64, limits).node is None
    out = place([full, _node("kv", free=0)], prefix, 64, limits)
    assert out.node is None and out.reason == "saturated"
    assert place([], prefix, 64, limits).reason == "none"


class _Tok:
    """A stand-in tokenizer: one token per character."""
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_prompt_ids_of_request_bodies() -> None:
    tok = _Tok()
    assert prompt_ids(b'{"prompt": "ab"}', "/v1/completions", tok) == [97, 98]
    assert prompt_ids(b'{"prompt": [[5, 6]]}', "/v1/completions", tok) == [5, 6]
    assert prompt_ids(b'{"prompt": ["a", "b"]}', "/v1/completions", tok) is None   # a batch
    chat = b'{"messages": [{"role": "user", "content": "hi"}]}'
    assert prompt_ids(chat, "/v1/chat/completions", tok) == tok.encode("<user>hi<assistant>")
    assert prompt_ids(b"not json", "/v1/completions", tok) is None
    assert prompt_ids(b'{"messages": 3}', "/v1/chat/completions", tok) is None


# ---- the decode node's prefill choice ------------------------------------------------------

def _prefill_load(per_token_s: float, queued: int = 0) -> LoadVector:
    return LoadVector(0, 0, 100, queued, (512, 4096), (queued, 0, 0), (1 if queued else 0, 0, 0),
                      (0.001, per_token_s, 1e-9, 0.001, 0.0), 1.0, 512, 16)


def _decode_component():
    from moed.roles.decode import DecodeComponent
    cfg = Config(server=ServerConfig(role="decode"), model=ModelConfig(path="/m"))
    d = DecodeComponent(cfg, "d1")
    d.layout = "L"
    return d


def test_advertised_cost_is_read_back_from_the_gossip() -> None:
    adv = advertised_of(_prefill_load(1e-5, queued=300))
    assert adv is not None and adv.queued_tokens == (300, 0, 0) and adv.bucket(1000) == 1
    assert adv.coefficients.per_token_s == 1e-5
    assert advertised_of(LoadVector(1, 2, 3, 4)) is None                 # the release before
    assert advertised_of(LoadVector(cost=(1.0,) * 5, bucket_edges=(512,),
                                    queued_tokens=(1,), queued_requests=(1,))) is None


def test_node_choice_avoids_incompatible_and_breaker_open_nodes_and_prefers_the_fast() -> None:
    d = _decode_component()
    fast = Candidate("http://fast", "http://fast", "prefill", "L", load=_prefill_load(1e-6))
    slow = Candidate("http://slow", "http://slow", "prefill", "L",
                     load=_prefill_load(1e-4, queued=3000))
    other_layout = Candidate("http://x", "http://x", "prefill", "OTHER", load=_prefill_load(0))
    opened = Candidate("http://open", "http://open", "prefill", "L", load=_prefill_load(0),
                       health=PeerHealth(PeerState.OPEN, 1, 1, opened_at=1e12))  # cooling down
    picks = Counter(d.choose([fast, slow, other_layout, opened], set(), 2000).name
                    for _ in range(200))
    assert picks["http://x"] == 0 and picks["http://open"] == 0
    # power of two choices over the two eligible: both drawn every time, the fast one wins
    assert picks["http://fast"] == 200
    # our own unreported jobs on `fast` push the choice to the other node
    d.inflight_tokens["http://fast"] = 10_000_000
    assert d.choose([fast, slow], set(), 2000).name == "http://slow"
    # tried already (a retry): the other one, even if slower
    d.inflight_tokens.clear()
    assert d.choose([fast, slow], {"http://fast"}, 2000).name == "http://slow"
    # nothing advertised (static peers): the fewest jobs in flight
    s1, s2 = Candidate("http://s1", "http://s1", "prefill"), Candidate("http://s2", "http://s2",
                                                                       "prefill", inflight=3)
    assert d.choose([s2, s1], set(), 2000).name == "http://s1"
    assert d.choose([other_layout], set(), 2000) is None


def test_node_choice_never_offers_a_dead_member() -> None:
    from types import SimpleNamespace

    from moed.cluster.state import ClusterView, MemberInfo, MemberState, NodeMeta

    def member(name: str, state: MemberState, role: str = "prefill") -> MemberInfo:
        meta = NodeMeta(role, f"http://{name}", "m", "L", "agent")
        return MemberInfo(name, state, 1, f"{name}:1", meta, _prefill_load(1e-6), 1, 0.0)

    view = ClusterView.build("d1", [member("d1", MemberState.ALIVE, "decode"),
                                    member("dead", MemberState.DEAD),
                                    member("suspect-gone", MemberState.LEFT),
                                    member("live", MemberState.ALIVE)], 1)
    d = _decode_component()
    d._membership = SimpleNamespace(view=lambda: view)
    d._app = SimpleNamespace(state=SimpleNamespace(model_name="m"))
    assert [c.name for c in d.candidates()] == ["http://live"]
    assert {d.choose(d.candidates(), set(), 100).name for _ in range(20)} == {"http://live"}
