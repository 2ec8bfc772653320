"""Release fields in membership metadata (version, label, model id, config hash, protocol):
they gossip at the end of NodeMeta, so a node of the release before (five fields) and this
one read each other; the compatibility rule every placement policy applies; the model id."""
from __future__ import annotations

import json

import pytest

from moed.cluster import wire
from moed.cluster.state import (GRAMMAR_JOBS, PROTOCOL, ClusterView, LoadVector, MemberInfo, MemberState,
                                NodeMeta, incompatibility, incompatible_counts, protocol_range)
from moed.cluster.wire import Alive, Keyring
from moed.balance.candidate import protocol_compatible

KEY = Keyring(b"v" * 32)
NEW = NodeMeta("decode", "http://10.0.0.2:8000", "tiny", "L1", "agent", "0.1.0", "canary-2",
               "abc123abc123", "cfg999cfg999", "1-2")


def _roundtrip(meta_fields: list) -> NodeMeta:
    body = json.dumps(["n0", 1, [["A", "n1", 3, "h:1", meta_fields, 2, [1, 2, 3, 4]]]]).encode()
    data = bytes([wire.VERSION]) + body
    _, _, got = wire.decode(KEY, data + KEY.sign(data), wire.MAX_PACKET)
    assert isinstance(got[0], Alive)
    return got[0].meta


def test_release_fields_roundtrip_and_show_in_cluster_json() -> None:
    assert _roundtrip(NEW.to_list()) == NEW
    frag = wire.fragment(Alive("n1", 3, "h:1", NEW, 2, LoadVector()))
    assert len(frag) < 300               # room in a 1400-byte packet for piggybacked updates
    m = MemberInfo("n1", MemberState.ALIVE, 3, "h:1", NEW, LoadVector(), 0, 0.0)
    got = ClusterView.build("n1", [m], 1).to_json()["members"][0]
    assert {k: got[k] for k in ("version", "label", "model_id", "config", "protocol")} == {
        "version": "0.1.0", "label": "canary-2", "model_id": "abc123abc123",
        "config": "cfg999cfg999", "protocol": "1-2"}


def test_release_before_and_release_after_decode_here() -> None:
    old = _roundtrip(["prefill", "http://x", "tiny", "L1", "ag"])      # the release before
    assert old == NodeMeta("prefill", "http://x", "tiny", "L1", "ag")
    assert (old.version, old.label, old.model_id, old.config, old.protocol) == ("",) * 5
    after = _roundtrip(NEW.to_list() + ["zone-b", "more"])            # a later release
    assert after == NEW
    with pytest.raises(wire.DecodeError):
        _roundtrip(["prefill", "http://x", "tiny", "L1"])              # short of version 1


def test_protocol_ranges() -> None:
    assert protocol_range("1-3") == (1, 3) and protocol_range("2") == (2, 2)
    assert protocol_range("") is None and protocol_range("3-1") is None
    assert protocol_range("x") is None and protocol_range("1-2-3") is None
    assert protocol_compatible("1-2", "2-5") and not protocol_compatible("1-1", "2-3")
    assert protocol_compatible(PROTOCOL, "")           # the release before spoke version 1
    assert not protocol_compatible("2-3", "")          # ... which a 2-3 node no longer speaks
    assert not protocol_compatible(PROTOCOL, "garbage")


def _meta(role: str, model_id: str = "m1", layout: str = "L1", protocol: str = "1-1") -> NodeMeta:
    return NodeMeta(role=role, layout=layout, model_id=model_id, protocol=protocol)


def test_compatibility_rule() -> None:
    d = _meta("decode")
    assert incompatibility(d, _meta("prefill")) == ""
    assert incompatibility(d, _meta("prefill", model_id="m2")) == "model"
    assert incompatibility(d, _meta("prefill", layout="L2")) == "layout"
    assert incompatibility(d, _meta("prefill", protocol="2-2")) == "protocol"
    assert incompatibility(d, _meta("prefill", model_id="")) == ""      # not advertised
    assert incompatibility(_meta("prefill"), d) == ""                   # symmetric
    # only a prefill/decode pair shares KV: a router or another decode node may differ
    assert incompatibility(d, _meta("decode", model_id="m2", layout="L2")) == ""
    assert incompatibility(_meta("router", model_id=""), _meta("decode", "m2")) == ""
    assert incompatibility(_meta("router"), _meta("decode", protocol="5-6")) == "protocol"
    counts = incompatible_counts(d, [_meta("prefill", "m2"), _meta("prefill", "m2"),
                                     _meta("prefill"), _meta("prefill", layout="L9"),
                                     _meta("colocated", protocol="9")])
    assert counts == {"model": 2, "layout": 1, "protocol": 1}


def test_model_id_tells_checkpoints_apart(tmp_path) -> None:
    from moed.model.identity import model_id

    def ckpt(name: str, config: str, weights: bytes) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(config)
        (d / "model.safetensors").write_bytes(weights)
        return str(d)

    a = ckpt("a", '{"h": 1}', b"\0" * 100_000 + b"seed0")
    same = ckpt("same", '{"h": 1}', b"\0" * 100_000 + b"seed0")
    reseeded = ckpt("reseeded", '{"h": 1}', b"\0" * 100_000 + b"seed1")   # same size
    other_cfg = ckpt("cfg", '{"h": 2}', b"\0" * 100_000 + b"seed0")
    ids = {model_id(p) for p in (a, reseeded, other_cfg)}
    assert model_id(a) == model_id(same) and len(ids) == 3
    assert len(model_id(a)) == 12
    assert model_id("") == "" and model_id(tmp_path / "missing") == ""


def test_real_checkpoints_of_two_seeds_differ(make_checkpoint) -> None:
    from moed.model.identity import model_id

    a, b = make_checkpoint("qwen3_moe", seed=0), make_checkpoint("qwen3_moe", seed=1)
    assert model_id(a) != model_id(b) and model_id(a) == model_id(a)


def _member(name: str, meta: NodeMeta, state: MemberState = MemberState.ALIVE) -> MemberInfo:
    return MemberInfo(name, state, 1, f"{name}:7946", meta, LoadVector(), 0, 0.0)


def test_placement_sees_only_compatible_members() -> None:
    """The router's backends and a decode node's prefill candidates both apply the rule."""
    from types import SimpleNamespace

    from moed.api.backends import MembershipBackends
    from moed.config import load
    from moed.roles.decode import DecodeComponent

    me = NodeMeta("decode", "http://d:1", "tiny", "L1", "", "0.1.0", "v1", "m1", "c", PROTOCOL)
    view = ClusterView.build("d", [
        _member("d", me),
        _member("p-same", NodeMeta("prefill", "http://p1:1", "tiny", "L1", model_id="m1",
                                   protocol=PROTOCOL)),
        _member("p-other-model", NodeMeta("prefill", "http://p2:1", "tiny", "L1",
                                          model_id="m2", protocol=PROTOCOL)),
        _member("p-old-release", NodeMeta("prefill", "http://p3:1", "tiny", "L1")),
        _member("p-future", NodeMeta("prefill", "http://p4:1", "tiny", "L1", model_id="m1",
                                     protocol="7-9")),
        _member("c-future", NodeMeta("colocated", "http://c1:1", "tiny", protocol="7-9")),
        _member("c-now", NodeMeta("colocated", "http://c2:1", "tiny", label="v2",
                                  protocol=PROTOCOL))], version=1)
    cfg = load(environ={}, overrides={"model": {"path": "m"}, "server": {"role": "decode"}})
    dec = DecodeComponent(cfg, "d")
    dec._membership = SimpleNamespace(view=lambda: view)
    dec._app = SimpleNamespace(state=SimpleNamespace(model_name="tiny"))
    assert sorted(c.url for c in dec.candidates()) == ["http://p1:1", "http://p3:1"]
    # a job with a grammar needs protocol 2: the release before (p3) would sample token one
    # unconstrained, so it is no candidate for one
    assert sorted(c.url for c in dec.candidates(GRAMMAR_JOBS)) == ["http://p1:1"]
    # a static peer that membership knows to run another checkpoint is dropped too
    dec.cfg = load(environ={}, overrides={"model": {"path": "m"}, "server": {"role": "decode"},
                                          "transfer": {"prefill_peers": ["http://p2:1",
                                                                         "http://s:1"]}})
    assert sorted(c.url for c in dec.candidates()) == ["http://p1:1", "http://p3:1",
                                                       "http://s:1"]

    rcfg = load(environ={}, overrides={"server": {"role": "router"}})
    backends = MembershipBackends(lambda: view, lambda: rcfg).backends()
    assert sorted(b.name for b in backends) == ["c-now", "d"]
    assert {b.name: b.label for b in backends}["c-now"] == "v2"
